// Attention for one new token per sequence (decode) with grouped-query heads:
// out[b, h] = softmax(scale * q[b, h] . k[b, h / G]^T) v[b, h / G], for the G query heads
// that share each key/value head.
//
// Why: a decode step reads the whole K/V cache once per layer, and that read is the
// attention's whole cost. cuDNN's decode path (a 16x128x128 flash tile, by its kernel's
// name) reaches 1.2 TB/s of K/V on the H200 at batch 32, as if it streamed a key/value head
// once for each query head sharing it. Here one CTA takes one key/value head and all its G
// query heads, so every cached byte is read once; the cache's sequence axis is split across
// CTAs (each a slice of at most CHUNK keys) so that a batch of one still fills the GPU.
//
// Per CTA: the G queries, pre-scaled by scale * log2(e), live in registers. Phase 1: D/8
// threads take one key (8 dims each, one 16-byte load; 4 keys a thread in flight at once),
// dot it with the G queries and reduce across their group; the slice's scores go to shared
// memory. Phase 2: a warp per query head takes the slice's max and the sum of 2^(s - max).
// Phase 3: D/8 threads take one value row and accumulate p * v for the G heads; the key
// slots are then summed in shared memory. With one slice the CTA writes out = acc / sum;
// with several it publishes (max, sum, acc) in fp32 and the last CTA of the head (a counter
// per head, left zero) combines the slices in a fixed order, so the result does not depend
// on which CTA finished last.
//
// Inputs may be strided views (a KV cache's keys[..., :offset, :], read in place: copying
// the cache to a contiguous array would cost more than the attention).

namespace omlx_sdpa {

constexpr float LOG2E = 1.4426950408889634f;

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }

// Eight consecutive elements of a row as floats: one 16-byte load when they are contiguous
// and aligned (a cache's rows are), else one load each.
template <typename T>
__device__ __forceinline__ void load8(const T* p, int64_t stride, float (&f)[8]) {
  if (stride == 1 && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = to_float(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = to_float(p[i * stride]);
  }
}

// This thread's 8 dims of rows base + u * SLOTS + slot (u < U) of a key/value head's
// slice that starts at row t0 (`head` points at the thread's dims of row 0); rows past
// the slice's n stay as given. The U loads are in flight together: one row's latency per
// U rows, not per row.
template <int U, int SLOTS, typename T>
__device__ __forceinline__ void load_rows(const T* head, const int64_t* strides, int t0, int base, int slot, int n,
                                          float (&f)[U][8]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int t = base + u * SLOTS + slot;
    if (t < n) load8(head + (int64_t)(t0 + t) * strides[2], strides[3], f[u]);
  }
}

// Template parameters: T the activation type, D the head size (64 or 128), G query heads
// per key/value head (1..8), CHUNK the most keys of one CTA's slice. Launch: 128 threads;
// gridDim.x = batch * key/value heads, gridDim.y = the slices (each at most CHUNK keys).
// q [B, Hq, 1, D], k and v [B, Hkv, T, D] with any strides; out [B, Hq, 1, D] contiguous;
// sequence b's keys begin at starts[b] (a batch cache's left padding: 0 for none);
// with more than one slice `locks` holds B * Hkv zeros (left zero) and `partial` has
// gridDim.y * B * Hq * (D + 2) floats.
template <typename T, int D, int G, int CHUNK>
__device__ __forceinline__ void decode(
    const T* __restrict__ q, const int64_t* q_strides, const T* __restrict__ k, const int64_t* k_strides,
    const T* __restrict__ v, const int64_t* v_strides, float scale, const int32_t* starts,
    const int32_t* locks, T* __restrict__ out, float* __restrict__ partial, int Hkv, int keys) {
  static_assert(D == 64 || D == 128, "head size 64 or 128");
  static_assert(G >= 1 && G <= 8, "1 to 8 query heads per key/value head");
  constexpr int THREADS = 128;
  constexpr int LANES = D / 8;            // threads per key row
  constexpr int SLOTS = THREADS / LANES;  // rows a CTA takes at once
  constexpr int U = 4;                    // rows a thread loads at once
  static_assert(SLOTS * G * D <= G * CHUNK, "the slot sums fit in the score buffer");

  __shared__ float scores[G * CHUNK];  // phase 1-3: [G][CHUNK]; phase 3 end: [SLOTS][G][D]
  __shared__ float row_max[G], row_sum[G];
  __shared__ int last_arrival;

  const int tid = threadIdx.x, lane = tid % LANES, slot = tid / LANES;
  const int head = blockIdx.x, b = head / Hkv, kvh = head % Hkv;
  const int splits = gridDim.y, split = blockIdx.y;
  const int per_cta = (keys + splits - 1) / splits;
  const int t0 = split * per_cta, t1 = min(keys, t0 + per_cta);
  const int n = max(0, t1 - t0);
  const int first = starts[b] - t0;  // the sequence's keys begin here (left padding before)
  const int Hq = Hkv * G;

  // The G queries' dims [8 * lane, 8 * lane + 8), times scale * log2(e).
  float qr[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const T* qp = q + b * q_strides[0] + (kvh * G + g) * q_strides[1] + 8 * lane * q_strides[3];
    load8(qp, q_strides[3], qr[g]);
#pragma unroll
    for (int i = 0; i < 8; ++i) qr[g][i] *= scale * LOG2E;
  }

  // Phase 1: scores of the slice's keys, U rows per thread at a time.
  const T* kb = k + b * k_strides[0] + kvh * k_strides[1] + 8 * lane * k_strides[3];
  for (int base = 0; base < n; base += U * SLOTS) {  // the same trips for every thread: whole-warp shuffles
    float kf[U][8] = {};
    load_rows<U, SLOTS>(kb, k_strides, t0, base, slot, n, kf);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = base + u * SLOTS + slot;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) s = fmaf(qr[g][i], kf[u][i], s);
#pragma unroll
        for (int width = LANES / 2; width > 0; width /= 2) s += __shfl_xor_sync(0xffffffffu, s, width);
        if (t < n && lane == 0) scores[g * CHUNK + t] = t >= first ? s : -INFINITY;
      }
    }
  }
  __syncthreads();

  // Phase 2: each query head's max and sum over the slice; scores become 2^(s - max).
  const int warp = tid / 32, wl = tid % 32;
  for (int g = warp; g < G; g += THREADS / 32) {
    float m = -INFINITY;
    for (int t = wl; t < n; t += 32) m = fmaxf(m, scores[g * CHUNK + t]);
#pragma unroll
    for (int width = 16; width > 0; width /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, width));
    float l = 0.0f;
    for (int t = wl; t < n; t += 32) {  // a slice of padding only: every p is 0 (no inf - inf)
      const float p = m == -INFINITY ? 0.0f : exp2f(scores[g * CHUNK + t] - m);
      scores[g * CHUNK + t] = p;
      l += p;
    }
#pragma unroll
    for (int width = 16; width > 0; width /= 2) l += __shfl_xor_sync(0xffffffffu, l, width);
    if (wl == 0) row_max[g] = m, row_sum[g] = l;
  }
  __syncthreads();

  // Phase 3: p * v over the slice, per key slot, then the slots summed.
  float acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[g][i] = 0.0f;
  const T* vb = v + b * v_strides[0] + kvh * v_strides[1] + 8 * lane * v_strides[3];
  for (int base = 0; base < n; base += U * SLOTS) {
    float vf[U][8] = {};
    load_rows<U, SLOTS>(vb, v_strides, t0, base, slot, n, vf);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = base + u * SLOTS + slot;
      if (t >= n) break;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float p = scores[g * CHUNK + t];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(p, vf[u][i], acc[g][i]);
      }
    }
  }
  __syncthreads();  // every score read: the buffer now takes the slots' sums
  float* sums = scores;  // [SLOTS][G][D]
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int i = 0; i < 8; ++i) sums[(slot * G + g) * D + 8 * lane + i] = acc[g][i];
  __syncthreads();

  if (splits == 1) {
    for (int idx = tid; idx < G * D; idx += THREADS) {
      const int g = idx / D, d = idx % D;
      float total = 0.0f;
      for (int s = 0; s < SLOTS; ++s) total += sums[(s * G + g) * D + d];
      out[((int64_t)b * Hq + kvh * G + g) * D + d] = from_float<T>(total / row_sum[g]);
    }
    return;
  }

  // Several slices: publish (max, sum, acc) of this one; the last CTA of the head combines.
  const int64_t rows = (int64_t)gridDim.x * G;  // B * Hq: a slice's rows in `partial`
  for (int idx = tid; idx < G * (D + 2); idx += THREADS) {
    const int g = idx / (D + 2), d = idx % (D + 2);
    const int64_t row = (int64_t)b * Hq + kvh * G + g;
    float value;
    if (d == D) {
      value = row_max[g];
    } else if (d == D + 1) {
      value = row_sum[g];
    } else {
      value = 0.0f;
      for (int s = 0; s < SLOTS; ++s) value += sums[(s * G + g) * D + d];
    }
    partial[(split * rows + row) * (D + 2) + d] = value;
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) last_arrival = atomicAdd(const_cast<int32_t*>(locks) + head, 1) == splits - 1;
  __syncthreads();
  if (!last_arrival) return;
  __threadfence();
  for (int idx = tid; idx < G * D; idx += THREADS) {
    const int g = idx / D, d = idx % D;
    const int64_t row = (int64_t)b * Hq + kvh * G + g;  // this query head among B * Hq
    float m = -INFINITY;
    for (int s = 0; s < splits; ++s) m = fmaxf(m, __ldcg(partial + (s * rows + row) * (D + 2) + D));
    float l = 0.0f, o = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const float* p = partial + (s * rows + row) * (D + 2);
      const float w = __ldcg(p + D) == -INFINITY ? 0.0f : exp2f(__ldcg(p + D) - m);
      l = fmaf(__ldcg(p + D + 1), w, l);
      o = fmaf(__ldcg(p + d), w, o);
    }
    out[row * D + d] = from_float<T>(o / l);
  }
  if (tid == 0) atomicExch(const_cast<int32_t*>(locks) + head, 0);
}

}  // namespace omlx_sdpa

// ---- body ----
  omlx_sdpa::decode<T, D, G, CHUNK>(q, q_strides.data(), k, k_strides.data(), v, v_strides.data(), scale[0],
                                    starts, locks, out, partial, k_shape[1], k_shape[2]);
