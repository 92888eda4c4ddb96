"""One ane procedure as a Core ML program: INT8 weights, per-channel scales, fixed shapes.

The program is built with coremltools' MIL builder: `y = linear(x, dequantize(q, scale))`
with `x` of the fixed prefill shape (tokens, in_features) in float16, the weight an INT8
constant with one float16 scale per output channel (`constexpr_affine_dequantize`, axis 0,
zero point 0, from the iOS 17 / macOS 14 opset on) and, for MLP gate/up, the gate and up
rows concatenated along the output channels: one fused matmul, whose two halves the lane
hands back to the gate and up projections. The SiLU gate stays on the GPU side: mlx-lm's
MLP computes `silu(gate) * up` itself, and omlx replaces projections, not the MLP.

Building and saving work on any OS (`ct.convert(..., skip_model_load=True)`); only
compiling and running need macOS (`runtime`). `read_package` reads a saved package back
(ops, shapes, the INT8 weights and scales) so tests can check what was written.
"""

import contextlib
import io
import logging
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omlx_core.prefill.ane.banks import Int8Bank

INPUT, OUTPUT, WEIGHT = "x", "y", "w"


def coremltools():
    """coremltools, imported quietly (off macOS it logs that its native runtime is absent)."""
    logger = logging.getLogger("coremltools")
    level = logger.level
    if platform.system() != "Darwin":
        logger.setLevel(logging.ERROR)
    try:
        import coremltools as ct
    finally:
        logger.setLevel(level)
    return ct


def preload() -> None:
    """Import coremltools and its MIL builder and converter now (seconds, tens of MB), so a
    measured build counts its own memory only."""
    coremltools()
    from coremltools.converters.mil import Builder  # noqa: F401
    from coremltools.converters.mil.mil import types  # noqa: F401
    from coremltools.converters.mil.frontend.milproto import load  # noqa: F401


@dataclass(frozen=True)
class PackageContents:
    """What a saved package holds, read back from its spec and weight file."""

    ops: list[str]
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    q: np.ndarray
    scales: np.ndarray
    bias: np.ndarray | None


def build_program(bank: Int8Bank, tokens: int):
    """The MIL program of one procedure, for inputs of exactly `tokens` rows."""
    ct = coremltools()
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    rows, in_features = bank.q.shape
    bias = bank.bias if bank.bias is not None else np.zeros((rows,), dtype=np.float16)

    @mb.program(input_specs=[mb.TensorSpec(shape=(tokens, in_features), dtype=types.fp16)],
                opset_version=ct.target.iOS17)
    def program(x):
        weight = mb.constexpr_affine_dequantize(quantized_data=bank.q, scale=bank.scales,
                                                zero_point=np.int8(0), axis=0, name=WEIGHT)
        return mb.linear(x=x, weight=weight, bias=bias, name=OUTPUT)

    return program


def save_package(bank: Int8Bank, tokens: int, path: Path) -> Path:
    """Convert the procedure to an ML program for CPU_AND_NE and save it at `path`."""
    ct = coremltools()
    program = build_program(bank, tokens)
    with contextlib.redirect_stderr(io.StringIO()):  # the pass pipelines' progress bars
        model = ct.convert(program, convert_to="mlprogram", compute_units=ct.ComputeUnit.CPU_AND_NE,
                           minimum_deployment_target=ct.target.iOS17, skip_model_load=True)
    model.save(str(path))
    return path


def read_package(path: Path) -> PackageContents:
    """The ops, I/O shapes and constants of a saved package (no Core ML runtime needed)."""
    ct = coremltools()
    from coremltools.converters.mil.frontend.milproto.load import load as load_milproto

    model = ct.models.MLModel(str(path), skip_model_load=True)
    spec = model.get_spec()
    program = load_milproto(spec, spec.specificationVersion, model.weights_dir)
    operations = list(program.functions["main"].operations)
    dequantize = next(op for op in operations if op.op_type == "constexpr_affine_dequantize")
    linear = next(op for op in operations if op.op_type == "linear")
    shape = lambda feature: tuple(int(d) for d in feature.type.multiArrayType.shape)  # noqa: E731
    bias = linear.bias.val if linear.bias is not None else None
    return PackageContents(
        ops=[op.op_type for op in operations if op.op_type != "const"],
        input_shape=shape(spec.description.input[0]), output_shape=shape(spec.description.output[0]),
        q=np.asarray(dequantize.quantized_data.val), scales=np.asarray(dequantize.scale.val),
        bias=None if bias is None else np.asarray(bias))
