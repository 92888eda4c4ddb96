"""The decode quantized matmul: routing, module replacement and its composition with the
prefill paths, gating off where CUDA is absent, the kernel source compiling for sm_90,
the dense-copy path's exactness and memory accounting, and the device benchmark's
exactness check (run here with the dense fallback). The kernel's own exactness is
checked on the GPU machine by scripts/bench/decode.py (docs/benchmarks/decode-h200-qmm.json)."""

import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load

from omlx_core.decode.dense_copy import DenseCopyLinear, install_dense_copy
from omlx_core.errors import OmlxError
from omlx_core.kernels import qmm_decode
from omlx_core.kernels.qmm_decode import ALL_FORMATS, Config, DecodeQuantizedLinear
from omlx_core.kernels.registry import decide, install_kernels
from omlx_core.memory.guard import MemoryGuard
from omlx_core.memory.weights import weights_bytes
from omlx_core.models.testing import build_tiny_model
from omlx_core.prefill.fast_paths import DequantizedPrefill, install_fast_paths, unwrap
from omlx_core.prefill.split import replace_module, rows_of
from omlx_core.settings import load_settings

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "scripts" / "bench" / "decode.py"
H200 = {"backend": "cuda", "arch": "sm_90", "gpu": "NVIDIA H200"}
CPU = {"backend": "cpu", "arch": None, "gpu": None}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("qmm") / "llama", quantized=True, bits=4,
                            group_size=64)


def quantized(k=128, n=96, bits=4, group=64, dtype=mx.bfloat16, bias=False) -> nn.QuantizedLinear:
    linear = nn.Linear(k, n, bias=bias)
    linear.set_dtype(dtype)
    return nn.QuantizedLinear.from_linear(linear, group_size=group, bits=bits)


def quantized_linears(model) -> dict:
    return {path: m for path, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}


# -- routing -------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens,expected", [(1, False), (2, True), (7, True), (64, True), (65, False), (512, False)])
def test_batched_decode_sized_inputs_take_the_kernel(tokens, expected):
    layer = DecodeQuantizedLinear.of(quantized())
    assert layer.uses_kernel(mx.zeros((1, tokens, 128), dtype=mx.bfloat16)) is expected


def test_one_token_takes_the_kernel_only_when_asked():
    assert DecodeQuantizedLinear.of(quantized(), min_tokens=1).uses_kernel(mx.zeros((1, 1, 128), dtype=mx.bfloat16))


def test_batched_decode_counts_every_row_as_a_token():
    layer = DecodeQuantizedLinear.of(quantized())
    assert layer.uses_kernel(mx.zeros((32, 1, 128), dtype=mx.bfloat16))
    assert not layer.uses_kernel(mx.zeros((65, 1, 128), dtype=mx.bfloat16))


def test_inputs_the_kernel_cannot_compute_keep_mlx():
    layer = DecodeQuantizedLinear.of(quantized())
    assert not layer.uses_kernel(mx.zeros((2, 1, 128), dtype=mx.float32))  # scales are bf16
    assert not DecodeQuantizedLinear.of(quantized(bits=3, group=64)).uses_kernel(
        mx.zeros((2, 128), dtype=mx.bfloat16))


def test_prefill_inputs_run_quantized_linear_unchanged():
    plain = quantized(bias=True)
    layer = DecodeQuantizedLinear.of(plain)
    x = mx.random.normal((1, 100, 128)).astype(mx.bfloat16)
    assert mx.array_equal(layer(x), plain(x))
    assert layer.calls == 0


def test_the_kernel_refuses_clearly_without_cuda():
    if qmm_decode.kernel_available() == "":
        pytest.skip("this machine runs CUDA")
    layer = DecodeQuantizedLinear.of(quantized())
    with pytest.raises(OmlxError, match="needs MLX's CUDA backend"):
        layer(mx.zeros((2, 1, 128), dtype=mx.bfloat16))


@pytest.mark.parametrize("n,k,tokens", [(4096, 4096, 1), (4096, 12288, 1), (12288, 4096, 32), (17, 1088, 64),
                                        (1001, 1056, 9)])
def test_every_launch_shape_fits_its_shared_memory_and_reaches_the_cta_target(n, k, tokens):
    config = qmm_decode.default_config(tokens, 4)
    splits = config.splits(n, k)
    blocks = math.ceil(k / 128)
    assert 8 * config.tiles >= tokens
    assert math.ceil(blocks / splits) * 128 <= config.slice_k  # one CTA's slice is staged whole
    assert 1 <= splits <= blocks
    ctas = math.ceil(n / config.block_n) * splits
    assert ctas >= min(config.ctas, math.ceil(n / config.block_n) * max(1, blocks // config.warps_k))


def test_a_launch_carries_partials_and_counters_only_when_k_is_split_mocked_cuda(monkeypatch):
    # Mocked: MLX's CUDA backend cannot exist here; the stand-in kernel records its call.
    calls = []

    def kernel(config, dtype, bits, group_size, split, segments=1, residual=False):
        def run(inputs, output_shapes, output_dtypes, grid, threadgroup):
            calls.append({"split": split, "inputs": len(inputs), "shapes": output_shapes, "grid": grid})
            return [mx.zeros(shape, dtype=d) for shape, d in zip(output_shapes, output_dtypes)]
        return run

    monkeypatch.setattr(qmm_decode, "kernel_available", lambda: "")
    monkeypatch.setattr(qmm_decode, "_kernel", kernel)
    qmm_decode.launch_for.cache_clear()
    try:
        config = qmm_decode.default_config(2, 4)
        n_wide = config.block_n * config.ctas  # the CTA target already, one slice: K whole
        wide = DecodeQuantizedLinear.of(quantized(k=config.slice_k, n=n_wide))
        narrow = DecodeQuantizedLinear.of(quantized(k=4096, n=128))  # 1 CTA column: K split
        x, x_narrow = mx.zeros((2, 1, config.slice_k), dtype=mx.bfloat16), mx.zeros((2, 1, 4096), dtype=mx.bfloat16)
        assert wide(x).shape == (2, 1, n_wide) and narrow(x_narrow).shape == (2, 1, 128)  # no reshape of x
        assert calls[0]["split"] is False and calls[0]["inputs"] == 4 and calls[0]["shapes"] == [(2, 1, n_wide)]
        splits = calls[1]["grid"][1]
        assert calls[1]["split"] is True and calls[1]["inputs"] == 5 and splits > 1
        assert calls[1]["shapes"] == [(2, 1, 128), (splits * 2 * 128,)]
        wide(x)
        assert wide.calls == 2 and list(wide._launches) == [2]  # one launch per token count, reused
        assert type(wide(x.astype(mx.float16))) is mx.array and wide.calls == 2  # fp16: MLX's path
    finally:
        qmm_decode.launch_for.cache_clear()


def reference_kernel(calls: list):
    """A stand-in for MLX's CUDA kernel (mocked: the CUDA backend cannot exist here) that
    computes what the kernel computes, each linear of the launch by mx.quantized_matmul
    (plus the residual when given), and records each launch."""
    def kernel(config, dtype, bits, group_size, split, segments=1, residual=False):
        def run(inputs, output_shapes, output_dtypes, grid, threadgroup):
            calls.append({"segments": segments, "x": inputs[0], "residual": residual,
                          "inputs": list(qmm_decode.inputs(split, segments, residual))})
            assert len(inputs) == len(calls[-1]["inputs"])
            x, rest = inputs[0], inputs[1:]
            weights = rest[:3 * segments]
            outs = [mx.quantized_matmul(x, *weights[3 * s:3 * s + 3], transpose=True, group_size=group_size,
                                        bits=bits) for s in range(segments)]
            if residual:
                outs = [rest[3 * segments] + outs[0]]
            return outs + ([mx.zeros(output_shapes[-1], dtype=mx.float32)] if split else [])
        return run
    return kernel


@pytest.fixture
def reference_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(qmm_decode, "kernel_available", lambda: "")
    monkeypatch.setattr(qmm_decode, "_kernel", reference_kernel(calls))
    qmm_decode.launch_for.cache_clear()
    yield calls
    qmm_decode.launch_for.cache_clear()


def test_siblings_of_one_input_are_grouped_into_one_launch_mocked_cuda(tiny_path, reference_cuda):
    model, _ = load(str(tiny_path))
    tokens = mx.array([[3, 14, 15], [9, 2, 6]])
    stock = model(tokens)
    paths = qmm_decode.install(model, formats=ALL_FORMATS)
    layers = len(model.layers)
    attention = model.layers[0].self_attn
    assert attention.q_proj._group is attention.k_proj._group is attention.v_proj._group is not None
    assert model.layers[0].mlp.gate_proj._group is model.layers[0].mlp.up_proj._group is not None
    assert model.layers[0].mlp.down_proj._group is None and attention.o_proj._group is None
    grouped = model(tokens)  # 6 tokens: every linear on the (reference) kernel
    assert mx.array_equal(grouped, stock)  # each linear got its own output, not a sibling's
    # Per layer: q/k/v in one launch, gate/up in one, o and down alone (and the head, if quantized).
    assert [c["segments"] for c in reference_cuda[:4]] == [3, 1, 2, 1]
    assert len(reference_cuda) == 4 * layers + ("lm_head" in paths) and len(paths) == 7 * layers + ("lm_head" in paths)
    assert all(m.calls == 1 for m in quantized_linears(model).values() if isinstance(m, DecodeQuantizedLinear))
    assert attention.q_proj._group.x is None  # every kept output handed out: x is not held


def test_a_grouped_linear_called_with_another_input_launches_again_mocked_cuda(reference_cuda):
    model = nn.Module()
    model.q_proj, model.k_proj = quantized(n=64), quantized(n=32)
    model.v_proj = quantized(n=32)
    qmm_decode.install(model, formats=ALL_FORMATS)
    x, other = (mx.random.normal((4, 128)).astype(mx.bfloat16) for _ in range(2))
    q = model.q_proj(x)
    k_other = model.k_proj(other)  # not the input q was launched with: its own launch
    assert len(reference_cuda) == 2 and reference_cuda[1]["x"] is other
    expected = mx.quantized_matmul(other, model.k_proj.weight, model.k_proj.scales, model.k_proj.biases,
                                   transpose=True, group_size=64, bits=4)
    assert mx.array_equal(k_other, expected) and q.shape == (4, 64)
    assert model.v_proj(other).shape == (4, 32) and len(reference_cuda) == 2  # kept from that launch


def test_no_group_across_formats_or_when_asked_not_to(reference_cuda):
    model = nn.Module()
    model.gate_proj, model.up_proj = quantized(n=64, bits=4), quantized(n=64, bits=8)
    qmm_decode.install(model, formats=ALL_FORMATS)
    assert model.gate_proj._group is None and model.up_proj._group is None
    same = nn.Module()
    same.gate_proj, same.up_proj = quantized(n=64), quantized(n=64)
    qmm_decode.install(same, formats=ALL_FORMATS, group=False)
    assert same.gate_proj._group is None


# -- module replacement and composition ----------------------------------------------------

def test_install_replaces_quantized_linears_with_the_same_arrays(tiny_path):
    model, _ = load(str(tiny_path))
    before = quantized_linears(model)
    size = weights_bytes(model)
    keys = [k for k, _ in tree_flatten(model.parameters())]
    paths = qmm_decode.install(model, formats=ALL_FORMATS)
    assert sorted(paths) == sorted(before)
    after = dict(model.named_modules())
    for path, original in before.items():
        assert isinstance(after[path], DecodeQuantizedLinear)
        assert after[path].weight is original.weight and after[path].scales is original.scales
    assert weights_bytes(model) == size  # the counters are not parameters
    assert [k for k, _ in tree_flatten(model.parameters())] == keys
    for path in paths:
        replace_module(model, path, qmm_decode.plain(after[path]))
    assert all(type(m) is nn.QuantizedLinear for m in quantized_linears(model).values())


def test_a_server_warms_one_batch_per_launch_shape_only_where_the_kernel_is_installed(tiny_path):
    model, _ = load(str(tiny_path))
    assert qmm_decode.shape_changes(model, 32) == []  # plain QuantizedLinear: nothing to compile
    qmm_decode.install(model, formats=ALL_FORMATS)
    assert qmm_decode.shape_changes(model, 32) == [2, 9, 17]
    assert qmm_decode.shape_changes(model, 200) == [2, 9, 17, 33]
    assert qmm_decode.shape_changes(model, 1) == []
    starts = qmm_decode.shape_changes(model, qmm_decode.MAX_TOKENS)
    assert [qmm_decode.tiles_for(t) for t in starts] == sorted({qmm_decode.tiles_for(t) for t in range(2, 65)})


def test_prefill_fast_path_wraps_the_decode_linear_and_unwrap_finds_it(tiny_path):
    model, _ = load(str(tiny_path))
    qmm_decode.install(model, formats=ALL_FORMATS)
    settings = load_settings(tiny_path.parent / "home", cli={"prefill.dense": "on", "compute.upcast_quantized": "off"})
    report = install_fast_paths(model, settings)
    assert report.dense_layers
    for layer in report.dense_layers:
        assert isinstance(layer, DequantizedPrefill) and isinstance(layer.quantized, DecodeQuantizedLinear)
        assert unwrap(layer) is layer.quantized
        part = rows_of(layer, 0, 64).quantized  # the split lanes slice it as any quantized linear
        assert isinstance(part, DecodeQuantizedLinear) and part.weight.shape[0] == 64
        x = mx.random.normal((1, 300, part.weight.shape[1] * 8)).astype(mx.bfloat16)
        assert mx.array_equal(part(x), layer.quantized(x)[..., :64])

def test_installed_after_the_prefill_path_it_replaces_the_wrapped_linear(tiny_path):
    model, _ = load(str(tiny_path))
    settings = load_settings(tiny_path.parent / "home", cli={"prefill.dense": "on", "compute.upcast_quantized": "off"})
    report = install_fast_paths(model, settings)
    paths = qmm_decode.install(model, formats=ALL_FORMATS)
    assert paths and all(path.endswith(".quantized") for path in paths)
    assert all(isinstance(layer.quantized, DecodeQuantizedLinear) for layer in report.dense_layers)


def test_only_checked_formats_are_installed_by_default():
    model = nn.Module()
    model.a = quantized(bits=4, group=64, dtype=mx.bfloat16)
    model.b = quantized(bits=4, group=64, dtype=mx.float16)  # not checked on the device
    assert qmm_decode.install(model) == ["a"]
    assert type(model.b) is nn.QuantizedLinear


# -- gating ----------------------------------------------------------------------------------

def test_gated_to_llama_on_the_h200_and_off_elsewhere(tiny_path, tmp_path):
    from omlx_core.kernels.registry import model_facts

    model, _ = load(str(tiny_path))
    spec = qmm_decode.SPEC
    llama = model_facts(model, None)
    cpu = decide(spec, "auto", CPU, llama, model)
    assert not cpu.active and "cuda backend" in cpu.reason
    assert not decide(spec, "on", CPU, llama, model).active
    h200 = decide(spec, "auto", H200, llama, model)
    assert h200.active and h200.validated and "llama" in h200.reason
    a100 = decide(spec, "auto", {"backend": "cuda", "arch": "sm_80", "gpu": "NVIDIA A100"}, llama, model)
    assert not a100.active and "not validated on this hardware" in a100.reason
    hybrid, _ = load(str(build_tiny_model("qwen3_5", tmp_path / "qwen3_5", quantized=True, bits=4, group_size=64)))
    qwen = decide(spec, "auto", H200, model_facts(hybrid, None), hybrid)
    assert not qwen.active and "not validated for this model" in qwen.reason
    forced = decide(spec, "on", H200, model_facts(hybrid, None), hybrid)
    assert forced.active and not forced.validated
    assert not decide(spec, "auto", H200, llama, nn.Linear(8, 8)).active  # nothing to replace


def test_validated_install_takes_batched_decode_and_leaves_one_token_to_mlx(tiny_path):
    model, _ = load(str(tiny_path))
    report = install_kernels(model, None, {}, kernels=(qmm_decode.SPEC,), hardware=H200)
    layers = [m for m in quantized_linears(model).values() if isinstance(m, DecodeQuantizedLinear)]
    assert report.active == ["qmm_decode"] and layers and len(layers) == len(report.replaced["qmm_decode"])
    assert all(m.min_tokens == 2 for m in layers)
    x = mx.random.normal((1, 1, layers[0].weight.shape[1] * 8)).astype(mx.bfloat16)
    assert not layers[0].uses_kernel(x) and layers[0].uses_kernel(mx.concatenate([x, x]))


def test_a_tied_embedding_takes_the_kernel_as_the_output_head(tmp_path):
    path = build_tiny_model("llama", tmp_path / "tied", quantized=True, bits=4, group_size=64,
                            shape={"tie_word_embeddings": True})
    model, _ = load(str(path))
    assert "lm_head" not in dict(model.named_modules())  # the head is the embedding's as_linear
    stock = model.model.embed_tokens
    tokens = mx.array([[3, 1, 4, 1, 5]])
    prompt = mx.arange(70)[None] % stock.num_embeddings  # 70 positions: a prefill, past the kernel's 64
    x = mx.random.normal((1, 1, stock.dims)).astype(mx.bfloat16)
    before = (stock(tokens), stock.as_linear(x), model(tokens[:, :1]), model(prompt))
    report = install_kernels(model, None, {}, kernels=(qmm_decode.SPEC,), hardware=H200)
    head = model.model.embed_tokens
    assert isinstance(head, qmm_decode.DecodeQuantizedEmbedding) and "model.embed_tokens" in report.replaced["qmm_decode"]
    assert head["weight"] is stock["weight"] and (head.num_embeddings, head.dims) == (stock.num_embeddings, stock.dims)
    assert qmm_decode._takes(head, mx.concatenate([x, x])) and not qmm_decode._takes(head, x)
    # Lookups, one token and a prefill as the head are MLX's as before (no kernel here): the same values.
    after = (head(tokens), head.as_linear(x), model(tokens[:, :1]), model(prompt))
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, after)) and head.calls == 0
    assert type(qmm_decode.plain(head)) is nn.QuantizedEmbedding
    assert mx.array_equal(qmm_decode.plain(head).as_linear(x), before[1]).item()


def test_an_untied_embedding_is_left_alone(tiny_path):
    model, _ = load(str(tiny_path))
    install_kernels(model, None, {}, kernels=(qmm_decode.SPEC,), hardware=H200)
    assert type(model.model.embed_tokens) is nn.QuantizedEmbedding


def test_install_kernels_leaves_the_model_alone_here(tiny_path):
    if qmm_decode.kernel_available() == "":
        pytest.skip("this machine runs CUDA")
    model, _ = load(str(tiny_path))
    report = install_kernels(model, None, {"kernels.qmm_decode": "auto"}, kernels=(qmm_decode.SPEC,))
    assert report.active == []
    assert all(type(m) is nn.QuantizedLinear for m in quantized_linears(model).values())


# -- the source compiles for the H200 --------------------------------------------------------

@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("tokens,bits,group,dtype,split,segments,residual", [
    (1, 4, 64, mx.bfloat16, False, 1, False), (1, 4, 64, mx.bfloat16, True, 1, False),
    (9, 8, 32, mx.bfloat16, True, 1, False), (17, 4, 128, mx.float16, True, 1, False),
    (64, 8, 64, mx.bfloat16, False, 1, False), (1, 4, 64, mx.bfloat16, True, 3, False),
    (33, 8, 64, mx.bfloat16, True, 2, False), (9, 4, 64, mx.bfloat16, True, 1, True),
    (33, 4, 64, mx.bfloat16, False, 1, True), (64, 8, 64, mx.bfloat16, True, 1, True)])
def test_kernel_compiles_for_sm90_within_its_register_budget(tmp_path, tokens, bits, group, dtype, split, segments,
                                                              residual):
    config = qmm_decode.default_config(tokens, bits)
    source = tmp_path / "k.cu"
    source.write_text(qmm_decode.generated_source(config, dtype, bits, group, split, segments=segments,
                                                  residual=residual))
    done = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
                           str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    registers = int(re.search(r"Used (\d+) registers", done.stderr).group(1))
    spilled = int(re.search(r"(\d+) bytes spill stores", done.stderr).group(1))
    assert registers <= 65536 // (config.threads * config.per_sm)  # the launch bounds took effect
    assert spilled <= 64
    frame = int(re.search(r"(\d+) bytes stack frame", done.stderr).group(1))
    assert frame <= 16 * math.ceil(spilled / 16)  # no local arrays: the frame holds the spills alone


# -- the dense copy ----------------------------------------------------------------------------

def test_dense_copy_leaves_other_quantized_subclasses_alone(tiny_path, home):
    model, _ = load(str(tiny_path))
    report = install_fast_paths(model, load_settings(home, cli={"compute.upcast_quantized": "on"}))
    assert report.upcast_layers
    # The 16-bit (CUDA) copy keeps their compute; the CPU backend's float32 copy replaces them.
    assert install_dense_copy(model, {"compute.dense_copy": "on"}, backend="cuda").layers == []


def test_dense_copy_is_off_by_default_on_cuda(tiny_path, home):
    model, _ = load(str(tiny_path))
    report = install_dense_copy(model, load_settings(home), backend="cuda")
    assert report.layers == [] and report.extra_bytes == 0 and "compute.dense_copy is auto" in report.reason


def test_dense_copy_computes_decode_on_the_dequantized_weight():
    plain = quantized(k=256, n=80, bits=4, group=32, bias=True)
    layer = DenseCopyLinear.of(plain)
    weight = mx.dequantize(plain.weight, plain.scales, plain.biases, group_size=32, bits=4, dtype=mx.bfloat16)
    x = mx.random.normal((3, 1, 256)).astype(mx.bfloat16)
    assert mx.array_equal(layer(x), x @ weight.T + plain.bias)
    truth = x.astype(mx.float32) @ weight.astype(mx.float32).T + plain.bias.astype(mx.float32)
    assert mx.max(mx.abs(layer(x).astype(mx.float32) - truth)).item() <= mx.max(mx.abs(truth)).item() / 128
    assert layer.calls == 2
    big = mx.random.normal((1, 70, 256)).astype(mx.bfloat16)
    assert mx.array_equal(layer(big), plain(big))  # prefill-sized: QuantizedLinear's own path
    assert layer.calls == 2


def test_dense_copy_bytes_are_reported_not_counted_as_weights(tiny_path):
    model, _ = load(str(tiny_path))
    shapes = [(m.weight.shape[0], m.weight.shape[1] * 32 // m.bits) for m in quantized_linears(model).values()]
    size = weights_bytes(model)
    report = install_dense_copy(model, {"compute.dense_copy": "on"}, backend="cuda")
    assert len(report.layers) == len(shapes)
    assert report.extra_bytes == sum(out * inp * 2 for out, inp in shapes)
    assert weights_bytes(model) == size
    assert report.as_dict()["extra_bytes"] == report.extra_bytes


def test_dense_copy_greedy_decode_matches_dense_weights(tiny_path):
    from mlx_lm.generate import generate_step

    def greedy(model):
        prompt = mx.array([5, 17, 42, 99], dtype=mx.int32)
        return [int(t) for t, _ in generate_step(prompt, model, max_tokens=64)]

    reference, _ = load(str(tiny_path))
    for path, module in list(quantized_linears(reference).items()):
        dense = nn.Linear(1, 1, bias=False)
        dense.weight = mx.dequantize(module.weight, module.scales, module.biases, group_size=module.group_size,
                                     bits=module.bits, dtype=module.scales.dtype)
        replace_module(reference, path, dense)
    # Prefill of the 4-token prompt runs the copy too (<= 64 tokens), so every product is the same.
    model, _ = load(str(tiny_path))
    report = install_dense_copy(model, {"compute.dense_copy": "on"}, backend="cuda")
    assert greedy(model) == greedy(reference)
    assert sum(layer.calls for layer in report.layers) > 0


def test_serve_charges_the_dense_copy_to_the_memory_guard(tiny_path, home, tmp_path):
    from omlx_core.serve.registry import ModelRegistry

    guard = MemoryGuard(total_bytes=64 * 2**30)
    # compute.upcast_quantized off: on the CPU backend its float32 layers keep their own compute.
    registry = ModelRegistry(home, [str(tiny_path)], guard,
                             cli_settings={"compute.dense_copy": "on", "compute.upcast_quantized": "off"})
    other = shutil.copytree(tiny_path, tmp_path / "other")  # loaded on request: not pinned, evictable
    loaded = registry.get(str(other))
    extras = guard.snapshot()["extras"]
    assert extras[f"dense_copy:{loaded.id}"] == loaded.dense_copy.extra_bytes > 0
    assert registry.evict_one(set())
    assert f"dense_copy:{loaded.id}" not in guard.snapshot()["extras"]


# -- the device benchmark's exactness check ------------------------------------------------------

def bench():
    sys.path.insert(0, str(BENCH.parent))
    import decode

    return decode


def test_benchmark_exactness_check_passes_the_dense_path_and_fails_a_wrong_one():
    decode = bench()
    cases = [(4, 64, mx.bfloat16, 1088, 1001, (1, 9)), (8, 32, mx.bfloat16, 1056, 17, (3,))]
    good = decode.run_exact(decode.dense_matmul, cases=cases)
    assert good["cases"] == 3 and good["failed"] == 0

    def off_by_a_bit(x, wq, scales, biases, group, bits, **_):
        return decode.dense_matmul(x, wq, scales, biases, group, bits) * 1.03

    bad = decode.run_exact(off_by_a_bit, cases=cases)
    assert bad["failed"] == 3 and not any(bad["formats"].values())


def test_benchmark_judges_the_issues_goals_from_its_rows():
    decode = bench()

    def layer(k, n, m, us):
        return {"k": k, "n": n, "m": m, "variant": "ours", "us": us, "gbps": k * n * 0.5625 / us / 1e3}

    # The H200's figures at 17874ef (docs/benchmarks/decode-h200-layers.json) for 4096x12288,
    # and a 4096x4096 that would meet both goals.
    result = {"layers": {"rows": [layer(4096, 12288, 1, 18.6), layer(4096, 12288, 32, 42.4),
                                  layer(4096, 4096, 1, 4.0), layer(4096, 4096, 32, 5.0),
                                  {**layer(4096, 4096, 1, 1.0), "variant": "mlx_qmm"}]},
              "model": {"rows": [{"batch": 1, "stock_tps": 160.0, "kernel_tps": 179.0, "fused_tps": 340.0},
                                 {"batch": 8, "kernel_tps": 9000.0},
                                 {"batch": 32, "stock_tps": 303.0, "kernel_tps": 2727.0}]}}
    judged = {(row["goal"], row["case"]): row for row in decode.goals(result)}
    assert {key: row["met"] for key, row in judged.items()} == {
        ("M=1 effective bandwidth", "4096x12288"): False, ("M=32 time over M=1", "4096x12288"): False,
        ("M=1 effective bandwidth", "4096x4096"): True, ("M=32 time over M=1", "4096x4096"): True,
        ("batch-1 decode", "fused"): True, ("batch-32 aggregate", "kernel"): False}
    assert judged[("M=32 time over M=1", "4096x12288")]["measured"] == pytest.approx(42.4 / 18.6)
    slow_stock = {"model": {"rows": [{"batch": 1, "stock_tps": 200.0, "fused_tps": 340.0}]}}
    assert [row["met"] for row in decode.goals(slow_stock)] == [False]  # 340 is under twice stock
    assert decode.goals({}) == []


def test_benchmark_refuses_the_kernel_where_it_is_unavailable(tmp_path):
    if qmm_decode.kernel_available() == "":
        pytest.skip("this machine runs CUDA")
    done = subprocess.run([sys.executable, str(BENCH), "--parts", "exact", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "qmm_decode kernel is not available" in done.stderr and "--matmul dense" in done.stderr


def test_bench_batch_cache_decodes_what_the_plain_cache_does(tiny_path):
    # The model part's serve-like cache (BatchKVCache: offsets per sequence, an array mask)
    # must compute the same steps as mlx-lm's KVCache, or its timings compare different work.
    from mlx_lm.models.cache import BatchKVCache, KVCache
    from mlx_lm.utils import load

    decode = bench()
    model, _ = load(str(tiny_path))
    steps = {}
    for kind in decode.CACHES:
        mx.random.seed(3)
        cache = decode.prefilled(model, 2, 40, kind)
        assert all(isinstance(c, BatchKVCache if kind == "batch" else KVCache) for c in cache)
        token, tokens = mx.array([[5], [9]], dtype=mx.int32), []
        for _ in range(6):
            token = decode.greedy_step(model, cache, token)
            tokens.append(token.tolist())
        for layer_cache in cache:
            layer_cache.trim(6)  # as decode_step_seconds puts the context back between repeats
        steps[kind] = (tokens, decode.greedy_step(model, cache, mx.array([[5], [9]], dtype=mx.int32)).tolist())
    assert steps["batch"] == steps["plain"]
    assert steps["plain"][1] == steps["plain"][0][0]  # trimmed back, the first step repeats


def test_bench_prepares_the_dense_copy_as_serve_does(tiny_path, home):
    from omlx_core.bench.offline import install_key, prepare_model
    from omlx_core.models.resolve import ModelRef

    on = load_settings(home, cli={"compute.dense_copy": "on", "compute.upcast_quantized": "off"})
    off = load_settings(home, cli={"compute.upcast_quantized": "off"})
    assert install_key(on) != install_key(off)  # two variants never share one prepared model
    prepared = prepare_model(ModelRef(tiny_path.name, tiny_path.name, tiny_path), on)
    assert any(isinstance(m, DenseCopyLinear) for _, m in prepared.model.named_modules())


def test_the_header_includes_the_source_by_path_and_digest_and_compiles(tmp_path):
    import hashlib
    import shutil
    import subprocess

    from omlx_core.kernels.registry import kernel_path

    path = kernel_path(qmm_decode.SOURCE)
    text = qmm_decode.source_text()
    assert text.startswith(f'#include "{path}"')
    assert hashlib.sha256(path.read_bytes()).hexdigest()[:16] in text  # a changed file is a new module
    assert len(qmm_decode.header(qmm_decode.default_config(1, 4), mx.bfloat16, 4, 64)) < 1000
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed: the include's compile is checked where it is")
    unit = tmp_path / "qmm.cu"
    unit.write_text(qmm_decode.generated_source(qmm_decode.default_config(32, 4), mx.bfloat16, 4, 64, split=True))
    done = subprocess.run(["nvcc", "-arch=sm_90a", "-std=c++17", "-c", str(unit), "-o", str(tmp_path / "qmm.o")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
