"""The ane lane on a real Neural Engine: Core ML compiles, loads and runs the packages.

macOS on Apple Silicon with coremltools only; skipped everywhere else (no Core ML runtime
exists there). These tests have not been run by the engineer who wrote them (Linux only).
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load

from omlx_core.prefill.lanes import ane_eligibility

ELIGIBLE, REASON = ane_eligibility()
pytestmark = pytest.mark.skipif(not ELIGIBLE, reason=f"needs Core ML on the Neural Engine: {REASON}")


def test_a_compiled_package_computes_its_int8_linear(tmp_path):
    from omlx_core.prefill.ane.banks import build_bank
    from omlx_core.prefill.ane.program import INPUT, OUTPUT, save_package
    from omlx_core.prefill.ane.runtime import load_package

    weight = np.random.default_rng(0).standard_normal((256, 128)).astype(np.float32) * 0.05
    bank = build_bank(256, 128, lambda a, b: weight[a:b].copy())
    model = load_package(save_package(bank, 64, tmp_path / "p.mlpackage"))
    x = np.random.default_rng(1).standard_normal((64, 128)).astype(np.float16)
    got = np.asarray(model.predict({INPUT: x})[OUTPUT], dtype=np.float32)
    want = x.astype(np.float32) @ bank.dequantized().T
    assert got.shape == (64, 256)
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()  # float16 compute on the ANE


@pytest.mark.parametrize("dual", ["off", "on"])
def test_install_runs_the_ane_slice_beside_the_gpu(home, tmp_path, dual):
    from omlx_core.models.testing import build_tiny_model
    from omlx_core.prefill.install import install_lanes
    from omlx_core.settings import load_settings

    path = build_tiny_model("qwen3_5", tmp_path / "m", quantized=True, dtype="float16")
    model, _ = load(str(path))
    reference, _ = load(str(path))
    settings = load_settings(home, cli={"prefill.lanes": ["gpu", "ane"], "prefill.split_min_tokens": 4,
                                        "prefill.ane.tokens": 64, "prefill.ane.dual": dual})
    report = install_lanes(model, settings, fp16_clone=False)
    ane = next(lane for lane in report.as_dict()["lanes"] if lane["name"] == "ane")
    assert ane["attempted"] and ane["procedures"]["resident"] > 0 and not ane["warnings"]
    assert ane["procedures"]["gdn"] > 0 and (ane["procedures"]["dual"] > 0) == (dual == "on")
    tokens = mx.array(np.random.default_rng(0).integers(10, 200, (1, 96)))
    want, got = reference(tokens), model(tokens)
    assert float(mx.abs(got - want).max()) <= 0.1 * float(mx.abs(want).max())
    assert report.ane.as_dict()["calls"] > 0
