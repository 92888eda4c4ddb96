"""The server's memory guard: admit a request only if its worst case fits.

Policy. The guard charges what is committed, not what the allocator shows right now:
weights per loaded model, each admitted request's reservation (its KV at prompt +
max_tokens, from `kv.worst_case_kv_bytes`), and named extra allocations that later
features register (e.g. "prefill.dense_dequant"). A request is charged the larger of its
reservation and the live KV the engine last reported for it, so an estimate that proves
low is still counted. Memory the allocator holds on to after freeing, or a transient
that has already passed, is phantom growth: it never refuses a request, and a request
that fits its reservation never fails later for lack of what others reserved.

- Hard watermark: `admit` refuses (`MemoryRefused`, HTTP 507) a request whose
  reservation would take committed bytes past it.
- Soft watermark: above it `over_soft()` is true, so the engine holds new requests back,
  and `prefill_chunk_size` halves the prefill chunk once per call (down to a floor),
  doubling it back toward the requested size once committed memory falls below it.

All methods take one lock: the engine thread and the HTTP handlers share a guard.
"""

import threading
from dataclasses import dataclass

from omlx_core.errors import InputError, OmlxError
from omlx_core.memory.capacity import total_memory_bytes, watermark_bytes
from omlx_core.units import format_bytes

DEFAULT_MIN_PREFILL_CHUNK = 256


class MemoryRefused(OmlxError):
    """A request whose worst-case KV would cross the hard watermark (HTTP 507)."""

    http_status = 507

    def __init__(self, request_id: str, needed: int, available: int, watermark: int):
        self.request_id = request_id
        self.needed = needed
        self.available = available
        self.watermark = watermark
        super().__init__(
            f"request {request_id} needs {format_bytes(needed)} of memory but only "
            f"{format_bytes(available)} is free below the hard watermark of "
            f"{format_bytes(watermark)}; shorten the prompt or max_tokens, wait for "
            f"running requests, or raise memory.hard_watermark"
        )


@dataclass(frozen=True)
class Admission:
    """A reservation the guard granted."""

    request_id: str
    model_id: str
    reserved_bytes: int
    committed_bytes: int  # everything committed once this was reserved
    over_soft: bool


@dataclass
class _Request:
    model_id: str
    reserved: int
    live: int = 0

    @property
    def charged(self) -> int:
        return max(self.reserved, self.live)


class MemoryGuard:
    """Accounts weights, per-request KV reservations and extras against watermarks."""

    def __init__(self, *, total_bytes: int | None = None,
                 soft_watermark: int | float | str = 0.80,
                 hard_watermark: int | float | str = 0.90,
                 min_prefill_chunk: int = DEFAULT_MIN_PREFILL_CHUNK):
        self.total_bytes = int(total_bytes) if total_bytes is not None else total_memory_bytes()
        self.soft_bytes = watermark_bytes(soft_watermark, self.total_bytes, "memory.soft_watermark")
        self.hard_bytes = watermark_bytes(hard_watermark, self.total_bytes, "memory.hard_watermark")
        if self.soft_bytes > self.hard_bytes:
            raise InputError(
                f"memory.soft_watermark ({format_bytes(self.soft_bytes)}) is above "
                f"memory.hard_watermark ({format_bytes(self.hard_bytes)}); lower the soft one"
            )
        if min_prefill_chunk < 1:
            raise InputError(f"min_prefill_chunk must be at least 1, not {min_prefill_chunk}")
        self.min_prefill_chunk = min_prefill_chunk
        self._lock = threading.Lock()
        self._weights: dict[str, int] = {}
        self._requests: dict[str, _Request] = {}
        self._extras: dict[str, int] = {}
        self._chunk: int | None = None  # the adapted prefill chunk; None = as requested

    # Weights and extras -----------------------------------------------------------

    def register_weights(self, model_id: str, nbytes: int) -> None:
        """Charge a loaded model's weights (see `weights.weights_bytes`)."""
        with self._lock:
            self._weights[model_id] = _non_negative(nbytes, f"weights of {model_id}")

    def release_weights(self, model_id: str) -> None:
        with self._lock:
            self._weights.pop(model_id, None)

    def register_extra(self, name: str, nbytes: int) -> None:
        """Charge a named allocation outside weights and KV; registering again replaces it."""
        with self._lock:
            self._extras[name] = _non_negative(nbytes, f"extra {name}")

    def release_extra(self, name: str) -> None:
        with self._lock:
            self._extras.pop(name, None)

    # Requests ---------------------------------------------------------------------

    def admit(self, request_id: str, model_id: str, worst_case_bytes: int) -> Admission:
        """Reserve a request's worst-case KV, or raise `MemoryRefused` if it cannot fit."""
        needed = _non_negative(worst_case_bytes, f"worst case of request {request_id}")
        with self._lock:
            if request_id in self._requests:
                raise InputError(f"request {request_id} is already admitted; release it first")
            committed = self._committed()
            available = max(0, self.hard_bytes - committed)
            if needed > available:
                raise MemoryRefused(request_id, needed, available, self.hard_bytes)
            self._requests[request_id] = _Request(model_id, needed)
            committed += needed
            return Admission(request_id, model_id, needed, committed, committed > self.soft_bytes)

    def record_kv(self, request_id: str, live_bytes: int) -> None:
        """The engine reports a running request's real KV (`kv.actual_kv_bytes`)."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is not None:
                request.live = _non_negative(live_bytes, f"KV of request {request_id}")

    def release(self, request_id: str) -> int:
        """Free a request's reservation; returns the bytes freed (0 if it held none)."""
        with self._lock:
            request = self._requests.pop(request_id, None)
            return request.charged if request else 0

    # Policy -----------------------------------------------------------------------

    def committed_bytes(self) -> int:
        with self._lock:
            return self._committed()

    def available_bytes(self) -> int:
        """What a new request could still reserve below the hard watermark."""
        with self._lock:
            return max(0, self.hard_bytes - self._committed())

    def over_soft(self) -> bool:
        with self._lock:
            return self._committed() > self.soft_bytes

    def prefill_chunk_size(self, requested: int) -> int:
        """The prefill chunk to use next: one adaptive step from the last one.

        Over the soft watermark it halves (not below min_prefill_chunk, nor above
        `requested`); under it, it doubles back until it reaches `requested`.
        """
        if requested < 1:
            raise InputError(f"prefill chunk must be at least 1 token, not {requested}")
        with self._lock:
            current = min(self._chunk or requested, requested)
            if self._committed() > self.soft_bytes:
                chunk = max(current // 2, min(self.min_prefill_chunk, requested))
            else:
                chunk = min(current * 2, requested)
            self._chunk = chunk
            return chunk

    def snapshot(self) -> dict:
        """The guard's state for /api/status; bytes throughout."""
        with self._lock:
            committed = self._committed()
            requests = {
                request_id: {"model": r.model_id, "reserved_bytes": r.reserved,
                             "live_bytes": r.live}
                for request_id, r in self._requests.items()
            }
            return {
                "total_bytes": self.total_bytes,
                "soft_watermark_bytes": self.soft_bytes,
                "hard_watermark_bytes": self.hard_bytes,
                "committed_bytes": committed,
                "available_bytes": max(0, self.hard_bytes - committed),
                "over_soft": committed > self.soft_bytes,
                "prefill_chunk": self._chunk,
                "weights": dict(self._weights),
                "weights_bytes": sum(self._weights.values()),
                "kv": {
                    "requests": requests,
                    "reserved_bytes": sum(r.reserved for r in self._requests.values()),
                    "live_bytes": sum(r.live for r in self._requests.values()),
                    "charged_bytes": sum(r.charged for r in self._requests.values()),
                },
                "extras": dict(self._extras),
                "extras_bytes": sum(self._extras.values()),
            }

    def _committed(self) -> int:
        return (sum(self._weights.values())
                + sum(r.charged for r in self._requests.values())
                + sum(self._extras.values()))


def _non_negative(nbytes: int, what: str) -> int:
    if isinstance(nbytes, bool) or int(nbytes) != nbytes or nbytes < 0:
        raise InputError(f"{what}: {nbytes!r} is not a byte count")
    return int(nbytes)
