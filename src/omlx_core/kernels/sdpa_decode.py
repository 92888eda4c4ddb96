"""Decode attention with grouped-query heads as an `mx.fast.cuda_kernel`.

Why: at batch 32 and a 1k context, cuDNN's decode attention is 4.0 of a Qwen3-8B-shape
step's 11.2 ms of GPU time on the H200 (docs/benchmarks/decode-h200-profile-grouped.json):
111 us a layer for 134 MB of K/V (1.2 TB/s), as if each key/value head were streamed once
for each query head sharing it. `kernels/sdpa_decode.cu` reads every cached byte once (see
the file's comment).

- `decode_attention(q, k, v, scale, starts)`: `mx.fast.scaled_dot_product_attention` for
  one query token per sequence, k and v read in place (strided views included), each
  sequence's keys from `starts` on (a batch cache's left padding; the mask it stands for).
- `fusable(q, k, v)`: why the kernel cannot compute these inputs, or None.
- `append(cache, keys, values)`: the cache's update for one token per sequence, the row
  written in place (a second kernel, `write_rows`) where no reader can have seen it: mlx-lm's
  slice update copies the whole cache while the previous step still runs.
- `DecodeAttention`: mlx-lm's llama/qwen2/qwen3 `Attention` whose one-token steps on a
  KVCache or BatchKVCache run the kernel (its forward restated for that case, in three
  steps: `project`, `attend`, `output`). Its prefill on those caches is mlx-lm's forward
  restated with `small_attention` (a small prefill's attention unfused: no cuDNN graph
  built for each new shape); every other call runs mlx-lm's module itself.
  `install(model)` replaces those modules by name.

Validated on the H200 for llama-architecture models (scripts/bench/attention.py: exact
against MLX and fp32, greedy decode; decode.py and serve.py: the whole step and 32 streams),
so `auto` installs it there. One sequence takes it too (MIN_BATCH).
Where the `qk_norm_rope` kernel is installed too, its one-token steps begin with that
prologue (q/k norms and RoPE in one launch), and the output projection adds the layer's
residual when decode_block's DecodeBlock asks (`residual`).
"""

import math
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

from omlx_core.errors import OmlxError
from omlx_core.kernels import qk_norm_rope
from omlx_core.kernels.qmm_decode import DecodeQuantizedLinear
from omlx_core.kernels.registry import (HardwareMatch, KernelSpec, ModelMatch, Validation, included_source,
                                        replace_modules)
from omlx_core.kernels.restated import Restated
from omlx_core.prefill import small_attention
from omlx_core.prefill.fast_paths import unwrap

SOURCE = "sdpa_decode.cu"
HEAD_DIMS = (64, 128)
MAX_GROUP = 8  # query heads per key/value head
THREADS = 128
SMS = 132  # H200 multiprocessors
CTAS_PER_SM = 2  # what the slices aim at (and fit an SM's registers): 8 warps, 64 KB of loads in flight
MIN_KEYS = 64  # fewest keys of a slice: below this a CTA's fixed cost outweighs its reads
MAX_SPLITS = 64  # most slices of one head (the kernel's combine holds their weights)
REGISTERS = 65536  # an SM's 32-bit registers: CTAS_PER_SM CTAs of THREADS must fit them
DTYPES = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half"}  # and their CUDA types
# Sequences from which the kernel attends. At one sequence MLX's attention kernel is faster
# on its own (docs/benchmarks/attention-h200.json), but with its host cost and mlx-lm's
# copying cache update the whole step is slower: docs/benchmarks/decode-h200-one-sequence.json.
MIN_BATCH = 1


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
    """Slices of the cache's length: with the batch's (sequence, key/value head) pairs,
    about CTAS_PER_SM CTAs an SM, none of under MIN_KEYS keys, at most MAX_SPLITS."""
    wanted = math.ceil(CTAS_PER_SM * SMS / pairs)
    return max(1, min(wanted, math.ceil(keys / MIN_KEYS), MAX_SPLITS))


def body(cuda_type: str, dim: int, group: int) -> str:
    return (f"omlx_sdpa::decode<{cuda_type}, {dim}, {group}>(q, q_strides.data(), k, k_strides.data(), v, "
            "v_strides.data(), scale[0], starts, locks, out, partial, k_shape[1], keys[0]);")


@lru_cache(maxsize=None)
def _kernel(dtype: mx.Dtype, dim: int, group: int):
    """One kernel per activation type, head size and group, its values written into its
    source: MLX formats template values into a kernel's source on every call."""
    return mx.fast.cuda_kernel(name=f"omlx_sdpa_decode_{str(dtype).split('.')[-1]}_{dim}_{group}",
                               input_names=["q", "k", "v", "scale", "starts", "locks", "keys"],
                               output_names=["out", "partial"], source=body(DTYPES[dtype], dim, group),
                               header=included_source(SOURCE), ensure_row_contiguous=False)


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
    """softmax(scale * q k^T) v for q [B, Hq, 1, D] and k, v [B, Hkv, T, D], every argument
    checked (DecodeAttention checks with `fusable` and calls `launch`). `starts`: int32 [B],
    where each sequence's keys begin (a batch cache's left padding; none by default).
    `locks`: B * Hkv int32 zeros owned by the caller, never used by two calls at once (the
    kernel leaves them zero), else fresh zeros per call."""
    from omlx_core.hardware import mlx_backend

    if (backend := mlx_backend()) != "cuda":
        raise OmlxError(f"sdpa_decode needs MLX's CUDA backend (mx.fast.cuda_kernel); this MLX runs on {backend}")
    if why := fusable(q, k, v):
        raise OmlxError(f"sdpa_decode cannot compute {why}")
    if locks is None:
        locks = mx.zeros((q.shape[0] * k.shape[1],), dtype=mx.int32)
    return launch(q, k, v, scale, starts, locks)


def launch(q: mx.array, k: mx.array, v: mx.array, scale: float, starts: mx.array | None,
           locks: mx.array, written: mx.array | None = None, keys: int | None = None) -> mx.array:
    """The kernel's call for inputs `fusable` accepted, over the first `keys` rows of k and v
    (all by default: the cache's buffers are read in place, no view of them made). `written`:
    `append`'s output when it wrote row `keys - 1` in place (it holds `keys`, and orders the
    kernel after that write)."""
    batch, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    keys = k.shape[2] if keys is None else keys
    splits = splits_for(batch * kv_heads, keys)
    partial = splits * batch * heads * (dim + 2) if splits > 1 else 1  # one slice: unused
    starts = _no_padding(batch) if starts is None else starts.astype(mx.int32)
    count = qk_norm_rope.position(keys) if written is None else written  # the key count, on the GPU
    out, _ = _kernel(q.dtype, dim, heads // kv_heads)(
        inputs=[q, k, v, _scale(float(scale)), starts, locks, count],
        grid=(batch * kv_heads * THREADS, splits, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(batch, heads, 1, dim), (partial,)], output_dtypes=[q.dtype, mx.float32])
    return out


APPEND_THREADS = 256


def append_body(cuda_type: str) -> str:
    return (f"omlx_sdpa::append<{cuda_type}>(k_new, k_new_strides.data(), v_new, v_new_strides.data(), "
            "k_buf, k_buf_strides.data(), v_buf, v_buf_strides.data(), k_new_shape[1], k_new_shape[3], "
            "v_new_shape[3], position, written, "
            "(int64_t)k_new_shape[0] * k_new_shape[1] * (k_new_shape[3] + v_new_shape[3]), "
            "offset, next_offset, offset_shape[0]);")


@lru_cache(maxsize=None)
def _append_kernel(dtype: mx.Dtype):
    return mx.fast.cuda_kernel(
        name=f"omlx_sdpa_append_{str(dtype).split('.')[-1]}",
        input_names=["k_new", "v_new", "k_buf", "v_buf", "position", "offset"],
        output_names=["written", "next_offset"],
        source=append_body(DTYPES[dtype]), header=included_source(SOURCE), ensure_row_contiguous=False)


def write_rows(k_buf: mx.array, v_buf: mx.array, keys: mx.array, values: mx.array, row: int,
               offset: mx.array | None = None) -> tuple[mx.array, mx.array | None]:
    """Row `row` of k_buf and v_buf [B, Hkv, T, D] set to keys and values [B, Hkv, 1, D] in
    place (no new array: MLX does not know the buffers changed). Returns the output the
    reader of that row must take as an input, and `offset + 1` for a batch cache's int32
    offsets (computed in the same launch), else None."""
    total = keys.size + values.size
    steps = _no_padding(1) if offset is None else offset
    written, following = _append_kernel(keys.dtype)(
        inputs=[keys, values, k_buf, v_buf, qk_norm_rope.position(row), steps],
        grid=(math.ceil(max(total, steps.size) / APPEND_THREADS) * APPEND_THREADS, 1, 1),
        threadgroup=(APPEND_THREADS, 1, 1), output_shapes=[(1,), steps.shape], output_dtypes=[mx.int32, mx.int32])
    return written, None if offset is None else following


def append(cache, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array, mx.array | None, int]:
    """The cache updated with one token per sequence on a CACHES cache, the row written in
    place (`write_rows`) where the buffers are the cache's own and have room: the buffers,
    `write_rows`' output and the rows they hold now (`launch`'s inputs); where mlx-lm's
    update ran, what `cache.update_and_fetch(keys, values)` gave, None and their length.

    Why: mlx-lm's update is a slice update, which copies the whole buffer unless nothing
    else holds it, and the previous step's attention holds it until the GPU has run it: a
    pipelined step copied every layer's cache (scripts/bench/cache_update.py).
    In place is safe for a row no reader has seen: the buffers are the ones mlx-lm's last
    update made for this cache (its own: fresh, or a buffer nothing else held) and the row
    is the one after that update's, so every view taken since ends before it. Anything
    else (a first step, a full buffer, a trim, a filter or merge, another cache's arrays)
    runs mlx-lm's update, which copies where it must."""
    batched = type(cache).__name__ == "BatchKVCache"
    row = cache._idx if batched else cache.offset
    k_buf, v_buf = cache.keys, cache.values
    owned = getattr(cache, "_omlx_rows", None)
    if (owned is None or owned[0] is not k_buf or owned[1] is not v_buf or owned[2] != row
            or row >= k_buf.shape[2] or k_buf.dtype != keys.dtype or v_buf.dtype != values.dtype
            or k_buf.shape[:2] != keys.shape[:2] or k_buf.shape[3] != keys.shape[3]
            or v_buf.shape[:2] != values.shape[:2] or v_buf.shape[3] != values.shape[3]
            or (batched and (cache.offset.dtype != mx.int32 or cache.offset.ndim != 1))):
        k, v = cache.update_and_fetch(keys, values)
        cache._omlx_rows = (cache.keys, cache.values, row + keys.shape[2])
        return k, v, None, k.shape[2]
    written, offset = write_rows(k_buf, v_buf, keys, values, row, cache.offset if batched else None)
    if batched:
        cache.offset = offset
        cache._idx += 1
    else:
        cache.offset += 1
    cache._omlx_rows = (k_buf, v_buf, row + 1)
    return k_buf, v_buf, written, row + 1


def own_buffers(cache) -> None:
    """Let `append` write the next row of a batch cache in place from the next step on,
    where a merge or a filter has just made its buffers: whole arrays of their own that
    nothing else holds (BatchKVCache.extend pads and concatenates, filter gathers), whose
    rows from `_idx` on no reader has seen. The caller must know they are such arrays (not
    a view: filter's shift of the left padding slices them).

    Why: else the step after each merge or filter runs mlx-lm's update, its own ops in the
    middle of the step, so the step's CUDA graphs differ from every steady step's and MLX
    builds them anew (on an H100 the first decode after a merge took 31-32 ms against 8-11:
    docs/benchmarks/admission-h100-qwen3-8b-shape-phases.json)."""
    if type(cache).__name__ == "BatchKVCache" and cache.keys is not None:
        cache._omlx_rows = (cache.keys, cache.values, cache._idx)


# mlx-lm attention classes whose forward DecodeAttention.decode restates (one token, a cache).
ARCHITECTURES = ("llama", "qwen2", "qwen3")
CACHES = ("KVCache", "BatchKVCache")  # mlx-lm caches whose keys it reads: plain, or left-padded


def is_attention(module) -> bool:
    kind = type(module)
    return kind.__name__ == "Attention" and kind.__module__.rsplit(".", 1)[-1] in ARCHITECTURES


class DecodeAttention(Restated):
    """mlx-lm's Attention of ARCHITECTURES, its one-token steps on the kernel and its
    prefill through small_attention (a Restated module: every other call runs mlx-lm's
    forward)."""

    OWN = ("kernel_calls", small_attention.LIMIT)

    def __init__(self, original, prologue: "qk_norm_rope.Prologue | None" = None):
        super().__init__(original)
        object.__setattr__(self, "_locks", {})  # counters per batch size
        object.__setattr__(self, "_prologue", prologue)  # qk_norm_rope's install gives one
        object.__setattr__(self, "kernel_calls", 0)
        object.__setattr__(self, small_attention.LIMIT, small_attention.SMALL_SCORES)  # prefill: configure()

    def __call__(self, x: mx.array, mask=None, cache=None, residual: mx.array | None = None) -> mx.array:
        """mlx-lm's forward, plus `residual` if given (decode_block's DecodeBlock passes
        the layer's input: the output projection adds it in its launch where it can)."""
        if self.decodes(x, cache):
            return self.decode(x, mask, cache, residual)
        out = self.prefill(x, mask, cache) if self.prefills(cache) else self._forward(self, x, mask, cache)
        return out if residual is None else residual + out

    @staticmethod
    def decodes(x: mx.array, cache) -> bool:
        """One token per sequence on a cache whose keys `attend` reads: the restated case."""
        return x.shape[1] == 1 and type(cache).__name__ in CACHES

    @staticmethod
    def prefills(cache) -> bool:
        """Several tokens per sequence on a cache `prefill` updates as mlx-lm does."""
        return type(cache).__name__ in CACHES

    def prefill(self, x: mx.array, mask, cache) -> mx.array:
        """mlx-lm's forward for several tokens per sequence, its attention through
        small_attention (no cuDNN graph built for a small prefill's new shape)."""
        queries, keys, values = self.project(x, cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
        return self.output(small_attention.attention(queries, keys, values, self.scale, mask, self.small_scores))

    def decode(self, x: mx.array, mask, cache, residual: mx.array | None = None) -> mx.array:
        """mlx-lm's forward for one token per sequence, in three steps: `project`,
        `attend`, `output` (decode_block compiles the first and the last)."""
        queries, keys, values = self.project(x, cache.offset)
        return self.output(self.attend(queries, keys, values, mask, cache), residual)

    def project(self, x: mx.array, offset) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys and values of x's tokens, (batch, heads, length, dim), the norms and
        RoPE from `offset` applied: qk_norm_rope's prologue where it takes them (one token
        per sequence)."""
        batch, length, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        prologue = self._prologue  # q/k norms and RoPE: one launch where qk_norm_rope takes them
        if prologue is not None and length == 1 and prologue.takes(self, queries):
            queries, keys = prologue(self, queries, keys, offset)
        else:
            queries, keys = qk_norm_rope.reference(self, queries, keys, offset)
        return queries, keys, values.reshape(batch, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, mask, cache) -> mx.array:
        """The cache updated with this step's keys and values, and the attention of the
        queries over it: from MIN_BATCH sequences the kernel (a BatchKVCache's mask, left
        padding and nothing causal at one token, becomes `starts`), else mlx-lm's."""
        batch = queries.shape[0]
        if batch < MIN_BATCH or fusable(queries, keys, values) is not None:  # as mlx-lm's module computes it
            from mlx_lm.models.base import scaled_dot_product_attention

            keys, values = cache.update_and_fetch(keys, values)
            return scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        keys, values, written, rows = append(cache, keys, values)  # fusable judged the rows as it judges the cache
        object.__setattr__(self, "kernel_calls", self.kernel_calls + 1)
        locks = self._locks.get(batch)
        if locks is None:
            locks = self._locks[batch] = mx.zeros((batch * self.n_kv_heads,), dtype=mx.int32)
        return launch(queries, keys, values, self.scale, getattr(cache, "left_padding", None), locks, written, rows)

    def output(self, attended: mx.array, residual: mx.array | None = None) -> mx.array:
        """The output projection of the attended heads (batch, heads, length, dim), plus
        `residual` if given: added in qmm_decode's launch where the projection is one."""
        batch, _, length, _ = attended.shape
        attended = attended.transpose(0, 2, 1, 3).reshape(batch, length, -1)
        if residual is None:
            return self.o_proj(attended)
        o_proj = unwrap(self.o_proj)
        if isinstance(o_proj, DecodeQuantizedLinear):
            return o_proj.with_residual(attended, residual)
        return residual + self.o_proj(attended)


def plain(module) -> nn.Module:
    """mlx-lm's Attention of the same modules and attributes for a DecodeAttention (undoes
    `install`); any other module as given."""
    return module.original() if isinstance(module, DecodeAttention) else module


def attention_paths(model) -> list[str]:
    return [path for path, module in model.named_modules() if is_attention(module)]


def install(model) -> list[str]:
    """Replace every attention module of ARCHITECTURES by a DecodeAttention; their paths."""
    return replace_modules(model, SOURCE, attention_paths(model), DecodeAttention)


SPEC = KernelSpec(
    name="sdpa_decode",
    replaces="mlx-lm's attention at one token per sequence (decode) for llama, qwen2 and qwen3",
    source=SOURCE,
    validated=(Validation(ModelMatch.architecture("llama"), HardwareMatch("cuda", "sm_90", "NVIDIA H200"),
                          "docs/benchmarks/attention-h200.json, decode-h200-model-attention.json, "
                          "serve-h200-qwen3-8b-shape-32-streams-attention.json"),),
    applies=lambda model: bool(attention_paths(model)),
    absent="llama, qwen2 or qwen3 attention",
    install=install,
)


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
    """The translation unit mx.fast.cuda_kernel compiles for this CUDA type, head size and
    group (its wrapper written out the way MLX 0.32 writes it), with a stand-in for MLX's
    device header: for `nvcc -arch=sm_90a` on a machine with no GPU."""
    params = ",\n".join(f"    {param}" for param in (
        f"const {dtype}* q", "const __grid_constant__ Strides q_strides",
        f"const {dtype}* k", "const __grid_constant__ Shape k_shape", "const __grid_constant__ Strides k_strides",
        f"const {dtype}* v", "const __grid_constant__ Strides v_strides",
        "const float* scale", "const int32_t* starts", "const int32_t* locks", "const int32_t* keys",
        f"{dtype}* out", "float* partial"))
    return _unit("omlx_sdpa_decode", params, body(dtype, dim, group))


def append_generated_source(dtype: str) -> str:
    """`generated_source` for the append kernel (`write_rows`) of this CUDA type."""
    params = ",\n".join(f"    {param}" for param in (
        f"const {dtype}* k_new", "const __grid_constant__ Shape k_new_shape",
        "const __grid_constant__ Strides k_new_strides",
        f"const {dtype}* v_new", "const __grid_constant__ Shape v_new_shape",
        "const __grid_constant__ Strides v_new_strides",
        f"const {dtype}* k_buf", "const __grid_constant__ Strides k_buf_strides",
        f"const {dtype}* v_buf", "const __grid_constant__ Strides v_buf_strides",
        "const int32_t* position", "const int32_t* offset", "const __grid_constant__ Shape offset_shape",
        "int32_t* written", "int32_t* next_offset"))
    return _unit("omlx_sdpa_append", params, append_body(dtype))


def _unit(name: str, params: str, source: str) -> str:
    return (STANDALONE_PRELUDE + included_source(SOURCE) + "namespace mlx::core::cu {\n\n"
            f"__global__ void custom_kernel_{name}(\n{params}) {{\n  " + source
            + "\n}\n\n} // namespace mlx::core::cu\n")
