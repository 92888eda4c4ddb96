"""Decode attention with grouped-query heads as an `mx.fast.cuda_kernel`.

Why: at batch 32 and a 1k context, cuDNN's decode attention is 4.0 of a Qwen3-8B-shape
step's 11.2 ms of GPU time on the H200 (docs/benchmarks/decode-h200-profile-grouped.json):
111 us a layer for 134 MB of K/V. Its query tile holds one head, so a key/value head is
streamed once for each of the query heads sharing it. `kernels/sdpa_decode.cu` reads every
cached byte once (see the file's comment).

- `decode_attention(q, k, v, scale, starts)`: `mx.fast.scaled_dot_product_attention` for
  one query token per sequence, k and v read in place (strided views included), each
  sequence's keys from `starts` on (a batch cache's left padding; the mask it stands for).
- `fusable(q, k, v)`: why the kernel cannot compute these inputs, or None.

Not yet installed in models: scripts/bench/decode.py's `attention` part checks it against
MLX and times it on the GPU first (no GPU time was left to run it when it was written).
"""

import math
from functools import lru_cache

import mlx.core as mx

from omlx_core.errors import OmlxError

SOURCE = "sdpa_decode.cu"
BODY_MARKER = "// ---- body ----"
HEAD_DIMS = (64, 128)
MAX_GROUP = 8  # query heads per key/value head
CHUNK = 1024  # most keys of one CTA's slice (its scores sit in shared memory)
THREADS = 128
SMS = 132  # H200 multiprocessors: the slices aim at two CTAs for each
DTYPES = (mx.bfloat16, mx.float16)


def fusable(q: mx.array, k: mx.array, v: mx.array) -> str | None:
    """Why the kernel cannot give this attention (one query token, no mask), or None."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return "q, k and v must be [batch, heads, length, head size]"
    batch, heads, length, dim = q.shape
    if length != 1:
        return f"{length} query tokens (the kernel takes one per sequence: decode)"
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != dim:
        return f"k {k.shape} and v {v.shape} do not fit q {q.shape}"
    if dim not in HEAD_DIMS:
        return f"head size {dim} (the kernel takes {' or '.join(map(str, HEAD_DIMS))})"
    if heads % k.shape[1] or not 1 <= heads // k.shape[1] <= MAX_GROUP:
        return f"{heads} query heads over {k.shape[1]} key/value heads (the kernel takes 1..{MAX_GROUP} per head)"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q {q.dtype}, k {k.dtype}, v {v.dtype} (all bf16 or all fp16)"
    if k.shape[2] < 1:
        return "an empty cache"
    return None


def splits_for(pairs: int, keys: int) -> int:
    """Slices of the cache's length: each at most CHUNK keys, and with the batch's
    (sequence, key/value head) pairs about two CTAs an SM, none under 64 keys."""
    fit = math.ceil(keys / CHUNK)
    wanted = math.ceil(2 * SMS / pairs)
    return max(fit, min(wanted, math.ceil(keys / 64)))


@lru_cache(maxsize=1)
def _source() -> tuple[str, str]:
    from omlx_core.kernels.registry import kernel_source

    header, body = kernel_source(SOURCE).split(BODY_MARKER, 1)
    return header, body


@lru_cache(maxsize=1)
def _kernel():
    header, body = _source()
    return mx.fast.cuda_kernel(name="omlx_sdpa_decode", input_names=["q", "k", "v", "scale", "starts", "locks"],
                               output_names=["out", "partial"], source=body, header=header,
                               ensure_row_contiguous=False)


@lru_cache(maxsize=64)
def _scale(value: float) -> mx.array:
    scale = mx.array([value], dtype=mx.float32)
    mx.eval(scale)
    return scale


@lru_cache(maxsize=64)
def _no_padding(batch: int) -> mx.array:
    starts = mx.zeros((batch,), dtype=mx.int32)
    mx.eval(starts)
    return starts


def decode_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, starts: mx.array | None = None,
                     locks: mx.array | None = None) -> mx.array:
    """softmax(scale * q k^T) v for q [B, Hq, 1, D] and k, v [B, Hkv, T, D]. `starts`:
    int32 [B], where each sequence's keys begin (a batch cache's left padding; none by
    default). `locks`: B * Hkv int32 zeros owned by the caller, never used by two calls at
    once (the kernel leaves them zero), else fresh zeros per call."""
    from omlx_core.hardware import mlx_backend

    if (backend := mlx_backend()) != "cuda":
        raise OmlxError(f"sdpa_decode needs MLX's CUDA backend (mx.fast.cuda_kernel); this MLX runs on {backend}")
    if why := fusable(q, k, v):
        raise OmlxError(f"sdpa_decode cannot compute {why}")
    batch, heads, _, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    pairs = batch * kv_heads
    splits = splits_for(pairs, keys)
    if locks is None:
        locks = mx.zeros((pairs,), dtype=mx.int32)
    partial = splits * batch * heads * (dim + 2) if splits > 1 else 1  # one slice: unused
    out, _ = _kernel()(
        inputs=[q, k, v, _scale(float(scale)), _no_padding(batch) if starts is None else starts.astype(mx.int32), locks],
        template=[("T", q.dtype), ("D", dim), ("G", heads // kv_heads), ("CHUNK", CHUNK)],
        grid=(pairs * THREADS, splits, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(batch, heads, 1, dim), (partial,)], output_dtypes=[q.dtype, mx.float32])
    return out


STANDALONE_PRELUDE = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cooperative_groups.h>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
}
"""


def generated_source(dtype: str, dim: int, group: int) -> str:
    """The translation unit mx.fast.cuda_kernel compiles for these template values (its
    wrapper written out the way MLX 0.32 writes it), with a stand-in for MLX's device
    header: for `nvcc -arch=sm_90a` on a machine with no GPU."""
    header, body = _source()
    params = ",\n".join([f"    const {dtype}* q", "    const __grid_constant__ Strides q_strides", f"    const {dtype}* k",
                         "    const __grid_constant__ Shape k_shape", "    const __grid_constant__ Strides k_strides",
                         f"    const {dtype}* v", "    const __grid_constant__ Strides v_strides",
                         "    const float* scale", "    const int32_t* starts", "    const int32_t* locks", f"    {dtype}* out", "    float* partial"])
    return (STANDALONE_PRELUDE + header + "namespace mlx::core::cu {\n\n"
            f"__global__ void custom_kernel_omlx_sdpa_decode(\n{params}) {{\n"
            f"  using T = {dtype};\n  constexpr int D = {dim};\n  constexpr int G = {group};\n"
            f"  constexpr int CHUNK = {CHUNK};\n" + body + "\n}\n\n} // namespace mlx::core::cu\n")
