"""Float32 compute for 16-bit quantized layers on MLX's CPU backend.

MLX's CPU kernel for a quantized matmul with float16 or bfloat16 inputs is 10-50× slower
than the same matmul in float32 (measured on x86-64, MLX 0.32.4, a 1536×576 4-bit layer:
fp16 0.06 GF/s, bf16 0.3 GF/s, float32 3.1 GF/s, at 1 and 256 tokens alike). So on that
backend a 16-bit quantized linear (or tied quantized embedding used as the output head)
casts its input, scales and biases to float32, multiplies, and casts the result back: the
same packed weights, no resident copy, and at least the precision of the 16-bit path.

The replacements are subclasses of MLX's own quantized layers, so every other path that
looks for a quantized linear (dequantize-to-dense, the lanes' slicing) still finds one.
"""

import mlx.core as mx
import mlx.nn as nn

SIXTEEN_BIT = (mx.float16, mx.bfloat16)


def _float32_matmul(layer, x: mx.array) -> mx.array:
    biases = layer.get("biases")
    out = mx.quantized_matmul(x.astype(mx.float32), layer["weight"], scales=layer["scales"].astype(mx.float32),
                              biases=None if biases is None else biases.astype(mx.float32), transpose=True,
                              group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
    return out


class Float32QuantizedLinear(nn.QuantizedLinear):
    """A quantized linear whose 16-bit inputs are multiplied in float32."""

    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype not in SIXTEEN_BIT:
            return super().__call__(x)
        out = _float32_matmul(self, x)
        if "bias" in self:
            out = out + self["bias"]
        return out.astype(x.dtype)


class Float32QuantizedEmbedding(nn.QuantizedEmbedding):
    """A quantized embedding whose use as the (tied) output head multiplies in float32."""

    def as_linear(self, x: mx.array) -> mx.array:
        if x.dtype not in SIXTEEN_BIT:
            return super().as_linear(x)
        return _float32_matmul(self, x).astype(x.dtype)


def rehome(module: nn.Module, cls: type) -> nn.Module:
    """The same parameters and attributes under the subclass `cls` (nothing is copied)."""
    replacement = cls.__new__(cls)
    replacement.__dict__.update(module.__dict__)
    dict.update(replacement, module)
    return replacement


def upcast_candidates(model) -> list[tuple[str, nn.Module, type]]:
    """Affine-quantized linears and embeddings with 16-bit scales: (path, module, replacement class)."""
    found = []
    for path, module in model.named_modules():
        if getattr(module, "mode", None) != "affine" or module.get("scales") is None:
            continue
        if module["scales"].dtype not in SIXTEEN_BIT:
            continue
        if type(module) is nn.QuantizedLinear:
            found.append((path, module, Float32QuantizedLinear))
        elif type(module) is nn.QuantizedEmbedding:
            found.append((path, module, Float32QuantizedEmbedding))
    return found
