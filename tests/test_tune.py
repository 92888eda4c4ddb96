"""`omlx tune` on tiny real models (CPU): what it searches, what it recommends, where it goes.

The tiny models are fast enough that a whole tune (search, release, fresh-load
verification) takes seconds, so these run the real procedure end to end.
"""

import json

import pytest

from conftest import run_omlx
from omlx_core.bench.workload import Workload
from omlx_core.models.clone_fp16 import clone_fp16
from omlx_core.models.resolve import resolve
from omlx_core.models.testing import build_tiny_model
from omlx_core.settings import load_settings
from omlx_core.settings.files import model_store
from omlx_core.tune.measure import Calibrator
from omlx_core.tune.run import run_tune
from omlx_core.tune.space import Candidate, effective_key, search_space

SMALL = Workload((96, 160), gen=2, repeats=2, warmup=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    home = tmp_path_factory.mktemp("tune-home")
    build_tiny_model("llama", home / "models" / "llama")
    build_tiny_model("llama", home / "models" / "llama-q", quantized=True)
    build_tiny_model("qwen3_5", home / "models" / "hybrid-bf16")
    clone_fp16(home / "models" / "hybrid-bf16", home / "models" / "hybrid")
    clone_fp16(home / "models" / "llama", home / "models" / "llama-fp16")
    return home


def test_cli_stages_the_recommendation_and_save_makes_it_active(models):
    document = json.loads(run_omlx(models, "tune", "llama-q", "--ctx", "96,160", "--gen", "2",
                                   "--repeats", "2", "--budget-s", "60", "--json", check=True).stdout)
    stored = model_store(models, resolve("llama-q", models).key).read()
    assert stored["working"]["prefill"]["chunk_size"] == int(document["recommendation"]["settings"]["prefill.chunk_size"])
    assert "profiles" not in stored or not stored["profiles"]  # the active profile is untouched
    assert document["staged"]["profile"] == "working" and document["saved_profile"] is None
    assert document["schema"] == "omlx.tune/1" and document["model"]["fingerprint"].startswith("mf-")
    assert {c["label"] for c in document["candidates"]} >= {document["best"]["label"]}

    run_omlx(models, "-q", "tune", "llama-q", "--ctx", "96", "--gen", "2", "--repeats", "2",
             "--budget-s", "30", "--save", "--profile", "tuned", check=True)
    stored = model_store(models, resolve("llama-q", models).key).read()
    assert stored["active"] == "tuned" and "working" not in stored
    settings = load_settings(models, resolve("llama-q", models).key)
    assert settings.profile == "tuned" and settings.resolved["prefill.dense"].source != "default"


def test_export_writes_toml_with_every_candidate(models, tmp_path):
    out = tmp_path / "tune.toml"
    run_omlx(models, "-q", "tune", "llama", "--ctx", "600", "--gen", "2", "--repeats", "2",
             "--budget-s", "30", "--export", str(out), check=True)
    import tomllib

    report = tomllib.loads(out.read_text())
    assert report["recommendation"]["label"] and len(report["candidates"]) >= 2
    assert report["hardware"]["fingerprint"] and report["created"]


def test_the_gdn_share_never_goes_below_the_structural_floor(models):
    ref = resolve("hybrid", models)
    document = run_tune(ref, models, Workload((300,), gen=2, repeats=1, warmup=0), budget_s=120)
    floor = document["gdn_floor_share"]
    assert floor > 0
    gdn = next(c for c in document["controls"] if c["name"] == "cpu_share.gdn_qkv")
    assert all(v == 0 or v >= floor for v in gdn["values"])
    shares = [float(c["settings"]["prefill.cpu_share.gdn_qkv"]) for c in document["candidates"]]
    assert any(shares) and all(s == 0 or s >= floor for s in shares)


def test_no_gdn_control_for_a_model_without_gated_delta_layers(models):
    document = run_tune(resolve("llama-fp16", models), models, SMALL, budget_s=60)
    names = [c["name"] for c in document["controls"]]
    assert "cpu_share.gdn_qkv" not in names and "cpu_share.mlp_down" in names
    assert any("cpu_share.gdn_qkv" in note and "no gated-delta" in note for note in document["notes"])
    assert all(float(c["settings"]["prefill.cpu_share.gdn_qkv"]) == 0 for c in document["candidates"])


def test_engines_are_released_before_verification(models):
    document = run_tune(resolve("llama", models), models, Workload((600,), gen=2, repeats=2, warmup=1),
                        budget_s=60)
    assert len(document["candidates"]) >= 2 and document["model_loads"] >= 1
    memory = document["memory"]
    assert memory["after_release_bytes"] <= memory["baseline_bytes"] + (256 << 10)


class _Slowed:
    """A model that really takes `delay` s longer per forward pass (a stand-in for a slow path)."""

    def __init__(self, model, delay: float = 0.5):
        self.model, self.delay = model, delay

    def __call__(self, *args, **kwargs):
        import time

        time.sleep(self.delay)
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


class ForcedSlow(Calibrator):
    """The real calibrator, except that candidates with 256-token chunks run on `_Slowed`."""

    def _model(self, sets):
        from dataclasses import replace

        prepared = super()._model(sets)
        return replace(prepared, model=_Slowed(prepared.model)) if sets["prefill.chunk_size"] == "256" \
            else prepared


def test_a_forced_slow_candidate_is_never_recommended(models):
    from dataclasses import replace

    from omlx_core.bench.variants import VariantSpec, variant_settings
    from omlx_core.tune.run import build_space
    from omlx_core.tune.search import tune

    ref = resolve("llama", models)
    workload = Workload((600,), gen=2, repeats=2, warmup=1)
    space = build_space(ref, load_settings(models, ref.key), 600)
    space.controls = [replace(c, values=c.values + (256,)) if c.name == "chunk_size" else c
                      for c in space.controls]
    calibrator = ForcedSlow(ref, lambda sets: variant_settings(models, ref.key, VariantSpec(None, sets)),
                            workload, hard_bytes=1 << 40)
    outcome = tune(space, calibrator, 600, budget_s=120)
    slow = [r for r in outcome.candidates if r.settings["prefill.chunk_size"] == "256"]
    assert slow and slow[0].prefill_tps < 0.5 * outcome.candidates[0].prefill_tps
    assert outcome.recommended.get("chunk_size") != 256 and outcome.best.settings["prefill.chunk_size"] != "256"


def test_on_a_single_lane_machine_the_recommendation_is_the_default(models):
    # bf16 (no FP16 clone: no cpu lane), not quantized (no dense path), prompts shorter
    # than every chunk: nothing here can change the work, so the default must stand.
    document = run_tune(resolve("llama", models), models, Workload((96,), gen=2, repeats=2, warmup=1),
                        budget_s=60)
    rec = document["recommendation"]
    assert rec["is_default"] and len(document["candidates"]) == 1
    assert rec["settings"]["prefill.cpu_sharing.enabled"] == "false"
    assert rec["settings"]["prefill.dense"] == "off"
    assert any("FP16 clone" in note for note in document["notes"])


def test_candidates_that_do_the_same_work_share_a_key():
    space = search_space([], cpu_lane=(False, "no BLAS"), fp16_clone=False, quantized=True, max_ctx=1000)
    default = space.default()
    assert effective_key(default.with_value("chunk_size", 4096), 1000) == \
        effective_key(default.with_value("chunk_size", 8192), 1000)
    assert effective_key(default.with_value("dense_min_tokens", 2048), 1000) == effective_key(default, 1000)
    assert isinstance(default, Candidate) and default.settings()["prefill.dense"] == "off"


def test_with_no_accelerator_the_share_grid_reaches_the_whole_layer(tmp_path):
    """MLX's own lane is the CPU there, and host BLAS may deserve every channel."""
    from mlx_lm import load

    from omlx_core.models.testing import build_tiny_model
    from omlx_core.prefill.plan import find_targets

    model, _ = load(str(build_tiny_model("llama", tmp_path / "m")))
    targets = find_targets(model)
    grids = {}
    for accelerator in (True, False):
        space = search_space(targets, cpu_lane=(True, "numpy"), fp16_clone=True, quantized=False, max_ctx=1000,
                             accelerator=accelerator)
        grids[accelerator] = {c.name: c.values for c in space.controls}
    assert max(grids[True]["cpu_share.mlp_gate_up"]) < 0.5
    assert max(grids[False]["cpu_share.mlp_gate_up"]) == 1.0 == max(grids[False]["cpu_share.mlp_down"])
    assert grids[False]["cpu_share.mlp_gate_up"][0] == 0.0  # the default first


class ForcedSlowCopy(Calibrator):
    """The real calibrator, except that the models of `slow` (a compute.dense_copy value) run on `_Slowed`."""

    slow = "on"

    def _model(self, sets):
        from dataclasses import replace

        prepared = super()._model(sets)
        slowed = _Slowed(prepared.model, delay=0.05)  # a decode step of the tiny model takes ~ms
        return replace(prepared, model=slowed) if sets.get("compute.dense_copy") == self.slow else prepared


class ForcedSlowWithoutCopy(ForcedSlowCopy):
    slow = "off"


@pytest.mark.parametrize("calibrator, choice", [(ForcedSlowCopy, "off"), (ForcedSlowWithoutCopy, "on")])
def test_the_dense_copy_is_staged_only_when_it_decodes_faster(models, calibrator, choice):
    document = run_tune(resolve("llama-q", models), models, Workload((96,), gen=2, repeats=1, warmup=0),
                        budget_s=5, calibrator_class=calibrator, decode_batch=2)
    decode = document["decode"]
    assert decode["batch"] == 2 and decode["tokens"] >= 16
    assert all(len(samples) == 3 for samples in decode["samples"].values())
    assert decode["choice"] == choice and document["recommendation"]["settings"]["compute.dense_copy"] == choice
    slower, faster = ("on", "off") if choice == "off" else ("off", "on")
    assert max(decode["samples"][slower]) < min(decode["samples"][faster])
    assert (decode["ratio"]["low"] > 1) == (choice == "on")
    assert document["recommendation"]["decode_reason"] == decode["reason"]


def test_the_dense_copy_is_left_out_for_a_model_that_is_not_quantized(models):
    document = run_tune(resolve("llama", models), models, Workload((96,), gen=2, repeats=1, warmup=0),
                        budget_s=5, decode_batch=2)
    assert document["decode"] is None and "compute.dense_copy" not in document["recommendation"]["settings"]
    assert "compute.dense_copy: left out, the checkpoint is not quantized" in document["notes"]
