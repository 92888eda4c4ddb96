"""One generation request's explicit state, shared by the HTTP handler and the engine thread.

The handler creates it and reads events from `events`; the engine thread advances it and
hands its events to the event loop through an `Outbox` (thread-safe, one call per pass). `cancel()` is how a client that went
away frees its slot: the engine sees the flag on its next step.
"""

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass, field
from enum import Enum

_ids = itertools.count(1)


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Started:
    """Admitted: the request holds a slot and its memory reservation."""

    cached_tokens: int  # prompt tokens taken from the prefix cache


@dataclass
class Delta:
    text: str
    tokens: int  # generated so far


@dataclass
class Finished:
    reason: str  # stop | length | cancelled | error
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    error: Exception | None = None


@dataclass
class Request:
    model_id: str
    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    loop: asyncio.AbstractEventLoop | None = None
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    status: Status = Status.WAITING
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class Outbox:
    """Events the engine thread makes in one pass, handed to the event loop in one call.

    Why: one `call_soon_threadsafe` per token per request wakes the loop that often (32
    times a decode step at 32 streams), and each wake-up's Python runs against the engine
    thread's for the GIL. Events keep their order; a request without a loop (no event
    loop waits on it) gets its events at once."""

    def __init__(self):
        self._pending: list[tuple[Request, object]] = []

    def add(self, request: Request, event) -> None:
        if request.loop is None:
            request.events.put_nowait(event)
        else:
            self._pending.append((request, event))

    def flush(self) -> None:
        if not self._pending:
            return
        by_loop: dict = {}
        for request, event in self._pending:
            by_loop.setdefault(request.loop, []).append((request, event))
        self._pending = []
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: list) -> None:
    for request, event in items:
        request.events.put_nowait(event)
