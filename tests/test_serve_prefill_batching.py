"""PrefillBatching: the prompts of the next prefill step, from mlx-lm's prompt responses."""

from types import SimpleNamespace

from omlx_core.serve.prefill_batching import PrefillBatching


def response(uid, done, total, end_of_prompt=False):
    return SimpleNamespace(uid=uid, progress=(done, total), end_of_prompt=end_of_prompt)


def test_waiting_prompts_join_while_prompts_times_longest_chunk_fit_the_budget():
    batching = PrefillBatching(cap=32)
    for uid, tokens in enumerate([100, 120, 300, 50]):
        batching.inserted(uid, tokens)
    # 100 and 120 pad to 2 x 120 = 240; the 300 (chunked to 256) makes it 3 x 256, then 4 x 256.
    assert batching.batch_size(chunk=256, budget=200) == 1
    assert batching.batch_size(chunk=256, budget=512) == 2
    assert batching.batch_size(chunk=256, budget=1024) == 4


def test_the_cap_bounds_the_batch():
    batching = PrefillBatching(cap=3)
    for uid in range(8):
        batching.inserted(uid, 10)
    assert batching.batch_size(chunk=2048, budget=2048) == 3


def test_a_long_prompt_in_the_batch_keeps_short_ones_out_until_it_ends():
    batching = PrefillBatching(cap=32)
    batching.inserted(0, 5000)
    batching.inserted(1, 10)
    assert batching.batch_size(chunk=2048, budget=2048) == 1
    batching.stepped([response(0, 2048, 5000)])
    assert batching.batch_size(chunk=2048, budget=2048) == 1  # 2 x 2048 > 2048
    batching.stepped([response(0, 4096, 5000)])
    assert batching.batch_size(chunk=2048, budget=2048) == 2  # 904 left: 2 x 904 fits
    batching.stepped([response(0, 5000, 5000, end_of_prompt=True), response(1, 9, 10)])
    assert batching.batch_size(chunk=2048, budget=2048) == 1  # 1 is in the batch, nothing waits


def test_prompts_about_to_generate_take_a_slot_but_no_prefill():
    batching = PrefillBatching(cap=32)
    for uid in range(32):
        batching.inserted(uid, 128)
    assert batching.batch_size(chunk=2048, budget=2048) == 16  # 16 x 128
    batching.stepped([response(uid, 127, 128) for uid in range(16)])  # one token left: they split next
    assert batching.batch_size(chunk=2048, budget=2048) == 16 + 16


def test_removed_prompts_leave_the_count():
    batching = PrefillBatching(cap=32)
    for uid in range(4):
        batching.inserted(uid, 600)
    batching.stepped([response(0, 512, 600)])
    batching.removed([0, 1])
    assert batching.batch_size(chunk=2048, budget=1200) == 2  # 2 and 3: 2 x 600
