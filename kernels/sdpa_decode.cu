// Attention for one new token per sequence (decode) with grouped-query heads:
// out[b, h] = softmax(scale * q[b, h] . k[b, h / G]^T) v[b, h / G], for the G query heads
// that share each key/value head.
//
// Why: a decode step reads the whole K/V cache once per layer, and that read is the
// attention's whole cost. One CTA takes one key/value head and all its G query heads, so
// every cached byte is read once; the cache's sequence axis is split across CTAs (slices)
// so that a small batch still fills the GPU.
//
// Tensor cores (mma.sync m16n8k16), one warp per 16 keys a trip: the G queries are the
// A operand's rows (G <= 8 of its 16; the rest zero), so S = Q K^T is two mma n-tiles of 8
// keys; their accumulators are, register for register, the A operand of P V (P rounded to
// the activation type, as flash attention does), whose n-tiles are 8 head dims each. A dot
// product does not care in which order its terms are summed, so each thread loads whole
// 16-byte pieces: 4 of a key row's dims for every k-step, and of the value rows the dims
// that its B fragments need; pieces are laid out so that a warp's load covers whole
// 128-byte lines. A register-only loop (one 16-byte load per thread and row, a shuffle
// reduction per score) reached 1.2-1.5 TB/s: its arithmetic, not HBM, set the pace.
//
// Each warp keeps, per query head, a running max, a running sum of 2^(s - max) (s scaled
// by log2(e)) and P V, rescaled when the max grows; the CTA's warps are merged in shared
// memory. With one slice the CTA writes out = acc / sum; with several it publishes (max,
// sum, acc) in fp32 and the last CTA of the head (a counter per head, left zero) combines
// the slices in a fixed order, so the result does not depend on which CTA finished last.
//
// Left padding (a batch cache's `starts`) is never read: its rows may hold anything, NaN
// included (a padded query row of a prefill attends to nothing), and 0 * NaN is NaN.
// Inputs may be strided views, read in place (copying the cache to a contiguous array would
// cost more than the attention); a cache's whole buffers are taken as they are, the kernel
// attending over their first `keys` rows (a count the append kernel writes on the GPU, so no
// view of the buffers is made per step: each would be a node of MLX's graph to encode).

namespace omlx_sdpa {

constexpr float LOG2E = 1.4426950408889634f;
constexpr int MAX_SPLITS = 64;  // slices of one head: the combine's weights sit in shared memory

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }

// Two floats as one mma operand register (lo in the low half).
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// C += A B for A's rows 0-7 only (a1 = a3 = 0: rows 8-15 are no query head), so only
// c[0] and c[1] are kept. One body for both types: AB is the PTX name of the operands'.
#define OMLX_SDPA_MMA(AB)                                                                    \
  float z0 = 0.0f, z1 = 0.0f;                                                                \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." AB "." AB                            \
               ".f32 {%0, %1, %2, %3}, {%4, %6, %5, %6}, {%7, %8}, {%0, %1, %2, %3};"        \
               : "+f"(c[0]), "+f"(c[1]), "+f"(z0), "+f"(z1)                                  \
               : "r"(a0), "r"(a2), "r"(0u), "r"(b0), "r"(b1))
template <typename T>
__device__ __forceinline__ void mma(float (&c)[2], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float (&c)[2], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  OMLX_SDPA_MMA("bf16");
}
template <>
__device__ __forceinline__ void mma<__half>(float (&c)[2], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  OMLX_SDPA_MMA("f16");
}
#undef OMLX_SDPA_MMA

// Eight consecutive elements of a row, raw: one 16-byte load when they are contiguous and
// aligned (a cache's rows are), else one load each.
template <typename T>
__device__ __forceinline__ uint4 load8(const T* p, int64_t stride) {
  if (stride == 1 && (reinterpret_cast<uintptr_t>(p) & 15) == 0) return *reinterpret_cast<const uint4*>(p);
  union { uint4 raw; T e[8]; } u;
#pragma unroll
  for (int i = 0; i < 8; ++i) u.e[i] = p[i * stride];
  return u.raw;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Element e (0-7) of piece `lo` and of piece `hi` as one operand register (lo low).
__device__ __forceinline__ uint32_t interleave(const uint4& lo, const uint4& hi, int e) {
  return __byte_perm(word(lo, e >> 1), word(hi, e >> 1), (e & 1) ? 0x7632 : 0x5410);
}

// Exponent base 2 that takes 2^(-inf - -inf) as 0 (a warp that has seen no key yet).
__device__ __forceinline__ float weight(float s, float m) { return s == -INFINITY ? 0.0f : exp2f(s - m); }

// Template parameters: T the activation type, D the head size (64 or 128), G query heads
// per key/value head (1..8). Launch: 128 threads; gridDim.x = batch * key/value heads,
// gridDim.y = the slices of the cache's length (at most MAX_SPLITS). q [B, Hq, 1, D], k and
// v [B, Hkv, T, D] with any strides, of which rows 0 .. keys - 1 are attended over (keys <= T);
// out [B, Hq, 1, D] contiguous; sequence b's keys begin
// at starts[b] (a batch cache's left padding: 0 for none); with more than one slice `locks`
// holds B * Hkv zeros (left zero) and `partial` has gridDim.y * B * Hq * (D + 2) floats.
template <typename T, int D, int G>
__device__ __forceinline__ void decode(
    const T* __restrict__ q, const int64_t* q_strides, const T* __restrict__ k, const int64_t* k_strides,
    const T* __restrict__ v, const int64_t* v_strides, float scale, const int32_t* starts,
    const int32_t* locks, T* __restrict__ out, float* __restrict__ partial, int Hkv, int keys) {
  static_assert(D == 64 || D == 128, "head size 64 or 128");
  static_assert(G >= 1 && G <= 8, "1 to 8 query heads per key/value head");
  constexpr int THREADS = 128, WARPS = THREADS / 32;
  constexpr int KEYS = 16;      // keys of a warp's trip
  constexpr int KP = D / 32;    // 16-byte pieces of a key row a thread loads (4 dims of each k-step)
  constexpr int NT = D / 8;     // P V n-tiles of 8 dims
  constexpr int VP = NT / 8;    // 16-byte pieces of a value row a thread loads

  __shared__ float warp_max[WARPS][G], warp_sum[WARPS][G], warp_acc[WARPS][G][D];
  __shared__ float row_max[G], row_sum[G];
  __shared__ float split_weight[MAX_SPLITS][G];
  __shared__ int last_arrival;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane >> 2, t = lane & 3;  // mma fragment coordinates
  const int head = blockIdx.x, b = head / Hkv, kvh = head % Hkv;
  const int splits = gridDim.y, split = blockIdx.y;
  const int per_cta = (keys + splits - 1) / splits;
  const int t1 = min(keys, (split + 1) * per_cta);
  const int t0 = max(split * per_cta, starts[b]);  // the slice's rows past the padding
  const int Hq = Hkv * G;
  const float log2_scale = scale * LOG2E;

  // Piece i of a thread's key dims holds dims [32 i + 8 t, +8): a warp's load takes 64
  // contiguous bytes of each of 8 rows. k-step j uses piece j / 2, words 2 (j % 2) and +1.
  // The query (A rows: query head g) takes the same dims of its row.
  uint32_t qa[D / 16][2];
  {
    uint4 qp[KP];
#pragma unroll
    for (int i = 0; i < KP; ++i)
      qp[i] = g < G ? load8(q + b * q_strides[0] + (kvh * G + g) * q_strides[1] + (32 * i + 8 * t) * q_strides[3],
                            q_strides[3])
                    : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < D / 16; ++j)
      qa[j][0] = word(qp[j / 2], 2 * (j % 2)), qa[j][1] = word(qp[j / 2], 2 * (j % 2) + 1);
  }

  // P V n-tile n, column c is dim 64 (n / 8) + 8 c + n % 8: a value piece p of this thread
  // (B column g) holds dims [64 p + 8 g, +8) of each of its four rows; its outputs (rows g,
  // columns 2t and 2t + 1) are dims 64 (n / 8) + 16 t + n % 8 and that + 8.
  float acc[NT][2];
#pragma unroll
  for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = 0.0f;
  float m = -INFINITY, l = 0.0f;  // query head g's running max; this thread's share of its sum

  const T* kb = k + b * k_strides[0] + kvh * k_strides[1];
  const T* vb = v + b * v_strides[0] + kvh * v_strides[1];
  for (int base = t0 + warp * KEYS; base < t1; base += WARPS * KEYS) {  // warp-uniform trips
    uint4 kp[2][KP], vp[4][VP];
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // score n-tile `half`: keys base + 8 half + g
      const int row = base + 8 * half + g;
#pragma unroll
      for (int i = 0; i < KP; ++i)
        kp[half][i] = row < t1 ? load8(kb + (int64_t)row * k_strides[2] + (32 * i + 8 * t) * k_strides[3], k_strides[3])
                               : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // P V's k rows 2t, 2t + 1, 2t + 8, 2t + 9
      const int row = base + 2 * t + (r & 1) + 8 * (r >> 1);
#pragma unroll
      for (int p = 0; p < VP; ++p)
        vp[r][p] = row < t1 ? load8(vb + (int64_t)row * v_strides[2] + (64 * p + 8 * g) * v_strides[3], v_strides[3])
                            : make_uint4(0, 0, 0, 0);
    }

    float s[2][2];  // [n-tile][column]: query head g against keys base + 8 half + 2t + column
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      s[half][0] = s[half][1] = 0.0f;
#pragma unroll
      for (int j = 0; j < D / 16; ++j)
        mma<T>(s[half], qa[j][0], qa[j][1], word(kp[half][j / 2], 2 * (j % 2)), word(kp[half][j / 2], 2 * (j % 2) + 1));
    }
    float top = m;
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int row = base + 8 * half + 2 * t + c;
        s[half][c] = row < t1 ? s[half][c] * log2_scale : -INFINITY;
        top = fmaxf(top, s[half][c]);
      }
    top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
    top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
    const float rescale = weight(m, top);
    m = top;
    l *= rescale;
#pragma unroll
    for (int n = 0; n < NT; ++n) acc[n][0] *= rescale, acc[n][1] *= rescale;
    float p[2][2];
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int c = 0; c < 2; ++c) p[half][c] = weight(s[half][c], m), l += p[half][c];
    const uint32_t pa0 = pack2<T>(p[0][0], p[0][1]), pa2 = pack2<T>(p[1][0], p[1][1]);
#pragma unroll
    for (int n = 0; n < NT; ++n)
      mma<T>(acc[n], pa0, pa2, interleave(vp[0][n / 8], vp[1][n / 8], n % 8),
             interleave(vp[2][n / 8], vp[3][n / 8], n % 8));
  }
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);

  // The warps merged: each query head's max over the CTA, its sum and P V rescaled to it.
  if (g < G) {
    if (t == 0) warp_max[warp][g] = m, warp_sum[warp][g] = l;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const int d = 64 * (n / 8) + 16 * t + n % 8;
      warp_acc[warp][g][d] = acc[n][0], warp_acc[warp][g][d + 8] = acc[n][1];
    }
  }
  __syncthreads();
  if (tid < G) {
    float most = -INFINITY, total = 0.0f;
    for (int w = 0; w < WARPS; ++w) most = fmaxf(most, warp_max[w][tid]);
    for (int w = 0; w < WARPS; ++w) total = fmaf(warp_sum[w][tid], weight(warp_max[w][tid], most), total);
    row_max[tid] = most, row_sum[tid] = total;
  }
  __syncthreads();
  auto merged = [&](int h, int d) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) total = fmaf(warp_acc[w][h][d], weight(warp_max[w][h], row_max[h]), total);
    return total;
  };

  if (splits == 1) {
    for (int idx = tid; idx < G * D; idx += THREADS) {
      const int h = idx / D, d = idx % D;
      out[((int64_t)b * Hq + kvh * G + h) * D + d] = from_float<T>(merged(h, d) / row_sum[h]);
    }
    return;
  }

  // Several slices: publish (max, sum, acc) of this one; the last CTA of the head combines.
  const int64_t rows = (int64_t)gridDim.x * G;  // B * Hq: a slice's rows in `partial`
  for (int idx = tid; idx < G * (D + 2); idx += THREADS) {
    const int h = idx / (D + 2), d = idx % (D + 2);
    const int64_t row = (int64_t)b * Hq + kvh * G + h;
    partial[(split * rows + row) * (D + 2) + d] = d == D ? row_max[h] : d == D + 1 ? row_sum[h] : merged(h, d);
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) last_arrival = atomicAdd(const_cast<int32_t*>(locks) + head, 1) == splits - 1;
  __syncthreads();
  if (!last_arrival) return;
  __threadfence();
  // Every slice's max and sum read at once (one load each, all in flight), then the weights.
  const int64_t first_row = (int64_t)b * Hq + kvh * G;
  float* slice_max = &warp_acc[0][0][0];  // the warps' sums are no longer needed: scratch
  float* slice_sum = slice_max + MAX_SPLITS * G;
  static_assert(2 * MAX_SPLITS <= WARPS * D, "the slices' max and sum fit the scratch");
  for (int idx = tid; idx < splits * G; idx += THREADS) {
    const float* p = partial + ((idx / G) * rows + first_row + idx % G) * (D + 2);
    slice_max[idx] = __ldcg(p + D), slice_sum[idx] = __ldcg(p + D + 1);
  }
  __syncthreads();
  if (tid < G) {
    float most = -INFINITY, total = 0.0f;
    for (int s = 0; s < splits; ++s) most = fmaxf(most, slice_max[s * G + tid]);
    for (int s = 0; s < splits; ++s) {
      split_weight[s][tid] = weight(slice_max[s * G + tid], most);  // a slice of padding only weighs 0
      total = fmaf(slice_sum[s * G + tid], split_weight[s][tid], total);
    }
    row_sum[tid] = total;
  }
  __syncthreads();
  for (int idx = tid; idx < G * D; idx += THREADS) {
    const int h = idx / D, d = idx % D;
    float o = 0.0f;
#pragma unroll 8
    for (int s = 0; s < splits; ++s)
      o = fmaf(__ldcg(partial + (s * rows + first_row + h) * (D + 2) + d), split_weight[s][h], o);
    out[(first_row + h) * D + d] = from_float<T>(o / row_sum[h]);
  }
  if (tid == 0) atomicExch(const_cast<int32_t*>(locks) + head, 0);
}

// This step's key and value rows written into the cache's buffers in place, at row `pos`
// of every (sequence, key/value head): k_new, v_new [B, Hkv, 1, D], k_buf, v_buf
// [B, Hkv, T, D], any strides. `written` (one int32, pos + 1) is what the attention takes
// as an input: the only edge ordering it after this write in MLX's graph. With them, a
// batch cache's per-sequence offsets step on: next_offset[i] = offset[i] + 1 for `offsets`
// of them (mlx-lm's `offset + 1`, which would be a launch of its own).
//
// Why in place: mlx-lm's cache writes a step's row with a slice update, which reuses the
// buffer only when nothing else holds it; while the previous step still runs on the GPU
// (mlx-lm's generators and `omlx serve` build and encode the next step meanwhile) its
// attention holds the buffer, so every layer copied its whole cache each step. The
// caller writes only rows no earlier reader saw (DecodeAttention's append).
// Launch: one thread per element of k_new and v_new, and at least `offsets`.
template <typename T>
__device__ void append(const T* k_new, const int64_t* kn_strides, const T* v_new, const int64_t* vn_strides,
                       const T* k_buf, const int64_t* kb_strides, const T* v_buf, const int64_t* vb_strides,
                       int heads, int k_dim, int v_dim, const int32_t* position, int32_t* written, int64_t total,
                       const int32_t* offset, int32_t* next_offset, int offsets) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int pos = position[0];
  if (i == 0) written[0] = pos + 1;
  if (i < offsets) next_offset[i] = offset[i] + 1;
  const int64_t keys = total / (k_dim + v_dim) * k_dim;  // the first `keys` elements are k_new's
  if (i >= total) return;
  const bool value = i >= keys;
  const int dim = value ? v_dim : k_dim;
  const int64_t e = value ? i - keys : i;
  const int d = e % dim, h = (e / dim) % heads;
  const int64_t b = e / dim / heads;
  const int64_t* ns = value ? vn_strides : kn_strides;
  const int64_t* bs = value ? vb_strides : kb_strides;
  const T* src = value ? v_new : k_new;
  T* dst = const_cast<T*>(value ? v_buf : k_buf);
  dst[b * bs[0] + h * bs[1] + (int64_t)pos * bs[2] + d * bs[3]] = src[b * ns[0] + h * ns[1] + d * ns[3]];
}

}  // namespace omlx_sdpa
