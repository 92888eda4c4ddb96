"""The serve warm-up: dummy decode batches (1 sequence, each decode-kernel launch shape,
max_concurrency) through the server's own generator before the first request (real tiny
model, real server)."""

import httpx
import mlx.core as mx
import pytest

from conftest import TINY, omlx_env
from omlx_core.serve.engine import WARMUP_TOKENS, warm_up


def test_warm_up_decodes_one_and_the_widest_batch_and_leaves_the_generator_empty(tiny_home, monkeypatch):
    from mlx_lm.utils import load

    from omlx_core.serve.batch_generator import JoiningBatchGenerator, JoiningGenerationBatch

    model, _ = load(str(tiny_home / "models" / TINY))
    generator = JoiningBatchGenerator(model, completion_batch_size=6, prefill_batch_size=4)
    merges, filters = [], []
    extend, keep = JoiningGenerationBatch.extend, JoiningGenerationBatch.filter
    monkeypatch.setattr(JoiningGenerationBatch, "extend",
                        lambda batch, other: merges.append((len(batch.uids), len(other.uids))) or extend(batch, other))
    monkeypatch.setattr(JoiningGenerationBatch, "filter",
                        lambda batch, rows: filters.append((len(batch.uids), len(rows))) or keep(batch, rows))
    sizes = warm_up(generator, 6)
    assert {1, 6} <= sizes and max(sizes) == 6  # one sequence, max_running, and what lay between
    assert (3, 3) in merges  # half of the widest batch joined the other half decoding
    assert (6, 3) in filters  # and that half finished first

    (uid,) = generator.insert([[5, 6, 7]], max_tokens=[WARMUP_TOKENS + 2])
    seen = []
    for _ in range(20):
        _, responses = generator.next()
        seen += [r.uid for r in responses]
        if any(r.finish_reason for r in responses):
            break
    assert seen == [uid] * (WARMUP_TOKENS + 2)  # nothing of the warm-up is left to decode
    generator.close()
    mx.clear_cache()


@pytest.mark.parametrize("warmup", ["true", "false"])
def test_the_server_answers_with_warm_up_on_and_off(start_server, tiny_home, warmup):
    env = omlx_env(tiny_home, OMLX_SERVER_WARMUP=warmup)
    server = start_server(tiny_home, "--model", TINY, "--max-concurrency", "4", env=env)
    answer = httpx.post(server.url + "/v1/completions", timeout=120,
                        json={"model": TINY, "prompt": "hello", "max_tokens": 3, "ignore_eos": True})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 3
    metrics = httpx.get(server.url + "/metrics").text  # the warm-up's dummy tokens are not counted
    assert f'omlx_generation_tokens_total{{model="{TINY}"}} 3.0' in metrics
