"""Core ML programs of the ane lane, built and saved with coremltools on this machine:
their structure (INT8 constant with per-channel float16 scales, one linear, fixed float16
shapes, the fused gate/up output) and weights that read back exactly as the banks made them."""

import numpy as np
import pytest
from mlx_lm.utils import load

from omlx_core.models.testing import build_tiny_model
from omlx_core.prefill.ane.banks import build_bank
from omlx_core.prefill.ane.program import build_program, read_package, save_package
from omlx_core.prefill.ane.staged import _row_reader, plan_procedures, staged_build
from omlx_core.prefill.plan import SplitPlan, find_targets
from omlx_core.prefill.split import dense_rows


def _bank(rows=192, in_features=128, bias=False, seed=0):
    weight = np.random.default_rng(seed).standard_normal((rows, in_features)).astype(np.float32)
    return build_bank(rows, in_features, lambda a, b: weight[a:b].copy(),
                      bias=np.linspace(-1, 1, rows) if bias else None)


def test_program_is_an_int8_dequantize_feeding_one_linear_of_fixed_shape():
    bank = _bank()
    program = build_program(bank, tokens=256)
    function = program.functions["main"]
    ops = [op for op in function.operations if op.op_type != "const"]
    assert [op.op_type for op in ops] == ["constexpr_affine_dequantize", "linear"]
    dequantize, linear = ops
    assert dequantize.quantized_data.val.dtype == np.int8 and dequantize.scale.val.dtype == np.float16
    assert dequantize.axis.val == 0 and dequantize.zero_point.val == 0  # per output channel, symmetric
    assert linear.weight is dequantize.outputs[0]
    (x,) = function.inputs.values()
    assert tuple(x.shape) == (256, 128) and x.dtype.__name__ == "fp16"
    assert tuple(function.outputs[0].shape) == (256, 192)


def test_saved_package_weights_round_trip_exactly(tmp_path):
    bank = _bank(bias=True, seed=2)
    path = save_package(bank, 64, tmp_path / "proc.mlpackage")
    assert (path / "Manifest.json").is_file()
    contents = read_package(path)
    assert contents.ops == ["constexpr_affine_dequantize", "linear"]
    assert contents.input_shape == (64, 128) and contents.output_shape == (64, 192)
    assert contents.q.dtype == np.int8 and np.array_equal(contents.q, bank.q)
    assert contents.scales.dtype == np.float16 and np.array_equal(contents.scales, bank.scales)
    assert np.array_equal(contents.bias, bank.bias)


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_staged_packages_hold_the_fused_gate_up_and_the_projections_rows(tmp_path, arch):
    model, _ = load(str(build_tiny_model(arch, tmp_path / arch, quantized=True, dtype="float16")))
    plan = SplitPlan({"mlp_gate_up": {"ane": 0.5}, "mlp_down": {"ane": 0.25}, "gdn_qkv": {"ane": 0.5}})
    targets = find_targets(model)
    build = staged_build(model, targets, plan, 128, tmp_path / "packages", dual=False)
    assert not build.failures
    modules = dict(model.named_modules())
    by_name = {p.name: p for p in build.procedures}
    assert by_name.keys() == {p.name for p in plan_procedures(targets, plan, 128)}
    fused = next(p for p in build.procedures if p.name.endswith("gate_up"))
    contents = read_package(fused.packages[0])
    assert contents.input_shape == (128, 128) and contents.output_shape == (128, 2 * 128)  # gate | up
    again = build_bank(fused.rows, fused.in_features, _row_reader(fused, modules))
    assert np.array_equal(contents.q, again.q) and np.array_equal(contents.scales, again.scales)
    gate, up = fused.segments
    source = np.concatenate([np.array(dense_rows(modules[s.path], s.start, s.start + s.rows)) for s in (gate, up)])
    approx = contents.q.astype(np.float32) * contents.scales.astype(np.float32)[:, None]
    assert np.abs(source - approx).max() == pytest.approx(fused.error.max_abs, rel=1e-5)
    kinds = {p.kind for p in build.procedures}
    assert kinds == ({"mlp", "gdn"} if arch == "qwen3_5" else {"mlp"})
