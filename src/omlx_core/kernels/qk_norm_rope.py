"""Decode attention's prologue, q/k RMS norm (qwen3) and RoPE, as one `mx.fast.cuda_kernel`.

Why: mlx-lm computes it as two RoPE launches per layer, four with qwen3's norms, each
tiny on the GPU and each paid for by the host (Python, then MLX's encoding); at 32
sequences the host bounds a decode step on some machines. `kernels/qk_norm_rope.cu`
does it all in one launch with MLX's roundings (see the file's comment).

- `Prologue.of(attention)`: what the kernel needs to know of an mlx-lm attention module of
  sdpa_decode's ARCHITECTURES (its norms' epsilon, its rope's base, scale or frequency
  table), or None where it cannot take it (`why_not` says why).
- `Prologue.__call__(attention, queries, keys, offset)`: q [B, 1, Hq*D] and k [B, 1, Hkv*D]
  as a projection gives them to [B, Hq, 1, D] and [B, Hkv, 1, D], normed and rotated.
- `reference(attention, queries, keys, offset)`: the same by mlx-lm's own ops (the path
  wherever the kernel does not run, and the benchmark's baseline).
- `install(model)`: gives every sdpa_decode DecodeAttention of the model its Prologue (a
  registered kernel of its own, after sdpa_decode; exact on the H100 and the H200 and
  faster on the GPU, but not yet measurably faster for a whole step
  (docs/benchmarks/decode-h200-residual-prologue.json): not validated, so `auto` leaves it
  off and `on` tries it).
"""

import math
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

from omlx_core.kernels.registry import KernelSpec, included_source, replace_modules

SOURCE = "qk_norm_rope.cu"
HEAD_DIMS = (64, 128)
DTYPES = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half"}
THREADS = 128  # four rows (warps) a CTA


def reference(attention, queries: mx.array, keys: mx.array, offset) -> tuple[mx.array, mx.array]:
    """mlx-lm's steps for the projected queries and keys [B, L, heads * dim]: per-head norms
    (if any), the transpose, RoPE from `offset` (an int, or one per sequence)."""
    batch, length = queries.shape[:2]
    queries = queries.reshape(batch, length, attention.n_heads, -1)
    keys = keys.reshape(batch, length, attention.n_kv_heads, -1)
    if "q_norm" in attention:  # qwen3: RMS norm per head (of the last axis: before the transpose or after)
        queries, keys = attention.q_norm(queries), attention.k_norm(keys)
    queries, keys = queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3)
    return attention.rope(queries, offset=offset), attention.rope(keys, offset=offset)


def rope_parameters(rope) -> dict | str:
    """How an mlx-lm rope module rotates (dims, traditional, and a base with a scale or a
    frequency table), or why the kernel cannot rotate as it does."""
    from mlx_lm.models.rope_utils import Llama3RoPE

    if type(rope) is nn.RoPE:
        return {"dims": rope.dims, "traditional": rope.traditional, "log2_base": math.log2(rope.base),
                "scale": float(rope.scale), "freqs": None}
    if type(rope) is Llama3RoPE:
        return {"dims": rope.dims, "traditional": rope.traditional, "log2_base": 0.0, "scale": 1.0,
                "freqs": rope._freqs.astype(mx.float32)}
    return f"rope {type(rope).__name__} (the kernel rotates as nn.RoPE and Llama3RoPE do)"


def why_not(attention) -> str | None:
    """Why the kernel cannot compute this attention module's prologue, or None."""
    parameters = rope_parameters(attention.rope)
    if isinstance(parameters, str):
        return parameters
    dim = parameters["dims"]  # the whole head, which `Prologue.takes` checks per step
    if dim not in HEAD_DIMS:
        return f"rotary size {dim} (the kernel rotates heads of {' or '.join(map(str, HEAD_DIMS))})"
    norms = [attention.get(name) for name in ("q_norm", "k_norm")]
    if any(n is not None for n in norms):
        if not all(type(n) is nn.RMSNorm and n.weight.shape == (dim,) for n in norms):
            return "q/k norms other than an RMS norm over one head"
        if norms[0].eps != norms[1].eps:
            return "q and k norms of different epsilons"
    return None


@dataclass(frozen=True, eq=False)
class Prologue:
    """One attention module's prologue on the kernel (see the module docstring)."""

    dim: int  # head size: RoPE rotates all of it
    q_heads: int
    kv_heads: int
    norm: bool  # qwen3's q_norm and k_norm
    traditional: bool
    params: mx.array  # float32 [log2 base, scale, eps]
    freqs: mx.array | None  # Llama 3's frequency table, else None (a base)

    @classmethod
    def of(cls, attention) -> "Prologue | None":
        if why_not(attention) is not None:
            return None
        rope = rope_parameters(attention.rope)
        norm = "q_norm" in attention
        eps = attention.q_norm.eps if norm else 0.0
        params = mx.array([rope["log2_base"], rope["scale"], eps], dtype=mx.float32)
        mx.eval(params, *([rope["freqs"]] if rope["freqs"] is not None else []))
        return cls(rope["dims"], attention.n_heads, attention.n_kv_heads, norm, rope["traditional"], params,
                   rope["freqs"])

    def takes(self, attention, queries: mx.array) -> bool:
        """Per step: an activation type the kernel computes, the norms' own type if any,
        and the shapes this prologue was made for."""
        return (queries.dtype in DTYPES and (not self.norm or attention.q_norm.weight.dtype == queries.dtype)
                and queries.shape[-1] == self.q_heads * self.dim)

    def __call__(self, attention, queries: mx.array, keys: mx.array, offset) -> tuple[mx.array, mx.array]:
        batch = queries.shape[0]
        per_sequence = isinstance(offset, mx.array) and offset.size > 1
        offsets = offset.astype(mx.int32) if isinstance(offset, mx.array) else position(int(offset))
        inputs = [queries, keys]
        inputs += [attention.q_norm.weight, attention.k_norm.weight] if self.norm else []
        inputs += [self.freqs] if self.freqs is not None else []
        rows = batch * (self.q_heads + self.kv_heads)
        kernel = _kernel(queries.dtype, self.dim, self.q_heads, self.kv_heads, self.norm, self.traditional,
                         self.freqs is not None, per_sequence)
        return kernel(inputs=inputs + [offsets, self.params], grid=(math.ceil(rows * 32 / THREADS) * THREADS, 1, 1),
                      threadgroup=(THREADS, 1, 1),
                      output_shapes=[(batch, self.q_heads, 1, self.dim), (batch, self.kv_heads, 1, self.dim)],
                      output_dtypes=[queries.dtype, queries.dtype])


@lru_cache(maxsize=4096)
def position(offset: int) -> mx.array:
    """One int32 position for every sequence (a plain cache's offset), made once per value."""
    position = mx.array([offset], dtype=mx.int32)
    mx.eval(position)
    return position


def inputs(norm: bool, freqs: bool) -> list[str]:
    return (["q", "k"] + (["q_weight", "k_weight"] if norm else []) + (["freqs"] if freqs else [])
            + ["offsets", "params"])


def body(cuda_type: str, dim: int, q_heads: int, kv_heads: int, norm: bool, traditional: bool, freqs: bool,
         per_sequence: bool) -> str:
    flags = ", ".join(str(flag).lower() for flag in (norm, traditional, freqs, per_sequence))
    return (f"omlx_qknr::qk_norm_rope<{cuda_type}, {dim}, {q_heads}, {kv_heads}, {flags}>(q, k, "
            + ("q_weight, k_weight, " if norm else "nullptr, nullptr, ") + ("freqs, " if freqs else "nullptr, ")
            + "offsets, params, q_out, k_out, q_shape[0]);")


@lru_cache(maxsize=None)
def _kernel(dtype: mx.Dtype, dim: int, q_heads: int, kv_heads: int, norm: bool, traditional: bool, freqs: bool,
            per_sequence: bool):
    """One kernel per specialization, its values written into its source: MLX formats
    template values into a kernel's source on every call."""
    values = (dim, q_heads, kv_heads) + tuple(int(flag) for flag in (norm, traditional, freqs, per_sequence))
    return mx.fast.cuda_kernel(name=f"omlx_qk_norm_rope_{str(dtype).split('.')[-1]}_" + "_".join(map(str, values)),
                               input_names=inputs(norm, freqs), output_names=["q_out", "k_out"],
                               source=body(DTYPES[dtype], dim, q_heads, kv_heads, norm, traditional, freqs,
                                           per_sequence),
                               header=included_source(SOURCE), ensure_row_contiguous=True)


STANDALONE_PRELUDE = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
namespace mlx::core::cu { using Shape = cuda::std::array<int32_t, 10>; }
"""


def generated_source(dtype: mx.Dtype, dim: int, q_heads: int, kv_heads: int, norm: bool, traditional: bool,
                     freqs: bool, per_sequence: bool) -> str:
    """The translation unit mx.fast.cuda_kernel compiles for this specialization (its
    wrapper written out the way MLX 0.32 writes it), with a stand-in for MLX's device
    header: for `nvcc -arch=sm_90a` on a machine with no GPU."""
    t = DTYPES[dtype]
    types = {"q": t, "k": t, "q_weight": t, "k_weight": t, "freqs": "float", "offsets": "int32_t", "params": "float"}
    params = [f"const {types[name]}* {name}" for name in inputs(norm, freqs)]
    params.insert(1, "const __grid_constant__ Shape q_shape")
    params += [f"{t}* q_out", f"{t}* k_out"]
    return (STANDALONE_PRELUDE + included_source(SOURCE) + "namespace mlx::core::cu {\n\n"
            "__global__ void custom_kernel_omlx_qk_norm_rope(\n    " + ",\n    ".join(params) + ") {\n  "
            + body(t, dim, q_heads, kv_heads, norm, traditional, freqs, per_sequence) + "\n}\n\n"
            "} // namespace mlx::core::cu\n")


def decode_attention_paths(model) -> list[str]:
    from omlx_core.kernels.sdpa_decode import DecodeAttention

    return [path for path, module in model.named_modules() if isinstance(module, DecodeAttention)]


def install(model) -> list[str]:
    """Replace every DecodeAttention whose prologue the kernel takes by one that runs it."""
    from omlx_core.kernels.sdpa_decode import DecodeAttention  # it imports this module

    modules = dict(model.named_modules())
    paths = [path for path in decode_attention_paths(model) if why_not(modules[path]) is None]
    return replace_modules(model, SOURCE, paths, lambda module: DecodeAttention(module.original(), Prologue.of(module)))


SPEC = KernelSpec(
    name="qk_norm_rope",
    replaces="mlx-lm's q/k RMS norms and RoPE at one token per sequence (decode), inside sdpa_decode's attention",
    source=SOURCE,
    validated=(),
    applies=lambda model: bool(decode_attention_paths(model)),
    absent="sdpa_decode's attention (kernels.sdpa_decode active)",
    install=install,
)
