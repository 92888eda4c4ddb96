"""How a model's per-sequence cache is cut into blocks and put back together.

A full-attention `KVCache` layer can be cut at any token: a block stores its rows, and
a prefix is the blocks' rows concatenated. Layers whose state is fixed or rotating
(gated-delta and SSM `ArraysCache`, sliding-window `RotatingKVCache`) cannot be rebuilt
from later blocks, so their whole state is snapshotted at the block that ends a stored
prefix, and only such a block can end a hit. A model with any other cache class is not
cached at all, and says why.
"""

from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_cache

SNAPSHOT_CLASSES = ("ArraysCache", "RotatingKVCache")


@dataclass(frozen=True)
class CacheLayout:
    classes: tuple[str, ...]  # the cache class of each layer, in the model's order
    unsupported: str | None = None  # why this model's cache cannot be stored, if it cannot

    @property
    def sliced(self) -> tuple[int, ...]:
        return tuple(i for i, name in enumerate(self.classes) if name == "KVCache")

    @property
    def snapshotted(self) -> tuple[int, ...]:
        return tuple(i for i, name in enumerate(self.classes) if name in SNAPSHOT_CLASSES)


def cache_layout(model) -> CacheLayout:
    classes = tuple(type(entry).__name__ for entry in mlx_cache.make_prompt_cache(model))
    others = sorted(set(classes) - {"KVCache", *SNAPSHOT_CLASSES})
    reason = f"cache class {', '.join(others)} cannot be stored in blocks" if others else None
    return CacheLayout(classes, reason)


def block_arrays(cache: list, layout: CacheLayout, start: int, end: int) -> dict[str, mx.array]:
    """The KV rows [start, end) of every full-attention layer, as owned copies."""
    arrays = {}
    for i in layout.sliced:
        arrays[f"{i}.keys"] = mx.contiguous(cache[i].keys[..., start:end, :])
        arrays[f"{i}.values"] = mx.contiguous(cache[i].values[..., start:end, :])
    return arrays


def snapshot(cache: list, layout: CacheLayout) -> tuple[dict[str, mx.array], dict]:
    """The whole state of each fixed or rotating layer: arrays, and the scalars beside them."""
    arrays, scalars = {}, {}
    for i in layout.snapshotted:
        for path, leaf in tree_flatten(cache[i].state):
            name = f"{i}.{path}"
            if isinstance(leaf, mx.array):
                arrays[name] = mx.contiguous(leaf)
            else:
                scalars[name] = leaf
    return arrays, scalars


def rebuild(layout: CacheLayout, blocks: list[dict], state: tuple[dict, dict] | None,
            tokens: int) -> list:
    """A per-sequence cache holding `tokens` tokens, from their blocks and the end snapshot."""
    cache = []
    for i, name in enumerate(layout.classes):
        if name == "KVCache":
            entry = mlx_cache.KVCache()
            entry.keys = mx.concatenate([block[f"{i}.keys"] for block in blocks], axis=2)
            entry.values = mx.concatenate([block[f"{i}.values"] for block in blocks], axis=2)
            entry.offset = tokens
        else:
            arrays, scalars = state
            prefix = f"{i}."
            leaves = [(k[len(prefix):], v) for k, v in {**arrays, **scalars}.items()
                      if k.startswith(prefix)]
            entry = getattr(mlx_cache, name).from_state(_unflatten(leaves))
        cache.append(entry)
    return cache


def _unflatten(leaves: list[tuple[str, object]]):
    """A cache's state from flattened leaves, sorted by position (tree_flatten's order)."""
    def order(item):
        return [int(part) if part.isdigit() else part for part in item[0].split(".")]
    return tuple(tree_unflatten(sorted(leaves, key=order)))
