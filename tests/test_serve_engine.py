"""The serve engine in-process (real tiny model, no HTTP): how admitted prompts are prefilled."""

import time

import pytest

from conftest import TINY
from omlx_core.memory.guard import MemoryGuard
from omlx_core.serve.engine import Engine
from omlx_core.serve.metrics import ServerMetrics
from omlx_core.serve.registry import ModelRegistry
from omlx_core.serve.request import Request
from omlx_core.serve.scheduler import Scheduler

PROMPTS = 4


def prefill_steps(home, prefill_batch: int, prefill_tokens: int = 4096, prompt_tokens: int = 4,
                  chunk_size: int = 2048) -> float:
    """Engine steps that prefilled, for PROMPTS requests queued before the engine starts
    (so all are admitted in its first pass)."""
    guard = MemoryGuard(total_bytes=64 * 2**30)
    registry = ModelRegistry(home, [TINY], guard, cli_settings={
        "server.prefill_batch": prefill_batch, "server.prefill_tokens": prefill_tokens,
        "prefill.chunk_size": chunk_size, "server.warmup": False})
    metrics = ServerMetrics()
    engine = Engine(registry, Scheduler(guard, max_running=PROMPTS, max_waiting=PROMPTS), guard, metrics)
    requests = [Request(TINY, [5 + i] * prompt_tokens, max_tokens=2, temperature=0.0) for i in range(PROMPTS)]
    for request in requests:
        engine.submit(request)
    engine.start()
    deadline = time.monotonic() + 120
    while any(r.finished_at is None for r in requests) and time.monotonic() < deadline:
        time.sleep(0.02)
    engine.stop()
    assert all(r.completion_tokens == 2 for r in requests)
    return metrics.registry.get_sample_value("omlx_engine_step_seconds_count", {"model": TINY, "phase": "prefill"})


# A group of prompts takes two steps in mlx-lm's generator: its prompts, then the split that
# starts their generation; the next group's prompts prefill in that second step.


@pytest.mark.parametrize("prefill_batch, groups", [(PROMPTS, 1), (1, PROMPTS)])
def test_admitted_prompts_prefill_server_prefill_batch_at_a_time(tiny_home, prefill_batch, groups):
    assert prefill_steps(tiny_home, prefill_batch) == groups + 1


@pytest.mark.parametrize("prefill_tokens, groups", [(64, 1), (32, 2), (16, 4)])
def test_a_prefill_step_holds_the_prompts_that_fit_server_prefill_tokens(tiny_home, prefill_tokens, groups):
    # Four 12-token prompts: 4 x 12 = 48 tokens fit 64, two (24) fit 32, one fits 16.
    assert prefill_steps(tiny_home, PROMPTS, prefill_tokens=prefill_tokens, prompt_tokens=12) == groups + 1


def test_the_step_budget_is_not_prefill_chunk_size(tiny_home):
    # A 16-token chunk with a 64-token budget: all four 12-token prompts in one step.
    assert prefill_steps(tiny_home, PROMPTS, prefill_tokens=64, prompt_tokens=12, chunk_size=16) == 2


def test_the_step_budget_is_twice_the_chunk_on_cuda_and_the_chunk_elsewhere_by_default():
    from omlx_core.serve.engine import prefill_tokens

    settings = {"server.prefill_tokens": 0, "prefill.chunk_size": 1024}
    assert prefill_tokens(settings, "cuda") == 2048
    assert prefill_tokens(settings, "metal") == prefill_tokens(settings, "cpu") == 1024
    assert prefill_tokens({**settings, "server.prefill_tokens": 300}, "cuda") == 300  # as set


def test_the_step_budget_shrinks_with_the_guards_chunk(tiny_home):
    guard = MemoryGuard(total_bytes=64 * 2**30)
    registry = ModelRegistry(tiny_home, [TINY], guard, cli_settings={
        "server.prefill_tokens": 4096, "prefill.chunk_size": 2048, "server.warmup": False})
    engine = Engine(registry, Scheduler(guard, max_running=2, max_waiting=2), guard, ServerMetrics())
    model = registry.get(TINY)
    engine._generator(model)  # resolves server.prefill_tokens with the generator
    assert engine._prefill_sizes(model) == (2048, 4096)
    guard.soft_bytes = -1  # over the soft watermark: the guard halves its chunk each step
    assert engine._prefill_sizes(model) == (1024, 2048)
    assert engine._prefill_sizes(model) == (512, 1024)


def test_a_slow_step_is_logged_with_its_shape(tiny_home, monkeypatch, caplog):
    from omlx_core.serve import engine

    monkeypatch.setattr(engine, "SLOW_STEP_S", 0.0)  # every step counts as slow
    with caplog.at_level("INFO", logger="omlx.serve"):
        prefill_steps(tiny_home, PROMPTS)
    lines = [r.getMessage() for r in caplog.records if "a step took" in r.getMessage()]
    assert any(f"0 sequences decoded, {PROMPTS} prompts prefilling" in line for line in lines), lines
    assert any(f"{PROMPTS} sequences decoded, 0 prompts prefilling" in line for line in lines), lines
    # Without a warm-up the split decodes PROMPTS sequences first; the steps after meet no new size.
    firsts = [line for line in lines if "first decode at batch size" in line]
    assert len(firsts) == 1 and f"first decode at batch size {PROMPTS})" in firsts[0], lines
    assert lines[-1].endswith("no decode batch size met first)"), lines
