// Fused deepseek_v41 indexer score for mx.fast.cuda_kernel (omlx_core/kernels/indexer_score.py).
//
//   out[b, i, n] = sum_h w[b, i, h] * relu(q[b, i, h] . k[b, n]) * scale   if n < lens[i]
//                = -inf                                                    otherwise
//
// without the [batch, length, heads, entries] tensor mlx-lm materializes. A block owns
// 256 entries (8 warps x 32) of one batch row and a range of queries; each warp keeps its
// 32 keys on chip for the block's whole life (as tensor-core B fragments in registers) and
// streams the queries through shared memory (double-buffered cp.async). Per query, one
// warp computes the 64 heads x 32 entries dot products with bf16/f16 mma.sync and fp32
// accumulation, then reduces over heads in registers.
//
// Exactness against mlx-lm's ops on MLX's CUDA backend:
// - relu, the scale and the head weight are applied as separate round-to-nearest fp32
//   operations (__fmul_rn: no FMA contraction), as the separate MLX ops do;
// - the sum over heads follows the order of MLX's column reduction (col_reduce_looped,
//   32 rows at a time, then a shfl_xor warp tree with masks 16, 8, 4, 2, 1):
//   t_j = (0 + v_j) + v_{j+32}, then the tree over j. With the mma layout (lane = 4g + c
//   holds heads g + 8m) the first three tree levels are in-thread and the last three are
//   shfl_xor 16, 8, 4 — the same additions in the same order;
// - the dot products match whenever they are exact in fp32, which is the case for
//   mlx-lm's fp4 fake-quantized q and index keys (products of two fp4 values with
//   power-of-two block scales sum exactly); for other inputs they may differ by rounding.
// Needs heads == 64 and head_dim % 16 == 0 (the caller checks and falls back to ops).
//
// The text before the body marker is the kernel's `header`, the rest its `source`.

namespace omlx_indexer {

__device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                    bool bf16) {
  if (bf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* shared) {
  unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

__device__ __forceinline__ void copy16(void* shared, const void* global) {
  unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(global));
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int PENDING>
__device__ __forceinline__ void wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

// MLX's maximum(x, 0): NaN stays, -0 becomes +0.
__device__ __forceinline__ float relu(float x) { return (x > 0.0f || x != x) ? x : 0.0f; }

}  // namespace omlx_indexer

// ---- body ----
  using namespace omlx_indexer;
  constexpr int H = 64;
  constexpr int WARPS = 8;
  constexpr int TILE_N = WARPS * 32;
  constexpr int ROW = D + 8;  // padded shared row: conflict-free ldmatrix
  constexpr int KSTEPS = D / 16;
  constexpr int CHUNKS = H * D / 8;  // 16-byte pieces of one query's q
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");

  __shared__ __align__(16) T q_tile[2][H * ROW];
  __shared__ __align__(16) float w_tile[2][H];

  const int L = q_shape[1];
  const int N = keys_shape[1];
  const int b = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane >> 2;
  const int c = lane & 3;
  const int warp_n0 = blockIdx.x * TILE_N + warp * 32;
  const int per_block = (L + gridDim.y - 1) / gridDim.y;
  const int i_begin = blockIdx.y * per_block;
  const int i_end = min(L, i_begin + per_block);
  if (i_begin >= i_end) {
    return;  // the whole block: no barrier is skipped by part of it
  }

  const T* qb = q + (int64_t)b * L * H * D;
  const T* kb = keys + (int64_t)b * N * D;
  const float* wb = weights + (int64_t)b * L * H;
  float* ob = out + (int64_t)b * L * N;
  const float sc = scale[0];

  // This warp's 32 keys as mma B fragments, for the block's life.
  unsigned kf[4][KSTEPS][2];
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int n = warp_n0 + nt * 8 + g;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      if (n < N) {
        const unsigned* row = reinterpret_cast<const unsigned*>(kb + (int64_t)n * D + ks * 16 + 2 * c);
        kf[nt][ks][0] = row[0];
        kf[nt][ks][1] = row[4];
      } else {
        kf[nt][ks][0] = 0u;
        kf[nt][ks][1] = 0u;
      }
    }
  }

  auto load = [&](int buffer, int i) {
    for (int chunk = threadIdx.x; chunk < CHUNKS; chunk += WARPS * 32) {
      const int row = chunk / (D / 8);
      const int col = (chunk % (D / 8)) * 8;
      copy16(&q_tile[buffer][row * ROW + col], qb + ((int64_t)i * H + row) * D + col);
    }
    if (threadIdx.x < H / 4) {
      copy16(&w_tile[buffer][threadIdx.x * 4], wb + (int64_t)i * H + threadIdx.x * 4);
    }
    commit();
  };

  load(0, i_begin);
  for (int i = i_begin; i < i_end; ++i) {
    const int buffer = (i - i_begin) & 1;
    if (i + 1 < i_end) {
      load(buffer ^ 1, i + 1);
      wait<1>();
    } else {
      wait<0>();
    }
    __syncthreads();

    const int visible = lens[i];
    float result[4][2];
    if (visible > warp_n0) {
      float acc[4][4][4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
        unsigned qf[4][4];
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          ldmatrix_x4(qf[mt], &q_tile[buffer][(mt * 16 + (lane & 15)) * ROW + ks * 16 + (lane >> 4) * 8]);
        }
#pragma unroll
        for (int mt = 0; mt < 4; ++mt)
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) mma(acc[mt][nt], qf[mt], kf[nt][ks], IS_BF16);
      }
      // This lane holds heads g + 8m (m = 0..7): m-tile m / 2, upper rows when m is odd.
      float wv[8];
#pragma unroll
      for (int m = 0; m < 8; ++m) wv[m] = w_tile[buffer][g + 8 * m];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int col = 0; col < 2; ++col) {
          float v[8];
#pragma unroll
          for (int m = 0; m < 8; ++m) {
            const float s = acc[m / 2][nt][(m % 2) * 2 + col];
            v[m] = __fmul_rn(__fmul_rn(relu(s), sc), wv[m]);
          }
          float t[4];  // t_j = (0 + v_j) + v_{j+32}, j = g + 8m
#pragma unroll
          for (int m = 0; m < 4; ++m) t[m] = __fadd_rn(__fadd_rn(0.0f, v[m]), v[m + 4]);
          // tree level 16 (j, j+16), level 8 (j, j+8): in this thread
          float x = __fadd_rn(__fadd_rn(t[0], t[2]), __fadd_rn(t[1], t[3]));
          // levels 4, 2, 1 over g: lanes 16, 8, 4 apart
          x = __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, 16));
          x = __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, 8));
          x = __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, 4));
          result[nt][col] = x;
        }
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) result[nt][0] = result[nt][1] = 0.0f;
    }

    // Every lane holds every sum; lanes g < 4 store n-tile g (32 consecutive entries).
    if (g < 4) {
      float r0 = result[0][0], r1 = result[0][1];
#pragma unroll
      for (int nt = 1; nt < 4; ++nt) {
        if (nt == g) {
          r0 = result[nt][0];
          r1 = result[nt][1];
        }
      }
      const int n = warp_n0 + g * 8 + 2 * c;
      float* row = ob + (int64_t)i * N;
      if (n < N) row[n] = n < visible ? r0 : __int_as_float(0xff800000);
      if (n + 1 < N) row[n + 1] = n + 1 < visible ? r1 : __int_as_float(0xff800000);
    }
    __syncthreads();  // the next prefetch overwrites the buffer read here
  }
