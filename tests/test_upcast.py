"""Float32 compute for 16-bit quantized layers on the CPU backend: same results, found by the
other paths, reported, and off when asked."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from omlx_core.models.testing import build_tiny_model
from omlx_core.prefill.fast_paths import install_fast_paths
from omlx_core.prefill.upcast import Float32QuantizedEmbedding, Float32QuantizedLinear


def _settings(**overrides):
    from omlx_core.settings.schema import defaults

    return {**defaults(), **overrides}


def _load(path):
    from mlx_lm import load

    return load(str(path))[0]


def _float32_copy(model):
    """The same quantized model with every float array in float32: the precision reference."""
    from mlx.utils import tree_map

    model.update(tree_map(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a,
                          model.parameters()))
    return model


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_upcast_layers_are_at_least_as_exact_as_the_16_bit_path(tmp_path, dtype):
    path = build_tiny_model("llama", tmp_path / dtype, quantized=True, dtype=dtype,
                            shape={"tie_word_embeddings": True})
    stock, model, truth = _load(path), _load(path), _float32_copy(_load(path))
    report = install_fast_paths(model, _settings(**{"compute.upcast_quantized": "on", "prefill.dense": "off"}))
    kinds = {type(m) for _, m in model.named_modules()}
    assert Float32QuantizedLinear in kinds and nn.QuantizedLinear not in kinds
    assert Float32QuantizedEmbedding in kinds
    assert report.upcast_layers == sum(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
                                       for _, m in model.named_modules())
    assert report.as_dict()["float32_quantized"]["layers"] == report.upcast_layers

    # One layer: the float32 product rounded once to the 16-bit output.
    layer = dict(model.named_modules())["model.layers.0.mlp.gate_proj"]
    x = mx.random.normal((8, layer.weight.shape[1] * 32 // layer.bits), key=mx.random.key(1)).astype(layer.scales.dtype)
    exact = x.astype(mx.float32) @ mx.dequantize(layer.weight, layer.scales.astype(mx.float32),
                                                 layer.biases.astype(mx.float32), group_size=layer.group_size,
                                                 bits=layer.bits).T
    ulp = 2.0 ** (-7 if dtype == "bfloat16" else -10)
    assert mx.abs(layer(x).astype(mx.float32) - exact).max().item() <= ulp * mx.abs(exact).max().item()

    # The whole model: no further from the float32 reference than MLX's 16-bit path.
    tokens = mx.array([[3, 17, 42, 5, 99, 12, 7, 64]])
    reference = truth(tokens)
    upcast_error = mx.abs(model(tokens).astype(mx.float32) - reference).max().item()
    stock_error = mx.abs(stock(tokens).astype(mx.float32) - reference).max().item()
    assert upcast_error <= stock_error * 1.05 + 1e-6


def test_float32_models_and_the_off_setting_keep_mlx_layers(tmp_path):
    path = build_tiny_model("llama", tmp_path / "f32", quantized=True, dtype="float32")
    model = _load(path)
    report = install_fast_paths(model, _settings(**{"compute.upcast_quantized": "on"}))
    assert report.upcast_layers == 0 and "no 16-bit" in report.reasons["upcast"]

    model = _load(build_tiny_model("llama", tmp_path / "f16", quantized=True, dtype="float16"))
    report = install_fast_paths(model, _settings(**{"compute.upcast_quantized": "off"}))
    assert report.upcast_layers == 0 and "off" in report.reasons["upcast"]
    assert not any(isinstance(m, Float32QuantizedLinear) for _, m in model.named_modules())


def test_the_dense_path_and_the_lanes_still_find_upcast_layers(tmp_path):
    from omlx_core.prefill.fast_paths import DequantizedPrefill
    from omlx_core.prefill.split import rows_of

    model = _load(build_tiny_model("llama", tmp_path / "f16", quantized=True, dtype="float16"))
    report = install_fast_paths(model, _settings(**{"compute.upcast_quantized": "on", "prefill.dense": "on"}))
    dense = [m for _, m in model.named_modules() if isinstance(m, DequantizedPrefill)]
    assert dense and len(dense) == len(report.dense_layers)
    assert all(isinstance(layer.quantized, Float32QuantizedLinear) for layer in dense)
    part = rows_of(dense[0].quantized, 0, 64)
    assert isinstance(part, Float32QuantizedLinear)


def test_status_says_whether_the_float32_path_is_on(home):
    import json

    from conftest import omlx_env, run_omlx

    from omlx_core.hardware import mlx_backend

    report = json.loads(run_omlx(home, "status", "--json", check=True).stdout)["fast_paths"]
    assert report["float32_quantized"] == {"enabled": mlx_backend() == "cpu", "setting": "auto", "min_tokens": 1}
    off = omlx_env(home, OMLX_COMPUTE_UPCAST_QUANTIZED="off")
    report = json.loads(run_omlx(home, "status", "--json", env=off, check=True).stdout)["fast_paths"]
    assert report["float32_quantized"]["enabled"] is False
