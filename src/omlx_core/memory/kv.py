"""What a model's KV cache costs per sequence, by the kind of cache each layer keeps.

Layers keep very different state: a full-attention `KVCache` grows with every token, a
`RotatingKVCache` stops growing at its window, the `ArraysCache` of a gated-delta or SSM
layer holds a constant state, a `QuantizedKVCache` stores packed values plus scales and
biases, and some models bring a cache class of their own. So a profile records, per
layer, the kind and the bytes that follow from it, and an estimate adds them up.

The numbers come from real shapes, not from config arithmetic: `kv_profile` builds the
model's own cache, runs a short forward pass and reads the arrays it made. The pass stays
lazy (shapes are known without computing values), so profiling even a large model is
cheap. `KVCache` allocates 256 rows at a time, so per-token cost is taken from one row
of each array (its non-sequence dims times the dtype size), never from a difference of
padded `nbytes`. A cache class we do not know is measured twice, at two lengths past any
window it advertises, and fitted with a line.
"""

import math
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

FULL = "full"            # grows by bytes_per_token with every token
QUANTIZED = "quantized"  # a full cache stored packed, scales and biases included
ROTATING = "rotating"    # grows until it holds `window` tokens
FIXED = "fixed"          # constant state per sequence (gated-delta, SSM, unused caches)
COMPOSITE = "composite"  # a CacheList: the sum of its parts
MEASURED = "measured"    # a cache class of the model's own: fixed_bytes + a per-token line

KINDS = (FULL, QUANTIZED, ROTATING, FIXED, COMPOSITE, MEASURED)

PROBE_TOKENS = 8
# Probe lengths for unknown caches are multiples of this, so pooled caches (a latent
# per 2, 4, ... tokens) are measured at whole groups.
_PROBE_QUANTUM = 32
_WINDOW_ATTRIBUTES = ("window_size", "max_size", "sliding_window", "chunk_size")


@dataclass(frozen=True)
class LayerKV:
    """The KV cost of one cache entry of the model, per sequence.

    bytes_per_token is per retained row; a composite's lies in its parts, and a pooled
    (measured) cache's can be a fraction. window: the rows a rotating cache keeps.
    """

    kind: str
    cache_type: str
    bytes_per_token: float = 0.0
    window: int | None = None
    fixed_bytes: int = 0
    step: int | None = None  # rows the cache allocates at a time, if it pads
    parts: tuple["LayerKV", ...] = ()

    def bytes_for(self, tokens: int, prefill_chunk: int | None = None,
                  slack: bool = False) -> float:
        """Bytes this layer holds for one sequence of `tokens` tokens."""
        if self.kind == COMPOSITE:
            return self.fixed_bytes + sum(p.bytes_for(tokens, prefill_chunk, slack)
                                          for p in self.parts)
        rows = tokens
        if self.kind == ROTATING:
            # Decoding keeps `window` rows; a prefill chunk of C is appended before the
            # oldest rows are dropped, so during prefill up to window + C rows coexist.
            held = self.window + (prefill_chunk or 0)
            rows = min(tokens, held)
            if slack and self.step:
                rows = min(rows + self.step - 1, max(rows, self.window))
        elif self.kind in (FULL, QUANTIZED) and slack and self.step:
            # Growth allocates whole steps, so up to step - 1 rows sit unused.
            rows = tokens + self.step - 1
        elif self.kind == FIXED:
            rows = 0
        return self.fixed_bytes + self.bytes_per_token * rows

    @property
    def grows(self) -> bool:
        """Whether this layer's cost keeps rising with the sequence, past any window."""
        if self.kind == COMPOSITE:
            return any(p.grows for p in self.parts)
        return self.kind in (FULL, QUANTIZED, MEASURED) and self.bytes_per_token > 0


@dataclass(frozen=True)
class KVProfile:
    """Per-layer KV costs of one model, in the order of its cache list."""

    layers: tuple[LayerKV, ...]

    @property
    def bytes_per_token(self) -> float:
        """What one more token costs once every window is full: only layers that grow."""
        return sum(_unbounded_per_token(layer) for layer in self.layers)

    @property
    def fixed_bytes(self) -> int:
        """Constant state per sequence (gated-delta / SSM layers and the like)."""
        return sum(_fixed(layer) for layer in self.layers)

    def kinds(self) -> list[str]:
        return [layer.kind for layer in self.layers]

    def to_dict(self) -> dict:
        return {
            "bytes_per_token": self.bytes_per_token,
            "fixed_bytes": self.fixed_bytes,
            "layers": [asdict(layer) for layer in self.layers],
        }


def _unbounded_per_token(layer: LayerKV) -> float:
    if layer.kind == COMPOSITE:
        return sum(_unbounded_per_token(p) for p in layer.parts)
    return layer.bytes_per_token if layer.grows else 0.0


def _fixed(layer: LayerKV) -> int:
    return layer.fixed_bytes + sum(_fixed(p) for p in layer.parts)


def estimate_kv_bytes(profile: KVProfile, tokens: int, batch: int = 1, *,
                      prefill_chunk: int | None = None, slack: bool = False) -> int:
    """Bytes the KV cache holds for `batch` sequences of `tokens` tokens each.

    prefill_chunk: the prompt is prefilled in chunks of this many tokens; windowed layers
    then briefly hold window + chunk rows. Leave None for the steady (decoding) size.
    slack: include the rows padded caches allocate ahead (less than one step per layer),
    an upper bound on their real `nbytes`. A batch is charged as `batch` sequences of the
    longest length, which is what left-padded batch caches hold.
    """
    per_sequence = sum(layer.bytes_for(tokens, prefill_chunk, slack) for layer in profile.layers)
    return math.ceil(per_sequence * batch)


def worst_case_kv_bytes(profile: KVProfile, prompt_tokens: int, max_tokens: int, *,
                        prefill_chunk: int | None = None) -> int:
    """What admitting a request reserves: its KV at prompt + max_tokens, padding included."""
    return estimate_kv_bytes(profile, prompt_tokens + max_tokens,
                             prefill_chunk=prefill_chunk, slack=True)


def actual_kv_bytes(cache: list[Any]) -> int:
    """The real bytes a prompt cache holds now, padding included (what it allocated)."""
    return sum(entry.nbytes for entry in cache)


def kv_profile(model, *, kv_bits: int | None = None, kv_group_size: int = 64) -> KVProfile:
    """Profile the cache `model.make_cache()` (or mlx-lm's default) builds for `model`.

    kv_bits: profile full-attention layers as mlx-lm's quantized KV cache of that many
    bits (what `kv_bits` in generation converts them to); other kinds keep their own.
    mlx-lm converts only after `quantized_kv_start` tokens, so a shorter sequence holds
    the full-precision size (`kv_profile(model)` without kv_bits).

    It runs the model, so call it once after loading, before an engine thread uses it.
    """
    cache = _probed_cache(model, PROBE_TOKENS)
    if kv_bits is not None:
        cache = [entry.to_quantized(group_size=kv_group_size, bits=kv_bits)
                 if type(entry) is KVCache and not entry.empty() else entry
                 for entry in cache]
    layers = [_known_layer(entry) for entry in cache]
    unknown = [i for i, layer in enumerate(layers) if layer is None]
    if unknown:
        window = max([_advertised_window(cache[i]) for i in unknown] + [0])
        short = _PROBE_QUANTUM * (window // _PROBE_QUANTUM + 1)
        at_short = _probed_cache(model, short)
        at_long = _probed_cache(model, 2 * short)
        for i in unknown:
            layers[i] = _measured_layer(at_short[i], at_long[i], short)
    return KVProfile(tuple(layers))


def _probed_cache(model, tokens: int) -> list[Any]:
    """The model's cache after a forward pass over `tokens` tokens (left lazy)."""
    cache = make_prompt_cache(model)
    model(mx.zeros((1, tokens), dtype=mx.int32), cache=cache)
    return cache


def _row_bytes(arrays) -> float:
    """Bytes of one sequence position of arrays shaped (batch, ..., sequence, dim)."""
    return sum(a.nbytes / (a.shape[0] * a.shape[-2]) for a in arrays)


def _known_layer(entry) -> LayerKV | None:
    """The cost of a cache of a class mlx-lm defines, from its arrays; None if unknown."""
    name = type(entry).__name__
    if isinstance(entry, CacheList):
        parts = [_known_layer(part) for part in entry.caches]
        if any(part is None for part in parts):
            return None
        return LayerKV(COMPOSITE, name, parts=tuple(parts))
    if isinstance(entry, ArraysCache):
        arrays = [a for a in entry.cache if a is not None]
        batch = arrays[0].shape[0] if arrays else 1
        return LayerKV(FIXED, name, fixed_bytes=sum(a.nbytes for a in arrays) // batch)
    if not isinstance(entry, (KVCache, QuantizedKVCache, RotatingKVCache,
                              ChunkedKVCache, ConcatenateKVCache)):
        return None
    if entry.keys is None:
        return LayerKV(FIXED, name)  # the model never writes to this one
    if isinstance(entry, QuantizedKVCache):
        per_token = _row_bytes((*entry.keys, *entry.values))
        return LayerKV(QUANTIZED, name, per_token, step=entry.step)
    per_token = _row_bytes((entry.keys, entry.values))
    if isinstance(entry, RotatingKVCache):
        return LayerKV(ROTATING, name, per_token, window=entry.max_size, step=entry.step)
    if isinstance(entry, ChunkedKVCache):
        return LayerKV(ROTATING, name, per_token, window=entry.chunk_size, step=entry.step)
    return LayerKV(FULL, name, per_token, step=getattr(entry, "step", None))


def _advertised_window(entry) -> int:
    """The largest window-like size an unknown cache carries, so probes reach past it."""
    sizes = [getattr(entry, attribute, None) for attribute in _WINDOW_ATTRIBUTES]
    return max([size for size in sizes if isinstance(size, int)] + [0])


def _measured_layer(at_short, at_long, short: int) -> LayerKV:
    """Fit fixed + per-token bytes through an unknown cache's sizes at short and 2*short.

    Past its windows such a cache grows linearly (a bounded part is constant, a pooled
    part grows by a row per group); before them the fit overestimates, the safe side.
    """
    per_token = max(0.0, (at_long.nbytes - at_short.nbytes) / short)
    fixed = max(0, at_short.nbytes - math.floor(per_token * short))
    kind = MEASURED if per_token or fixed else FIXED
    return LayerKV(kind, type(at_short).__name__, per_token, fixed_bytes=fixed)
