"""The kernel registry: gating by validated (model, hardware) pairs, settings, status."""

import json
import logging
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from conftest import omlx_env, run_omlx
from omlx_core.errors import OmlxError
from omlx_core.kernels.catalog import registered
from omlx_core.kernels.registry import (HardwareMatch, KernelSpec, ModelMatch, Validation, decide,
                                        install_kernels, kernel_source, kernels_dirs, machine_view,
                                        model_facts)
from omlx_core.prefill.split import replace_module
from omlx_core.settings.schema import BY_KEY

H200 = {"backend": "cuda", "arch": "sm_90", "gpu": "NVIDIA H200"}
H100 = {"backend": "cuda", "arch": "sm_90", "gpu": "NVIDIA H100 80GB HBM3"}
A100 = {"backend": "cuda", "arch": "sm_80", "gpu": "NVIDIA A100-SXM4-80GB"}
M3 = {"backend": "metal", "arch": "applegpu_g15s", "gpu": "Apple M3 Max"}
CPU = {"backend": "cpu", "arch": None, "gpu": None}


@dataclass
class Args:
    model_type: str = "toy"
    heads: int = 4


class Toy(nn.Module):
    """A model with two linears named like a real one's, and the args mlx-lm models carry."""

    def __init__(self, heads: int = 4, model_type: str = "toy"):
        super().__init__()
        self.args = Args(model_type, heads)
        self.model_type = model_type
        self.layers = [nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)]

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Doubled(nn.Module):
    """Our replacement: the original linear, times two (so a test sees it ran)."""

    def __init__(self, original):
        super().__init__()
        self.original = original

    def __call__(self, x):
        return 2 * self.original(x)


def install_doubled(model) -> list[str]:
    paths = [path for path, module in model.named_modules() if isinstance(module, nn.Linear)]
    for path in paths:
        replace_module(model, path, Doubled(dict(model.named_modules())[path]))
    return paths


def spec(validated=(), name="toy_double", source="toy.cu", applies=lambda m: hasattr(m, "layers")):
    return KernelSpec(name=name, replaces="toy linear", source=source, validated=tuple(validated),
                      applies=applies, absent="toy linears", install=install_doubled)


ARCH = ModelMatch.architecture("toy", heads=4)
ON_H200 = Validation(ARCH, HardwareMatch("cuda", "sm_90", "NVIDIA H200"))


def install(model, hardware, setting="auto", validated=(ON_H200,), fingerprint="mf-aaaa"):
    return install_kernels(model, fingerprint, {"kernels.toy_double": setting},
                           kernels=(spec(validated),), hardware=hardware)


@pytest.mark.parametrize("hardware", [H100, A100, M3, CPU])
def test_never_activates_on_an_unvalidated_hardware(hardware):
    model = Toy()
    report = install(model, hardware)
    (decision,) = report.decisions
    assert not decision.active and not report.replaced
    assert all(isinstance(layer, nn.Linear) for layer in model.layers)  # the ops path stays
    if hardware["backend"] == "cuda":
        assert decision.reason == f"not validated on this hardware (cuda {hardware['arch']} {hardware['gpu']})"
    else:
        assert decision.reason.startswith("needs the cuda backend")


def test_never_activates_for_an_unvalidated_model_on_validated_hardware():
    for model in (Toy(heads=8), Toy(model_type="other")):
        report = install(model, H200)
        assert not report.decisions[0].active
        assert report.decisions[0].reason.startswith("not validated for this model")
        assert "toy (heads=4)" in report.decisions[0].reason
    exact = Validation(ModelMatch(fingerprint="mf-bbbb"), ON_H200.hardware)
    assert not install(Toy(), H200, validated=(exact,), fingerprint="mf-aaaa").decisions[0].active


def test_activates_on_a_validated_pair_and_replaces_by_name():
    model = Toy()
    x = mx.ones((1, 8))
    expected = model(x)
    report = install(model, H200)
    (decision,) = report.decisions
    assert decision.active and decision.validated
    assert decision.reason == "validated on toy (heads=4) on cuda sm_90 NVIDIA H200"
    assert sorted(report.replaced["toy_double"]) == ["layers.0", "layers.1"]
    assert all(isinstance(layer, Doubled) for layer in model.layers)
    assert mx.allclose(model(x), 4 * expected).item()
    assert report.as_dict()["kernels"][0]["modules"] == 2


def test_exact_fingerprint_match():
    exact = Validation(ModelMatch(fingerprint="mf-aaaa"), HardwareMatch("cuda", "sm_90"))
    report = install(Toy(heads=99), H100, validated=(exact,), fingerprint="mf-aaaa")
    assert report.decisions[0].active
    assert report.decisions[0].reason == "validated on mf-aaaa on cuda sm_90"


def test_off_wins_over_validation():
    model = Toy()
    report = install(model, H200, setting="off")
    assert not report.decisions[0].active
    assert report.decisions[0].reason == "off by kernels.toy_double = off"
    assert isinstance(model.layers[0], nn.Linear)


def test_forced_on_activates_unvalidated_and_warns(caplog):
    model = Toy(heads=8)
    with caplog.at_level(logging.WARNING, logger="omlx.kernels"):
        report = install(model, H100, setting="on")
    (decision,) = report.decisions
    assert decision.active and not decision.validated
    assert decision.reason == "forced on by kernels.toy_double = on — unvalidated, results may differ"
    assert "forced on by kernels.toy_double = on" in caplog.text
    assert isinstance(model.layers[0], Doubled)


def test_forced_on_still_needs_the_backend_and_the_op():
    assert install(Toy(), CPU, setting="on").decisions[0].reason == \
        "needs the cuda backend; this machine computes on cpu"
    report = install_kernels(nn.Linear(2, 2), None, {"kernels.toy_double": "on"},
                             kernels=(spec(applies=lambda m: False),), hardware=H200)
    assert report.decisions[0].reason == "model has no toy linears" and not report.replaced


def test_a_failing_install_keeps_the_ops_path(caplog):
    def broken(model):
        raise RuntimeError("no compiler")

    failing = KernelSpec("toy_double", "toy linear", "toy.cu", (ON_H200,), lambda m: True, "x", broken)
    with caplog.at_level(logging.WARNING, logger="omlx.kernels"):
        report = install_kernels(Toy(), None, {}, kernels=(failing,), hardware=H200)
    assert not report.decisions[0].active
    assert report.decisions[0].reason == "install failed (RuntimeError: no compiler); the ops path runs"
    assert "no compiler" in caplog.text


def test_bad_setting_value_is_one_line_error():
    with pytest.raises(OmlxError, match="kernels.toy_double: invalid value 'maybe'"):
        decide(spec(), "maybe", H200)


def test_machine_view_says_whether_each_kernel_would_activate_here():
    kernels = (spec((ON_H200,)),)
    (here,) = machine_view({}, kernels=kernels, hardware=H200)
    assert here["active"] and here["reason"] == "validated on this hardware for toy (heads=4)"
    assert here["validated_on"] == ["toy (heads=4) on cuda sm_90 NVIDIA H200"]
    (there,) = machine_view({}, kernels=kernels, hardware=H100)
    assert not there["active"] and there["reason"].startswith("not validated on this hardware")
    (forced,) = machine_view({"kernels.toy_double": "on"}, kernels=kernels, hardware=H100)
    assert forced["active"] and forced["reason"].startswith("forced on")


def test_metal_hardware_match_by_chip():
    metal = Validation(ARCH, HardwareMatch("metal", gpu="Apple M3 Max"))
    kernels = (spec((metal,), source="toy.metal"),)
    assert machine_view({}, kernels=kernels, hardware=M3)[0]["active"]
    assert not machine_view({}, kernels=kernels, hardware={**M3, "gpu": "Apple M2"})[0]["active"]


def test_model_match_names_one_granularity():
    with pytest.raises(ValueError):
        ModelMatch()
    with pytest.raises(ValueError):
        ModelMatch(fingerprint="mf-a", model_type="toy")
    facts = model_facts(Toy(), "mf-a")
    assert facts.model_type == "toy" and facts.config["heads"] == 4


def test_every_registered_kernel_has_a_setting_and_a_source():
    for kernel in registered():
        setting = BY_KEY[kernel.setting_key]
        assert setting.default == "auto" and setting.choices == ("auto", "on", "off")
        assert kernel_source(kernel.source)


def test_missing_source_is_a_clear_error():
    with pytest.raises(OmlxError, match="kernel source nope.cu not found in"):
        kernel_source("nope.cu")
    assert kernels_dirs()[0].name == "kernels"


def test_status_lists_registered_kernels(home):
    report = json.loads(run_omlx(home, "status", "--json", check=True).stdout)
    names = [kernel["name"] for kernel in report["kernels"]]
    assert names == [kernel.name for kernel in registered()]
    for kernel in report["kernels"]:
        assert kernel["reason"] and isinstance(kernel["active"], bool)
    text = run_omlx(home, "status", check=True, env={**omlx_env(home), "COLUMNS": "250"}).stdout
    assert "indexer_score" in text and "[batch, length, heads, entries]" in text


def test_kernel_setting_rejects_bad_values(home):
    result = run_omlx(home, "settings", "set", "kernels.indexer_score", "maybe")
    assert result.returncode == 2
    assert "kernels.indexer_score: invalid value 'maybe'; expected one of auto, on, off" in result.stderr
    run_omlx(home, "settings", "set", "kernels.indexer_score", "off", check=True)
    report = json.loads(run_omlx(home, "status", "--json", check=True).stdout)
    assert all(k["reason"] == "off by kernels.indexer_score = off"
               for k in report["kernels"] if k["name"] == "indexer_score")


# --- the indexer score kernel's module, on this CPU machine (the kernel itself runs on CUDA) ---

from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.utils import load  # noqa: E402

from omlx_core.kernels import indexer_score  # noqa: E402
from omlx_core.models.testing import build_tiny_model  # noqa: E402

GREEDY_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    return build_tiny_model("deepseek_v41", tmp_path_factory.mktemp("dsv41") / "m", quantized=True)


def greedy(model, prompt) -> list[int]:
    return [int(token) for token, _ in generate_step(mx.array(prompt), model, max_tokens=GREEDY_TOKENS)]


def prompt_of(tokenizer) -> list[int]:
    text = "The harbour was quiet in the early morning. " * 6
    return tokenizer.encode(text)


def test_tiny_deepseek_generates_as_before_with_the_registry_installed(tiny_deepseek):
    stock, tokenizer = load(str(tiny_deepseek))
    prompt = prompt_of(tokenizer)
    assert len(prompt) > 40  # past the sliding window (16): the indexer selects
    expected = greedy(stock, prompt)
    model, _ = load(str(tiny_deepseek))
    report = install_kernels(model, "mf-tiny", {})
    decision = next(d for d in report.decisions if d.kernel == "indexer_score")
    assert not decision.active and decision.reason == "needs the cuda backend; this machine computes on cpu"
    assert indexer_score.indexer_paths(model)  # mlx-lm's modules stay
    assert greedy(model, prompt) == expected


def test_fused_indexer_module_matches_mlx_lm_and_keeps_the_parameters(tiny_deepseek):
    stock, tokenizer = load(str(tiny_deepseek))
    prompt = prompt_of(tokenizer)
    expected = greedy(stock, prompt)
    model, _ = load(str(tiny_deepseek))
    before = sorted(name for name, _ in tree_flatten(model.parameters()))
    paths = indexer_score.install(model)  # forced in, as kernels.indexer_score = on would
    assert sorted(paths) == [f"model.layers.{i}.self_attn.indexer" for i in (1, 4, 6)]
    modules = dict(model.named_modules())
    assert all(isinstance(modules[path], indexer_score.FusedIndexer) for path in paths)
    after = sorted(name for name, _ in tree_flatten(model.parameters()))
    assert after == before
    assert greedy(model, prompt) == expected
    # On CPU the module computes the scores with the ops expression, and says so.
    assert sum(modules[p].ops_calls for p in paths) > 0 and sum(modules[p].fused_calls for p in paths) == 0


@pytest.mark.parametrize("candidate_source,with_candidates", [(True, False), (False, True), (False, False)])
def test_fused_indexer_outputs_equal_mlx_lm_indexer(candidate_source, with_candidates):
    from mlx_lm.models import deepseek_v41 as ds
    from mlx_lm.models.rope_utils import YarnRoPE

    args = ds.ModelArgs(hidden_size=64, q_lora_rank=32, head_dim=64, qk_rope_head_dim=16,
                        compress_ratios=(4,), kv_source_layer_ids=(0,), index_source_layer_ids=(0,),
                        candidate_source_layer_id=0 if candidate_source else -1,
                        candidate_topk_blocks=3, candidate_block_size=4,
                        index_n_heads=8, index_head_dim=32, index_topk=6)
    mx.random.seed(3)
    original = ds.Indexer(args, 0)
    fused = indexer_score.FusedIndexer(original)
    rope = YarnRoPE(dims=16, traditional=True, base=160000.0)
    length, entries, start = 24, 40, 150
    x = mx.random.normal((2, length, 64))
    q_residual = mx.random.normal((2, length, 32))
    index_k = ds._fake_quant_fp4(mx.random.normal((2, entries, 32)), block_size=32)
    candidates = mx.random.uniform(shape=(2, length, entries)) > 0.3 if with_candidates else None
    kwargs = dict(index_k=index_k, candidates=candidates, rope=rope, start_pos=start)
    top_ops, cand_ops = original(x, q_residual, **kwargs)
    top_fused, cand_fused = fused(x, q_residual, **kwargs)
    assert mx.array_equal(top_ops, top_fused).item()
    assert (cand_ops is None) == (cand_fused is None)
    if cand_ops is not None:
        assert mx.array_equal(cand_ops, cand_fused).item()
    assert (top_ops >= 0).sum().item() > 0


def test_indexer_kernel_is_validated_only_for_v4_flash_shapes_on_the_h200():
    from omlx_core.kernels.registry import ModelFacts

    flash = ModelFacts(None, "deepseek_v41", {"index_n_heads": 64, "index_head_dim": 128})
    tiny = ModelFacts(None, "deepseek_v41", {"index_n_heads": 4, "index_head_dim": 64})
    spec_ = indexer_score.SPEC
    assert decide(spec_, "auto", H200, flash).active
    assert decide(spec_, "auto", H200, flash).reason.startswith(
        "validated on deepseek_v41 (index_head_dim=128, index_n_heads=64) on cuda sm_90 NVIDIA H200")
    assert not decide(spec_, "auto", H200, tiny).active
    assert not decide(spec_, "auto", H100, flash).active
    assert not decide(spec_, "auto", M3, flash).active
    assert not decide(spec_, "off", H200, flash).active


def test_fusable_says_why_not():
    q = mx.zeros((1, 4, 64, 128), dtype=mx.bfloat16)
    keys = mx.zeros((1, 16, 128), dtype=mx.bfloat16)
    if mx.default_device() == mx.cpu:
        assert indexer_score.fusable(q, keys) == "the kernel runs on CUDA only"
    assert indexer_score.SPEC.applies(Toy()) is False


def test_every_model_match_covers_any_architecture_on_its_hardware_only():
    from omlx_core.kernels.registry import ModelFacts

    match = ModelMatch.every_model()
    assert match.matches(ModelFacts(None, "llama", {})) and match.matches(ModelFacts("mf-x", None, {}))
    assert match.describe() == "every model"
    spec_ = KernelSpec("exact_op", "an op", "dequantize.cu", (Validation(match, HardwareMatch("cuda", "sm_90")),),
                       applies=lambda model: True, absent="the op", install=None)
    assert decide(spec_, "auto", H200, ModelFacts(None, "qwen3_5", {})).active
    assert not decide(spec_, "auto", A100, ModelFacts(None, "qwen3_5", {})).active


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_dequantize_kernel_is_active_on_the_h200_for_quantized_models_only(arch, tmp_path):
    from mlx_lm.utils import load

    from omlx_core.kernels import dequantize
    from omlx_core.models.testing import build_tiny_model

    quantized, _ = load(str(build_tiny_model(arch, tmp_path / "q", quantized=True)))
    plain, _ = load(str(build_tiny_model(arch, tmp_path / "f")))
    facts = model_facts(quantized, None)
    assert decide(dequantize.SPEC, "auto", H200, facts, quantized).active
    assert not decide(dequantize.SPEC, "auto", H100, facts, quantized).active  # validated on the H200 only
    assert not decide(dequantize.SPEC, "auto", H200, model_facts(plain, None), plain).active
    assert not decide(dequantize.SPEC, "auto", CPU, facts, quantized).active
