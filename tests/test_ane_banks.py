"""The ane lane's portable part: per-channel INT8 banks and their error, and the staged
build's memory, dual banks and per-layer failures, on real tiny models (no Core ML runtime
is needed: packages are built and saved, which coremltools does on Linux too)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load

from omlx_core.models.testing import build_tiny_model
from omlx_core.prefill.ane.banks import QMAX, build_bank, quantize_rows, sample_activations
from omlx_core.prefill.ane.program import read_package, save_package
from omlx_core.prefill.ane.staged import plan_procedures, staged_build
from omlx_core.prefill.plan import SplitPlan, find_targets
from omlx_core.prefill.split import dense_rows

HALF = SplitPlan({kind: {"ane": 0.5} for kind in ("mlp_gate_up", "mlp_down", "gdn_qkv")})


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A quantized qwen3_5 hybrid (MLP and GDN targets), wide enough that a layer's slice
    dwarfs coremltools' fixed overhead per conversion."""
    path = build_tiny_model("qwen3_5", tmp_path_factory.mktemp("ane") / "hybrid", quantized=True,
                            dtype="float16", shape={"hidden_size": 512, "intermediate_size": 2048})
    model, _ = load(str(path))
    return model


def test_rows_are_symmetric_int8_with_float16_scales():
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((96, 64)) * rng.uniform(0.01, 3, (96, 1))).astype(np.float32)
    weight[5] = 0.0  # an all-zero channel must not divide by zero
    q, scales = quantize_rows(weight)
    assert q.dtype == np.int8 and scales.dtype == np.float16 and scales.shape == (96,)
    assert q.min() >= -QMAX and q.max() <= QMAX  # symmetric: -128 never used
    assert not q[5].any() and np.isfinite(scales).all()
    nonzero = np.arange(96) != 5
    assert (np.abs(q[nonzero]).max(axis=1) >= QMAX - 1).all()  # each channel uses its range
    wide = scales.astype(np.float32)[:, None]
    # within half a step of its own channel's scale (plus the scale's float16 rounding)
    assert (np.abs(weight - q * wide) <= 0.5 * wide + np.abs(weight).max(axis=1, keepdims=True) * 2**-10).all()


def test_bank_error_metrics_match_a_direct_computation():
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((200, 128)).astype(np.float32) * 0.05
    activations = sample_activations(128, tokens=32, seed=3)
    bank = build_bank(200, 128, lambda a, b: weight[a:b].copy(), activations=activations, blocks=7)
    approx = bank.dequantized()
    diff = weight - approx
    out, out_approx = activations @ weight.T, activations @ approx.T
    error = bank.error
    assert error.max_abs == pytest.approx(np.abs(diff).max(), rel=1e-5)
    assert error.rel_rms == pytest.approx(np.linalg.norm(diff) / np.linalg.norm(weight), rel=1e-4)
    assert error.output_max_abs == pytest.approx(np.abs(out - out_approx).max(), rel=1e-4)
    assert error.output_rel_rms == pytest.approx(np.linalg.norm(out - out_approx) / np.linalg.norm(out), rel=1e-4)
    assert 0 < error.rel_rms < 0.02  # INT8 per channel: well under 2% on Gaussian rows


def test_bank_of_a_quantized_layer_is_measured_against_its_dequantized_rows(hybrid):
    modules = dict(hybrid.named_modules())
    target = next(t for t in find_targets(hybrid) if t.kind == "gdn_qkv")
    module = modules[target.path]
    bank = build_bank(128, target.in_features, lambda a, b: np.array(dense_rows(module, 64 + a, 64 + b)))
    source = np.array(dense_rows(module, 64, 192))
    assert np.abs(source - bank.dequantized()).max() == pytest.approx(bank.error.max_abs, rel=1e-5)
    assert bank.error.output_rel_rms < 0.02 and bank.nbytes == 128 * target.in_features + 128 * 2


def test_staged_build_peak_extra_stays_within_one_and_a_half_layer_slices(hybrid, tmp_path):
    build = staged_build(hybrid, find_targets(hybrid), HALF, 64, tmp_path, dual=False)
    assert not build.failures and build.procedures
    slice_bytes = build.largest_slice_fp32_bytes  # the fused gate/up: 2 x 1024 rows x 512 x 4 B
    assert slice_bytes == 2 * 1024 * 512 * 4
    total = build.peak_extra_bytes + build.host_peak_extra_bytes  # MLX and host (numpy) memory
    assert 0 < total <= 1.5 * slice_bytes, (build.peak_extra_bytes, build.host_peak_extra_bytes)
    every_layer = sum(p.slice_fp32_bytes() for p in build.procedures)
    assert total < every_layer / 4  # never all layers in float32
    assert build.retained_cache_bytes == mx.get_cache_memory() == 0  # reported, and cleared
    assert all(p.packages[0].is_dir() for p in build.procedures)


def test_procedures_fuse_gate_and_up_and_count_per_layer(hybrid):
    targets = find_targets(hybrid)
    procedures = plan_procedures(targets, HALF, 64)
    layers = len(hybrid.language_model.model.layers)
    gdn = sum(t.kind == "gdn_qkv" for t in targets)
    assert sum(p.kind == "mlp" for p in procedures) == 2 * layers  # gate_up fused, down
    assert sum(p.kind == "gdn" for p in procedures) == gdn > 0
    fused = next(p for p in procedures if p.name.endswith(".mlp.gate_up"))
    gate, up = fused.segments
    assert gate.path.endswith("gate_proj") and up.path.endswith("up_proj")
    assert (gate.offset, up.offset, gate.rows + up.rows) == (0, gate.rows, fused.rows)
    assert gate.start == up.start == 1024  # the ane slice is the trailing half of each


def test_dual_banks_are_two_halves_of_one_staged_slice(hybrid, tmp_path):
    targets = find_targets(hybrid)
    seen = []

    def save(bank, tokens, path):
        seen.append((path.name, bank))
        return save_package(bank, tokens, path)

    dual = staged_build(hybrid, targets, HALF, 64, tmp_path / "dual", dual=True, save=save)
    single = staged_build(hybrid, targets, HALF, 64, tmp_path / "single", dual=False)
    assert len(dual.procedures) == len(single.procedures) and not dual.failures
    for procedure, alone in zip(dual.procedures, single.procedures):
        assert procedure.dual and len(procedure.packages) == 2 and sum(procedure.bank_rows) == procedure.rows
        assert procedure.staged_rows == procedure.rows  # staged once, not once per bank
        whole = read_package(alone.packages[0])
        halves = [read_package(path) for path in procedure.packages]
        assert np.array_equal(np.concatenate([h.q for h in halves]), whole.q)
        assert np.array_equal(np.concatenate([h.scales for h in halves]), whole.scales)
    banks = dict(seen)
    first = dual.procedures[0]
    a, b = (banks[path.name] for path in first.packages)
    assert a.q.base is not None and a.q.base is b.q.base  # views of the one staged array


def test_a_failing_layer_is_named_with_its_cause_and_the_rest_are_built(hybrid, tmp_path):
    targets = find_targets(hybrid)
    broken = plan_procedures(targets, HALF, 64)[1].name

    def save(bank, tokens, path):
        if path.name.startswith(broken + "."):
            raise OSError("no space left on device")
        return save_package(bank, tokens, path)

    build = staged_build(hybrid, targets, HALF, 64, tmp_path, dual=False, save=save)
    (failure,) = build.failures
    assert failure.name == broken and "OSError: no space left on device" in failure.cause
    assert failure.warning == f"ane lane: {broken} not built: OSError: no space left on device"
    assert broken not in [p.name for p in build.procedures]
    assert len(build.procedures) == len(plan_procedures(targets, HALF, 64)) - 1
