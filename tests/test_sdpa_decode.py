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
from omlx_core.kernels import sdpa_decode

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
def test_slices_fit_the_score_buffer_and_fill_the_gpu_when_the_cache_allows(pairs, keys):
    splits = sdpa_decode.splits_for(pairs, keys)
    assert math.ceil(keys / splits) <= sdpa_decode.CHUNK
    if math.ceil(2 * sdpa_decode.SMS / pairs) <= math.ceil(keys / 64):  # long enough: two CTAs an SM
        assert pairs * splits >= 2 * sdpa_decode.SMS
    else:  # short: slices of about 64 keys
        assert splits == math.ceil(keys / 64)


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
    assert int(re.search(r"Used (\d+) registers", done.stderr).group(1)) <= 128  # 4 CTAs of 128 threads an SM


def test_benchmark_exactness_check_passes_mlx_and_fails_a_wrong_attention():
    sys.path.insert(0, str(BENCH))
    import attention

    cases = [(2, 8, 2, 64, 37, 256, mx.bfloat16, None), (1, 4, 4, 128, 300, 512, mx.float16, None),
             (3, 8, 2, 128, 90, 256, mx.bfloat16, (0, 5, 60))]
    good = attention.run_exact(attention.mlx_attention, cases=cases)
    assert good["cases"] == 3 and good["failed"] == 0

    def stale_by_one(q, k, v, scale, starts):  # forgets the newest cached token
        return attention.mlx_attention(q, k[..., :-1, :], v[..., :-1, :], scale, starts)

    def padding_ignored(q, k, v, scale, starts):
        return attention.mlx_attention(q, k, v, scale)

    assert attention.run_exact(stale_by_one, cases=cases)["failed"] == 3
    assert attention.run_exact(padding_ignored, cases=cases)["failed"] == 1  # only the padded case differs
