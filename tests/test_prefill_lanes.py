"""Heterogeneous prefill: split plans, split linears against the unsplit layer, gating,
the staged build's memory, failure handling and what the server reports."""

import json

import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load

from conftest import omlx_env
from omlx_core.errors import OmlxError
from omlx_core.models.clone_fp16 import clone_fp16
from omlx_core.models.testing import build_tiny_model
from omlx_core.prefill.install import FP16_NEEDED, install_lanes
from omlx_core.prefill.plan import SplitPlan, Target, find_targets
from omlx_core.prefill.split import SplitLinear
from omlx_core.settings import load_settings

CPU_ON = {"prefill.lanes": ["gpu", "cpu"], "prefill.cpu_sharing.enabled": True,
          "prefill.split_min_tokens": 4}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("lanes")
    made = {}
    for arch in ("llama", "qwen3_5"):
        for quantized in (False, True):
            made[arch, quantized] = build_tiny_model(arch, root / f"{arch}-{quantized}",
                                                     quantized=quantized, dtype="float16")
    return made


def settings(home, **cli):
    return load_settings(home, cli={**CPU_ON, **cli})


def test_plan_aligns_slices_and_gives_the_rest_to_gpu():
    target = Target("model.layers.0.mlp.gate_proj", "mlp_gate_up", 1000, 64)
    slices = SplitPlan({"mlp_gate_up": {"cpu": 0.3}}).slices(target)
    assert [(s.lane, s.start, s.stop) for s in slices] == [("gpu", 0, 744), ("cpu", 744, 1000)]
    assert SplitPlan({"mlp_gate_up": {"cpu": 0.05}}).slices(target) == SplitPlan().slices(target)
    everything = SplitPlan({"mlp_down": {"cpu": 1.0}}).slices(Target("d", "mlp_down", 512, 64))
    assert [(s.lane, s.size) for s in everything] == [("cpu", 512)]
    with pytest.raises(Exception, match="not in"):
        SplitPlan({"mlp_down": {"cpu": 1.5}})
    with pytest.raises(Exception, match="unknown target kind"):
        SplitPlan({"attention": {"cpu": 0.5}})


def test_gdn_share_respects_the_structural_floor():
    target = Target("model.layers.0.linear_attn.in_proj_qkvz", "gdn_qkv", 3072, 64, floor=384)
    (gpu, cpu) = SplitPlan({"gdn_qkv": {"cpu": 0.1}}).slices(target)
    assert cpu.size == 384 and gpu.size == 3072 - 384  # 307 channels rounded up to one floor
    (gpu, cpu) = SplitPlan({"gdn_qkv": {"cpu": 0.5}}).slices(target)
    assert cpu.size % 384 == 0 and cpu.size <= 1536


def test_targets_per_architecture(checkpoints):
    dense, _ = load(str(checkpoints["llama", False]))
    kinds = {t.kind for t in find_targets(dense)}
    assert kinds == {"mlp_gate_up", "mlp_down"}  # dense models: MLP only
    hybrid, _ = load(str(checkpoints["qwen3_5", False]))
    gdn = [t for t in find_targets(hybrid) if t.kind == "gdn_qkv"]
    assert gdn and all(t.floor >= 64 and t.floor % 64 == 0 for t in gdn)


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
@pytest.mark.parametrize("quantized", [False, True], ids=["float16", "quantized"])
def test_split_equals_the_unsplit_layer_per_target_kind(checkpoints, arch, quantized):
    model, _ = load(str(checkpoints[arch, quantized]))
    modules = dict(model.named_modules())
    plan = SplitPlan({kind: {"cpu": 0.5} for kind in ("mlp_gate_up", "mlp_down", "gdn_qkv")})
    seen = set()
    for target in find_targets(model):
        if target.kind in seen:
            continue
        seen.add(target.kind)
        original = modules[target.path]
        split = SplitLinear(target.path, original, plan.slices(target), min_tokens=4)
        x = (0.5 * mx.random.normal((2, 16, target.in_features), key=mx.random.key(1))).astype(mx.float16)
        want, got = original(x).astype(mx.float32), split(x).astype(mx.float32)
        assert split.calls == 1 and got.shape == want.shape
        # fp16 tolerance: a few ulp of the largest output (the unsplit quantized kernel
        # accumulates in float16; the cpu lane in float32)
        scale = float(mx.abs(want).max())
        assert float(mx.abs(want - got).max()) <= 5e-3 * scale, target.path
        small = x[:, :1]  # decode-sized: the unsplit path, bit for bit
        assert mx.array_equal(split(small), original(small)) and split.calls == 1
    assert seen == ({"mlp_gate_up", "mlp_down", "gdn_qkv"} if arch == "qwen3_5" else {"mlp_gate_up", "mlp_down"})


def test_cpu_sharing_needs_an_fp16_clone(checkpoints, home):
    model, _ = load(str(checkpoints["llama", True]))
    report = install_lanes(model, settings(home), fp16_clone=False)
    cpu = next(lane for lane in report.as_dict()["lanes"] if lane["name"] == "cpu")
    assert cpu["attempted"] and cpu["reason"] == FP16_NEEDED and sum(cpu["procedures"].values()) == 0
    assert not report.split_layers


def test_install_on_a_clone_generates_the_same_greedy_tokens(checkpoints, home, tmp_path):
    from omlx_core.bench.runs import run_generation

    clone = tmp_path / "clone"
    clone_fp16(checkpoints["llama", True], clone)
    plain, _ = load(str(clone))
    split, _ = load(str(clone))
    report = install_lanes(split, settings(home, **{"prefill.cpu_share.mlp_down": 0.5}), fp16_clone=True)
    cpu = report.as_dict()["lanes"][1]
    layers = len(plain.model.layers)
    assert cpu["procedures"]["mlp"] == 3 * layers and cpu["procedures"]["gdn"] == 0
    assert cpu["resident_bytes"] == report.extra_bytes > 0
    prompt = np.random.default_rng(0).integers(10, 200, (1, 64))
    want = run_generation(plain, prompt, 8, 16, set()).token_ids
    got = run_generation(split, prompt, 8, 16, set()).token_ids
    assert got == want and sum(layer.calls for layer in report.split_layers) > 0


def test_staged_build_peak_stays_near_one_slice(checkpoints, home):
    model, _ = load(str(checkpoints["qwen3_5", True]))
    report = install_lanes(model, settings(home, **{f"prefill.cpu_share.{k}": 0.5 for k in
                                                    ("mlp_gate_up", "mlp_down", "gdn_qkv")}),
                           fp16_clone=True)
    largest = max(layer.lane_bytes for layer in report.split_layers)
    assert report.build_peak_extra_bytes <= 1.5 * largest
    assert report.retained_cache_bytes == 0


def test_a_failing_cpu_lane_names_the_layer_and_drains_the_gpu_work(checkpoints):
    model, _ = load(str(checkpoints["llama", False]))
    target = find_targets(model)[0]
    split = SplitLinear(target.path, dict(model.named_modules())[target.path],
                        SplitPlan({"mlp_gate_up": {"cpu": 0.5}}).slices(target), min_tokens=1)

    class BrokenSlice:
        nbytes = 0

        def __call__(self, x):
            raise MemoryError("no room for the product")

    split.cpu = BrokenSlice()
    with pytest.raises(OmlxError, match=f"cpu lane failed in {target.path}: MemoryError"):
        split(mx.ones((1, 8, target.in_features), dtype=mx.float16))


def test_server_reports_lanes_and_procedures(start_server, checkpoints, tmp_path_factory):
    home = tmp_path_factory.mktemp("lanes-home")
    clone_fp16(checkpoints["qwen3_5", True], home / "models" / "hybrid-fp16")
    (home / "settings.json").write_text(json.dumps({"prefill": {
        "lanes": ["gpu", "cpu"], "cpu_sharing.enabled": True, "split_min_tokens": 8}}))
    server = start_server(home, "--model", "hybrid-fp16", env=omlx_env(home))
    reply = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"prompt": "word " * 40, "max_tokens": 3, "temperature": 0})
    assert reply.status_code == 200
    (model,) = httpx.get(server.url + "/api/status").json()["models"]
    lanes = {lane["name"]: lane for lane in model["prefill"]["lanes"]}
    assert lanes["cpu"]["attempted"] and lanes["cpu"]["configured"] and lanes["cpu"]["eligible"]
    assert lanes["cpu"]["procedures"]["gdn"] > 0 and lanes["cpu"]["procedures"]["mlp"] > 0
    assert model["prefill"]["split_calls"] > 0 and model["prefill"]["warmup_s"] > 0
    memory = httpx.get(server.url + "/api/status").json()["memory"]
    assert memory["extras"]["prefill_lanes:hybrid-fp16"] == model["prefill"]["extra_bytes"] > 0
    assert lanes["ane"]["eligible"] is False and lanes["ane"]["reason"]
