// The prologue of decode attention in one launch: each head of q and k (qwen3: RMS norm
// per head first) rotated by RoPE at its sequence's position, written as [B, H, 1, D].
//
// Why: mlx-lm computes this as two RoPE launches (four with qwen3's norms) per layer, each
// a few microseconds of GPU ramp and tail for a few kilobytes, and each costing the host
// its Python and MLX's encoding: at batch 32 a decode step is bound by that host work on
// some machines (docs/benchmarks/decode-h100-host-profile.json).
//
// One warp takes one (sequence, head) row of D values; lane l holds the pairs
// (i, i + D / 2) (traditional: (2i, 2i + 1)) for i = l, l + 32, ... The arithmetic is
// MLX's, rounding where MLX's separate ops round: the norm's x * rsqrt(mean(x^2) + eps)
// to T, times the weight in T; RoPE in fp32 from those T values, theta = scale * position
// * inv_freq with inv_freq = 2^(-(i / (D/2)) log2 base), or 1 / freqs[i] for a frequency
// table (Llama 3's), rounded to T once.

namespace omlx_qknr {

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }

// One row: in and out D values apart; `weight` null: no norm.
template <typename T, int D, bool TRADITIONAL, bool FREQS>
__device__ __forceinline__ void row(const T* in, T* out, const T* weight, float eps, float position,
                                    float log2_base, const float* freqs) {
  constexpr int HALF = D / 2, PAIRS = HALF / 32;
  const int lane = threadIdx.x & 31;
  float a[PAIRS], b[PAIRS];
#pragma unroll
  for (int p = 0; p < PAIRS; ++p) {
    const int i = lane + 32 * p;
    a[p] = to_float(in[TRADITIONAL ? 2 * i : i]);
    b[p] = to_float(in[TRADITIONAL ? 2 * i + 1 : i + HALF]);
  }
  if (weight != nullptr) {
    float squares = 0.0f;
#pragma unroll
    for (int p = 0; p < PAIRS; ++p) squares += a[p] * a[p] + b[p] * b[p];
#pragma unroll
    for (int step = 16; step > 0; step >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, step);
    const float normalizer = rsqrtf(squares / D + eps);
#pragma unroll
    for (int p = 0; p < PAIRS; ++p) {
      const int i = lane + 32 * p;
      const int ia = TRADITIONAL ? 2 * i : i, ib = TRADITIONAL ? 2 * i + 1 : i + HALF;
      a[p] = to_float(from_float<T>(to_float(weight[ia]) * to_float(from_float<T>(a[p] * normalizer))));
      b[p] = to_float(from_float<T>(to_float(weight[ib]) * to_float(from_float<T>(b[p] * normalizer))));
    }
  }
#pragma unroll
  for (int p = 0; p < PAIRS; ++p) {
    const int i = lane + 32 * p;
    const float inv_freq = FREQS ? static_cast<float>(1.0 / freqs[i])  // in double, as MLX divides
                                  : exp2f(-(static_cast<float>(i) / HALF) * log2_base);
    float s, c;
    sincosf(position * inv_freq, &s, &c);
    out[TRADITIONAL ? 2 * i : i] = from_float<T>(a[p] * c - b[p] * s);
    out[TRADITIONAL ? 2 * i + 1 : i + HALF] = from_float<T>(a[p] * s + b[p] * c);
  }
}

// q [B, HQ * D] and k [B, HKV * D] (one token per sequence); warp w of the grid takes row
// w of q's B * HQ rows, then of k's. `offsets`: each sequence's position ([B]), or one for
// all ([1]); params: log2 base, scale, eps.
template <typename T, int D, int HQ, int HKV, bool NORM, bool TRADITIONAL, bool FREQS, bool PER_SEQ>
__device__ __forceinline__ void qk_norm_rope(const T* q, const T* k, const T* q_weight, const T* k_weight,
                                             const float* freqs, const int32_t* offsets, const float* params,
                                             T* q_out, T* k_out, int batch) {
  static_assert(D % 64 == 0, "whole pairs for every lane");
  const int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int q_rows = batch * HQ;
  if (w >= q_rows + batch * HKV) return;
  const bool is_q = w < q_rows;
  const int r = is_q ? w : w - q_rows;
  const int b = r / (is_q ? HQ : HKV);
  const float position = params[1] * static_cast<float>(offsets[PER_SEQ ? b : 0]);
  const T* weight = NORM ? (is_q ? q_weight : k_weight) : nullptr;
  row<T, D, TRADITIONAL, FREQS>((is_q ? q : k) + (size_t)r * D, (is_q ? q_out : k_out) + (size_t)r * D, weight,
                                params[2], position, params[0], freqs);
}

}  // namespace omlx_qknr
