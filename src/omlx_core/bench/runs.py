"""One timed generation run: a prompt of exactly N tokens, then exactly G new tokens.

`run_generation` is omlx's loop; it has the shape of mlx-lm's `generate_step` (prompt in
`chunk_size` pieces with the cache evaluated after each, the last prompt token together
with the first sample, then one token per step with the next step queued before the
current one is read) but takes a whole batch of equal-length prompts at once and never
stops early: EOS is masked out of the logits, so the model keeps producing ordinary
tokens and the count is exact. It counts what it feeds and what it gets back, rather
than trusting the arguments, so a test can check the work really was N and G tokens.

`run_mlx_lm` runs stock `mlx_lm.generate.stream_generate` (or `batch_generate` for a
batch) with its default settings, for the `--baseline mlx-lm` ratio.

Timings: TTFT runs from the first prompt token fed to the first generated token read
back; decode from that first token to the last. Prefill tok/s = batch x prompt / TTFT,
as mlx-lm reports it; decode tok/s = batch x (G - 1) / decode time, the steps actually
timed (mlx-lm divides G by the same interval, 1/G higher).
"""

import copy
import math
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from omlx_core.bench.memory import PeakMemory


@dataclass(frozen=True)
class Measurement:
    batch: int
    prompt_tokens: int  # per sequence, as fed to the model
    generated_tokens: int  # per sequence, as read back
    ttft_s: float
    decode_s: float
    e2e_s: float
    peak_mlx_memory_bytes: int
    peak_rss_bytes: int
    cache_tokens: int | None = None  # the KV cache's own count afterwards, when it keeps one
    token_ids: tuple[tuple[int, ...], ...] = ()  # what each sequence generated (omlx's loop)

    @property
    def prefill_tps(self) -> float:
        return self.batch * self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else math.nan

    @property
    def decode_tps(self) -> float:
        steps = self.generated_tokens - 1
        return self.batch * steps / self.decode_s if steps > 0 and self.decode_s > 0 else math.nan

    def metrics(self) -> dict[str, float]:
        return {
            "prefill_tps": self.prefill_tps,
            "ttft_s": self.ttft_s,
            "decode_tps": self.decode_tps,
            "e2e_s": self.e2e_s,
            "peak_mlx_memory_bytes": float(self.peak_mlx_memory_bytes),
            "peak_rss_bytes": float(self.peak_rss_bytes),
        }


def _eos_mask(width: int, suppress: set[int]) -> mx.array:
    mask = np.zeros((width,), dtype=np.float32)
    ids = [i for i in suppress if 0 <= i < width]
    mask[ids] = -np.inf
    return mx.array(mask)


def _cache_tokens(cache) -> int | None:
    offset = getattr(cache[0], "offset", None) if cache else None
    return int(offset) if isinstance(offset, int) else None


def run_generation(model, prompts: np.ndarray, gen: int, chunk_size: int,
                   suppress: set[int], memory: PeakMemory | None = None) -> Measurement:
    """Prefill `prompts` (batch, length) in `chunk_size` pieces, then decode `gen` tokens."""
    from mlx_lm.generate import generation_stream
    from mlx_lm.models.cache import make_prompt_cache

    memory = memory or PeakMemory()
    batch, length = prompts.shape
    tokens = mx.array(prompts.astype(np.int32))
    cache = make_prompt_cache(model)
    mask = None

    def step(inputs: mx.array) -> mx.array:
        nonlocal mask
        logits = model(inputs, cache=cache)[:, -1, :]
        if mask is None:
            mask = _eos_mask(logits.shape[-1], suppress)
        return mx.argmax(logits + mask, axis=-1)

    memory.start()
    fed = 0
    produced: list[list[int]] = []
    with mx.stream(generation_stream):
        start = time.perf_counter()
        while length - fed > 1:
            n = min(chunk_size, length - fed - 1)
            model(tokens[:, fed:fed + n], cache=cache)
            mx.eval([c.state for c in cache])
            fed += n
            mx.clear_cache()
        y = step(tokens[:, fed:])
        fed = length
        mx.async_eval(y)
        for i in range(gen):
            if i + 1 < gen:
                next_y = step(y[:, None])
                mx.async_eval(next_y)
            produced.append(y.tolist())
            if i == 0:
                first = time.perf_counter()
            if i % 256 == 0:
                mx.clear_cache()
            if i + 1 < gen:
                y = next_y
        last = time.perf_counter()
    if any(len(row) != batch for row in produced):
        raise RuntimeError("the model returned a different batch size than it was given")
    return Measurement(
        batch=batch, prompt_tokens=fed, generated_tokens=len(produced),
        ttft_s=first - start, decode_s=last - first, e2e_s=last - start,
        peak_mlx_memory_bytes=memory.mlx_bytes(), peak_rss_bytes=memory.rss_bytes(),
        cache_tokens=_cache_tokens(cache),
        token_ids=tuple(zip(*produced)),
    )


def _never_stopping(tokenizer):
    """A copy of the tokenizer with no EOS ids, so mlx-lm generates exactly max_tokens."""
    quiet = copy.copy(tokenizer)
    quiet.eos_token_ids = set()
    return quiet


def run_mlx_lm(model, tokenizer, prompts: np.ndarray, gen: int,
               memory: PeakMemory | None = None) -> Measurement:
    """Stock mlx-lm, default settings: `stream_generate` for one sequence, else `batch_generate`."""
    from mlx_lm.generate import batch_generate, stream_generate

    memory = memory or PeakMemory()
    batch, length = prompts.shape
    tokenizer = _never_stopping(tokenizer)
    memory.start()
    if batch == 1:
        start = time.perf_counter()
        first = None
        response = None
        for response in stream_generate(model, tokenizer, mx.array(prompts[0].astype(np.int32)),
                                        max_tokens=gen):
            if first is None:
                first = time.perf_counter()
        last = time.perf_counter()
        return Measurement(
            batch=1, prompt_tokens=response.prompt_tokens, generated_tokens=response.generation_tokens,
            ttft_s=first - start, decode_s=last - first, e2e_s=last - start,
            peak_mlx_memory_bytes=memory.mlx_bytes(), peak_rss_bytes=memory.rss_bytes(),
        )
    start = time.perf_counter()
    result = batch_generate(model, tokenizer, prompts.astype(np.int32).tolist(), max_tokens=gen)
    last = time.perf_counter()
    stats = result.stats
    # batch_generate hands back no per-token times: its prompt time stands in for TTFT
    # and its decode time for the decode interval.
    # Its prompt counter leaves out the last prompt token, which it feeds with the first
    # decode step; the whole prompt was processed all the same.
    return Measurement(
        batch=batch, prompt_tokens=length,
        generated_tokens=stats.generation_tokens // batch,
        ttft_s=stats.prompt_time, decode_s=stats.decode_time, e2e_s=last - start,
        peak_mlx_memory_bytes=memory.mlx_bytes(), peak_rss_bytes=memory.rss_bytes(),
    )
