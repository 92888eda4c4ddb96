"""Affine dequantize at HBM bandwidth, for the dequantize-to-dense prefill path.

Why: dequantize-to-dense makes each quantized layer's dense weight once per prefill chunk,
and MLX's CUDA `mx.dequantize` ran far below bandwidth on the H200, so at a 2048-token
chunk it cost about a third of the chunk (scripts/bench/dequantize.py measures it).
`kernels/dequantize.cu` reads each packed byte once with 16-byte loads and writes the
dense weight with 16-byte stores.

- `dequantize(w, scales, biases, group_size, bits, dtype)`: `mx.dequantize` of MLX's affine
  layout (4 or 8 bits, group size 32/64/128) to bf16 or fp16, each value one fp32 fused
  multiply-add rounded once.
- `SPEC`: its registry entry, validated on the H200 for every model. It replaces no module of its own: the dense path
  (`prefill.fast_paths.DequantizedPrefill`) is what calls `mx.dequantize`, so it asks the
  kernel report whether this kernel is active and then calls `dequantize` here.
"""

import mlx.core as mx
import mlx.nn as nn

from omlx_core.kernels.registry import HardwareMatch, KernelSpec, ModelMatch, Validation, kernel_source

SOURCE = "dequantize.cu"
BODY_MARKER = "// ---- body ----"
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = (mx.bfloat16, mx.float16)
THREADS = 256

_kernel = None


def supported(bits: int, group_size: int, mode: str, dtype: mx.Dtype) -> str:
    """Empty when the kernel computes this format, else why not (one line)."""
    if mode != "affine":
        return f"quantization mode {mode} (the kernel reads the affine layout)"
    if bits not in BITS or group_size not in GROUP_SIZES:
        return f"{bits}-bit weights in groups of {group_size} (the kernel reads 4 or 8 bits, groups of 32, 64, 128)"
    if dtype not in DTYPES:
        return f"dtype {dtype} (the kernel writes bfloat16 or float16)"
    return ""


def _dequantize_kernel():
    global _kernel
    if _kernel is None:
        header, body = kernel_source(SOURCE).split(BODY_MARKER, 1)
        _kernel = mx.fast.cuda_kernel(name="omlx_dequantize", input_names=["w", "scales", "biases"],
                                      output_names=["out"], source=body, header=header)
    return _kernel


def dequantize(w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
               dtype: mx.Dtype) -> mx.array:
    """`mx.dequantize(w, scales, biases, group_size, bits, dtype=dtype)` on the kernel
    (a format `supported` accepts; scales and biases are read in their own dtype)."""
    rows, words = w.shape
    chunks = rows * words // 4
    (out,) = _dequantize_kernel()(
        inputs=[w, scales, biases],
        template=[("T", dtype), ("BITS", bits), ("GROUP", group_size)],
        grid=(-(-chunks // THREADS) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, words * 32 // bits)], output_dtypes=[dtype])
    return out


def applies(model) -> bool:
    return any(isinstance(module, nn.QuantizedLinear)
               and not supported(module.bits, module.group_size, module.mode, mx.bfloat16)
               for _, module in model.named_modules())


# Bit-identical to mx.dequantize in all 48 checked cases (every format it accepts, real and odd
# shapes; docs/benchmarks/dequantize-h200.json), so its result cannot depend on the model; in a
# whole Qwen3-8B-shape prefill it is 12% faster than MLX's dequantize at 2048-token chunks and
# 10% at 4096 (docs/benchmarks/dequantize-h200-model.json).
H200 = Validation(ModelMatch.every_model(), HardwareMatch("cuda", "sm_90", "NVIDIA H200"),
                  "docs/benchmarks/dequantize-h200.json, docs/benchmarks/dequantize-h200-model.json")

SPEC = KernelSpec(
    name="dequantize",
    replaces="mx.dequantize in the dequantize-to-dense prefill path (affine 4/8-bit, groups 32/64/128)",
    source=SOURCE,
    validated=(H200,),
    applies=applies,
    absent="affine 4- or 8-bit quantized linears (group 32, 64 or 128)",
    install=None,
)
