"""KV estimates match real caches after real prefills; the guard admits, refuses and adapts.

Every model is a real mlx-lm model with random weights: the tiny checkpoints of
`build_tiny_model` (llama, the qwen3_5 hybrid, deepseek_v41) loaded from disk, a tiny
llama whose config turns three of its four layers into sliding-window layers, and a tiny
falcon_h1 built in-process, whose layers are CacheLists of an SSM state and a KV cache.
"""

import json
import os
import random
import threading

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; never ask a hub

import mlx.core as mx
import psutil
import pytest
from mlx_lm.models import falcon_h1
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_lm.utils import load

from omlx_core.errors import InputError, OmlxError
from omlx_core.memory import (
    MemoryGuard,
    MemoryRefused,
    actual_kv_bytes,
    estimate_kv_bytes,
    kv_profile,
    total_memory_bytes,
    weights_bytes,
    worst_case_kv_bytes,
)
from omlx_core.memory.kv import COMPOSITE, FIXED, FULL, MEASURED, QUANTIZED, ROTATING
from omlx_core.models.testing import build_tiny_model

GiB = 1024**3
CHUNK = 100     # prefill chunk, as the engine would run it
WINDOW = 64     # sliding window of the rotating llama
TOLERANCE = 0.05


# Models ---------------------------------------------------------------------------

def _rotating_llama(path):
    """The tiny llama with layers 0-2 as sliding-window layers: RotatingKVCache there."""
    build_tiny_model("llama", path)
    config = json.loads((path / "config.json").read_text())
    config["sliding_window"] = WINDOW
    config["layer_types"] = ["sliding_attention"] * 3 + ["full_attention"]
    (path / "config.json").write_text(json.dumps(config))
    return path


def _tiny_falcon_h1():
    args = falcon_h1.ModelArgs.from_dict({
        "model_type": "falcon_h1", "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "mamba_d_ssm": 128, "mamba_n_heads": 2, "mamba_d_head": 64,
        "mamba_d_state": 16, "mamba_chunk_size": 32, "vocab_size": 512, "head_dim": 32,
        "num_attention_heads": 4, "num_key_value_heads": 2,
    })
    return falcon_h1.Model(args)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory-models")
    loaded = {}
    # MLX's CPU GatherMM, which deepseek_v41's routed experts use, runs only float32.
    for arch, dtype in (("llama", "bfloat16"), ("qwen3_5", "bfloat16"),
                        ("deepseek_v41", "float32")):
        loaded[arch] = load(str(build_tiny_model(arch, root / arch, dtype=dtype)))[0]
    loaded["llama_q4"] = load(str(build_tiny_model("llama", root / "q4", quantized=True)))[0]
    loaded["rotating"] = load(str(_rotating_llama(root / "rotating")))[0]
    loaded["falcon_h1"] = _tiny_falcon_h1()
    return loaded


def prefill(model, cache, tokens: int, batch: int = 1, chunk: int = CHUNK):
    """Run `tokens` prompt tokens through `model` in chunks, evaluating each step."""
    ids = mx.random.randint(0, 512, (batch, tokens), key=mx.random.key(tokens))
    for start in range(0, tokens, chunk):
        mx.eval(model(ids[:, start:start + chunk], cache=cache))
    return cache


def used_bytes(entry) -> int:
    """Bytes of the rows a cache holds, without the rows KVCache allocates ahead.

    KVCache (and QuantizedKVCache) grow 256 rows at a time, so their `nbytes` counts rows
    no token has written yet; the used part is `keys[..., :offset, :]` and likewise for
    values. A RotatingKVCache holds at most its array's rows. ArraysCache state and
    deepseek_v41's LayerCache are concatenated to size, so all of them is used.
    """
    if isinstance(entry, CacheList):
        return sum(used_bytes(part) for part in entry.caches)
    if isinstance(entry, ArraysCache):
        return sum(a.nbytes for a in entry.cache if a is not None)
    if isinstance(entry, QuantizedKVCache):
        return sum(a[..., :entry.offset, :].nbytes for a in (*entry.keys, *entry.values))
    if isinstance(entry, RotatingKVCache):
        rows = min(entry.offset, entry.keys.shape[2])
        return entry.keys[..., :rows, :].nbytes + entry.values[..., :rows, :].nbytes
    if isinstance(entry, KVCache):
        return (entry.keys[..., :entry.offset, :].nbytes
                + entry.values[..., :entry.offset, :].nbytes)
    return entry.nbytes


def assert_close(estimate: int, real: int):
    assert abs(estimate - real) <= TOLERANCE * real, (estimate, real)


# KV estimates against real caches ---------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "qwen3_5", "rotating", "deepseek_v41"])
@pytest.mark.parametrize("tokens", [300, 1000])
def test_estimate_matches_the_used_part_of_the_cache_after_prefill(models, name, tokens):
    """Compared: the estimate against the used rows of every cache (padding left out),
    within 5%; and the padding-inclusive nbytes, which must lie between the plain
    estimate and the estimate with allocation slack."""
    model = models[name]
    profile = kv_profile(model)
    cache = prefill(model, make_prompt_cache(model), tokens)

    estimate = estimate_kv_bytes(profile, tokens, prefill_chunk=CHUNK)
    assert_close(estimate, sum(used_bytes(entry) for entry in cache))
    padded = actual_kv_bytes(cache)
    assert padded >= estimate
    assert padded <= estimate_kv_bytes(profile, tokens, prefill_chunk=CHUNK, slack=True)


def test_rotating_layers_stop_at_their_window(models):
    model = models["rotating"]
    profile = kv_profile(model)
    assert profile.kinds() == [ROTATING] * 3 + [FULL]
    assert {layer.window for layer in profile.layers[:3]} == {WINDOW}
    # Only the full layer adds per token once windows are full.
    assert profile.bytes_per_token == profile.layers[3].bytes_per_token

    cache = prefill(model, make_prompt_cache(model), 1000)
    # During prefill a windowed layer holds the window plus the chunk just appended...
    for entry in cache[:3]:
        assert WINDOW < entry.keys.shape[2] < WINDOW + CHUNK
    # ...and once decoding, the window alone: the steady estimate (no prefill_chunk).
    mx.eval(model(mx.array([[7]]), cache=cache))
    assert all(entry.keys.shape[2] == WINDOW for entry in cache[:3])
    assert_close(estimate_kv_bytes(profile, 1001), sum(used_bytes(e) for e in cache))


def test_hybrid_per_token_cost_counts_only_the_attention_layer(models):
    model = models["qwen3_5"]
    profile = kv_profile(model)
    assert profile.kinds() == [FIXED, FIXED, FIXED, FULL]

    # One full-attention layer: K and V, 2 KV heads of 64 dims, bfloat16.
    args = model.language_model.args
    per_token = 2 * args.num_key_value_heads * args.head_dim * 2
    assert profile.bytes_per_token == per_token
    assert (estimate_kv_bytes(profile, 1000) - estimate_kv_bytes(profile, 300)
            == 700 * per_token)

    # The gated-delta state is the same size after 300 and 1000 tokens, and the profile
    # carries it as fixed bytes per sequence.
    short = prefill(model, make_prompt_cache(model), 300)
    long = prefill(model, make_prompt_cache(model), 1000)
    gdn_short = [used_bytes(entry) for entry in short[:3]]
    assert gdn_short == [used_bytes(entry) for entry in long[:3]]
    assert profile.fixed_bytes == sum(gdn_short)


def test_quantized_kv_counts_packed_values_scales_and_biases(models):
    model = models["llama"]
    profile = kv_profile(model, kv_bits=4, kv_group_size=32)
    assert profile.kinds() == [QUANTIZED] * 4
    # Per layer and token: K and V for 2 heads, each 32 dims packed at 4 bits (16 bytes)
    # plus one bfloat16 scale and one bias per group of 32.
    assert profile.bytes_per_token == 4 * 2 * 2 * (16 + 2 + 2)
    assert profile.bytes_per_token < kv_profile(model).bytes_per_token

    cache = prefill(model, [QuantizedKVCache(group_size=32, bits=4) for _ in range(4)], 300)
    estimate = estimate_kv_bytes(profile, 300)
    assert_close(estimate, sum(used_bytes(entry) for entry in cache))
    assert estimate <= actual_kv_bytes(cache) <= estimate_kv_bytes(profile, 300, slack=True)


def test_cache_list_layers_sum_their_parts(models):
    model = models["falcon_h1"]
    profile = kv_profile(model)
    assert profile.kinds() == [COMPOSITE] * 2
    assert [part.kind for part in profile.layers[0].parts] == [FIXED, FULL]
    assert profile.bytes_per_token == 2 * profile.layers[0].parts[1].bytes_per_token

    cache = prefill(model, make_prompt_cache(model), 300)
    assert_close(estimate_kv_bytes(profile, 300), sum(used_bytes(entry) for entry in cache))


def test_an_unknown_cache_class_is_measured_past_its_window(models):
    """deepseek_v41 brings its own LayerCache: a 16-row window everywhere, plus latents
    that the kv-source layers 1 (a latent per 2 tokens) and 4 (per token) accumulate."""
    profile = kv_profile(models["deepseek_v41"])
    assert set(profile.kinds()) == {MEASURED}
    growing = {i: layer.bytes_per_token for i, layer in enumerate(profile.layers)
               if layer.bytes_per_token}
    # compress_kv + index_k rows, 64 float32 dims each.
    assert growing == {1: 2 * 64 * 4 / 2, 4: 2 * 64 * 4}
    # The window of 16 float32 rows of 64 is every layer's constant part.
    assert {layer.fixed_bytes for layer in profile.layers} == {16 * 64 * 4}


def test_batch_charges_every_sequence(models):
    model = models["llama"]
    profile = kv_profile(model)
    cache = prefill(model, make_prompt_cache(model), 300, batch=2)
    assert estimate_kv_bytes(profile, 300, batch=2) == 2 * estimate_kv_bytes(profile, 300)
    assert_close(estimate_kv_bytes(profile, 300, batch=2),
                 sum(used_bytes(entry) for entry in cache))


def test_worst_case_covers_prompt_plus_max_tokens_with_padding(models):
    model = models["llama"]
    profile = kv_profile(model)
    worst = worst_case_kv_bytes(profile, 300, 200, prefill_chunk=CHUNK)
    assert worst == estimate_kv_bytes(profile, 500, prefill_chunk=CHUNK, slack=True)
    cache = prefill(model, make_prompt_cache(model), 300)
    for token in range(200):
        mx.eval(model(mx.array([[token]]), cache=cache))
    assert actual_kv_bytes(cache) <= worst


def test_weights_bytes_match_the_checkpoint_tensors(models, tmp_path):
    for name in ("llama", "llama_q4"):
        path = build_tiny_model("llama", tmp_path / name, quantized=name == "llama_q4")
        on_disk = sum(value.nbytes for value in mx.load(str(path / "model.safetensors")).values())
        assert weights_bytes(models[name]) == on_disk
    assert weights_bytes(models["llama_q4"]) < weights_bytes(models["llama"])


# The guard --------------------------------------------------------------------------

def guard_16g(**kwargs) -> MemoryGuard:
    """16 GiB, soft at 10 GiB, hard at 12 GiB, 4 GiB of weights."""
    kwargs.setdefault("soft_watermark", 10 * GiB)
    guard = MemoryGuard(total_bytes=16 * GiB, hard_watermark=0.75, **kwargs)
    guard.register_weights("tiny", 4 * GiB)
    return guard


def test_admission_below_and_above_the_hard_watermark():
    guard = guard_16g()
    admitted = guard.admit("r1", "tiny", 6 * GiB)
    assert (admitted.reserved_bytes, admitted.committed_bytes) == (6 * GiB, 10 * GiB)
    assert not admitted.over_soft

    with pytest.raises(MemoryRefused) as refused:
        guard.admit("r2", "tiny", 3 * GiB)
    error = refused.value
    assert (error.needed, error.available, error.watermark) == (3 * GiB, 2 * GiB, 12 * GiB)
    assert isinstance(error, OmlxError) and error.http_status == 507
    message = str(error)
    assert "\n" not in message
    for text in ("r2", "3.0 GiB", "2.0 GiB", "12.0 GiB", "memory.hard_watermark"):
        assert text in message
    # A refusal reserves nothing; exactly what is left still fits.
    assert guard.admit("r3", "tiny", 2 * GiB).committed_bytes == 12 * GiB


def test_release_frees_the_reservation():
    guard = guard_16g()
    guard.admit("r1", "tiny", 8 * GiB)
    with pytest.raises(MemoryRefused):
        guard.admit("r2", "tiny", 1 * GiB)
    assert guard.release("r1") == 8 * GiB
    assert guard.release("r1") == 0  # releasing twice is harmless
    guard.admit("r2", "tiny", 8 * GiB)
    with pytest.raises(InputError):
        guard.admit("r2", "tiny", 1)


def test_extras_and_live_kv_count_against_the_watermark():
    guard = guard_16g()
    guard.register_extra("prefill.dense_dequant", 2 * GiB)
    guard.register_extra("prefill.dense_dequant", 3 * GiB)  # replaces, does not add
    with pytest.raises(MemoryRefused) as refused:
        guard.admit("r1", "tiny", 6 * GiB)
    assert refused.value.available == 5 * GiB
    guard.release_extra("prefill.dense_dequant")
    guard.admit("r1", "tiny", 6 * GiB)

    # A request is charged its reservation until its live KV outgrows it.
    guard.record_kv("r1", 1 * GiB)
    assert guard.committed_bytes() == 10 * GiB
    guard.record_kv("r1", 7 * GiB)
    assert guard.committed_bytes() == 11 * GiB

    snapshot = guard.snapshot()
    assert snapshot["total_bytes"] == 16 * GiB
    assert snapshot["soft_watermark_bytes"] == 10 * GiB
    assert snapshot["hard_watermark_bytes"] == 12 * GiB
    assert snapshot["weights"] == {"tiny": 4 * GiB}
    assert snapshot["kv"]["requests"] == {
        "r1": {"model": "tiny", "reserved_bytes": 6 * GiB, "live_bytes": 7 * GiB}}
    assert (snapshot["committed_bytes"], snapshot["available_bytes"]) == (11 * GiB, 1 * GiB)
    assert snapshot["over_soft"] and snapshot["extras"] == {}
    json.dumps(snapshot)  # /api/status serves it as is


def test_prefill_chunk_shrinks_above_soft_and_grows_back():
    guard = guard_16g()
    assert guard.prefill_chunk_size(2048) == 2048
    guard.admit("big", "tiny", 7 * GiB)  # 11 GiB committed: over the 10 GiB soft mark
    assert guard.over_soft()
    assert [guard.prefill_chunk_size(2048) for _ in range(5)] == [1024, 512, 256, 256, 256]
    guard.release("big")
    assert not guard.over_soft()
    assert [guard.prefill_chunk_size(2048) for _ in range(4)] == [512, 1024, 2048, 2048]
    # Never above what is asked for, nor floored above it.
    assert guard.prefill_chunk_size(128) == 128
    guard.admit("big", "tiny", 7 * GiB)
    assert guard.prefill_chunk_size(128) == 128


def test_watermarks_accept_bytes_fractions_and_text():
    guard = MemoryGuard(total_bytes=16 * GiB, soft_watermark="8GiB", hard_watermark=0.75)
    assert (guard.soft_bytes, guard.hard_bytes) == (8 * GiB, 12 * GiB)
    with pytest.raises(InputError):
        MemoryGuard(total_bytes=16 * GiB, soft_watermark=0.95, hard_watermark=0.9)
    assert MemoryGuard().total_bytes == total_memory_bytes()
    if mx.default_device() == mx.cpu:
        assert total_memory_bytes() == psutil.virtual_memory().total


def test_concurrent_admit_and_release_keep_the_books_straight():
    guard = guard_16g()
    guard.register_extra("prefill.dense_dequant", 1 * GiB)
    hard, base = guard.hard_bytes, guard.committed_bytes()
    seen_over_hard = []

    def worker(seed: int):
        rng = random.Random(seed)
        held = []
        for step in range(400):
            if held and rng.random() < 0.5:
                guard.release(held.pop(rng.randrange(len(held))))
                continue
            request_id = f"w{seed}-{step}"
            try:
                admitted = guard.admit(request_id, "tiny", rng.randrange(1, GiB))
            except MemoryRefused as error:
                assert error.needed > error.available
                continue
            if admitted.committed_bytes > hard:
                seen_over_hard.append(admitted)
            held.append(request_id)
        for request_id in held:
            guard.release(request_id)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not seen_over_hard
    assert guard.committed_bytes() == base
    assert guard.snapshot()["kv"]["requests"] == {}
