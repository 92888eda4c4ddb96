"""Decode on a resident dense copy of each quantized weight: memory for speed.

Why: where memory allows, a bf16 (or fp16) copy of a quantized linear's weight makes a
decode-sized input a plain dense GEMM, which at batched decode beats MLX's quantized
matmul on some backends (measured: scripts/bench/decode.py). The copy is the
dequantized weight in the scales' dtype, made once at install, so the result equals
`x @ dequantize(w).T` (the dequantize-to-dense prefill's arithmetic). It costs the copy's
bytes for as long as the model is loaded: `DenseCopyReport.extra_bytes` is what the
memory guard is charged, like the prefill lanes' resident slices.

Off by default (`decode.dense_copy`); the tuner can pick it when memory allows.
"""

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

MAX_TOKENS = 64  # decode-sized: the inputs the copy computes


class DenseCopyLinear(nn.QuantizedLinear):
    """A QuantizedLinear that also holds its weight dense, for inputs of 1..max_tokens."""

    @classmethod
    def of(cls, layer: nn.QuantizedLinear, max_tokens: int = MAX_TOKENS) -> "DenseCopyLinear":
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        for key in ("weight", "scales", "biases", "bias"):
            if key in layer:
                module[key] = layer[key]
        module.group_size, module.bits, module.mode = layer.group_size, layer.bits, layer.mode
        module.max_tokens = max_tokens
        module.calls = 0
        # Underscored: not a parameter (not saved, not counted as the model's weights).
        module._dense = mx.dequantize(layer.weight, layer.scales, layer.get("biases"), group_size=layer.group_size,
                                      bits=layer.bits, mode=layer.mode, dtype=layer.scales.dtype)
        module._dense_t = module._dense.T  # a view, made once: the call adds no transpose to the graph
        mx.eval(module._dense, module._dense_t)
        object.__setattr__(module, "_dtype", module._dense.dtype)
        module.freeze()
        return module

    @property
    def copy_bytes(self) -> int:
        return self._dense.nbytes

    def uses_copy(self, x: mx.array) -> bool:
        return 1 <= x.size // x.shape[-1] <= self.max_tokens and x.dtype == self._dtype

    def __call__(self, x: mx.array) -> mx.array:
        # Per call Python is on a decode step's critical path (a few hundred linears).
        if not self.uses_copy(x):
            return super().__call__(x)
        object.__setattr__(self, "calls", self.calls + 1)  # Module.__setattr__ costs microseconds
        out = x @ self["_dense_t"]
        return out + self["bias"] if "bias" in self else out


@dataclass
class DenseCopyReport:
    layers: list = field(default_factory=list, repr=False)
    reason: str = ""

    @property
    def extra_bytes(self) -> int:
        """The copies' bytes: charged to the memory guard while the model is loaded."""
        return sum(layer.copy_bytes for layer in self.layers)

    def as_dict(self) -> dict:
        return {"layers": len(self.layers), "extra_bytes": self.extra_bytes,
                "calls": sum(layer.calls for layer in self.layers), "reason": self.reason}


def eligible(module) -> bool:
    """A plain quantized linear with 16-bit scales, or a decode-kernel one (the copy replaces
    it, as the setting asks); other QuantizedLinear subclasses keep their own compute."""
    from omlx_core.kernels.qmm_decode import DecodeQuantizedLinear

    return ((type(module) is nn.QuantizedLinear or isinstance(module, DecodeQuantizedLinear))
            and module.scales.dtype in (mx.bfloat16, mx.float16))


def install_dense_copy(model, settings, max_tokens: int = MAX_TOKENS) -> DenseCopyReport:
    """Give every quantized linear a dense copy when `decode.dense_copy` is on. Layer by
    layer (each copy is evaluated before the next), so the install's peak is the copies."""
    from omlx_core.prefill.split import replace_module

    report = DenseCopyReport()
    if not settings["decode.dense_copy"]:
        report.reason = "off: set decode.dense_copy to keep a dense copy of quantized weights for decode"
        return report
    for path, module in list(model.named_modules()):
        if eligible(module):
            layer = DenseCopyLinear.of(module, max_tokens)
            replace_module(model, path, layer)
            report.layers.append(layer)
    report.reason = (f"{len(report.layers)} quantized linears decode (1..{max_tokens} tokens) on a dense copy"
                     if report.layers else "no quantized linears with 16-bit scales in this model")
    return report
