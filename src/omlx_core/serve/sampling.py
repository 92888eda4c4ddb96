"""Per-request sampling and stop strings, so requests batched together stay independent."""

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p


def make_sampler(temperature: float, top_p: float, seed: int | None):
    """A sampler with its own PRNG key when seeded: same seed, same tokens, whatever the batch."""
    if temperature == 0:
        return lambda logprobs: mx.argmax(logprobs, axis=-1)
    key = mx.random.key(seed) if seed is not None else None

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        if 0 < top_p < 1:
            logprobs = apply_top_p(logprobs, top_p)
        scaled = logprobs * (1.0 / temperature)
        if key is None:
            return mx.random.categorical(scaled)
        key, draw = mx.random.split(key)
        return mx.random.categorical(scaled, key=draw)

    return sample


class StopText:
    """Cuts generated text at the first stop string, holding back a possible partial match."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text that is safe to emit now."""
        if self.stopped:
            return ""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.pending = self.pending[:cut], ""
            return out
        hold = max((k for s in self.stops for k in range(1, len(s))
                    if self.pending.endswith(s[:k])), default=0)
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
