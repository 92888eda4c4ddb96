// Quantized matmul for decode-sized inputs (1..64 tokens): out[M, N] = x[M, K] @ W^T,
// W in MLX's affine layout: packed uint32 rows (BITS = 4 or 8, low bits first), one scale
// and one bias per GS consecutive inputs (w = scale * q + bias), GS = 32, 64 or 128.
//
// Why it is fast at small M: every weight byte is read once per call with 16-byte
// streaming loads, dequantized in registers, and used for all M rows at once on the
// tensor cores (mma.sync m16n8k16). The weight is the mma's A operand (16 output channels
// x 16 inputs), the activations its B operand (16 inputs x 8 tokens), so the only padding
// is tokens up to a multiple of 8. Inputs are permuted inside each 32-input chunk so that a
// thread's A fragment is a run of packed values it loaded itself: the dot product does not
// care about the order of k, as long as A and B use the same one. The activations of a
// CTA's K slice are staged once in shared memory in that permuted order (one
// conflict-free 16-byte read per B fragment). The K dimension is split across the warps of
// a CTA (reduced in shared memory, in a fixed order) and across CTAs (fp32 partials; the
// last CTA of a row tile to finish adds them in a fixed order and resets its counter):
// enough CTAs stream the weights to reach HBM bandwidth even when N is small.
//
// A fused form saves a decoder layer launches (omlx_core/kernels/decode_block.py): RES adds
// a residual to the output (both output projections), rounding as MLX's separate add does.
//
// The `header` of the mx.fast.cuda_kernel #includes this file by path; the kernel body
// only calls qmm_decode<...>() (see omlx_core/kernels/qmm_decode.py).

namespace omlx_qmm {

template <typename T> struct Pair;
template <> struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static constexpr uint32_t magic = 0x43004300u;  // (128, 128): 128 + q for a 4-bit q
};
template <> struct Pair<__half> {
  using type = __half2;
  static constexpr uint32_t magic = 0x64006400u;  // (1024, 1024): 1024 + q
};

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }

template <typename T2> __device__ __forceinline__ uint32_t bits_of(T2 v) {
  return *reinterpret_cast<uint32_t*>(&v);
}
template <typename T2> __device__ __forceinline__ T2 pair_of(uint32_t v) {
  return *reinterpret_cast<T2*>(&v);
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// 16 bytes of weights, read once: no L1 allocation, so the activations stay cached.
__device__ __forceinline__ uint4 load_stream(const uint32_t* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// (a & mask) | bits as one LOP3: written in C, ptxas splits it in two (one instruction
// takes one immediate operand, and this expression has two constants).
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t mask, uint32_t bits) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(bits));
  return d;
}

// Two 4-bit values (nibbles `shift/4` and `shift/4 + 4` of `word`) as scale * q + bias,
// in the activation type: the nibbles land in the mantissa of `magic`, subtracting it is
// exact, and the fused multiply-add rounds once.
template <typename T>
__device__ __forceinline__ uint32_t dequant4(uint32_t word, int shift, uint32_t scale2, uint32_t bias2) {
  using T2 = typename Pair<T>::type;
  const uint32_t q = and_or(word >> shift, 0x000F000Fu, Pair<T>::magic);
  T2 v = __hsub2(pair_of<T2>(q), pair_of<T2>(Pair<T>::magic));
  return bits_of(__hfma2(v, pair_of<T2>(scale2), pair_of<T2>(bias2)));
}

// Byte `i` of `word` as a float: it lands in the mantissa of 2^23, subtracting is exact.
__device__ __forceinline__ float byte_value(uint32_t word, int i) {
  return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7540 + i)) - 8388608.0f;
}

template <typename T> __device__ __forceinline__ uint32_t pack(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack<__nv_bfloat16>(float lo, float hi) {
  return bits_of(__floats2bfloat162_rn(lo, hi));
}
template <> __device__ __forceinline__ uint32_t pack<__half>(float lo, float hi) {
  return bits_of(__floats2half2_rn(lo, hi));
}

template <typename T> __device__ __forceinline__ float rounded(float v) { return to_float(from_float<T>(v)); }

// C += A B on the tensor cores. One body for both types: AB is the PTX name of the operands'.
#define OMLX_QMM_MMA(AB)                                                                     \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." AB "." AB                            \
               ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"        \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                              \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
template <typename T>
__device__ __forceinline__ void mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  OMLX_QMM_MMA("bf16");
}
template <>
__device__ __forceinline__ void mma<__half>(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  OMLX_QMM_MMA("f16");
}
#undef OMLX_QMM_MMA

// Template parameters:
//   NT  token tiles of 8 (M <= 8 * NT)      R   16-row tiles per warp
//   WR  warps along N in a CTA              WK  warps along K in a CTA
//   U   128-input blocks loaded per round   KC  most inputs of one CTA's K slice (smem)
//   SL  16-byte loads of x a thread has in flight while staging
// Launch: blockDim.x = 32 * WR * WK; gridDim.x = ceil(N / (16 * R * WR)), one column tile
// a CTA; gridDim.y = the split of K across CTAs (every slice at most KC inputs); dynamic
// shared memory: max(staged, reduced), staged = 8 * NT * KC * 2 bytes of x and reduced =
// 8 * NT * (16 * R * WR + 4) * 4 bytes for the sums, which reuse x's place once the
// products are done. K is a multiple of 32 and of GS. When gridDim.y > 1, `locks`
// holds one zero per column tile and is left zero and `partial` holds gridDim.y * M * N
// floats; with one slice per column tile neither is touched (null).
// `tile` is the column tile computed (its place in its segment).
// RES: out = T(product) + residual (M x N), as the decoder adds its residual stream.
template <typename T, int BITS, int GS, int NT, int R, int WR, int WK, int U, int KC, int SL, bool RES>
__device__ __forceinline__ void qmm_decode(
    const T* __restrict__ x, const uint32_t* __restrict__ w, const T* __restrict__ scales,
    const T* __restrict__ biases, const T* __restrict__ residual, const int32_t* locks, T* __restrict__ out,
    float* __restrict__ partial, int M, int K, int N, int tile) {
  static_assert(BITS == 4 || BITS == 8, "4 or 8 bits");
  static_assert(GS == 32 || GS == 64 || GS == 128, "group size 32, 64 or 128");
  static_assert(KC % 128 == 0, "K slices are whole 128-input blocks");
  constexpr int BN = 16 * R * WR;  // output channels of one CTA
  constexpr int BNP = BN + 4;      // padded row of the reduction buffer (no bank conflicts)
  constexpr int V = BITS / 4;      // 16-byte loads per thread, row and block (32 inputs)
  extern __shared__ uint4 smem[];
  __shared__ int last_arrival;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;  // mma fragment coordinates
  const int wr = warp % WR, wk = warp / WR;
  const int splits = gridDim.y, split = blockIdx.y;
  const int blocks = (K + 127) / 128;
  const int per_cta = (blocks + splits - 1) / splits;
  const int first = split * per_cta;
  const int own = max(0, min(per_cta, blocks - first));  // this CTA's 128-input blocks
  const int mine = own > wk ? (own - wk + WK - 1) / WK : 0;  // this warp's: wk, wk + WK, ...
  const int row0 = tile * BN + wr * 16 * R;
  const size_t row_words = (size_t)K * BITS / 32;
  const int groups = K / GS;

  // One round of a warp's weights (U blocks of 128 inputs x R 16-row tiles), in registers.
  // Two rounds are held: the next one's loads are in flight while this one is computed, so
  // HBM is streaming all the while, not only between a CTA's start and its first mma.
  struct Round {
    uint4 wv[U][R][2][V];
    T sc[U][R][2], bi[U][R][2];
  };
  Round ping, pong;

  auto load = [&](Round& rd, int round) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = round + u;
      const int k = (first + wk + WK * i) * 128 + t * 32;  // this thread's 32 inputs
      const bool valid = i < mine && k < K;
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = row0 + r * 16 + g + 8 * h;
          if (valid && row < N) {
            const uint32_t* src = w + row * row_words + k * BITS / 32;
#pragma unroll
            for (int v = 0; v < V; ++v) rd.wv[u][r][h][v] = load_stream(src + 4 * v);
            rd.sc[u][r][h] = scales[(size_t)row * groups + k / GS];
            rd.bi[u][r][h] = biases[(size_t)row * groups + k / GS];
          } else {
#pragma unroll
            for (int v = 0; v < V; ++v) rd.wv[u][r][h][v] = make_uint4(0, 0, 0, 0);
            rd.sc[u][r][h] = from_float<T>(0.0f);
            rd.bi[u][r][h] = from_float<T>(0.0f);
          }
        }
      }
    }
  };

  load(ping, 0);  // the first two rounds are in flight while the activations are staged
  load(pong, U);

  // Stage x[:, slice] as [block][chunk j][token tile][token][thread t] of 16-byte units,
  // the 8 inputs of each unit in the order (0, 4, 1, 5, 2, 6, 3, 7). Only the M real token
  // rows are staged: an mma output column depends on its own B column alone, so whatever
  // the unstaged rows hold reaches only outputs that are never written. Consecutive threads
  // take consecutive units of that layout (t, then token, then chunk, then block), so when
  // the tokens fill their tiles of 8 each store of 8 threads fills 128 contiguous bytes: no
  // bank conflicts, where the order of x itself (its rows 2 KB apart) put four threads on
  // each bank (on the H200 this measured neutral: docs/benchmarks/decode-h200-staging.json;
  // copying with cp.async instead, every unit in flight at once and reordered in place, was
  // slower there at every layer of 16-64 tokens). The tokens are counted up to a power of
  // two, so a unit's place is shifts and masks: a division by M cost more instructions
  // than the copy itself (at 32 tokens the staging was 45% of the kernel's instructions).
  // Loads go out in batches of SL, so their latencies overlap instead of adding up: x
  // comes from L2, and at 32 tokens a thread copies 16 units; in batches of 2 the wait for
  // them was a quarter of the kernel's time (Nsight Compute's stall samples on the H200,
  // decode-h200-qmm-ncu.json).
  const int lg = M > 1 ? 32 - __clz(M - 1) : 0;  // log2 of the token slots
  const int k0 = first * 128;
  const int units = (per_cta * 16) << lg;
  for (int base = threadIdx.x; base < units; base += SL * blockDim.x) {
    uint4 v[SL];
#pragma unroll
    for (int u = 0; u < SL; ++u) {
      const int idx = base + u * blockDim.x;
      const int m = (idx >> 2) & ((1 << lg) - 1), chunk = idx >> (2 + lg);  // chunk: 4 * block + j
      const int k = k0 + (chunk >> 2) * 128 + (idx & 3) * 32 + (chunk & 3) * 8;
      v[u] = make_uint4(0, 0, 0, 0);
      if (idx < units && m < M && k < K) v[u] = *reinterpret_cast<const uint4*>(x + (size_t)m * K + k);
    }
#pragma unroll
    for (int u = 0; u < SL; ++u) {
      const int idx = base + u * blockDim.x;
      const int m = (idx >> 2) & ((1 << lg) - 1), chunk = idx >> (2 + lg);
      if (idx >= units) break;
      if (m >= M) continue;
      uint4 p;
      p.x = __byte_perm(v[u].x, v[u].z, 0x5410);
      p.y = __byte_perm(v[u].x, v[u].z, 0x7632);
      p.z = __byte_perm(v[u].y, v[u].w, 0x5410);
      p.w = __byte_perm(v[u].y, v[u].w, 0x7632);
      smem[((chunk * NT + (m >> 3)) * 8 + (m & 7)) * 4 + (idx & 3)] = p;
    }
  }
  __syncthreads();

  float acc[R][NT][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][n][e] = 0.0f;

  using T2 = typename Pair<T>::type;
  auto compute = [&](const Round& rd, int round) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (round + u >= mine) break;
      const int bl = wk + WK * (round + u);  // block within the CTA's slice
      uint32_t s2[R][2], b2[R][2];
      float sf[R][2], bf[R][2];
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          s2[r][h] = bits_of(T2(rd.sc[u][r][h], rd.sc[u][r][h]));
          b2[r][h] = bits_of(T2(rd.bi[u][r][h], rd.bi[u][r][h]));
          sf[r][h] = to_float(rd.sc[u][r][h]);
          bf[r][h] = to_float(rd.bi[u][r][h]);
        }
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // 8 inputs per thread, two mma k-steps
        uint4 b[NT];
#pragma unroll
        for (int n = 0; n < NT; ++n) b[n] = smem[((bl * 4 + j) * NT + n) * 32 + lane];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          uint32_t a0[4], a1[4];  // A fragments of k-steps 2j and 2j + 1
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if constexpr (BITS == 4) {
              const uint32_t word = word_of(rd.wv[u][r][h][0], j);
              a0[h] = dequant4<T>(word, 0, s2[r][h], b2[r][h]);
              a0[2 + h] = dequant4<T>(word, 4, s2[r][h], b2[r][h]);
              a1[h] = dequant4<T>(word, 8, s2[r][h], b2[r][h]);
              a1[2 + h] = dequant4<T>(word, 12, s2[r][h], b2[r][h]);
            } else {
              const uint32_t lo = word_of(rd.wv[u][r][h][j >> 1], (2 * j) & 3);
              const uint32_t hi = word_of(rd.wv[u][r][h][j >> 1], (2 * j + 1) & 3);
              float q[8];
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                q[e] = fmaf(byte_value(lo, e), sf[r][h], bf[r][h]);
                q[4 + e] = fmaf(byte_value(hi, e), sf[r][h], bf[r][h]);
              }
              a0[h] = pack<T>(q[0], q[4]);
              a0[2 + h] = pack<T>(q[1], q[5]);
              a1[h] = pack<T>(q[2], q[6]);
              a1[2 + h] = pack<T>(q[3], q[7]);
            }
          }
#pragma unroll
          for (int n = 0; n < NT; ++n) {
            mma<T>(acc[r][n], a0, b[n].x, b[n].y);
            mma<T>(acc[r][n], a1, b[n].z, b[n].w);
          }
        }
      }
    }
  };
  for (int round = 0; round < mine; round += 2 * U) {
    compute(ping, round);
    if (round + 2 * U < mine) load(ping, round + 2 * U);
    if (round + U >= mine) break;
    compute(pong, round + U);
    if (round + 3 * U < mine) load(pong, round + 3 * U);
  }

  // Reduce the K-warps in a fixed order: [token][channel] floats in shared memory, in x's
  // place (every warp is past its products after the barrier).
  float* red = reinterpret_cast<float*>(smem);
  __syncthreads();
  for (int step = 0; step < WK; ++step) {
    if (wk == step) {
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int channel = wr * 16 * R + r * 16 + g + 8 * (e >> 1);
            const int token = n * 8 + 2 * t + (e & 1);
            float* p = red + token * BNP + channel;
            *p = step == 0 ? acc[r][n][e] : *p + acc[r][n][e];
          }
    }
    __syncthreads();
  }

  const int col0 = tile * BN;
  const int width = min(BN, N - col0);
  // The output in T; with RES plus the residual, one more rounding as MLX's separate add.
  auto store = [&](int m, int col, float value) {
    const size_t at = (size_t)m * N + col;
    if constexpr (RES) {
      out[at] = from_float<T>(rounded<T>(value) + to_float(residual[at]));
    } else {
      out[at] = from_float<T>(value);
    }
  };
  if (splits == 1) {
    for (int idx = threadIdx.x; idx < M * BN; idx += blockDim.x) {
      const int m = idx / BN, c = idx - m * BN;
      if (c < width) store(m, col0 + c, red[m * BNP + c]);
    }
    return;
  }

  // Split K across CTAs: publish this slice's sums; the last CTA of the row tile adds all
  // slices in order (so the result does not depend on which CTA finished last).
  for (int idx = threadIdx.x; idx < M * BN; idx += blockDim.x) {
    const int m = idx / BN, c = idx - m * BN;
    if (c < width) partial[((size_t)split * M + m) * N + col0 + c] = red[m * BNP + c];
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int before = atomicAdd(const_cast<int32_t*>(locks) + tile, 1);
    last_arrival = before == splits - 1;
  }
  __syncthreads();
  if (!last_arrival) return;
  __threadfence();
  // Each output adds the slices in order (a result that does not depend on which CTA came
  // last). A thread takes OUTS outputs at once and loads four slices of each before adding:
  // 4 * OUTS loads in flight from L2. With four (one output at a time) the loads of the sum
  // were a quarter of the 64-token kernel's stall samples on an H100
  // (docs/benchmarks/decode-h100-profile.json).
  constexpr int OUTS = 4;
  const size_t stride = (size_t)M * N;
  for (int base = threadIdx.x; base < M * BN; base += OUTS * blockDim.x) {
    const float* p[OUTS];
    bool live[OUTS];
    float sum[OUTS];
#pragma unroll
    for (int o = 0; o < OUTS; ++o) {
      const int idx = base + o * blockDim.x, m = idx / BN, c = idx - m * BN;
      live[o] = idx < M * BN && c < width;
      p[o] = partial + (size_t)(live[o] ? m : 0) * N + col0 + (live[o] ? c : 0);
      sum[o] = 0.0f;
    }
    for (int s = 0; s < splits; s += 4) {
      float v[4][OUTS];
#pragma unroll
      for (int q = 0; q < 4; ++q)
#pragma unroll
        for (int o = 0; o < OUTS; ++o) v[q][o] = live[o] && s + q < splits ? __ldcg(p[o] + (s + q) * stride) : 0.0f;
#pragma unroll
      for (int q = 0; q < 4; ++q)
#pragma unroll
        for (int o = 0; o < OUTS; ++o)
          if (s + q < splits) sum[o] += v[q][o];
    }
#pragma unroll
    for (int o = 0; o < OUTS; ++o) {
      const int idx = base + o * blockDim.x, m = idx / BN, c = idx - m * BN;
      if (live[o]) store(m, col0 + c, sum[o]);
    }
  }
  if (threadIdx.x == 0) atomicExch(const_cast<int32_t*>(locks) + tile, 0);
}

// S linears of one input in one launch (q/k/v, or gate/up): segment s has its own weights,
// scales, biases, N[s] rows and output. The column tiles are the segments' tiles one after
// another (each with its segment's counters, the segments' tiles following each other in
// `locks`, and its partials, gridDim.y * M * N[s] floats per segment, one after another).
// One launch instead of S: a decode step pays the host for every launch, and each launch's
// ramp and tail on the GPU.
// RES (see qmm_decode) takes one segment: an output projection.
template <typename T, int BITS, int GS, int NT, int R, int WR, int WK, int U, int KC, int S, int SL,
          bool RES = false>
__device__ __forceinline__ void qmm_decode_segments(
    const T* __restrict__ x, const uint32_t* const (&w)[S], const T* const (&scales)[S],
    const T* const (&biases)[S], const int (&N)[S], const T* residual, const int32_t* locks,
    T* const (&out)[S], float* partial, int M, int K) {
  static_assert(S == 1 || !RES, "a residual takes one linear");
  constexpr int BN = 16 * R * WR;
  // Every index below is a constant once unrolled: the pointers stay in registers.
  int tile = blockIdx.x;
  const int32_t* lk = locks;
  float* part = partial;
  const uint32_t* ws = w[0];
  const T *ss = scales[0], *bs = biases[0];
  T* os = out[0];
  int n = N[0];
  bool found = false;
#pragma unroll
  for (int i = 0; i < S; ++i) {
    const int tiles = (N[i] + BN - 1) / BN;
    if (!found && tile < tiles) {
      found = true;
      ws = w[i], ss = scales[i], bs = biases[i], os = out[i], n = N[i];
    } else if (!found) {
      tile -= tiles;
      if (lk != nullptr) lk += tiles;
      if (part != nullptr) part += (size_t)gridDim.y * M * N[i];
    }
  }
  if (!found) return;  // never for a grid of the segments' tiles
  qmm_decode<T, BITS, GS, NT, R, WR, WK, U, KC, SL, RES>(x, ws, ss, bs, residual, lk, os, part, M, K, n, tile);
}

}  // namespace omlx_qmm
