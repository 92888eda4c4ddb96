"""The decode attention kernel: what it accepts, how it splits the cache, that it compiles
for sm_90, and that its benchmark's exactness check can fail. It cannot run here (no CUDA):
scripts/bench/attention.py checks its results on the GPU."""

import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from omlx_core.errors import OmlxError
from omlx_core.kernels import qk_norm_rope, sdpa_decode

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench"


def qkv(batch=2, heads=8, kv_heads=2, dim=128, tokens=40, dtype=mx.bfloat16, length=1):
    q = mx.zeros((batch, heads, length, dim), dtype=dtype)
    k = mx.zeros((batch, kv_heads, tokens, dim), dtype=dtype)
    return q, k, mx.zeros_like(k)


def test_one_query_token_of_a_supported_shape_is_fusable():
    assert sdpa_decode.fusable(*qkv()) is None
    assert sdpa_decode.fusable(*qkv(heads=8, kv_heads=8, dim=64, dtype=mx.float16)) is None


@pytest.mark.parametrize("inputs, reason", [
    (qkv(length=2), "2 query tokens"),
    (qkv(dim=96), "head size 96"),
    (qkv(heads=32, kv_heads=2), "32 query heads over 2"),
    (qkv(heads=6, kv_heads=4), "6 query heads over 4"),
    (qkv(dtype=mx.float32), "float32"),
    (qkv(tokens=0), "an empty cache"),
])
def test_what_the_kernel_cannot_compute_is_named(inputs, reason):
    assert reason in sdpa_decode.fusable(*inputs)


def test_k_and_v_must_fit_q():
    q, k, _ = qkv()
    assert "do not fit" in sdpa_decode.fusable(q, k, mx.zeros((2, 2, 41, 128), dtype=mx.bfloat16))


@pytest.mark.parametrize("pairs, keys", [(8, 1024), (256, 1024), (8, 4096), (1, 100_000), (2, 1), (64, 77)])
def test_slices_fill_the_gpu_when_the_cache_is_long_enough(pairs, keys):
    splits = sdpa_decode.splits_for(pairs, keys)
    target = sdpa_decode.CTAS_PER_SM * sdpa_decode.SMS
    assert splits >= 1
    assert splits <= sdpa_decode.MAX_SPLITS
    if math.ceil(target / pairs) > sdpa_decode.MAX_SPLITS:  # one head: as many slices as the combine holds
        assert splits == min(sdpa_decode.MAX_SPLITS, math.ceil(keys / sdpa_decode.MIN_KEYS))
    elif math.ceil(target / pairs) <= math.ceil(keys / sdpa_decode.MIN_KEYS):  # long enough: the GPU filled
        assert target <= pairs * splits < target + pairs
    else:  # short: slices of about MIN_KEYS keys
        assert splits == math.ceil(keys / sdpa_decode.MIN_KEYS)


def test_the_kernel_refuses_clearly_without_cuda():
    from omlx_core.hardware import mlx_backend

    if mlx_backend() == "cuda":
        pytest.skip("this machine runs CUDA")
    with pytest.raises(OmlxError, match="sdpa_decode needs MLX's CUDA backend"):
        sdpa_decode.decode_attention(*qkv(), scale=128**-0.5)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("dtype", ["__nv_bfloat16", "__half"])
@pytest.mark.parametrize("dim", sdpa_decode.HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 4, sdpa_decode.MAX_GROUP])
def test_kernel_compiles_for_sm90_without_spills(tmp_path, dtype, dim, group):
    source = tmp_path / "k.cu"
    source.write_text(sdpa_decode.generated_source(dtype, dim, group))
    done = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
                           str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(re.search(r"(\d+) bytes spill stores", done.stderr).group(1)) == 0
    assert int(re.search(r"(\d+) bytes stack frame", done.stderr).group(1)) == 0
    registers = int(re.search(r"Used (\d+) registers", done.stderr).group(1))
    assert registers * sdpa_decode.THREADS * sdpa_decode.CTAS_PER_SM <= sdpa_decode.REGISTERS


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("dtype", ["__nv_bfloat16", "__half"])
def test_append_kernel_compiles_for_sm90_without_spills(tmp_path, dtype):
    source = tmp_path / "k.cu"
    source.write_text(sdpa_decode.append_generated_source(dtype))
    done = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
                           str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "custom_kernel_omlx_sdpa_append" in done.stderr  # the wrapper, not only the header, was compiled
    assert int(re.search(r"(\d+) bytes spill stores", done.stderr).group(1)) == 0


def test_benchmark_exactness_check_passes_mlx_and_fails_a_wrong_attention():
    sys.path.insert(0, str(BENCH))
    import attention

    cases = [(2, 8, 2, 64, 37, 256, mx.bfloat16, None), (1, 4, 4, 128, 300, 512, mx.float16, None),
             (3, 8, 2, 128, 90, 256, mx.bfloat16, (0, 5, 60))]
    good = attention.run_exact(attention.mlx_attention, cases=cases, poison=False)
    assert good["cases"] == 3 and good["failed"] == 0
    # MLX's attention reads the padded rows (times zero): NaN there shows it
    assert attention.run_exact(attention.mlx_attention, cases=cases)["failed"] == 1

    def stale_by_one(q, k, v, scale, starts):  # forgets the newest cached token
        return attention.mlx_attention(q, k[..., :-1, :], v[..., :-1, :], scale, starts)

    def padding_ignored(q, k, v, scale, starts):
        return attention.mlx_attention(q, k, v, scale)

    assert attention.run_exact(stale_by_one, cases=cases, poison=False)["failed"] == 3
    # only the padded case differs
    assert attention.run_exact(padding_ignored, cases=cases, poison=False)["failed"] == 1


# -- installed in models (the kernel mocked: MLX's CUDA backend cannot exist here) ----------

def reference_kernel(calls: list):
    """A stand-in for the kernel (mocked: no CUDA here): MLX's attention with the mask
    that `starts` stands for; records each call's padding."""
    sys.path.insert(0, str(BENCH))
    import attention

    def run(q, k, v, scale, starts, locks, written=None, keys=None):
        calls.append(None if starts is None else starts.tolist())
        if keys is not None:  # the kernel reads the first `keys` rows of the buffers
            k, v = k[..., :keys, :], v[..., :keys, :]
        return attention.mlx_attention(q, k, v, scale, None if starts is None else starts.tolist())
    return run


def write_rows_on_cpu(k_buf, v_buf, keys, values, row, offset=None):
    """A stand-in for the append kernel (mocked: no CUDA here) that writes in place as the
    kernel does, through numpy into MLX's CPU buffers (after what makes them has run)."""
    import numpy as np

    mx.eval(k_buf, v_buf, keys, values)
    for buffer, rows in ((k_buf, keys), (v_buf, values)):
        assert buffer.dtype == rows.dtype and buffer.dtype in (mx.bfloat16, mx.float16)
        memory = np.frombuffer(memoryview(buffer).cast("B"), dtype=np.uint16).reshape(buffer.shape)
        if rows.dtype == mx.float16:
            bits = np.array(rows).view(np.uint16)
        else:
            bits = np.array(rows.astype(mx.float32)).view(np.uint32) >> 16  # bf16 -> fp32 -> bf16 is exact
        memory[:, :, row, :] = bits[:, :, 0, :].astype(np.uint16)
    return mx.array([row + 1], dtype=mx.int32), None if offset is None else offset + 1


def mock_attention(monkeypatch, calls: list) -> None:
    """Both of the decode attention's kernels replaced by their stand-ins."""
    monkeypatch.setattr(sdpa_decode, "launch", reference_kernel(calls))
    monkeypatch.setattr(sdpa_decode, "write_rows", write_rows_on_cpu)


@pytest.fixture
def mocked_kernel(monkeypatch):
    calls = []
    mock_attention(monkeypatch, calls)
    return calls


def tiny_model(arch: str, head_dim: int = 64):
    import importlib

    import mlx.nn as nn

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    args = module.ModelArgs.from_dict({  # from_dict: qwen2 has no head_dim (hidden / heads, the same here)
        "model_type": arch, "hidden_size": 4 * head_dim, "num_hidden_layers": 2, "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 97,
        "max_position_embeddings": 512, "rope_theta": 10000.0, "head_dim": head_dim, "tie_word_embeddings": False})
    model = module.Model(args)
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    return model


def decode_logits(model, cache, prompt: mx.array, steps: int = 4) -> list:
    logits = model(prompt, cache=cache)[:, -1:, :]
    out = []
    for _ in range(steps):
        token = mx.argmax(logits, axis=-1).astype(mx.int32)
        logits = model(token, cache=cache)[:, -1:, :]
        out.append(logits)
    mx.eval(out)
    return out


@pytest.mark.parametrize("arch", sdpa_decode.ARCHITECTURES)
def test_installed_attention_decodes_as_mlx_lm_does_mocked_cuda(arch, mocked_kernel):
    from mlx_lm.models.cache import make_prompt_cache

    model = tiny_model(arch)
    prompt = mx.array([[3, 14, 15, 92, 65, 35, 89, 79]] * 2, dtype=mx.int32)
    stock = decode_logits(model, make_prompt_cache(model), prompt)
    paths = sdpa_decode.install(model)
    assert sorted(paths) == [f"model.layers.{i}.self_attn" for i in range(2)]
    ours = decode_logits(model, make_prompt_cache(model), prompt)
    assert len(mocked_kernel) == 4 * 2  # each decode step of each layer, the prefill not
    for a, b in zip(stock, ours):
        assert mx.array_equal(a, b)
    for path in paths:  # plain() gives mlx-lm's module back, the same arrays
        restored = sdpa_decode.plain(dict(model.named_modules())[path])
        assert type(restored).__name__ == "Attention" and restored.n_heads == 4
    assert sdpa_decode.plain(model) is model


@pytest.mark.parametrize("batched", [False, True])
def test_a_step_writes_its_cache_row_in_place_where_no_reader_saw_it_mocked_cuda(batched, mocked_kernel,
                                                                               monkeypatch):
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    model = tiny_model("qwen3")
    prompt = mx.array([[3, 14, 15, 92, 65, 35, 89, 79]] * 2, dtype=mx.int32)
    make = (lambda: [BatchKVCache([0, 0]) for _ in model.layers]) if batched else (lambda: make_prompt_cache(model))
    stock_cache = make()
    stock = decode_logits(model, stock_cache, prompt, steps=6)
    sdpa_decode.install(model)
    writes = []
    monkeypatch.setattr(sdpa_decode, "write_rows", lambda *args: writes.append(args[4]) or write_rows_on_cpu(*args))
    cache = make()
    ours = decode_logits(model, cache, prompt, steps=3)
    assert writes == [9, 9, 10, 10]  # the first step's rows by mlx-lm's update (no buffer of ours yet), then in place
    view = cache[0].keys[..., :11, :]  # a reader of every row so far
    seen = view * 1
    mx.eval(view, seen)
    for layer in cache:
        layer.trim(1)  # the next row is one the reader saw: mlx-lm's update, which copies
    writes.clear()
    logits = ours[-1]
    for _ in range(3):
        logits = model(mx.argmax(logits, axis=-1).astype(mx.int32), cache=cache)[:, -1:, :]
    mx.eval(logits)
    assert writes == [11, 11, 12, 12]  # row 10 by mlx-lm's update, then in place again
    assert mx.array_equal(view, seen)  # the reader's rows untouched
    assert (cache[0]._idx if batched else cache[0].offset) == 13
    assert mx.array_equal(cache[0].keys[..., :10, :], stock_cache[0].keys[..., :10, :])  # rows before the trim
    for a, b in zip(stock, ours):
        assert mx.array_equal(a, b)


def left_padded_logits(model, install) -> tuple[list, list]:
    """Decode logits on a batch cache whose second sequence is left-padded by 3: mlx-lm's,
    then after `install(model)`."""
    from mlx_lm.models.cache import BatchKVCache

    prompt = mx.array([[3, 14, 15, 92, 65, 35], [0, 0, 0, 7, 11, 13]], dtype=mx.int32)
    stock = decode_logits(model, [BatchKVCache([0, 3]) for _ in model.layers], prompt)
    install(model)
    return stock, decode_logits(model, [BatchKVCache([0, 3]) for _ in model.layers], prompt)


def test_left_padding_of_a_batch_cache_becomes_the_kernels_starts_mocked_cuda(mocked_kernel):
    stock, ours = left_padded_logits(tiny_model("qwen3"), sdpa_decode.install)
    assert mocked_kernel and all(starts == [0, 3] for starts in mocked_kernel)
    for a, b in zip(stock, ours):
        assert mx.allclose(a, b, atol=1e-2, rtol=0)  # stock masks with -inf in bf16, ours drops the keys


def test_attention_the_kernel_cannot_compute_runs_mlx_lms_path_mocked_cuda(mocked_kernel):
    from mlx_lm.models.cache import make_prompt_cache

    model = tiny_model("llama", head_dim=32)  # a head size the kernel does not take
    prompt = mx.array([[5, 6, 7, 8]] * 2, dtype=mx.int32)
    stock = decode_logits(model, make_prompt_cache(model), prompt)
    sdpa_decode.install(model)
    ours = decode_logits(model, make_prompt_cache(model), prompt)
    assert mocked_kernel == []
    assert all(m.kernel_calls == 0 for _, m in model.named_modules() if isinstance(m, sdpa_decode.DecodeAttention))
    for a, b in zip(stock, ours):
        assert mx.array_equal(a, b)


@pytest.mark.parametrize("min_batch", [1, 2])
def test_sequences_below_min_batch_stay_on_mlx_lms_attention_mocked_cuda(min_batch, mocked_kernel, monkeypatch):
    from mlx_lm.models.cache import make_prompt_cache

    monkeypatch.setattr(sdpa_decode, "MIN_BATCH", min_batch)
    model = tiny_model("llama")
    prompt = mx.array([[5, 6, 7, 8]], dtype=mx.int32)
    stock = decode_logits(model, make_prompt_cache(model), prompt)
    sdpa_decode.install(model)
    ours = decode_logits(model, make_prompt_cache(model), prompt)
    assert len(mocked_kernel) == (4 * 2 if min_batch == 1 else 0)  # each decode step of each layer
    for a, b in zip(stock, ours):
        assert mx.array_equal(a, b)


def test_auto_installs_it_where_validated_only_and_on_forces_it_elsewhere():
    from omlx_core.kernels.registry import install_kernels

    h200 = {"backend": "cuda", "arch": "sm_90", "gpu": "NVIDIA H200"}
    a100 = {"backend": "cuda", "arch": "sm_80", "gpu": "NVIDIA A100-SXM4-80GB"}
    layers = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    model = tiny_model("llama")
    auto = install_kernels(model, "mf-x", {}, kernels=(sdpa_decode.SPEC,), hardware=h200)
    assert auto.decisions[0].active and auto.decisions[0].validated
    assert sorted(auto.replaced["sdpa_decode"]) == layers

    for arch, hardware in (("llama", a100), ("qwen3", h200)):  # another GPU; an architecture not checked
        other = tiny_model(arch)
        off = install_kernels(other, "mf-x", {}, kernels=(sdpa_decode.SPEC,), hardware=hardware)
        assert not off.decisions[0].active and "not validated" in off.decisions[0].reason
        assert not any(isinstance(m, sdpa_decode.DecodeAttention) for _, m in other.named_modules())
        forced = install_kernels(other, "mf-x", {"kernels.sdpa_decode": "on"}, kernels=(sdpa_decode.SPEC,),
                                 hardware=hardware)
        assert forced.decisions[0].active and not forced.decisions[0].validated
        assert sorted(forced.replaced["sdpa_decode"]) == layers


def test_benchmark_greedy_check_passes_the_reference_and_catches_ignored_padding(monkeypatch, tmp_path):
    sys.path.insert(0, str(BENCH))
    import attention

    calls = []
    mock_attention(monkeypatch, calls)
    monkeypatch.setattr(qk_norm_rope.Prologue, "__call__",  # mlx-lm's ops in the prologue's place (no CUDA)
                        lambda self, module, q, k, offset: qk_norm_rope.reference(module, q, k, offset))
    good = attention.run_greedy(tmp_path, count=12)
    assert [row["identical"] and row["agrees"] for row in good] == [True, True]
    assert all(row["kernel_calls"] == 12 * 4 for row in good)  # every step of the tiny llama's 4 layers

    monkeypatch.setattr(sdpa_decode, "launch", lambda q, k, v, scale, starts, locks, written, keys: (
        attention.mlx_attention(q, k[..., :keys, :], v[..., :keys, :], scale)))  # attends to the padding too
    bad = attention.run_greedy(tmp_path, count=12)
    assert [row["agrees"] for row in bad] == [True, False]
    assert bad[1]["differs"][0] is None and not bad[1]["differs"][1]["near_tie"]  # the padded sequence, clearly


@pytest.mark.parametrize("arch", sdpa_decode.ARCHITECTURES)
def test_a_prefill_attends_through_small_attention_as_mlx_lm_does_mocked_cuda(arch, mocked_kernel, monkeypatch):
    """Prefill on the installed attention: small_attention's unfused form (no cuDNN graph per
    shape on CUDA), the same logits as mlx-lm's; on a left-padded batch cache too."""
    from omlx_core.prefill import small_attention

    unfused = []
    real = small_attention.unfused
    monkeypatch.setattr(small_attention, "unfused", lambda *a: unfused.append(a[3]) or real(*a))
    stock, ours = left_padded_logits(tiny_model(arch), sdpa_decode.install)
    assert len(unfused) == 2  # the prompt's forward, each layer; decode steps take the kernel
    assert mocked_kernel and len(mocked_kernel) == 4 * 2
    for a, b in zip(stock, ours):
        assert mx.allclose(a, b, atol=1e-2, rtol=0)  # as in the decode test of left padding
    model = tiny_model(arch)
    prompt = mx.array([[3, 14, 15, 92, 65, 35, 89, 79]] * 2, dtype=mx.int32)
    from mlx_lm.models.cache import make_prompt_cache

    reference = model(prompt, cache=make_prompt_cache(model))
    sdpa_decode.install(model)
    assert mx.array_equal(model(prompt, cache=make_prompt_cache(model)), reference)
    assert len(unfused) == 4


@pytest.mark.parametrize("limit", [0, 1 << 25])
def test_the_setting_sets_each_attentions_limit_and_0_keeps_mlx_attention_mocked_cuda(limit, mocked_kernel,
                                                                                     monkeypatch, tmp_path):
    from mlx_lm.models.cache import make_prompt_cache

    from omlx_core.prefill import small_attention
    from omlx_core.prefill.fast_paths import install_fast_paths
    from omlx_core.settings.effective import load_settings

    unfused = []
    real = small_attention.unfused
    monkeypatch.setattr(small_attention, "unfused", lambda *a: unfused.append(a[3]) or real(*a))
    model = tiny_model("qwen3")
    prompt = mx.array([[3, 14, 15, 92, 65, 35, 89, 79]] * 2, dtype=mx.int32)
    reference = model(prompt, cache=make_prompt_cache(model))
    sdpa_decode.install(model)
    settings = load_settings(tmp_path, cli={"prefill.small_attention_scores": limit, "prefill.dense": "off",
                                             "compute.upcast_quantized": "off"})
    report = install_fast_paths(model, settings).as_dict()["small_attention"]
    assert report["layers"] == 2 and report["max_scores"] == limit
    assert ("off" in report["reason"]) == (limit == 0)
    assert all(m.small_scores == limit for _, m in model.named_modules() if isinstance(m, sdpa_decode.DecodeAttention))
    assert mx.array_equal(model(prompt, cache=make_prompt_cache(model)), reference)  # on the CPU: MLX's fallback
    assert len(unfused) == (2 if limit else 0)
    assert sdpa_decode.plain(dict(model.named_modules())["model.layers.0.self_attn"]).__dict__.get("small_scores") is None
