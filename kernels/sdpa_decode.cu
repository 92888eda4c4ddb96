// Attention for one new token per sequence (decode) with grouped-query heads:
// out[b, h] = softmax(scale * q[b, h] . k[b, h / G]^T) v[b, h / G], for the G query heads
// that share each key/value head.
//
// Why: a decode step reads the whole K/V cache once per layer, and that read is the
// attention's whole cost. One CTA takes one key/value head and all its G query heads, so
// every cached byte is read once; the cache's sequence axis is split across CTAs (slices)
// so that a small batch still fills the GPU.
//
// One pass (flash decoding): D/8 threads take one key row and its value row (8 dims each,
// one 16-byte load of each), U rows a thread in flight at once, so a thread has 2 * U loads
// outstanding. The score of a row reduces across its D/8 threads with shuffles; each row
// slot keeps, per query head, a running max, a running sum of 2^(s - max) and its p * v,
// rescaled when the max grows. The CTA's slots are merged in shared memory. With one slice
// the CTA writes out = acc / sum; with several it publishes (max, sum, acc) in fp32 and the
// last CTA of the head (a counter per head, left zero) combines the slices in a fixed order,
// so the result does not depend on which CTA finished last.
//
// Left padding (a batch cache's `starts`) is never read: its rows may hold anything, NaN
// included (a padded query row of a prefill attends to nothing), and 0 * NaN is NaN.
// Inputs may be strided views (a KV cache's keys[..., :offset, :], read in place: copying
// the cache to a contiguous array would cost more than the attention).

namespace omlx_sdpa {

constexpr float LOG2E = 1.4426950408889634f;

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }

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

template <typename T>
__device__ __forceinline__ void unpack8(const uint4& raw, float (&f)[8]) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = to_float(e[i]);
}

// Exponent base 2 that takes 2^(-inf - -inf) as 0 (a slot that has seen no row yet).
__device__ __forceinline__ float weight(float s, float m) { return s == -INFINITY ? 0.0f : exp2f(s - m); }

// Template parameters: T the activation type, D the head size (64 or 128), G query heads
// per key/value head (1..8), U rows a thread loads at once. Launch: 128 threads; gridDim.x = batch * key/value heads,
// gridDim.y = the slices of the cache's length. q [B, Hq, 1, D], k and v [B, Hkv, T, D]
// with any strides; out [B, Hq, 1, D] contiguous; sequence b's keys begin at starts[b] (a
// batch cache's left padding: 0 for none); with more than one slice `locks` holds
// B * Hkv zeros (left zero) and `partial` has gridDim.y * B * Hq * (D + 2) floats.
template <typename T, int D, int G, int U>
__device__ __forceinline__ void decode(
    const T* __restrict__ q, const int64_t* q_strides, const T* __restrict__ k, const int64_t* k_strides,
    const T* __restrict__ v, const int64_t* v_strides, float scale, const int32_t* starts,
    const int32_t* locks, T* __restrict__ out, float* __restrict__ partial, int Hkv, int keys) {
  static_assert(D == 64 || D == 128, "head size 64 or 128");
  static_assert(G >= 1 && G <= 8, "1 to 8 query heads per key/value head");
  constexpr int THREADS = 128;
  constexpr int LANES = D / 8;            // threads per row
  constexpr int SLOTS = THREADS / LANES;  // rows a CTA takes at once

  __shared__ float slot_max[SLOTS][G], slot_sum[SLOTS][G];
  __shared__ float slot_acc[SLOTS][G][D];
  __shared__ float row_max[G], row_sum[G];
  __shared__ int last_arrival;

  const int tid = threadIdx.x, lane = tid % LANES, slot = tid / LANES;
  const int head = blockIdx.x, b = head / Hkv, kvh = head % Hkv;
  const int splits = gridDim.y, split = blockIdx.y;
  const int per_cta = (keys + splits - 1) / splits;
  const int t1 = min(keys, (split + 1) * per_cta);
  const int t0 = max(split * per_cta, starts[b]);  // the slice's rows past the padding
  const int Hq = Hkv * G;

  // The G queries' dims [8 * lane, 8 * lane + 8), times scale * log2(e).
  float qr[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    unpack8<T>(load8(q + b * q_strides[0] + (kvh * G + g) * q_strides[1] + 8 * lane * q_strides[3], q_strides[3]),
               qr[g]);
#pragma unroll
    for (int i = 0; i < 8; ++i) qr[g][i] *= scale * LOG2E;
  }

  float m[G], l[G], acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY, l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[g][i] = 0.0f;
  }

  const T* kb = k + b * k_strides[0] + kvh * k_strides[1] + 8 * lane * k_strides[3];
  const T* vb = v + b * v_strides[0] + kvh * v_strides[1] + 8 * lane * v_strides[3];
  for (int base = t0; base < t1; base += U * SLOTS) {  // the same trips for every thread: whole-warp shuffles
    uint4 kr[U], vr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = base + u * SLOTS + slot;
      if (t < t1) {
        kr[u] = load8(kb + (int64_t)t * k_strides[2], k_strides[3]);
        vr[u] = load8(vb + (int64_t)t * v_strides[2], v_strides[3]);
      }
    }
    float s[U][G];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[8];
      unpack8<T>(kr[u], kf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) dot = fmaf(qr[g][i], kf[i], dot);
#pragma unroll
        for (int width = LANES / 2; width > 0; width /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, width);
        s[u][g] = base + u * SLOTS + slot < t1 ? dot : -INFINITY;
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float top = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u) top = fmaxf(top, s[u][g]);
      const float rescale = weight(m[g], top);
      l[g] *= rescale;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[g][i] *= rescale;
      m[g] = top;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + u * SLOTS + slot >= t1) break;
      float vf[8];
      unpack8<T>(vr[u], vf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float p = weight(s[u][g], m[g]);
        l[g] += p;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(p, vf[i], acc[g][i]);
      }
    }
  }

  // The slots merged: each query head's max over the CTA, its sum and p * v rescaled to it.
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) slot_max[slot][g] = m[g], slot_sum[slot][g] = l[g];
#pragma unroll
    for (int i = 0; i < 8; ++i) slot_acc[slot][g][8 * lane + i] = acc[g][i];
  }
  __syncthreads();
  if (tid < G) {
    float top = -INFINITY, total = 0.0f;
    for (int s = 0; s < SLOTS; ++s) top = fmaxf(top, slot_max[s][tid]);
    for (int s = 0; s < SLOTS; ++s) total = fmaf(slot_sum[s][tid], weight(slot_max[s][tid], top), total);
    row_max[tid] = top, row_sum[tid] = total;
  }
  __syncthreads();
  auto merged = [&](int g, int d) {
    float total = 0.0f;
    for (int s = 0; s < SLOTS; ++s) total = fmaf(slot_acc[s][g][d], weight(slot_max[s][g], row_max[g]), total);
    return total;
  };

  if (splits == 1) {
    for (int idx = tid; idx < G * D; idx += THREADS) {
      const int g = idx / D, d = idx % D;
      out[((int64_t)b * Hq + kvh * G + g) * D + d] = from_float<T>(merged(g, d) / row_sum[g]);
    }
    return;
  }

  // Several slices: publish (max, sum, acc) of this one; the last CTA of the head combines.
  const int64_t rows = (int64_t)gridDim.x * G;  // B * Hq: a slice's rows in `partial`
  for (int idx = tid; idx < G * (D + 2); idx += THREADS) {
    const int g = idx / (D + 2), d = idx % (D + 2);
    const int64_t row = (int64_t)b * Hq + kvh * G + g;
    partial[(split * rows + row) * (D + 2) + d] = d == D ? row_max[g] : d == D + 1 ? row_sum[g] : merged(g, d);
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
    float top = -INFINITY;
    for (int s = 0; s < splits; ++s) top = fmaxf(top, __ldcg(partial + (s * rows + row) * (D + 2) + D));
    float total = 0.0f, o = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const float* p = partial + (s * rows + row) * (D + 2);
      const float w = weight(__ldcg(p + D), top);  // a slice of padding only weighs 0
      total = fmaf(__ldcg(p + D + 1), w, total);
      o = fmaf(__ldcg(p + d), w, o);
    }
    out[row * D + d] = from_float<T>(o / total);
  }
  if (tid == 0) atomicExch(const_cast<int32_t*>(locks) + head, 0);
}

}  // namespace omlx_sdpa

// ---- body ----
  omlx_sdpa::decode<T, D, G, U>(q, q_strides.data(), k, k_strides.data(), v, v_strides.data(), scale[0], starts, locks,
                                out, partial, k_shape[1], k_shape[2]);
