"""How many admitted prompts join the next prefill step: as many as fit a token budget.

mlx-lm's `BatchGenerator` prefills its prompt batch together, right-padded to the longest
chunk, and takes up to `prefill_batch_size` waiting prompts into it. A fixed count is wrong
both ways: a forward's fixed cost is most of a short prompt's (on an H100 8 prompts of 128
tokens take 39 ms, 32 take 102: docs/benchmarks/admission-h100-qwen3-8b-shape.json), so 32
streams that arrive together wait four steps of 8 for their first token, while eight
2,048-token chunks make one step of 16k tokens that holds every running stream (and needs
activations the memory guard never sized). Like vLLM's per-step token budget, this sizes
the batch before each step so that (prompts it prefills) x (longest chunk) stays within
the budget (`server.prefill_tokens`, scaled down with the chunk the guard allows), with at
least one prompt. On CUDA the budget is twice the chunk by default: on an H100, 32 streams
of 128-token prompts served 1.19x and 1.12x the tokens a second with a budget of 4096 as
with 2048 (fewer, fuller prefill steps:
docs/benchmarks/serve-h100-qwen3-8b-shape-32-streams-prefill-tokens.json).
"""

from collections import OrderedDict


class PrefillBatching:
    """Tracks one generator's prompts, waiting and in its prompt batch, by tokens left."""

    def __init__(self, cap: int):
        self.cap = cap  # server.prefill_batch: at most this many prompts in one step
        self._waiting: OrderedDict[int, int] = OrderedDict()  # uid -> prompt tokens, in insert order
        self._prefilling: dict[int, int] = {}  # uid -> prompt tokens not yet prefilled

    def inserted(self, uid: int, tokens: int) -> None:
        self._waiting[uid] = tokens

    def removed(self, uids) -> None:
        for uid in uids:
            self._waiting.pop(uid, None)
            self._prefilling.pop(uid, None)

    def stepped(self, prompt_responses) -> None:
        """Follow mlx-lm's prompt responses: a prompt in them is in the prompt batch, with
        `progress` = (tokens done, tokens in all); `end_of_prompt` moves it to generation."""
        for response in prompt_responses:
            self._waiting.pop(response.uid, None)
            if response.end_of_prompt:
                self._prefilling.pop(response.uid, None)
            else:
                done, total = response.progress
                self._prefilling[response.uid] = total - done

    def batch_size(self, chunk: int, budget: int) -> int:
        """The `prefill_batch_size` for the next step: the prompt batch as it stands plus
        the waiting prompts, in order, while the prompts the step prefills, times their
        longest chunk, fit the budget. A prompt with one token left only moves to generation
        in that step (mlx-lm splits it off before it prefills), so it takes a slot of the
        batch but no prefill."""
        staying = [min(left, chunk) for left in self._prefilling.values() if left > 1]
        rows, width, joining = len(staying), max(staying, default=0), 0
        for tokens in self._waiting.values():
            wider = max(width, min(tokens, chunk))
            if rows >= self.cap or (rows and (rows + 1) * wider > budget):
                break
            rows, width, joining = rows + 1, wider, joining + 1
        return max(len(self._prefilling) + joining, 1)
