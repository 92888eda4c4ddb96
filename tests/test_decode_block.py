"""decode_block: a decoder layer's decode step with the residual adds in qmm_decode's
output projections. The kernels are mocked (MLX's CUDA backend cannot exist here) by
stand-ins computing with MLX's ops what the kernels compute; the kernels' own results are
checked on the GPU machine by scripts/bench/decode.py (--parts exact: the residual rows;
--parts greedy)."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from test_qmm_decode import quantized, reference_kernel
from test_sdpa_decode import decode_logits, left_padded_logits, tiny_model
from test_sdpa_decode import mock_attention

from omlx_core.errors import OmlxError
from omlx_core.kernels import decode_block, qmm_decode, sdpa_decode
from omlx_core.kernels.decode_block import DecodeBlock
from omlx_core.kernels.qmm_decode import ALL_FORMATS, DecodeQuantizedLinear
from omlx_core.prefill.split import replace_module

PROMPT = mx.array([[3, 14, 15, 92, 65, 35, 89, 79]] * 2, dtype=mx.int32)
LAYER = [(3, False), (1, True), (2, False), (1, True)]  # a layer's launches: q/k/v, o_proj, gate/up, down


@pytest.fixture
def launches(monkeypatch) -> list:
    """Both kernels mocked; the quantized matmul's launches, recorded."""
    calls = []
    monkeypatch.setattr(qmm_decode, "kernel_available", lambda: "")
    monkeypatch.setattr(qmm_decode, "_kernel", reference_kernel(calls))
    mock_attention(monkeypatch, [])
    qmm_decode.launch_for.cache_clear()
    yield calls
    qmm_decode.launch_for.cache_clear()


def kinds(calls: list) -> list[tuple]:
    return [(c["segments"], c["residual"]) for c in calls]


@pytest.mark.parametrize("arch", decode_block.ARCHITECTURES)
def test_decode_blocks_decode_as_mlx_lm_does_mocked_cuda(arch, launches):
    model = tiny_model(arch)
    stock = decode_logits(model, make_prompt_cache(model), PROMPT)
    qmm_decode.install(model, formats=ALL_FORMATS)
    sdpa_decode.install(model)
    assert sorted(decode_block.install(model)) == [f"model.layers.{i}" for i in range(2)]
    assert all(type(layer) is DecodeBlock for layer in model.layers)
    ours = decode_logits(model, make_prompt_cache(model), PROMPT)
    for a, b in zip(stock, ours):
        assert mx.array_equal(a, b)
    # The first decode step traces each layer's compiled halves, recording their launches
    # once: q/k/v, o_proj plus the residual, gate/up, down (of MLX's swiglu) plus the
    # residual; then the (quantized) head. The later 3 steps replay the traces (no Python,
    # nothing recorded) and launch only the head from Python.
    assert kinds(launches[-12:]) == LAYER * 2 + [(1, False)] * 4


def test_the_compiled_step_replays_and_retraces_after_a_module_replacement_mocked_cuda(launches):
    model = tiny_model("qwen3")
    qmm_decode.install(model, formats=ALL_FORMATS)
    sdpa_decode.install(model)
    decode_block.install(model)
    traced_then_replayed = LAYER * 2 + [(1, False)] * 2  # then the head alone
    decode_logits(model, make_prompt_cache(model), PROMPT, steps=2)
    assert kinds(launches[-10:]) == traced_then_replayed
    replace_module(model, "lm_head", model.lm_head)  # any replacement: a trace may hold stale modules
    launches.clear()
    decode_logits(model, make_prompt_cache(model), PROMPT, steps=2)
    assert kinds(launches[-10:]) == traced_then_replayed
    launches.clear()
    decode_logits(model, make_prompt_cache(model), PROMPT, steps=2)
    assert kinds(launches[-3:]) == [(1, False)] * 3  # the prompt's head, each step's: the layers replayed


def test_one_sequence_takes_the_compiled_step_on_the_kernel_mocked_cuda(launches):
    model = tiny_model("llama")
    stock = decode_logits(model, make_prompt_cache(model), PROMPT[:1])
    qmm_decode.install(model, formats=ALL_FORMATS)
    sdpa_decode.install(model)
    decode_block.install(model)
    ours = decode_logits(model, make_prompt_cache(model), PROMPT[:1])  # a plain cache: its offset an int
    assert all(layer._compiled is not None for layer in model.layers)
    # the first step traces both layers on the kernel at one token; the head stays on MLX's qmv
    assert kinds([c for c in launches if c["x"].size // c["x"].shape[-1] == 1]) == LAYER * 2
    for a, b in zip(stock, ours):
        assert mx.array_equal(a, b)


def test_blocks_lower_their_linears_to_one_token_and_plain_restores_them_mocked_cuda(launches):
    model = tiny_model("qwen3")
    qmm_decode.install(model, formats=ALL_FORMATS)
    sdpa_decode.install(model)
    decode_block.install(model)
    linears = decode_block.decode_linears(model.layers[0])
    assert len(linears) == 7 and {linear.min_tokens for linear in linears} == {1}
    assert model.lm_head.min_tokens == qmm_decode.MIN_TOKENS  # outside the blocks: as installed
    decode_block.plain(model.layers[0])
    assert {linear.min_tokens for linear in linears} == {qmm_decode.MIN_TOKENS}


def test_the_compiled_step_on_a_left_padded_batch_cache_mocked_cuda(launches):
    def install(model):
        qmm_decode.install(model, formats=ALL_FORMATS)
        sdpa_decode.install(model)
        decode_block.install(model)

    stock, ours = left_padded_logits(tiny_model("qwen3"), install)
    assert kinds(launches[-12:]) == LAYER * 2 + [(1, False)] * 4
    for a, b in zip(stock, ours):
        assert mx.allclose(a, b, atol=1e-2, rtol=0)  # stock masks with -inf in bf16, the kernel drops the keys


def test_without_decode_attention_the_block_adds_attentions_residual_itself_mocked_cuda(launches):
    model = tiny_model("llama")
    stock = decode_logits(model, make_prompt_cache(model), PROMPT)
    qmm_decode.install(model, formats=ALL_FORMATS)
    decode_block.install(model)
    ours = decode_logits(model, make_prompt_cache(model), PROMPT)
    for a, b in zip(stock, ours):
        assert mx.array_equal(a, b)
    assert kinds(launches[-5:-1]) == [(3, False), (1, False), (2, False), (1, True)]


def test_inputs_beyond_the_kernels_token_counts_run_mlx_lms_block_mocked_cuda(launches):
    model = tiny_model("qwen3")
    prompt = mx.array([list(range(40))] * 2, dtype=mx.int32)  # 80 tokens: prefill-sized
    stock = model(prompt)
    qmm_decode.install(model, formats=ALL_FORMATS)
    decode_block.install(model)
    assert mx.array_equal(model(prompt), stock) and launches == []


def test_plain_gives_mlx_lms_block_back(launches):
    model = tiny_model("llama")
    qmm_decode.install(model, formats=ALL_FORMATS)
    decode_block.install(model)
    block = model.layers[0]
    restored = decode_block.plain(block)
    assert type(restored).__name__ == "TransformerBlock" and restored.mlp is block.mlp
    assert restored.self_attn is block.self_attn and restored.args is block.args
    assert decode_block.plain(model) is model


def test_no_decode_linear_no_decode_block():
    model = tiny_model("llama")
    assert decode_block.install(model) == [] and not decode_block.SPEC.applies(model)


def test_registered_after_the_kernels_it_builds_on_and_off_until_validated(launches):
    from omlx_core.kernels.catalog import registered
    from omlx_core.kernels.registry import install_kernels

    names = [spec.name for spec in registered()]
    assert names.index("decode_block") > names.index("qmm_decode")
    assert names.index("qk_norm_rope") > names.index("sdpa_decode")
    h200 = {"backend": "cuda", "arch": "sm_90", "gpu": "NVIDIA H200"}
    model = tiny_model("llama")
    report = install_kernels(model, None, {}, hardware=h200)
    decisions = {d.kernel: d for d in report.decisions}
    assert not decisions["decode_block"].active and "validated" in decisions["decode_block"].reason
    assert all(type(layer).__name__ == "TransformerBlock" for layer in model.layers)
    model = tiny_model("llama")
    forced = {"kernels.qmm_decode": "on", "kernels.decode_block": "on"}
    report = install_kernels(model, None, forced, hardware=h200)
    assert sorted(report.replaced["decode_block"]) == ["model.layers.0", "model.layers.1"]
    assert all(type(layer) is DecodeBlock for layer in model.layers)


def test_with_residual_falls_back_to_mlx_ops_where_the_kernel_does_not_take_the_layer_mocked_cuda(launches):
    layer = DecodeQuantizedLinear.of(quantized(k=128, n=96, bias=True))  # a bias: MLX's add
    x = mx.random.normal((4, 128)).astype(mx.bfloat16)
    residual = mx.random.normal((4, 96)).astype(mx.bfloat16)
    added = layer.with_residual(x, residual)
    assert kinds(launches) == [(1, False)]  # the plain launch; the bias and the add by MLX
    assert mx.array_equal(added, residual + layer(x))
    plain = DecodeQuantizedLinear.of(quantized(k=128, n=96))
    added = plain.with_residual(x, residual)
    assert kinds(launches[2:]) == [(1, True)]
    assert mx.array_equal(added, residual + plain(x))
    for other in (residual.astype(mx.float16), mx.zeros((4, 1), dtype=mx.bfloat16)):  # a broadcast: MLX's add
        assert mx.array_equal(plain.with_residual(x, other), other + plain(x))
    assert kinds(launches[4:]) == [(1, False)] * 4  # the plain launches only


@pytest.mark.parametrize("residual, message", [
    (mx.zeros((4, 95), dtype=mx.bfloat16), "residual (4, 95)"),
    (mx.zeros((4, 96), dtype=mx.float16), "residual (4, 96) mlx.core.float16"),
])
def test_residuals_that_do_not_fit_are_named_mocked_cuda(launches, residual, message):
    layer = quantized(k=128, n=96)
    x = mx.zeros((4, 128), dtype=mx.bfloat16)
    with pytest.raises(OmlxError, match=message.replace("(", r"\(").replace(")", r"\)")):
        qmm_decode.quantized_matmul_decode(x, layer.weight, layer.scales, layer.biases, 64, 4, residual=residual)
    with pytest.raises(OmlxError, match="takes one linear"):
        qmm_decode.grouped_matmul_decode(x, [(layer.weight, layer.scales, layer.biases)] * 2, 64, 4,
                                         residual=mx.zeros((4, 96), dtype=mx.bfloat16))
    assert launches == []
