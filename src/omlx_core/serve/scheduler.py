"""Admission: a bounded FIFO wait queue, a cap on running requests, and the memory guard.

A request waits while `server.max_concurrency` requests run, or while committed memory is
above the soft watermark and something is running. Its worst case KV (prompt +
max_tokens) is reserved with the memory guard before it runs; when the guard refuses and
nothing else is running (so nothing will free memory), it is refused with 507. FIFO: a
request that does not fit yet holds the head of the queue, so big requests are not starved.
"""

import threading
from collections import deque
from collections.abc import Callable

from omlx_core.memory.guard import MemoryRefused
from omlx_core.serve.errors import queue_full
from omlx_core.serve.request import Request, Status

RETRY_AFTER_S = 1


class Scheduler:
    def __init__(self, guard, max_running: int, max_waiting: int):
        self.guard = guard
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self.lock = threading.Lock()
        self.queue_rejections = 0

    def submit(self, request: Request) -> None:
        """Queue a request or raise APIError 503 (queue full)."""
        with self.lock:
            free_slots = max(0, self.max_running - len(self.running))
            if len(self.waiting) >= self.max_waiting + free_slots:
                self.queue_rejections += 1
                raise queue_full(len(self.waiting), self.max_waiting, RETRY_AFTER_S)
            self.waiting.append(request)

    def admit(self, kv_bytes: Callable[[Request], int],
              make_room: Callable[[Request], bool] = lambda request: False,
              ) -> tuple[list[Request], list[tuple[Request, Exception | None]]]:
        """Move what fits from waiting to running; returns (admitted, refused).

        `kv_bytes` gives a request's worst-case KV on its model (loading the model if
        need be); `make_room(request)` is asked to free memory (drop caches, evict an idle
        model) before a request is refused. A refusal is a `MemoryRefused`, another error
        (its model failed to load), or None when the request was cancelled while waiting.
        """
        admitted, refused = [], []
        with self.lock:
            if any(request.cancelled for request in self.waiting):
                refused += [(request, None) for request in self.waiting if request.cancelled]
                self.waiting = deque(request for request in self.waiting if not request.cancelled)
            while self.waiting and len(self.running) < self.max_running:
                if self.running and self.guard.over_soft():
                    break  # above the soft watermark new work waits for running work
                request = self.waiting[0]
                try:
                    self.guard.admit(request.id, request.model_id, kv_bytes(request))
                except MemoryRefused as refusal:
                    if make_room(request):
                        continue
                    if self.running:
                        break  # wait for running requests to free their KV
                    self.waiting.popleft()
                    refused.append((request, refusal))
                    continue
                except Exception as error:  # noqa: BLE001 - e.g. its model failed to load
                    self.waiting.popleft()
                    refused.append((request, error))
                    continue
                self.waiting.popleft()
                request.status = Status.RUNNING
                self.running[request.id] = request
                admitted.append(request)
        return admitted, refused

    def finish(self, request: Request) -> None:
        with self.lock:
            if self.running.pop(request.id, None) is not None:
                self.guard.release(request.id)
            elif request in self.waiting:
                self.waiting.remove(request)
            request.status = Status.FINISHED

    def counts_by_model(self) -> dict[str, tuple[int, int]]:
        """model id -> (running, waiting)."""
        with self.lock:
            counts: dict[str, list[int]] = {}
            for request in self.running.values():
                counts.setdefault(request.model_id, [0, 0])[0] += 1
            for request in self.waiting:
                counts.setdefault(request.model_id, [0, 0])[1] += 1
            return {model: (r, w) for model, (r, w) in counts.items()}

    def counts(self) -> dict:
        with self.lock:
            return {"running": len(self.running), "waiting": len(self.waiting),
                    "max_running": self.max_running, "max_waiting": self.max_waiting,
                    "queue_rejections": self.queue_rejections}
