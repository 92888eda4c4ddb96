"""What one benchmark runs: context lengths, generated tokens, batch, repeats and prompts.

Prompts are synthetic token ids drawn uniformly from the model's ordinary vocabulary
(special tokens such as BOS, EOS and chat markers left out, since they change what a
model does), from a seeded generator: the same seed gives the same prompts on any
machine, so two runs, two branches or two settings see identical work.
"""

from dataclasses import asdict, dataclass

import numpy as np

from omlx_core.errors import InputError

DEFAULT_SEED = 0


@dataclass(frozen=True)
class Workload:
    ctx: tuple[int, ...]  # prompt lengths in tokens, one measurement each
    gen: int = 128  # tokens generated per sequence, exactly
    batch: int = 1  # sequences run together
    repeats: int = 3  # measured runs per context length and variant
    warmup: int = 1  # discarded runs before them
    seed: int = DEFAULT_SEED

    def __post_init__(self):
        if not self.ctx:
            raise InputError("--ctx: give at least one context length, e.g. 4k")
        for length in self.ctx:
            if length < 1:
                raise InputError(f"--ctx: {length} is not a context length; use 1 or more tokens")
        for name, value, least in (("--gen", self.gen, 1), ("--batch", self.batch, 1),
                                   ("--repeats", self.repeats, 1), ("--warmup", self.warmup, 0)):
            if value < least:
                raise InputError(f"{name}: {value} is too small; use {least} or more")

    def as_dict(self) -> dict:
        document = asdict(self)
        document["ctx"] = list(self.ctx)
        return document


def special_token_ids(tokenizer) -> set[int]:
    """Ids a synthetic prompt must not contain: specials, added special tokens, EOS."""
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", True):
            special.add(int(token_id))
    special.update(getattr(tokenizer, "eos_token_ids", None) or [])
    return special


def ordinary_token_ids(tokenizer, vocab_size: int) -> np.ndarray:
    """Token ids that are real vocabulary: below both the model's and the tokenizer's size."""
    limit = min(int(vocab_size), len(tokenizer))
    excluded = special_token_ids(tokenizer)
    ids = np.array([i for i in range(limit) if i not in excluded], dtype=np.int64)
    if ids.size == 0:
        raise InputError("the tokenizer has no ordinary tokens to build a prompt from")
    return ids


def synthetic_prompts(vocabulary: np.ndarray, length: int, batch: int, seed: int) -> np.ndarray:
    """A (batch, length) array of token ids, the same for the same seed, length and batch."""
    rng = np.random.default_rng([seed, length, batch])
    return vocabulary[rng.integers(0, vocabulary.size, (batch, length))]
