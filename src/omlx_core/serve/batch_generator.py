"""mlx-lm's BatchGenerator, with each prompt's last token decoded by the running batch's step.

Why: mlx-lm prefills a prompt but its last token, then, in the step after, decodes that
token in a forward of its own (the prompts that finished together, a few rows through the
whole model) before it merges them into the running batch. On a GPU a decode forward costs
nearly the same for 2 rows as for 32, so every admission paid about one more decode step
that every running stream waited for: on an H100, 16 prompts took 18-21 ms beside a step of
8-11 ms (docs/benchmarks/admission-h100-qwen3-8b-shape-phases.json).

Here the finished prompts join the running batch at the start of that step, their last
token as their next input, and the step's one forward decodes them with everyone else. A
joined row reports nothing for that step (its input was a prompt token); its first token
comes out in the step after, the same step as in mlx-lm. Only the order within a step and
that one forward change: prompt processing, sampling and stop handling are mlx-lm's.

A merge (and a filter, when sequences finish) makes new cache buffers. They are evaluated
at once, in a submission of their own, and handed to sdpa_decode's in-place append
(`own_buffers`), so the step after decodes as every steady step does (the same ops, so
the same cached CUDA graphs), not with the copies and mlx-lm's cache update in its midst.

And MLX's buffer cache is kept after a prefill chunk and at every 512th decode step, up to
a bound (`CachedPromptBatch`, `kept_cache_bytes`), where mlx-lm empties it.

Nothing here reads an array back while a step is queued but the step's own tokens: a filter
reads the left padding once, from arrays already evaluated (`filter_caches`), and a step
splits no log-probabilities per row and takes no finished row's cache out (omlx reports and
reads neither). In mlx-lm each of those is a read per layer or an array per row: on a GPU,
a wait for the queued step, so the host builds the next one while the GPU idles.
"""

import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache, TokenBuffer

from omlx_core.kernels.sdpa_decode import own_buffers


def settle(caches: list) -> None:
    """Evaluate the batch caches' buffers that a merge or filter just made (async, as a
    submission of their own) and let the next step append to them in place."""
    batched = [c for c in caches if isinstance(c, BatchKVCache) and c.keys is not None]
    mx.async_eval([a for c in batched for a in (c.keys, c.values, c.offset, c.left_padding)])
    for cache in batched:
        own_buffers(cache)


def filter_caches(caches: list, keep: list[int]) -> bool:
    """Keep the rows `keep` of a batch's layer caches, as each cache's own `filter` does, but
    with the left padding read back once for all BatchKVCache layers (every layer of a batch
    holds the same), from the array as it stood, not from the gathered one. True where the
    BatchKVCache layers now hold whole new arrays (rows gathered, no shift of the padding
    slicing them into views): what `settle` may hand to the in-place append.

    Why: BatchKVCache.filter reads each layer's gathered left padding back to shift it. On a
    GPU the first read waits for the decode step already queued behind it, and the layers'
    reads follow one by one (36 round trips on a Qwen3-8B), while the step after waits to be
    built: every filter (a sequence finished) and every split of the prompt batch cost a
    pipelined step. Other caches filter themselves."""
    batched = [c for c in caches if type(c) is BatchKVCache]
    for cache in caches:
        if type(cache) is not BatchKVCache:
            cache.filter(keep)
    if not batched:
        return False
    shift = min(batched[0].left_padding.tolist()[i] for i in keep)
    rows = None if keep == list(range(batched[0].offset.shape[0])) else mx.array(keep)  # None: every row stays
    for cache in batched:
        if rows is not None:
            if cache.keys is not None:
                cache.keys, cache.values = cache.keys[rows], cache.values[rows]
            cache.offset, cache.left_padding = cache.offset[rows], cache.left_padding[rows]
        if shift > 0:
            if cache.keys is not None:
                cache.keys, cache.values = cache.keys[..., shift:, :], cache.values[..., shift:, :]
            cache._idx -= shift
            cache.left_padding = cache.left_padding - shift
    mx.async_eval([a for c in batched for a in (c.offset, c.left_padding)])  # ready for the next filter's read
    return rows is not None and shift == 0


class FilterOnce:
    """A prompt or generation batch whose `filter` filters its caches with `filter_caches`
    (and returns what it does)."""

    def filter(self, keep: list[int]) -> bool:
        caches, self.prompt_cache = self.prompt_cache, []
        super().filter(keep)  # every list of rows but the caches
        if not keep:
            return False
        self.prompt_cache = caches
        return filter_caches(caches, keep)


def kept_cache_bytes(total_bytes: int) -> int:
    """How much of MLX's buffer cache a prefill keeps: a sixteenth of the memory (5 GB of an
    H100's 80). That holds what the measured admissions reuse (a decode step's buffers, a
    merge of 32 short sequences' caches), not a long prefill's activations for ever."""
    return total_bytes // 16


def _no_clear() -> None:
    """mx.clear_cache while CachedPromptBatch.prompt runs."""


class CachedPromptBatch(FilterOnce, PromptProcessingBatch):
    """mlx-lm's prompt batch, but MLX's buffer cache is emptied after a prefill only where
    it holds more than `kept_bytes`, not after every chunk.

    Why: on CUDA emptying it frees every cached buffer, and the steps after allocate them
    all again. On an H100, with 16 prompts admitted beside 16 running, keeping it took the
    prefill step from 87 to 79 ms, the step that joins them from 52 to 35 ms and the decode
    steps after from 14.5 to 12 ms (docs/benchmarks/admission-h100-qwen3-8b-shape-joining.json)."""

    kept_bytes = 0

    def prompt(self, tokens) -> None:
        if not tokens:
            return
        clear = mx.clear_cache
        mx.clear_cache = _no_clear  # what mlx-lm's prompt calls (the engine thread is MLX's only caller)
        try:
            super().prompt(tokens)
        finally:
            mx.clear_cache = clear
        if mx.get_cache_memory() > self.kept_bytes:
            mx.clear_cache()


class JoiningGenerationBatch(FilterOnce, GenerationBatch):
    """A GenerationBatch whose rows may have a prompt's last token as their next input
    (`_joining`): a step decodes that token into the cache and `tokens` like any other
    input, but reports nothing for it and does not count it as generated."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._joining = [False] * len(self.uids)

    @classmethod
    def joining(cls, prompts: PromptProcessingBatch, last_tokens: list[int]) -> "JoiningGenerationBatch":
        """The prompts of `prompts` (prefilled but their last token) as rows whose next
        input is that token: no forward here, unlike `PromptProcessingBatch.generate`."""
        batch = cls.empty(prompts.model, prompts.fallback_sampler)
        count = len(prompts.uids)
        batch.uids = list(prompts.uids)
        batch.prompt_cache = prompts.prompt_cache
        batch.tokens = list(prompts.tokens)
        batch.samplers = list(prompts.samplers)
        batch.logits_processors = list(prompts.logits_processors)
        batch.stop_sequences = list(prompts.stop_sequences)
        batch.max_tokens = list(prompts.max_tokens)
        batch._next_tokens = mx.array(last_tokens, dtype=mx.uint32)
        batch._next_logprobs = [None] * count  # omlx reports no logprobs (see _step)
        batch._token_context = [TokenBuffer(t) for t in batch.tokens]
        batch._num_tokens = [0] * count
        batch._matchers = [s.matcher() for s in batch.stop_sequences]
        batch._joining = [True] * count
        return batch

    def extend(self, batch) -> None:
        merged = bool(self.prompt_cache) and bool(batch.prompt_cache)  # else one side's arrays, as they were
        super().extend(batch)
        self._joining.extend(getattr(batch, "_joining", [False] * len(batch.uids)))
        if merged:
            settle(self.prompt_cache)

    def filter(self, keep: list[int]) -> bool:
        fresh = super().filter(keep)
        self._joining = [self._joining[i] for i in keep]
        if fresh:  # rows gathered into whole new arrays (not the arrays it had, nor views of them)
            settle(self.prompt_cache)
        return fresh

    def _step(self) -> tuple[list[int], list]:
        """GenerationBatch._step without the rows' log-probabilities split apart (omlx's API
        reports none, and the split made an array per row each step, 32 at 32 streams, for
        the host to build and MLX to evaluate); with logits processors, mlx-lm's own."""
        if any(self.logits_processors):
            return super()._step()
        inputs = self._current_tokens = self._next_tokens
        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        samplers = [s or self.fallback_sampler for s in self.samplers or [None] * len(self.uids)]
        if all(s is samplers[0] for s in samplers):
            sampled = samplers[0](logprobs)
        else:
            sampled = mx.concatenate([s(logprobs[e:e + 1]) for e, s in enumerate(samplers)], axis=0)
        self._next_tokens = sampled
        mx.async_eval(sampled)  # the next step's tokens, computed while this step's are read
        tokens = inputs.tolist()
        for row, token in zip(self.tokens, tokens):
            row.append(token)
        self._current_logprobs = self._next_logprobs = [None] * len(tokens)  # mx.eval skips None
        return tokens, self._current_logprobs

    def next(self) -> list:
        """GenerationBatch.next, but a joining row's step gives no response, and a finished
        row's response no cache (omlx never reads it, and taking it out read every layer's
        left padding back: on a GPU, a wait for the queued step and a round trip a layer)."""
        if not self.uids:
            return []
        joining, self._joining = self._joining, [False] * len(self.uids)
        tokens, logprobs = self._step()
        keep, responses = [], []
        for i, uid in enumerate(self.uids):
            if joining[i]:
                keep.append(i)
                continue
            self._num_tokens[i] += 1
            finish_reason = "length" if self._num_tokens[i] >= self.max_tokens[i] else None
            if self._matchers[i].advance(tokens[i]):
                finish_reason = "stop"
            finished = finish_reason is not None
            if not finished:
                keep.append(i)
            responses.append(self.Response(
                uid=uid, token=tokens[i], logprobs=logprobs[i], finish_reason=finish_reason,
                prompt_cache=None, all_tokens=self.tokens[i] if finished else None))
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses


class JoiningBatchGenerator(BatchGenerator):
    """BatchGenerator whose step joins the prompts left with their last token to the
    running batch before it decodes, and which keeps up to `kept_cache_bytes` of MLX's
    buffer cache (see the module docstring). `decoded_rows`: rows the last step's
    decode forward ran, joined rows included; `prefilled_tokens`: prompt tokens it prefilled."""

    def __init__(self, model, kept_cache_bytes: int = 0, **kwargs):
        super().__init__(model, **kwargs)
        self._generation_batch = JoiningGenerationBatch.empty(self.model, self.sampler)
        self._prompt_batch = CachedPromptBatch.empty(self.model, self.sampler, prefill_step_size=self.prefill_step_size)
        self._prompt_batch.kept_bytes = kept_cache_bytes
        self.decoded_rows = self.prefilled_tokens = 0

    def _next(self):
        generation = self._generation_batch
        self.prefilled_tokens = 0
        if len(generation) >= self.completion_batch_size:  # hands full: decode only, as mlx-lm
            return [], self._decode()
        n = min(self.prefill_batch_size - len(self._prompt_batch),
                self.completion_batch_size - len(generation), len(self._unprocessed_sequences))
        if n > 0:
            self._prompt_batch.extend(self._make_batch(n))
        finished = [i for i, (segments, _, _) in enumerate(self._currently_processing)
                    if len(segments) == 1 and len(segments[0]) == 1]
        prompt_responses = self._join(finished) if finished else []
        generation_responses = self._decode()
        return prompt_responses + self._prefill_chunks(), generation_responses

    def _decode(self) -> list:
        """The running batch's step (joined rows included), counted as mlx-lm counts it."""
        generation = self._generation_batch
        self.decoded_rows = len(generation)
        if not self.decoded_rows:
            return []
        started = time.perf_counter()
        responses = generation.next()
        self._counters.decode_time += time.perf_counter() - started
        self._counters.generation_tokens += len(responses)
        self._counters.generation_steps += 1
        if self._counters.generation_steps % 512 == 0 and mx.get_cache_memory() > self._prompt_batch.kept_bytes:
            mx.clear_cache()  # mlx-lm's, every 512 steps; but as a prefill does, only above the kept bytes
        return responses

    def _join(self, finished: list[int]) -> list:
        """Move the prompts at `finished` (their last token all that is left) to the running batch."""
        last_tokens = [self._currently_processing[i][0][0][0] for i in finished]
        totals = [self._currently_processing[i][2] for i in finished]
        self._currently_processing = [p for i, p in enumerate(self._currently_processing) if i not in finished]
        joining = JoiningGenerationBatch.joining(self._prompt_batch.split(finished), last_tokens)
        self._generation_batch.extend(joining)
        return [PromptProcessingBatch.Response(uid, (total, total), True, True)
                for uid, total in zip(joining.uids, totals)]

    def _prefill_chunks(self) -> list:
        """The next chunk of each prompt in the prompt batch, prefilled in one forward (as
        mlx-lm's step does)."""
        responses, chunks = [], []
        for uid, processing in zip(self._prompt_batch.uids, self._currently_processing):
            segments = processing[0]
            chunk = segments[0][:self.prefill_step_size]
            segments[0] = segments[0][len(chunk):]
            end_of_segment = not segments[0]
            if end_of_segment:
                segments.pop(0)
            processing[1] += len(chunk)
            chunks.append(chunk)
            responses.append(PromptProcessingBatch.Response(uid, (processing[1], processing[2]), end_of_segment, False))
        self.prefilled_tokens = sum(len(c) for c in chunks)
        self._counters.prompt_tokens += self.prefilled_tokens
        started = time.perf_counter()
        self._prompt_batch.prompt(chunks)
        self._counters.prompt_time += time.perf_counter() - started
        return responses
