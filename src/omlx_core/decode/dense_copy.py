"""A resident dense copy of each quantized weight: memory for speed.

Why: a quantized matmul is not always the fastest way to use a quantized weight.
- On CUDA, MLX's quantized matmul at batched decode sizes runs far below bandwidth, while a
  bf16 copy makes each step a plain dense GEMM (scripts/bench/decode.py). The copy is the
  dequantized weight in the scales' dtype, used for decode-sized inputs (1..64 tokens).
- On MLX's CPU backend, its quantized matmul runs at 1-3 GFLOP/s while a dense float32
  product on an optimized BLAS (`omlx_core.blas`) runs 6x faster at one token and 20-50x at
  8 to 512 (SmolLM2's 1536x576 layer), and MLX's CPU dequantize is too slow to make the
  dense weight per call. There the copy is float32 and computes every input, prefill
  included; a tied embedding keeps one for its use as the output head.
The result is `x @ dequantize(w).T` in the copy's dtype. The copies cost their bytes for as
long as the model is loaded: `DenseCopyReport.extra_bytes` is what the memory guard is
charged, like the prefill lanes' resident slices.

`compute.dense_copy`: auto turns it on for MLX's CPU backend with an optimized BLAS when the
copies fit in a quarter of the machine's memory; on forces it (CUDA: the bf16 decode copy,
which the tuner can pick when memory allows); off never.
"""

import sys
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

MAX_TOKENS = 64  # CUDA: decode-sized, the inputs the copy computes
MEMORY_SHARE = 0.25  # auto: the copies may take this much of the machine's memory
SIXTEEN_BIT = (mx.bfloat16, mx.float16)


@dataclass(frozen=True)
class CopyPlan:
    """What a copy looks like on a backend: its dtype (None: the scales') and token range."""

    dtype: mx.Dtype | None
    max_tokens: int
    head: bool  # tied embeddings keep a copy for the output head too

    def dtype_of(self, module) -> mx.Dtype:
        return self.dtype or module.scales.dtype


GPU_PLAN = CopyPlan(None, MAX_TOKENS, head=False)
CPU_PLAN = CopyPlan(mx.float32, sys.maxsize, head=True)


def _dense(layer, dtype: mx.Dtype) -> mx.array:
    dense = mx.dequantize(layer.weight, layer.scales, layer.get("biases"), group_size=layer.group_size,
                          bits=layer.bits, mode=layer.mode, dtype=dtype)
    mx.eval(dense)
    return dense


def _copy_product(module, x: mx.array) -> mx.array:
    """x @ the copy, in the copy's dtype (a float32 copy takes 16-bit inputs too), as x's dtype."""
    dtype = module._dtype
    out = (x if x.dtype == dtype else x.astype(dtype)) @ module["_dense_t"]
    return out if out.dtype == x.dtype else out.astype(x.dtype)


def _adopt(module, arrays: dict, layer, dtype: mx.Dtype, max_tokens: int, dense: mx.array) -> None:
    """Fill a new copy-holding `module` from `layer`'s attributes, its parameter `arrays`
    and the `dense` weight (made by `_dense`, or a slice of another copy's)."""
    nn.Module.__init__(module)
    for key, value in arrays.items():
        module[key] = value
    module.group_size, module.bits, module.mode = layer.group_size, layer.bits, layer.mode
    module.max_tokens = max_tokens
    module.calls = 0
    # Underscored: not parameters (not saved, not counted as the model's weights).
    module._dense, module._dense_t = dense, dense.T  # the view made once: a call adds no transpose
    object.__setattr__(module, "_dtype", dtype)
    module.freeze()


def _parameters(layer, keys: tuple, rows: slice = slice(None)) -> dict:
    return {key: None if layer[key] is None else layer[key][rows] for key in keys if key in layer}


def _takes(module, x: mx.array) -> bool:
    return (x.size // x.shape[-1] <= module.max_tokens
            and (x.dtype == module._dtype or module._dtype == mx.float32))


class DenseCopyLinear(nn.QuantizedLinear):
    """A QuantizedLinear that also holds its weight dense, for inputs of 1..max_tokens."""

    KEYS = ("weight", "scales", "biases", "bias")

    @classmethod
    def of(cls, layer: nn.QuantizedLinear, max_tokens: int = MAX_TOKENS,
           dtype: mx.Dtype | None = None) -> "DenseCopyLinear":
        module = cls.__new__(cls)
        dtype = dtype or layer.scales.dtype
        _adopt(module, _parameters(layer, cls.KEYS), layer, dtype, max_tokens, _dense(layer, dtype))
        return module

    def rows(self, start: int, stop: int) -> "DenseCopyLinear":
        """Rows [start, stop) as a DenseCopyLinear of slices (the split lanes' gpu rows)."""
        part = DenseCopyLinear.__new__(DenseCopyLinear)
        _adopt(part, _parameters(self, self.KEYS, slice(start, stop)), self, self._dtype, self.max_tokens,
               self._dense[start:stop])
        return part

    @property
    def copy_bytes(self) -> int:
        return self._dense.nbytes

    def __call__(self, x: mx.array) -> mx.array:
        # Per call Python is on a decode step's critical path (a few hundred linears).
        if not _takes(self, x):
            return super().__call__(x)
        object.__setattr__(self, "calls", self.calls + 1)  # Module.__setattr__ costs microseconds
        out = _copy_product(self, x)
        return out + self["bias"] if "bias" in self else out


class DenseCopyEmbedding(nn.QuantizedEmbedding):
    """A quantized embedding whose use as the tied output head multiplies its dense copy;
    lookups read the packed table as before."""

    @classmethod
    def of(cls, layer: nn.QuantizedEmbedding, max_tokens: int, dtype: mx.Dtype) -> "DenseCopyEmbedding":
        module = cls.__new__(cls)
        _adopt(module, _parameters(layer, ("weight", "scales", "biases")), layer, dtype, max_tokens,
               _dense(layer, dtype))
        module.num_embeddings, module.dims = layer.num_embeddings, layer.dims
        return module

    @property
    def copy_bytes(self) -> int:
        return self._dense.nbytes

    def as_linear(self, x: mx.array) -> mx.array:
        if not _takes(self, x):
            return super().as_linear(x)
        object.__setattr__(self, "calls", self.calls + 1)
        return _copy_product(self, x)


@dataclass
class DenseCopyReport:
    layers: list = field(default_factory=list, repr=False)
    reason: str = ""
    max_tokens: int | None = None

    @property
    def extra_bytes(self) -> int:
        """The copies' bytes: charged to the memory guard while the model is loaded."""
        return sum(layer.copy_bytes for layer in self.layers)

    def as_dict(self) -> dict:
        unbounded = self.max_tokens == sys.maxsize
        return {"layers": len(self.layers), "extra_bytes": self.extra_bytes,
                "max_tokens": None if unbounded else self.max_tokens,
                "calls": sum(layer.calls for layer in self.layers), "reason": self.reason}


def eligible(module, plan: CopyPlan) -> bool:
    """A quantized linear whose compute the copy replaces: a plain one or a decode-kernel
    one with 16-bit scales; on the float32 plan also the float32-compute (upcast) ones,
    whatever their scales. Other QuantizedLinear subclasses keep their own compute."""
    from omlx_core.kernels.qmm_decode import DecodeQuantizedLinear
    from omlx_core.prefill.upcast import Float32QuantizedLinear

    if plan.dtype is not None and plan.dtype == mx.float32:
        return type(module) in (nn.QuantizedLinear, Float32QuantizedLinear, DecodeQuantizedLinear)
    return ((type(module) is nn.QuantizedLinear or isinstance(module, DecodeQuantizedLinear))
            and module.scales.dtype in SIXTEEN_BIT)


def head_eligible(model, path: str, module, plan: CopyPlan) -> bool:
    """The tied input embedding, which the model also multiplies as its output head."""
    from omlx_core.models.tied import tied_embedding
    from omlx_core.prefill.upcast import Float32QuantizedEmbedding

    return (plan.head and tied_embedding(model, path)
            and type(module) in (nn.QuantizedEmbedding, Float32QuantizedEmbedding))


def plan_for(settings, backend: str) -> tuple[CopyPlan | None, str]:
    """The copy this backend gets under `compute.dense_copy`, or None and why not."""
    from omlx_core.blas import blas_state

    choice = settings["compute.dense_copy"]
    if choice == "off":
        return None, "off: compute.dense_copy is off"
    plan = CPU_PLAN if backend == "cpu" else GPU_PLAN
    if choice == "auto" and not (backend == "cpu" and blas_state().loaded):
        return None, ("off: compute.dense_copy is auto, which keeps copies on MLX's CPU backend with an "
                      f"optimized BLAS only (here: {backend}; {blas_state().reason})")
    return plan, ""


def copies(model, plan: CopyPlan) -> list[tuple[str, nn.Module, int]]:
    """(path, module, copy bytes) for every layer the plan copies, before any is made."""
    found = []
    for path, module in model.named_modules():
        if eligible(module, plan) or head_eligible(model, path, module, plan):
            rows, packed = module.weight.shape
            found.append((path, module, rows * packed * 32 // module.bits * plan.dtype_of(module).size))
    return found


def install_dense_copy(model, settings, *, backend: str | None = None,
                       total_memory: int | None = None) -> DenseCopyReport:
    """Give the quantized linears (and a tied head) dense copies as `compute.dense_copy`
    asks here. Layer by layer (each copy is evaluated before the next), so the install's
    peak is the copies. `backend`/`total_memory` default to this machine's."""
    from omlx_core.hardware import mlx_backend
    from omlx_core.memory.capacity import total_memory_bytes
    from omlx_core.prefill.split import replace_module

    report = DenseCopyReport()
    plan, report.reason = plan_for(settings, backend or mlx_backend())
    if plan is None:
        return report
    found = copies(model, plan)
    needed = sum(size for _, _, size in found)
    total = total_memory or total_memory_bytes()
    if settings["compute.dense_copy"] == "auto" and needed > MEMORY_SHARE * total:
        report.reason = (f"off: the dense copies would take {needed / 2**30:.1f} GiB, over {MEMORY_SHARE:.0%} "
                         "of memory (compute.dense_copy = on forces them)")
        return report
    report.max_tokens = plan.max_tokens
    for path, module, _ in found:
        cls = DenseCopyEmbedding if isinstance(module, nn.QuantizedEmbedding) else DenseCopyLinear
        layer = cls.of(module, plan.max_tokens, plan.dtype_of(module))
        replace_module(model, path, layer)
        report.layers.append(layer)
    sizes = "every input" if plan.max_tokens == sys.maxsize else f"1..{plan.max_tokens} tokens"
    report.reason = (f"{len(report.layers)} quantized layers compute {sizes} on a dense "
                     f"{str(plan.dtype or 'scales-dtype').replace('mlx.core.', '')} copy "
                     f"({report.extra_bytes / 2**20:.0f} MiB)" if report.layers
                     else "no quantized layers this backend's copy replaces")
    return report
