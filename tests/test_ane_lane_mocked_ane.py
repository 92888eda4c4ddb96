"""The ane lane with Apple's Neural Engine mocked (it cannot exist on this machine).

Mocked, and only these: the platform check says "macOS on Apple Silicon", and Core ML's
load (`runtime.load_package`) is replaced by a numpy predictor that reads the saved
package back (its INT8 weights and scales, its fixed shape) and computes what the program
computes. Everything else is real: the tiny models, the staged build, the .mlpackage files,
the split linears, procedure counting, warnings, the memory guard, /api/status's document
and the tuner's space.
"""

import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load

from omlx_core.models.testing import build_tiny_model
from omlx_core.prefill import lanes as lanes_module
from omlx_core.prefill.ane import runtime
from omlx_core.prefill.ane.program import INPUT, OUTPUT, read_package
from omlx_core.prefill.install import install_lanes
from omlx_core.prefill.lanes import ANE_NO_COREMLTOOLS, ANE_NOT_APPLE, lane_statuses
from omlx_core.prefill.plan import find_targets
from omlx_core.settings import load_settings

ANE_ON = {"prefill.lanes": ["gpu", "ane"], "prefill.split_min_tokens": 4, "prefill.ane.tokens": 32,
          "prefill.ane.dual": "off", "prefill.ane_share.mlp_gate_up": 0.5, "prefill.ane_share.mlp_down": 0.5,
          "prefill.ane_share.gdn_qkv": 0.5}


class NumpyPackage:
    """Stands in for a compiled Core ML model: the package's own weights, on the CPU."""

    loads: list[str] = []

    def __init__(self, path):
        contents = read_package(path)
        self.shape = contents.input_shape
        self.weight = contents.q.astype(np.float32) * contents.scales.astype(np.float32)[:, None]
        self.bias = contents.bias.astype(np.float32)
        self.predictions = 0
        NumpyPackage.loads.append(path.name)

    def predict(self, data):
        x = data[INPUT]
        assert x.shape == self.shape and x.dtype == np.float16  # the fixed prefill surface
        self.predictions += 1
        return {OUTPUT: (x.astype(np.float32) @ self.weight.T + self.bias).astype(np.float16)}


@pytest.fixture
def mocked_ane(monkeypatch):
    monkeypatch.setattr(lanes_module, "on_apple_silicon", lambda: True)
    monkeypatch.setattr(runtime, "load_package", NumpyPackage)
    NumpyPackage.loads = []
    return NumpyPackage


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ane-lane")
    return {arch: build_tiny_model(arch, root / arch, quantized=True, dtype="float16")
            for arch in ("llama", "qwen3_5")}


def _lane(report, name="ane"):
    return next(lane for lane in report.as_dict()["lanes"] if lane["name"] == name)


def test_off_apple_silicon_the_lane_is_ineligible_and_says_why(home, checkpoints):
    settings = load_settings(home, cli=ANE_ON)
    ane = next(lane for lane in lane_statuses(settings) if lane.name == "ane")
    assert (ane.eligible, ane.enabled, ane.reason) == (False, False, ANE_NOT_APPLE)
    assert ANE_NOT_APPLE == "requires macOS on Apple Silicon"
    model, _ = load(str(checkpoints["llama"]))
    report = install_lanes(model, settings, fp16_clone=False)
    state = _lane(report)
    assert state["configured"] and state["attempted"] and state["reason"] == ANE_NOT_APPLE
    assert sum(state["procedures"].values()) == 0 and not report.split_layers
    from omlx_core.errors import OmlxError

    with pytest.raises(OmlxError, match="requires macOS on Apple Silicon"):
        runtime.load_package("anything.mlpackage")  # the real guard, before any Core ML call


def test_omlx_status_shows_the_ane_lane_line_with_its_reason(home):
    import platform

    from conftest import omlx_env, run_omlx

    if platform.system() == "Darwin" and platform.machine() == "arm64":
        pytest.skip("the ane lane is eligible on this machine")
    result = run_omlx(home, "status", check=True, env=omlx_env(home, COLUMNS="200"))
    line = next(line for line in result.stdout.splitlines() if line.strip("│ ").startswith("ane "))
    assert "ineligible" in line and "requires macOS on Apple Silicon" in line


def test_without_coremltools_the_lane_says_how_to_install_it_mocked_ane(home, monkeypatch):
    monkeypatch.setattr(lanes_module, "on_apple_silicon", lambda: True)
    monkeypatch.setitem(sys.modules, "coremltools", None)  # blocks the import, as if absent
    ane = next(lane for lane in lane_statuses(load_settings(home, cli=ANE_ON)) if lane.name == "ane")
    assert (ane.eligible, ane.reason) == (False, ANE_NO_COREMLTOOLS)
    assert ANE_NO_COREMLTOOLS == "pip install coremltools"


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_procedures_are_counted_and_the_split_matches_the_int8_reference_mocked_ane(
        home, checkpoints, mocked_ane, arch):
    model, _ = load(str(checkpoints[arch]))
    reference, _ = load(str(checkpoints[arch]))
    targets = find_targets(model)
    report = install_lanes(model, load_settings(home, cli=ANE_ON), fp16_clone=False)
    state = _lane(report)
    layers = sum(t.kind == "mlp_down" for t in targets)
    gdn = sum(t.kind == "gdn_qkv" for t in targets)
    assert state["attempted"] and state["procedures"] == {"mlp": 2 * layers, "gdn": gdn, "dual": 0,
                                                          "resident": 2 * layers + gdn}
    assert len(mocked_ane.loads) == 2 * layers + gdn and not state["warnings"]
    ane = report.ane
    assert all(p.banks[0].predictions == 1 for p in ane.loaded)  # warmed once at load
    assert state["resident_bytes"] == ane.bank_bytes + ane.surface_bytes == report.extra_bytes > 0
    assert ane.surface_bytes == sum(32 * (p.procedure.in_features + p.procedure.rows) * 2 for p in ane.loaded)

    x = (0.5 * mx.random.normal((1, 40, targets[0].in_features), key=mx.random.key(0))).astype(mx.float16)
    modules, originals = dict(model.named_modules()), dict(reference.named_modules())
    for target in targets:
        split, original = modules[target.path], originals[target.path]
        inputs = x if target.in_features == x.shape[-1] else mx.random.normal(
            (1, 40, target.in_features), key=mx.random.key(1)).astype(mx.float16)
        want, got = original(inputs).astype(mx.float32), split(inputs).astype(mx.float32)
        ane_rows = next(s for s in split.slices if s.lane == "ane")
        gpu_rows = slice(0, ane_rows.start)
        assert mx.array_equal(got[..., gpu_rows], want[..., gpu_rows])  # the gpu lane's rows are exact
        scale = float(mx.abs(want).max())
        assert float(mx.abs(got - want).max()) <= 0.05 * scale, target.path  # INT8 is approximate
        assert float(mx.abs(got - want).max()) > 0  # and it is not the float16 layer in disguise
    # 40 tokens through the fixed 32-row shape: two chunks, the last zero-padded
    assert all(p.banks[0].predictions in (1, 3) for p in ane.loaded)

    fused = next(p for p in ane.loaded if p.procedure.name.endswith("gate_up"))
    calls = fused.calls
    mlp = modules[fused.procedure.segments[0].path.rsplit(".", 1)[0]]
    mlp(x)  # mlx-lm's MLP calls gate_proj(x) and up_proj(x) with the same x
    assert fused.calls == calls + 1  # the fused procedure ran once for both halves


def test_three_lanes_at_once_and_a_failing_ane_call_names_the_layer_mocked_ane(
        home, checkpoints, mocked_ane, tmp_path):
    from omlx_core.errors import OmlxError
    from omlx_core.models.clone_fp16 import clone_fp16

    clone = tmp_path / "clone"
    clone_fp16(checkpoints["llama"], clone)
    model, _ = load(str(clone))
    reference, _ = load(str(clone))
    settings = load_settings(home, cli={**ANE_ON, "prefill.lanes": ["gpu", "cpu", "ane"],
                                        "prefill.cpu_sharing.enabled": True, "prefill.cpu_share.mlp_gate_up": 0.25,
                                        "prefill.ane_share.mlp_gate_up": 0.25})
    report = install_lanes(model, settings, fp16_clone=True)
    assert _lane(report, "cpu")["procedures"]["mlp"] > 0 and _lane(report, "ane")["procedures"]["mlp"] > 0
    up = next(layer for layer in report.split_layers if layer.path.endswith("up_proj"))
    assert [s.lane for s in up.slices] == ["gpu", "cpu", "ane"]
    x = mx.random.normal((1, 16, 128), key=mx.random.key(4)).astype(mx.float16)
    want, got = dict(reference.named_modules())[up.path](x), up(x)
    cpu, ane = up.slices[1], up.slices[2]
    assert float(mx.abs(got - want)[..., cpu.start:cpu.stop].max()) <= 5e-3 * float(mx.abs(want).max())
    assert float(mx.abs(got - want)[..., ane.start:].max()) <= 0.05 * float(mx.abs(want).max())

    def broken(x, source=None):
        raise RuntimeError("Core ML prediction failed")

    up.ane = broken
    with pytest.raises(OmlxError, match=f"ane lane failed in {up.path}: RuntimeError: Core ML"):
        up(x)


def test_dual_ane_counts_each_procedure_as_two_banks_mocked_ane(home, checkpoints, mocked_ane):
    single, _ = load(str(checkpoints["llama"]))
    model, _ = load(str(checkpoints["llama"]))
    targets = find_targets(model)
    install_lanes(single, load_settings(home, cli=ANE_ON), fp16_clone=False)
    report = install_lanes(model, load_settings(home, cli={**ANE_ON, "prefill.ane.dual": "on"}), fp16_clone=False)
    state = _lane(report)
    assert state["procedures"]["dual"] == state["procedures"]["resident"] > 0
    assert len(mocked_ane.loads) == 3 * state["procedures"]["resident"]  # 1 bank each, then 2 each
    document = report.as_dict()["ane"]
    assert document["dual"] and all(p["dual"] for p in document["procedures"])
    for target in targets:  # two halves, assembled, are the one bank's output
        x = mx.random.normal((1, 8, target.in_features), key=mx.random.key(2)).astype(mx.float16)
        want = dict(single.named_modules())[target.path](x)
        got = dict(model.named_modules())[target.path](x)
        assert got.shape == (1, 8, target.out_features), target.path
        # the same float32 products, summed by BLAS in other block shapes: float16 ulps apart
        assert float(mx.abs(got - want).max()) <= 2e-3 * float(mx.abs(want).max()), target.path


def test_a_failed_layer_warns_with_its_name_and_cause_and_stays_on_the_gpu_mocked_ane(
        home, checkpoints, mocked_ane, monkeypatch, caplog):
    model, _ = load(str(checkpoints["llama"]))
    reference, _ = load(str(checkpoints["llama"]))
    broken = "model.layers.1.mlp.down_proj"

    def load_or_fail(path):
        if path.name.startswith(broken):
            raise RuntimeError("ANE compiler rejected the program")
        return NumpyPackage(path)

    monkeypatch.setattr(runtime, "load_package", load_or_fail)
    with caplog.at_level("WARNING", logger="omlx.prefill"):
        report = install_lanes(model, load_settings(home, cli=ANE_ON), fp16_clone=False)
    state = _lane(report)
    warning = f"ane lane: {broken} not built: load failed: RuntimeError: ANE compiler rejected the program"
    assert state["warnings"] == [warning] and warning in caplog.text
    assert "1 warning(s)" in state["reason"] and report.as_dict()["ane"]["warnings"] == [warning]
    layers = len(model.model.layers)
    assert state["procedures"]["resident"] == 2 * layers - 1
    from omlx_core.prefill.split import SplitLinear

    kept = dict(model.named_modules())[broken]
    assert not isinstance(kept, SplitLinear)  # the failed layer is left as it was: all gpu
    x = mx.random.normal((1, 8, 256), key=mx.random.key(3)).astype(mx.float16)
    assert mx.array_equal(kept(x), dict(reference.named_modules())[broken](x))
    others = [layer for layer in report.split_layers if layer.path != broken]
    assert len(others) == 3 * layers - 1 and all(layer.ane is not None for layer in others)


def test_zero_procedures_is_a_warning_mocked_ane(home, checkpoints, mocked_ane):
    model, _ = load(str(checkpoints["llama"]))
    shares = {f"prefill.ane_share.{kind}": 0.0 for kind in ("mlp_gate_up", "mlp_down", "gdn_qkv")}
    report = install_lanes(model, load_settings(home, cli={**ANE_ON, **shares}), fp16_clone=False)
    state = _lane(report)
    assert state["attempted"] and sum(state["procedures"].values()) == 0
    assert state["warnings"] and "zero procedures" in state["warnings"][0]
    assert "prefill.ane_share.mlp_gate_up" in state["reason"]


def test_serve_charges_banks_and_surfaces_to_the_guard_and_reports_them_mocked_ane(
        home, checkpoints, mocked_ane):
    import shutil

    from omlx_core.memory.guard import MemoryGuard
    from omlx_core.serve.registry import ModelRegistry
    from omlx_core.serve.server import _prefill

    shutil.copytree(checkpoints["qwen3_5"], home / "models" / "hybrid")
    guard = MemoryGuard(total_bytes=64 << 30)
    registry = ModelRegistry(home, ["hybrid"], guard, cli_settings=ANE_ON)
    loaded = registry.get("hybrid")
    document = _prefill(loaded)
    ane = next(lane for lane in document["lanes"] if lane["name"] == "ane")
    assert ane["eligible"] and ane["configured"] and ane["attempted"]
    assert ane["procedures"]["gdn"] > 0 and ane["procedures"]["mlp"] > 0 and ane["procedures"]["resident"] > 0
    assert document["ane"]["surface_bytes"] > 0 and document["ane"]["worst_error"]["output_rel_rms"] < 0.05
    extras = guard.snapshot()["extras"]
    assert extras["prefill_lanes:hybrid"] == loaded.lanes.extra_bytes
    assert extras["prefill_lanes:hybrid"] >= document["ane"]["surface_bytes"] + document["ane"]["bank_bytes"]
    assert document["warmup_s"] > 0 and document["ane"]["calls"] > 0  # the load's warm-up prefill used it
    loaded.prompt_cache.close(timeout=None)


def test_the_tuner_searches_ane_shares_only_where_the_lane_is_eligible(checkpoints):
    from omlx_core.tune.space import search_space

    model, _ = load(str(checkpoints["qwen3_5"]))
    targets = find_targets(model)
    common = dict(cpu_lane=(True, "numpy"), fp16_clone=False, quantized=True, max_ctx=1000)
    eligible = search_space(targets, ane_lane=(True, "Core ML"), **common)
    names = [c.name for c in eligible.controls]
    assert {"ane_share.mlp_gate_up", "ane_share.mlp_down", "ane_share.gdn_qkv"} <= set(names)
    gdn = next(c for c in eligible.controls if c.name == "ane_share.gdn_qkv")
    assert gdn.values[0] == 0.0 and all(v == 0 or v >= gdn.minimum for v in gdn.values)
    candidate = eligible.default().with_value("ane_share.mlp_down", 0.25)
    sets = candidate.settings()
    assert sets["prefill.lanes"] == "gpu,ane" and sets["prefill.ane_share.mlp_down"] == "0.25"
    ineligible = search_space(targets, ane_lane=(False, ANE_NOT_APPLE), **common)
    assert not any(c.name.startswith("ane_share") for c in ineligible.controls)
    assert f"ane_share.mlp_down: not searched, the ane lane is ineligible ({ANE_NOT_APPLE})" in ineligible.notes


def test_the_calibrator_rejects_ane_shares_above_the_error_limit_mocked_ane(home, checkpoints, mocked_ane):
    from omlx_core.tune.measure import ane_output_error

    model, _ = load(str(checkpoints["llama"]))
    report = install_lanes(model, load_settings(home, cli=ANE_ON), fp16_clone=False)
    error = ane_output_error(report)
    assert error == max(p.procedure.error.output_rel_rms for p in report.ane.loaded) > 0
    assert ane_output_error(install_lanes(load(str(checkpoints["llama"]))[0], load_settings(home),
                                          fp16_clone=False)) == 0.0


def test_dual_ane_is_automatic_on_ultra_chips_only():
    from omlx_core.prefill.ane.install import dual_ane

    assert dual_ane("auto", "Apple M2 Ultra") and dual_ane("auto", "Apple M1 Ultra")
    assert not dual_ane("auto", "Apple M3 Max") and not dual_ane("auto", "AMD EPYC 7B13")
    assert dual_ane("on", "Apple M3 Max") and not dual_ane("off", "Apple M2 Ultra")
