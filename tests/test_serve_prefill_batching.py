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


def held_batching(wait_steps=3):
    """Two sequences decoding (inserted and through the prompt batch), then one new prompt."""
    batching = PrefillBatching(cap=32, wait_steps=wait_steps)
    batching.inserted(0, 128)
    batching.inserted(1, 128)
    batching.batch_size(chunk=2048, budget=2048)
    batching.stepped([response(0, 128, 128, end_of_prompt=True), response(1, 128, 128, end_of_prompt=True)])
    batching.inserted(2, 128)
    return batching


def test_a_prompt_waits_for_others_while_sequences_decode_and_slots_are_free():
    batching = held_batching(wait_steps=3)
    sizes = [batching.batch_size(chunk=2048, budget=2048, sequences=3, free=5) for _ in range(4)]
    assert sizes == [0, 0, 0, 1]  # held three steps, then prefilled alone


def test_prompts_that_arrive_while_one_waits_join_it():
    batching = held_batching(wait_steps=3)
    assert batching.batch_size(chunk=2048, budget=2048, sequences=3, free=5) == 0
    batching.inserted(3, 100)
    assert batching.batch_size(chunk=2048, budget=2048, sequences=4, free=4) == 0
    assert batching.batch_size(chunk=2048, budget=2048, sequences=4, free=4) == 0
    assert batching.batch_size(chunk=2048, budget=2048, sequences=4, free=4) == 2  # the oldest's wait is up


def test_no_wait_when_nothing_decodes_no_slot_is_free_or_the_budget_is_full():
    idle = PrefillBatching(cap=32, wait_steps=3)
    idle.inserted(0, 128)
    assert idle.batch_size(chunk=2048, budget=2048, sequences=1, free=7) == 1  # nothing decodes
    assert held_batching().batch_size(chunk=2048, budget=2048, sequences=3, free=0) == 1  # no prompt can join
    full = held_batching()
    full.inserted(3, 2000)
    assert full.batch_size(chunk=2048, budget=2048, sequences=4, free=4) == 1  # the next does not fit
    assert held_batching(wait_steps=0).batch_size(chunk=2048, budget=2048, sequences=3, free=5) == 1
