// Affine dequantize at HBM bandwidth for mx.fast.cuda_kernel (omlx_core/kernels/dequantize.py).
//
//   out[n, j] = scales[n, j / G] * q[n, j] + biases[n, j / G]
//
// for MLX's affine layout: q packed little-end first into uint32 words, BITS = 4 or 8, group
// size G >= 32. One thread reads 16 bytes of packed weights (4 words: 32 values at 4 bits, 16 at
// 8) with one L1-bypassing load; they lie in one group of one row because a row holds a whole
// number of groups and G >= 32 >= the values per thread. It reads that group's scale and bias,
// computes each value as one fp32 fused multiply-add rounded once to T, and writes 64 (4-bit)
// or 32 (8-bit) bytes with 16-byte stores. The dequantize-to-dense prefill path calls it once
// per layer per chunk, where MLX's own dequantize ran far below bandwidth.
//
// The text before the body marker is the kernel's `header`, the rest its `source`.

namespace omlx_dequant {

__device__ __forceinline__ uint4 load_streaming(const uint32_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b);

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <typename T, int BITS, int G>
__device__ void dequantize(const uint32_t* w, const T* scales, const T* biases, T* out,
                           int64_t chunks, int64_t row_words) {
  constexpr int PER_WORD = 32 / BITS;
  constexpr int VALUES = 4 * PER_WORD;  // values one thread makes
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  const int64_t chunk = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (chunk >= chunks) return;
  const int64_t word = chunk * 4;
  const int64_t row = word / row_words;
  const int64_t col = (word - row * row_words) * PER_WORD;  // first value's column
  const int64_t groups = row_words * PER_WORD / G;
  const int64_t group = row * groups + col / G;
  const float scale = float(scales[group]);
  const float bias = float(biases[group]);
  const uint4 packed = load_streaming(w + word);
  const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
  uint32_t pairs[VALUES / 2];
#pragma unroll
  for (int i = 0; i < VALUES / 2; ++i) {
    const int a = 2 * i, b = 2 * i + 1;
    const float qa = float((words[a / PER_WORD] >> ((a % PER_WORD) * BITS)) & MASK);
    const float qb = float((words[b / PER_WORD] >> ((b % PER_WORD) * BITS)) & MASK);
    pairs[i] = pack2<T>(__fmaf_rn(scale, qa, bias), __fmaf_rn(scale, qb, bias));
  }
  uint4* dst = reinterpret_cast<uint4*>(out + chunk * VALUES);
#pragma unroll
  for (int i = 0; i < VALUES / 8; ++i) {
    dst[i] = make_uint4(pairs[4 * i], pairs[4 * i + 1], pairs[4 * i + 2], pairs[4 * i + 3]);
  }
}

}  // namespace omlx_dequant

// ---- body ----
omlx_dequant::dequantize<T, BITS, GROUP>(w, scales, biases, out, int64_t(w_shape[0]) * w_shape[1] / 4,
                                         w_shape[1]);
