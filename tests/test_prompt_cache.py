"""The tiered prompt cache: real servers, real files on disk, tiny real models.

A repeated 4k-token prefix must be served from the cache (prompt tokens processed drop
to the suffix) with the same greedy output, from memory and, after a restart, from SSD;
a corrupted file must be found, deleted and recomputed; the writer queue must hold its
bound under a burst; and a hybrid model's gated-delta state must come back exactly.
"""

import json
import random
import time
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from conftest import omlx_env, run_omlx
from omlx_core.models.fingerprint import model_fingerprint
from omlx_core.models.testing import build_tiny_model
from omlx_core.prompt_cache.chain import block_keys, cacheable_tokens
from omlx_core.prompt_cache.disk import DiskTier
from omlx_core.prompt_cache.identity import cache_identity
from omlx_core.prompt_cache.layout import cache_layout
from omlx_core.prompt_cache.tiered import TieredPromptCache
from omlx_core.prompt_cache.writer import WriteQueue

LLAMA, HYBRID = "tiny-llama", "tiny-qwen35"
BLOCK = 256
PREFIX = 4096
LONG_CONTEXT = {"max_position_embeddings": 8192}


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 250) for _ in range(n)]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    home = tmp_path_factory.mktemp("cache-home")
    build_tiny_model("llama", home / "models" / LLAMA, shape=LONG_CONTEXT)
    build_tiny_model("qwen3_5", home / "models" / HYBRID, shape=LONG_CONTEXT)
    return home


def serve(start_server, home, *extra_env: tuple[str, str]):
    env = omlx_env(home, OMLX_PROMPT_CACHE_BLOCK_TOKENS=str(BLOCK), **dict(extra_env))
    return start_server(home, "--model", LLAMA, "--model", HYBRID, env=env)


def complete(server, model: str, prompt: list[int]) -> dict:
    response = httpx.post(server.url + "/v1/completions", timeout=300, json={
        "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    return {"text": body["choices"][0]["text"],
            "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


def cache_stats(server, model: str) -> dict:
    models = httpx.get(server.url + "/api/status", timeout=30).json()["models"]
    return next(m for m in models if m["id"] == model)["prompt_cache"]


def settle(server, model: str) -> dict:
    """Wait until the writer queue is empty (every accepted block is on SSD)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stats = cache_stats(server, model)
        if stats["writer"]["pending_entries"] == 0:
            return stats
        time.sleep(0.1)
    raise AssertionError(f"writer queue never drained: {stats}")


def test_a_repeated_4k_prefix_is_served_from_memory_with_the_same_output(start_server, home):
    server = serve(start_server, home)
    prefix = tokens(1, PREFIX)
    first = complete(server, LLAMA, prefix + tokens(2, 40))
    again = complete(server, LLAMA, prefix + tokens(2, 40))
    other = complete(server, LLAMA, prefix + tokens(3, 40))
    assert first["cached"] == 0
    assert again == {"text": first["text"], "cached": PREFIX}
    assert other["cached"] == PREFIX  # only the suffix is prefilled
    stats = cache_stats(server, LLAMA)
    assert stats["hit_tokens"] == {"memory": 2 * PREFIX, "disk": 0}
    assert stats["memory"]["bytes"] > 0 and stats["lookups"] == 3
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert f'omlx_prompt_cache_hit_tokens_total{{model="{LLAMA}",tier="memory"}} {2 * PREFIX}.0' in metrics
    server.stop()


def test_after_a_restart_the_prefix_comes_from_ssd(start_server, home):
    server = serve(start_server, home)
    prompt = tokens(4, PREFIX) + tokens(5, 30)
    first = complete(server, LLAMA, prompt)
    stats = settle(server, LLAMA)
    assert stats["disk"]["files"] >= PREFIX // BLOCK
    server.stop()

    server = serve(start_server, home)
    again = complete(server, LLAMA, prompt)
    assert again == {"text": first["text"], "cached": PREFIX}
    assert cache_stats(server, LLAMA)["hit_tokens"] == {"memory": 0, "disk": PREFIX}
    server.stop()


def test_a_corrupt_cache_file_is_deleted_and_the_prefix_recomputed(start_server, home):
    server = serve(start_server, home, ("OMLX_PROMPT_CACHE_MEMORY_BYTES", "1"))  # reads go to SSD
    prompt = tokens(6, PREFIX) + tokens(7, 30)
    first = complete(server, LLAMA, prompt)
    stats = settle(server, LLAMA)
    directory = Path(stats["disk"]["directory"])
    keys = block_keys(stats["identity"], prompt[:PREFIX], BLOCK)
    flipped = directory / f"{keys[3]}.kv.safetensors"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupted = bytes(data)
    flipped.write_bytes(corrupted)
    truncated = directory / f"{keys[9]}.kv.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:100])

    again = complete(server, LLAMA, prompt)
    assert again == {"text": first["text"], "cached": 3 * BLOCK}  # the blocks before the bad one
    assert settle(server, LLAMA)["disk"]["corrupt_files"] == 2  # both bad files found in one read
    assert flipped.read_bytes() != corrupted and truncated.stat().st_size > 100  # written afresh
    third = complete(server, LLAMA, prompt)
    assert third == {"text": first["text"], "cached": PREFIX}
    assert "corrupt_files_total" in httpx.get(server.url + "/metrics", timeout=30).text
    server.stop()


def test_a_hybrid_models_hit_restores_the_gated_delta_state(start_server, home):
    server = serve(start_server, home)
    prompt = tokens(8, PREFIX) + tokens(9, 25)
    first = complete(server, HYBRID, prompt)
    again = complete(server, HYBRID, prompt)
    assert again == {"text": first["text"], "cached": PREFIX}
    stats = cache_stats(server, HYBRID)
    assert stats["enabled"] and stats["hit_tokens"]["memory"] == PREFIX
    server.stop()


def test_a_restored_hybrid_cache_gives_the_logits_of_no_cache(home, tmp_path):
    path = home / "models" / HYBRID
    model, _ = load(str(path))
    layout = cache_layout(model)
    assert layout.sliced and layout.snapshotted  # attention and gated-delta layers both
    prompt = tokens(10, 3 * BLOCK + 17)
    boundary = cacheable_tokens(len(prompt), BLOCK)
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:boundary])[None], cache=cache)
    mx.eval([c.state for c in cache])
    identity = cache_identity(path, model_fingerprint(path))
    prompt_cache = TieredPromptCache(identity, layout, BLOCK, 1 << 30)
    assert prompt_cache.store(prompt[:boundary], cache) == 3 + 1  # three KV blocks, one snapshot

    hit = prompt_cache.lookup(prompt)
    assert hit.tokens == boundary
    cached = model(mx.array(prompt[boundary:])[None], cache=hit.cache)[0, -1]
    fresh = model(mx.array(prompt)[None], cache=make_prompt_cache(model))[0, -1]
    # A zeroed gated-delta state moves these logits by ~1e-2; a restored one by nothing.
    assert mx.abs(cached.astype(mx.float32) - fresh.astype(mx.float32)).max().item() < 2e-3
    # Without the snapshot the same KV blocks give no hit: the state cannot be rebuilt.
    shorter = prompt[:2 * BLOCK + 5]
    assert prompt_cache.lookup(shorter).tokens == 0


def test_the_writer_queue_holds_its_bound_under_a_burst(tmp_path):
    disk = DiskTier(tmp_path / "cache", "mf-test", cap_bytes=1 << 30)
    block = mx.zeros((1, 2, 256, 64), dtype=mx.float16)  # 64 KiB
    mx.eval(block)
    writer = WriteQueue(disk, max_bytes=5 * block.nbytes, min_entries=2, max_entries=64)
    with writer.paused():
        accepted = [writer.offer(f"{i:032x}.kv", {"0.keys": block}, {}) for i in range(100)]
        assert sum(accepted) == 5 and writer.dropped == 95
        assert writer.pending_bytes == writer.peak_pending_bytes <= writer.max_bytes
    assert writer.flush(timeout=30)
    assert disk.files == 5 and writer.written == 5 and writer.pending_bytes == 0

    tight = WriteQueue(disk, max_bytes=1, min_entries=2, max_entries=64)  # every block too big
    with tight.paused():
        assert sum(tight.offer(f"{i:032x}.state", {"0.0": block}, {}) for i in range(10)) == 2
    tight.close()
    writer.close()


def test_the_disk_tier_evicts_least_recently_used_files_over_its_cap(tmp_path):
    block = mx.ones((1, 2, 256, 64), dtype=mx.float16)
    disk = DiskTier(tmp_path / "cache", "mf-test", cap_bytes=3 * block.nbytes + 4096)
    for i in range(3):
        disk.write(f"{i:032x}.kv", {"0.keys": block}, {})
    assert disk.read(f"{0:032x}.kv") is not None  # block 0 is now the most recent
    disk.write(f"{3:032x}.kv", {"0.keys": block}, {})
    assert f"{1:032x}.kv" not in disk and f"{0:032x}.kv" in disk and disk.evicted_files == 1
    reopened = DiskTier(tmp_path / "cache", "mf-test", cap_bytes=1 << 30)
    assert reopened.files == 3
    assert DiskTier(tmp_path / "cache", "mf-other", 1 << 30).read(f"{0:032x}.kv") is None  # not its model


def test_two_checkpoints_with_one_layout_have_different_caches(tmp_path):
    a = build_tiny_model("llama", tmp_path / "a", seed=1)
    b = build_tiny_model("llama", tmp_path / "b", seed=2)
    assert model_fingerprint(a) == model_fingerprint(b)
    assert cache_identity(a, model_fingerprint(a)) != cache_identity(b, model_fingerprint(b))


def test_cache_clear_removes_one_models_files_or_all(home, tmp_path):
    from omlx_core.models.resolve import resolve
    from omlx_core.prompt_cache.identity import cache_dir, model_cache_identity

    mine = cache_dir(home, model_cache_identity(resolve(LLAMA, home)))
    other = cache_dir(home, "mf-other-000000000000")
    for directory in (mine, other):
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{0:032x}.kv.safetensors").write_bytes(b"x" * 10)
    shown = json.loads(run_omlx(home, "cache", "show", "--json", check=True).stdout)
    assert {c["identity"] for c in shown["caches"]} >= {mine.name, other.name}
    cleared = json.loads(run_omlx(home, "cache", "clear", "--model", LLAMA, "--json", check=True).stdout)
    assert [c["identity"] for c in cleared["removed"]] == [mine.name]
    assert not mine.exists() and other.exists()
    run_omlx(home, "cache", "clear", check=True)
    assert not other.exists()
