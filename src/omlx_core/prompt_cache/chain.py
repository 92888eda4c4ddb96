"""Block keys: a hash chain over fixed-size token blocks, rooted at the model's identity.

A block's key covers its own tokens and, through its parent's key, every token before
it, so equal keys mean equal prefixes of the same model, and a lookup walks the chain
block by block. Only whole blocks are keyed; a prompt's last token is never cached, so
a prompt that is all cache hit still has one token to prefill for its logits.
"""

import hashlib
from array import array


def block_keys(identity: str, tokens: list[int], block_tokens: int) -> list[str]:
    """The keys of the whole blocks in `tokens`, in order."""
    keys, parent = [], identity
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        digest = hashlib.sha256(parent.encode())
        digest.update(array("q", tokens[start:start + block_tokens]).tobytes())
        parent = digest.hexdigest()[:32]
        keys.append(parent)
    return keys


def cacheable_tokens(prompt_tokens: int, block_tokens: int) -> int:
    """How many leading tokens of a prompt may come from (or go to) the cache."""
    return max(0, (prompt_tokens - 1) // block_tokens * block_tokens)
