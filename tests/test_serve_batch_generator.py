"""The serve engine's JoiningBatchGenerator against mlx-lm's BatchGenerator: the same tokens
for every sequence, in the same steps, with one forward fewer per admission (real tiny
model, greedy, prompts admitted while others decode)."""

import mlx.core as mx
import pytest

from conftest import TINY
from omlx_core.serve.batch_generator import JoiningBatchGenerator

# (step at which they are inserted, prompts as segments, max_tokens): prompts of several
# lengths join while others decode; one has a single token, one two segments (as a prompt
# cached up to a block boundary is inserted), one stops at its first token.
ARRIVALS = [
    (0, [[[3, 4, 5, 6, 7]], [[8, 9]], [[10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]], [9, 6, 12]),
    (3, [[[21]], [[22, 23, 24], [25, 26, 27, 28]]], [7, 5]),
    (5, [[[30, 31, 32, 33]], [[40, 41, 42, 43, 44, 45]]], [1, 8]),
]


class CountingModel:
    """The model, counting its forwards (what a generator calls per step)."""

    def __init__(self, model):
        self.model, self.forwards = model, 0

    def __call__(self, *args, **kwargs):
        self.forwards += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def run(generator_class, model) -> tuple[dict, dict, list]:
    """Each sequence's tokens and the step of its first, by arrival order, and the
    forwards of each step."""
    counting = CountingModel(model)
    generator = generator_class(counting, completion_batch_size=8, prefill_batch_size=4, prefill_step_size=4)
    tokens, first_step, forwards, order = {}, {}, [], []
    pending = list(ARRIVALS)
    try:
        for step in range(60):
            while pending and pending[0][0] == step:
                _, segments, max_tokens = pending.pop(0)
                order += generator.insert_segments(segments, max_tokens=max_tokens)
            before = counting.forwards
            _, responses = generator.next()
            forwards.append(counting.forwards - before)
            for response in responses:
                tokens.setdefault(response.uid, []).append(response.token)
                first_step.setdefault(response.uid, step)
            if not pending and len(tokens) == len(order) and all(
                    len(tokens[u]) == m for u, m in zip(order, [m for _, _, ms in ARRIVALS for m in ms])):
                break
    finally:
        generator.close()
        mx.clear_cache()
    return ({i: tokens.get(u) for i, u in enumerate(order)}, {i: first_step.get(u) for i, u in enumerate(order)},
            forwards)


@pytest.fixture(scope="module")
def model(tiny_home):
    from mlx_lm.utils import load

    return load(str(tiny_home / "models" / TINY))[0]


def test_joining_generator_gives_mlx_lms_tokens_in_the_same_steps_with_fewer_forwards(model):
    from mlx_lm.generate import BatchGenerator

    ours, ours_first, ours_forwards = run(JoiningBatchGenerator, model)
    theirs, theirs_first, theirs_forwards = run(BatchGenerator, model)
    lengths = [m for _, _, ms in ARRIVALS for m in ms]
    assert [len(ours[i] or []) for i in range(len(lengths))] == lengths  # every sequence ran to max_tokens
    assert ours == theirs
    assert ours_first == theirs_first
    # mlx-lm decodes each group of finished prompts in a forward of its own; here the
    # running batch's forward takes them: one forward fewer per group (four groups).
    assert sum(theirs_forwards) - sum(ours_forwards) == 4
    assert max(ours_forwards) <= 2  # at most one decode and one prefill forward a step


def test_a_joined_row_removed_before_its_first_token_leaves_the_others_decoding(model):
    generator = JoiningBatchGenerator(model, completion_batch_size=8, prefill_batch_size=4, prefill_step_size=8)
    try:
        running, dropped = generator.insert([[3, 4, 5], [6, 7, 8, 9]], max_tokens=[6, 6])
        generator.next()  # both prefilled but their last token
        generator.next()  # both joined; their last tokens decoded, nothing reported
        generator.remove([dropped])
        seen = []
        for _ in range(10):
            _, responses = generator.next()
            seen += [r.uid for r in responses]
        assert seen == [running] * 6
    finally:
        generator.close()
        mx.clear_cache()


def test_after_a_join_or_a_finish_the_next_step_appends_in_place_mocked_cuda(monkeypatch):
    """With sdpa_decode installed (its kernels mocked: no CUDA here), the caches a merge or a
    filter makes are written in place from the next step on: mlx-lm's cache update runs only
    in the first decode step of a cache no merge made, and the tokens are the stock model's."""
    from mlx_lm.generate import BatchGenerator
    from test_sdpa_decode import mock_attention, tiny_model, write_rows_on_cpu

    from omlx_core.kernels import sdpa_decode

    model = tiny_model("qwen3")
    stock, _, _ = run(BatchGenerator, model)
    mock_attention(monkeypatch, [])
    sdpa_decode.install(model)
    appends, in_place = [], []
    append = sdpa_decode.append
    monkeypatch.setattr(sdpa_decode, "append", lambda cache, *a: appends.append(cache._idx) or append(cache, *a))
    monkeypatch.setattr(sdpa_decode, "write_rows", lambda *a: in_place.append(a[4]) or write_rows_on_cpu(*a))
    ours, _, forwards = run(JoiningBatchGenerator, model)
    assert ours == stock
    layers = len(model.layers)
    # mlx-lm's update twice a layer: the first decode step (the first prompts' cache, made
    # by no merge) and a one-token prefill chunk (the two-segment prompt's); every other
    # step in place, through 3 merges and 6 filters (without own_buffers, 8 times a layer)
    assert len(appends) >= 14 * layers
    assert len(appends) - len(in_place) == 2 * layers


@pytest.mark.parametrize("kept", [0, 1 << 40])
def test_mlxs_buffer_cache_is_emptied_only_above_the_kept_bytes(model, monkeypatch, kept):
    """mlx-lm empties MLX's buffer cache after every prefill chunk and every 512 decode
    steps; the generator here once after a prefill step at most, and at the 512th decode
    step, only where the cache holds more than `kept_cache_bytes`."""
    from mlx_lm.generate import BatchGenerator

    def clears(generator_class, **kwargs) -> list[int]:
        """Each step's clear_cache calls: two prompts of 10 and 7 tokens, prefilled 4 at a
        time (3 prefill steps), then two decode steps, the second counted as the 512th."""
        cleared = []
        monkeypatch.setattr(mx, "clear_cache", lambda: cleared.append(1))
        generator = generator_class(model, prefill_batch_size=4, prefill_step_size=4, **kwargs)
        steps = []
        try:
            generator.insert([list(range(3, 13)), list(range(20, 27))], max_tokens=[3, 3])
            for step in range(5):
                if step == 4:  # the 512th decode step, where mlx-lm empties the cache once more
                    generator._counters.generation_steps = 511
                before = len(cleared)
                generator.next()
                steps.append(len(cleared) - before)
        finally:
            generator.close()
            monkeypatch.undo()
        return steps

    theirs = clears(BatchGenerator)  # mlx-lm: after each chunk and after a padded batch's finalize
    assert theirs[1] == 2 and min(theirs[:3]) >= 1 and theirs[4] == 1
    assert clears(JoiningBatchGenerator, kept_cache_bytes=kept) == ([1, 1, 1, 0, 1] if kept == 0 else [0] * 5)


@pytest.mark.parametrize("padding, keep", [
    ([3, 1, 0, 2], [0, 2, 3]),  # a kept row unpadded: no shift
    ([3, 1, 0, 2], [1, 3]),  # the padding shrinks by 1: every layer shifted
    ([3, 1, 0, 2], [2]),
    ([3, 1, 1, 2], [0, 1, 2, 3]),  # every row stays (no gather), the padding still shifts
])
def test_filter_caches_leaves_what_batch_kv_caches_own_filter_leaves(padding, keep):
    """filter_caches reads the left padding once for all layers; each layer must end as
    mlx-lm's BatchKVCache.filter leaves it (rows, shifted padding, offsets, write position)."""
    from mlx_lm.models.cache import BatchKVCache

    from omlx_core.serve.batch_generator import filter_caches

    def layers(count: int = 3) -> list:
        caches = []
        for layer in range(count):
            cache = BatchKVCache(list(padding))  # four left-padded prompts
            keys = mx.random.normal((4, 2, 7, 8), key=mx.random.key(layer))
            cache.update_and_fetch(keys, keys * 2)
            caches.append(cache)
        return caches

    ours, theirs = layers(), layers()
    filter_caches(ours, list(keep))
    for cache in theirs:
        cache.filter(list(keep))
    for mine, stock in zip(ours, theirs):
        assert mine._idx == stock._idx
        for name in ("keys", "values", "offset", "left_padding"):
            assert mx.array_equal(getattr(mine, name), getattr(stock, name)).item(), name
    assert theirs[0]._idx == 7 - min(padding[i] for i in keep)  # mlx-lm's shift, as the case says
