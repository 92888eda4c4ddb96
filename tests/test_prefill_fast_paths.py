"""Fast prefill paths against mlx-lm's reference: chunked gated delta and dequantize-to-dense."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.gated_delta import gated_delta_ops
from mlx_lm.utils import load

from omlx_core.bench.runs import run_generation
from omlx_core.models.testing import build_tiny_model
from omlx_core.prefill.fast_paths import DequantizedPrefill
from omlx_core.prefill.gated_delta import chunked_gated_delta
from omlx_core.prefill.install import install_lanes, install_prefill
from omlx_core.settings import load_settings


def gdn_inputs(length: int, dtype, seed: int = 0, heads=(2, 4), dims=(32, 16)):
    key = mx.random.key(seed)
    keys = mx.random.split(key, 7)
    (hk, hv), (dk, dv) = heads, dims
    q = mx.random.normal((2, length, hk, dk), key=keys[0])
    k = mx.random.normal((2, length, hk, dk), key=keys[1])
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) / dk ** 0.5
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((2, length, hv, dv), key=keys[2])
    g = mx.random.uniform(0.3, 1.0, (2, length, hv), key=keys[3])
    beta = mx.random.uniform(0.0, 1.0, (2, length, hv), key=keys[4])
    state = 0.1 * mx.random.normal((2, hv, dv, dk), key=keys[5])
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), g, beta, state


@pytest.mark.parametrize("length", [1, 37, 64, 130, 300])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
def test_chunked_gated_delta_matches_the_reference(length, dtype, masked):
    q, k, v, g, beta, state = gdn_inputs(length, dtype)
    mask = None
    if masked:  # left padding of 5 steps on the first sequence
        mask = mx.array(np.arange(length)[None, :] >= np.array([[min(5, length - 1)], [0]]))
    want_y, want_state = gated_delta_ops(q, k, v, g, beta, state, mask)
    got_y, got_state = chunked_gated_delta(q, k, v, g, beta, state, mask)
    assert got_y.dtype == want_y.dtype and got_state.dtype == mx.float32
    valid = mask[..., None, None] if mask is not None else mx.array(True)
    error = float(mx.abs(mx.where(valid, want_y.astype(mx.float32) - got_y.astype(mx.float32), 0)).max())
    tolerance = 1e-5 if dtype == mx.float32 else 2e-2  # bf16 outputs: rounding of the result
    assert error <= tolerance
    assert float(mx.abs(want_state - got_state).max()) <= 1e-5


def test_chunked_gated_delta_refuses_vector_gates():
    q, k, v, g, beta, state = gdn_inputs(8, mx.float32)
    with pytest.raises(ValueError, match="scalar gates"):
        chunked_gated_delta(q, k, v, mx.repeat(g[..., None], 32, -1), beta, state)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return build_tiny_model("qwen3_5", tmp_path_factory.mktemp("gdn") / "qwen3_5", dtype="float32")


def test_a_tiny_qwen3_5_generates_the_same_32_greedy_tokens(hybrid, home):
    plain, _ = load(str(hybrid))
    fast, _ = load(str(hybrid))
    report = install_prefill(fast, load_settings(home), fp16_clone=False)
    layers = report.fast_paths.gdn_layers
    assert layers and report.as_dict()["fast_paths"]["chunked_gdn"]["layers"] == len(layers)
    prompt = np.random.default_rng(0).integers(10, 200, (1, 150))
    want = run_generation(plain, prompt, 32, 64, set()).token_ids
    got = run_generation(fast, prompt, 32, 64, set()).token_ids
    assert got == want
    assert all(layer.calls > 0 for layer in layers)  # the prompt went through the chunked path


def _exact(layer, x):
    """x @ W.T in float32 from the dequantized weights: what both paths approximate."""
    q = layer.quantized if isinstance(layer, DequantizedPrefill) else layer
    weight = mx.dequantize(q.weight, q.scales, q.biases, group_size=q.group_size, bits=q.bits,
                           dtype=mx.float32)
    return x.astype(mx.float32) @ weight.T


def _within_bf16(got, exact, reference):
    """got is as close to the exact product as the quantized kernel is, or within a bf16 ulp
    (2^-8) of the largest output; on MLX's CPU the quantized kernel is the less exact one."""
    error = float(mx.abs(got.astype(mx.float32) - exact).max())
    allowed = float(mx.abs(reference.astype(mx.float32) - exact).max())
    return error <= max(allowed, 2 ** -8 * float(mx.abs(exact).max()))


def test_dequantize_to_dense_matches_the_quantized_path_and_composes_with_lanes(tmp_path, home):
    path = build_tiny_model("llama", tmp_path / "q", quantized=True, dtype="bfloat16")
    reference, _ = load(str(path))
    dense, _ = load(str(path))
    settings = load_settings(home, cli={"prefill.dense": "on", "prefill.dense_min_tokens": 16,
                                        "compute.upcast_quantized": "off"})
    report = install_prefill(dense, settings, fp16_clone=False)
    layers = report.fast_paths.dense_layers
    assert layers and all(isinstance(layer, DequantizedPrefill) for layer in layers)
    largest = max(layer.dense_bytes for layer in layers)
    assert report.extra_bytes == report.fast_paths.dense_layer_bytes >= largest  # measured, charged
    originals = dict(reference.named_modules())
    paths = {id(module): name for name, module in dense.named_modules()}
    for layer in layers:  # every quantized linear, within bf16 tolerance of the quantized kernel
        original = originals[paths[id(layer)]]
        x = mx.random.normal((1, 48, layer.quantized.weight.shape[1] * 8), key=mx.random.key(2)).astype(mx.bfloat16)
        assert _within_bf16(layer(x), _exact(original, x), original(x)), paths[id(layer)]
        short = x[:, :4]  # below the threshold: the quantized kernel, bit for bit
        assert mx.array_equal(original(short), layer(short))
    assert sum(layer.calls for layer in layers) == len(layers)

    lanes = load_settings(home, cli={"prefill.lanes": ["gpu", "cpu"], "prefill.cpu_sharing.enabled": True,
                                     "prefill.split_min_tokens": 16, "prefill.cpu_share.mlp_down": 0.5})
    composed = install_lanes(dense, lanes, fp16_clone=True)
    split = composed.split_layers[0]
    assert isinstance(split.original, DequantizedPrefill)
    x = mx.random.normal((1, 48, split.cpu.weight.shape[1]), key=mx.random.key(3)).astype(mx.bfloat16)
    original = originals[split.path]
    assert _within_bf16(split(x), _exact(original, x), original(x))
    assert split.calls == 1


def _peak_of_forward(model, tokens) -> int:
    mx.eval(model(tokens))
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(model(tokens))
    return mx.get_peak_memory() - base


def test_dense_weights_are_transient_one_layer_at_a_time(tmp_path, home):
    path = build_tiny_model("llama", tmp_path / "q", quantized=True, dtype="bfloat16")
    quantized, _ = load(str(path))
    dense, _ = load(str(path))
    report = install_prefill(dense, load_settings(home, cli={"prefill.dense": "on",
                                                             "prefill.dense_min_tokens": 1}),
                             fp16_clone=False)
    tokens = mx.zeros((1, 8), dtype=mx.int32)
    extra = _peak_of_forward(dense, tokens) - _peak_of_forward(quantized, tokens)
    # measured on the largest layer alone; MLX's CPU stream may overlap a layer or two,
    # every layer dense at once would be about 29 (layers) times this
    one_layer = report.fast_paths.dense_layer_bytes
    assert 0 < extra <= 3 * one_layer


def test_load_time_measurement_of_a_whole_chunk_is_what_the_guard_is_charged(tmp_path, home):
    path = build_tiny_model("llama", tmp_path / "q", quantized=True, dtype="bfloat16")
    model, _ = load(str(path))
    settings = load_settings(home, cli={"prefill.dense": "on", "prefill.dense_min_tokens": 8,
                                        "prefill.chunk_size": 64,
                                        # the float32 path's own temporaries would hide the dense ones
                                        "compute.upcast_quantized": "off"})
    report = install_prefill(model, settings, fp16_clone=False, warmup_tokens=8)
    fast = report.fast_paths
    assert report.warmup_s > 0 and fast.dense_layer_bytes > 0 and fast.dense_chunk_bytes > 0
    assert report.extra_bytes == max(fast.dense_layer_bytes, fast.dense_chunk_bytes)


def test_dense_auto_is_off_on_this_cpu_backend(tmp_path, home):
    path = build_tiny_model("llama", tmp_path / "q", quantized=True)
    report = install_prefill(load(str(path))[0], load_settings(home), fp16_clone=False)
    assert not report.fast_paths.dense_layers
    assert "auto" in report.as_dict()["fast_paths"]["dequantize_to_dense"]["reason"]


def test_dense_path_uses_the_dequantize_kernel_only_where_the_registry_activates_it(tmp_path, home):
    from omlx_core.kernels.registry import install_kernels

    path = build_tiny_model("llama", tmp_path / "q", quantized=True, dtype="bfloat16")
    settings = load_settings(home, cli={"prefill.dense": "on", "kernels.dequantize": "on"})
    model, _ = load(str(path))
    # On this CPU backend the registry keeps MLX's dequantize even when forced on.
    kernels = install_kernels(model, None, settings)
    decision = next(d for d in kernels.decisions if d.kernel == "dequantize")
    assert not decision.active and "cuda" in decision.reason
    report = install_prefill(model, settings, fp16_clone=False, kernels=kernels)
    assert report.fast_paths.dense_layers and not any(layer.kernel for layer in report.fast_paths.dense_layers)
    assert report.as_dict()["fast_paths"]["dequantize_to_dense"]["kernel_layers"] == 0

    # Where the registry activates it (a CUDA report), supported layers take it.
    forced = install_kernels(model, None, settings, hardware={"backend": "cuda", "arch": "sm_90", "gpu": "X"})
    assert "dequantize" in forced.active and not forced.replaced.get("dequantize")  # no module of its own
    layer = report.fast_paths.dense_layers[0].quantized
    assert DequantizedPrefill(layer, 16, kernel=True).kernel
    three_bit = nn.QuantizedLinear.from_linear(nn.Linear(64, 32), group_size=32, bits=3)
    assert not DequantizedPrefill(three_bit, 16, kernel=True).kernel  # MLX's dequantize for it


def test_dequantize_kernel_says_which_formats_it_reads():
    from omlx_core.kernels.dequantize import supported

    assert supported(4, 64, "affine", mx.bfloat16) == "" and supported(8, 128, "affine", mx.float16) == ""
    assert "3-bit" in supported(3, 64, "affine", mx.bfloat16)
    assert "groups of 16" in supported(4, 16, "affine", mx.bfloat16)
    assert "mxfp4" in supported(4, 32, "mxfp4", mx.bfloat16)
    assert "float32" in supported(4, 64, "affine", mx.float32)


def test_dense_path_bounds_the_products_in_flight_and_keeps_none_after_prefill():
    from omlx_core.prefill import fast_paths

    layers = [DequantizedPrefill(nn.QuantizedLinear.from_linear(nn.Linear(64, 64), group_size=32, bits=4), 8)
              for _ in range(3 * fast_paths.IN_FLIGHT)]
    x = mx.random.normal((1, 16, 64))
    depth = []
    for layer in layers:
        x = layer(x)
        depth.append(len(DequantizedPrefill._queued))
    assert max(depth) == fast_paths.IN_FLIGHT  # each call hands its product over, the oldest is waited for
    want = mx.random.normal((1, 16, 64))
    got = want
    for layer in layers:
        got = layer(got)
        want = layer.quantized(want)
    assert float(mx.abs(got - want).max()) <= 1e-3 * float(mx.abs(want).max())
    layers[0](mx.random.normal((1, 1, 64)))  # a decode-sized call: the prefill is over
    assert not DequantizedPrefill._queued
