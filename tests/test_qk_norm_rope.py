"""qk_norm_rope: which attention modules' prologues the kernel takes, what it is handed
(inputs, specialization, grid) and that DecodeAttention routes through it, and that the
source compiles for sm_90. The kernel cannot run here (no CUDA): a stand-in computing with
MLX's ops from exactly what the kernel is handed takes its place (mocked), and
scripts/bench/attention.py --parts prologue checks the kernel's results on the GPU."""

import re
import shutil
import subprocess

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from mlx_lm.models.rope_utils import Llama3RoPE, YarnRoPE
from test_sdpa_decode import decode_logits, tiny_model
from test_sdpa_decode import mock_attention

from omlx_core.kernels import qk_norm_rope, sdpa_decode
from omlx_core.kernels.qk_norm_rope import Prologue


def attention_like(dim=128, heads=8, kv_heads=2, rope=None, norms=True, eps=(1e-6, 1e-6), dtype=mx.bfloat16):
    module = nn.Module()
    module.n_heads, module.n_kv_heads = heads, kv_heads
    module.rope = rope if rope is not None else nn.RoPE(dim, base=1_000_000.0)
    if norms:
        module.q_norm, module.k_norm = nn.RMSNorm(dim, eps=eps[0]), nn.RMSNorm(dim, eps=eps[1])
        module.q_norm.weight = (1 + 0.1 * mx.random.normal((dim,))).astype(dtype)
        module.k_norm.weight = (1 + 0.1 * mx.random.normal((dim,))).astype(dtype)
    return module


LLAMA3 = {"factor": 8.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("module, reason", [
    (attention_like(), None),
    (attention_like(norms=False, rope=Llama3RoPE(128, scaling_config=LLAMA3)), None),
    (attention_like(dim=64, norms=False, rope=nn.RoPE(64, traditional=True, scale=0.5)), None),
    (attention_like(rope=YarnRoPE(128)), "rope YarnRoPE"),
    (attention_like(dim=96), "rotary size 96"),
    (attention_like(eps=(1e-6, 1e-5)), "different epsilons"),
])
def test_which_prologues_the_kernel_takes_is_named(module, reason):
    assert qk_norm_rope.why_not(module) == reason or reason in qk_norm_rope.why_not(module)
    assert (Prologue.of(module) is None) == (reason is not None)


def test_a_step_the_prologue_was_not_made_for_keeps_mlx_lms_ops():
    module = attention_like()
    prologue = Prologue.of(module)
    assert prologue.takes(module, mx.zeros((2, 1, 8 * 128), dtype=mx.bfloat16))
    assert not prologue.takes(module, mx.zeros((2, 1, 8 * 128), dtype=mx.float32))  # not a kernel type
    assert not prologue.takes(module, mx.zeros((2, 1, 8 * 128), dtype=mx.float16))  # not the norms' type
    assert not prologue.takes(module, mx.zeros((2, 1, 8 * 256), dtype=mx.bfloat16))  # partial rotary


def stand_in(calls: list):
    """The kernel's place (mocked: no CUDA here): MLX's ops computing from exactly the
    inputs, specialization and launch the kernel gets."""
    def make(dtype, head_dim, q_heads, kv_heads, norm, traditional, freqs, per_sequence):
        def run(inputs, grid, threadgroup, output_shapes, output_dtypes):
            named = dict(zip(qk_norm_rope.inputs(norm, freqs), inputs))
            t = {"D": head_dim, "HQ": q_heads, "HKV": kv_heads, "NORM": norm, "TRADITIONAL": traditional,
                 "FREQS": freqs, "PER_SEQ": per_sequence}
            assert named["q"].dtype == dtype and output_dtypes == [dtype, dtype]
            calls.append({"norm": norm, "freqs": freqs, "template": t, "grid": grid})
            log2_base, scale, eps = named["params"].tolist()
            batch, dim = named["q"].shape[0], t["D"]
            offsets = named["offsets"] if t["PER_SEQ"] else named["offsets"][0].item()
            assert grid[0] * 1 >= 32 * batch * (t["HQ"] + t["HKV"]) and grid[0] % threadgroup[0] == 0
            outs = []
            for x, heads, weight in ((named["q"], t["HQ"], "q_weight"), (named["k"], t["HKV"], "k_weight")):
                x = x.reshape(batch, 1, heads, dim)
                if t["NORM"]:
                    x = mx.fast.rms_norm(x, named[weight], eps)
                x = x.transpose(0, 2, 1, 3)
                outs.append(mx.fast.rope(x, dim, traditional=t["TRADITIONAL"],
                                         base=None if t["FREQS"] else 2.0 ** log2_base, scale=scale, offset=offsets,
                                         freqs=named["freqs"] if t["FREQS"] else None))
            assert [o.shape for o in outs] == [tuple(s) for s in output_shapes]
            return outs
        return run
    return make


@pytest.fixture
def launches(monkeypatch) -> list:
    calls = []
    monkeypatch.setattr(qk_norm_rope, "_kernel", stand_in(calls))
    return calls


@pytest.mark.parametrize("module, offset", [
    (attention_like(), mx.array([3, 900, 17], dtype=mx.int32)),
    (attention_like(norms=False, rope=Llama3RoPE(128, scaling_config=LLAMA3)), 4000),
    (attention_like(dim=64, norms=False, rope=nn.RoPE(64, traditional=True, scale=0.5), dtype=mx.float16),
     mx.array([7], dtype=mx.int32)),
])
def test_the_kernel_is_handed_what_mlx_lm_computes_from_mocked_cuda(launches, module, offset):
    prologue = Prologue.of(module)
    dtype = mx.float16 if prologue.dim == 64 else mx.bfloat16
    queries = mx.random.normal((3, 1, 8 * prologue.dim)).astype(dtype)
    keys = mx.random.normal((3, 1, 2 * prologue.dim)).astype(dtype)
    ours = prologue(module, queries, keys, offset)
    stock = qk_norm_rope.reference(module, queries, keys, offset)
    for a, b in zip(ours, stock):
        assert a.shape == b.shape and mx.allclose(a.astype(mx.float32), b.astype(mx.float32), atol=0.02, rtol=0.02)
    assert launches[0]["template"]["PER_SEQ"] == (isinstance(offset, mx.array) and offset.size > 1)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_attention_takes_the_prologue_launch_mocked_cuda(arch, launches, monkeypatch):
    attention_calls = []
    mock_attention(monkeypatch, attention_calls)
    model = tiny_model(arch)
    prompt = mx.array([[3, 14, 15, 92, 65, 35, 89, 79]] * 2, dtype=mx.int32)
    stock = decode_logits(model, make_prompt_cache(model), prompt)
    sdpa_decode.install(model)
    assert qk_norm_rope.SPEC.applies(model)
    assert sorted(qk_norm_rope.install(model)) == [f"model.layers.{i}.self_attn" for i in range(2)]
    ours = decode_logits(model, make_prompt_cache(model), prompt)
    for a, b in zip(stock, ours):
        assert mx.allclose(a.astype(mx.float32), b.astype(mx.float32), atol=0.05, rtol=0.05)
    assert len(launches) == 4 * 2  # each decode step of each layer, the prefill not
    assert all(c["norm"] == (arch == "qwen3") for c in launches)
    cache = [BatchKVCache([0, 2]) for _ in model.layers]
    decode_logits(model, cache, prompt, steps=1)
    assert launches[-1]["template"]["PER_SEQ"] is True  # a batch cache: a position per sequence
    before = len(launches)
    one = decode_logits(model, make_prompt_cache(model), prompt[:1], steps=2)  # one sequence: the kernel too
    assert len(launches) == before + 2 * 2 and len(attention_calls) == 4 * 2 + 2 + 2 * 2
    assert all(o.shape == (1, 1, 97) for o in one)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("dtype, dim, heads, kv_heads, norm, traditional, freqs, per_sequence", [
    (mx.bfloat16, 128, 32, 8, True, False, False, True), (mx.bfloat16, 128, 32, 8, False, False, True, False),
    (mx.float16, 64, 16, 4, True, True, False, True)])
def test_kernel_compiles_for_sm90_without_spills(tmp_path, dtype, dim, heads, kv_heads, norm, traditional, freqs,
                                                 per_sequence):
    source = tmp_path / "k.cu"
    source.write_text(qk_norm_rope.generated_source(dtype, dim, heads, kv_heads, norm, traditional, freqs,
                                                    per_sequence))
    done = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
                           str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(re.search(r"(\d+) bytes spill stores", done.stderr).group(1)) == 0
    assert int(re.search(r"Used (\d+) registers", done.stderr).group(1)) <= 64


def test_without_sdpa_decode_there_is_no_prologue_to_install():
    model = tiny_model("llama")
    assert not qk_norm_rope.SPEC.applies(model) and qk_norm_rope.install(model) == []
    assert "kernels.sdpa_decode" in qk_norm_rope.SPEC.absent
