"""A bounded background queue that writes cache entries to the SSD tier.

Generation never waits for a disk: the engine hands an entry over and goes on. The queue
holds at most `max_bytes` of pending entries (a share of RAM) and between `min_entries`
and `max_entries` of them: below the floor an entry is always taken, so even a block
larger than the byte bound is written; past the bounds a new entry is dropped and
counted, never queued without limit. The entry's arrays are already evaluated, so the
writer thread only copies bytes out.
"""

import contextlib
import logging
import threading
from collections import deque
from dataclasses import dataclass

log = logging.getLogger("omlx.prompt_cache")


@dataclass
class _Pending:
    name: str
    arrays: dict
    header: dict
    nbytes: int


class WriteQueue:
    def __init__(self, disk, max_bytes: int, min_entries: int, max_entries: int):
        self.disk = disk
        self.max_bytes = max_bytes
        self.min_entries = min_entries
        self.max_entries = max(min_entries, max_entries)
        self.dropped = 0
        self.written = 0
        self.failed = 0
        self.pending_bytes = 0
        self.peak_pending_bytes = 0
        self._queue: deque[_Pending] = deque()
        self._names: set[str] = set()
        self._cond = threading.Condition()
        self._paused = False
        self._closed = False
        self._busy = False
        self._writing: _Pending | None = None
        self._thread = threading.Thread(target=self._run, name="omlx-cache-writer", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        with self._cond:
            return len(self._queue)

    def pending(self, name: str) -> bool:
        with self._cond:
            return name in self._names

    def bytes_outside(self, held) -> int:
        """Pending bytes of entries not in `held` (the memory tier), so none is charged twice."""
        with self._cond:
            entries = [*self._queue, *([self._writing] if self._writing else [])]
            return sum(e.nbytes for e in entries if e.name not in held)

    def offer(self, name: str, arrays: dict, header: dict) -> bool:
        """Queue an entry for writing; False (and counted) when the queue is full."""
        nbytes = sum(a.nbytes for a in arrays.values())
        with self._cond:
            if self._closed or name in self._names:
                return False
            count = len(self._queue)
            fits = count < self.min_entries or (
                count < self.max_entries and self.pending_bytes + nbytes <= self.max_bytes)
            if not fits:
                self.dropped += 1
                return False
            self._queue.append(_Pending(name, arrays, header, nbytes))
            self._names.add(name)
            self.pending_bytes += nbytes
            self.peak_pending_bytes = max(self.peak_pending_bytes, self.pending_bytes)
            self._cond.notify()
            return True

    @contextlib.contextmanager
    def paused(self):
        """Hold writes (the current one finishes first), e.g. while the cache is cleared."""
        with self._cond:
            self._paused = True
            while self._busy:
                self._cond.wait()
        try:
            yield self
        finally:
            with self._cond:
                self._paused = False
                self._cond.notify_all()

    def discard(self) -> None:
        """Drop everything pending (the cache was cleared)."""
        with self._cond:
            for entry in self._queue:
                self._names.discard(entry.name)
                self.pending_bytes -= entry.nbytes
            self._queue.clear()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued has been written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Take no more entries; write what is pending, waiting up to `timeout` (None: not at all)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if timeout is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or (self._queue and not self._paused))
                if self._closed and (not self._queue or self._paused):
                    return
                entry = self._writing = self._queue.popleft()
                self._busy = True
            try:
                self.disk.write(entry.name, entry.arrays, entry.header)
                self.written += 1
            except Exception as error:  # noqa: BLE001 - a failed write loses a cache entry, nothing more
                self.failed += 1
                log.warning("prompt cache: writing %s failed: %s", entry.name, error)
            with self._cond:
                self._busy = False
                self._writing = None
                self._names.discard(entry.name)
                self.pending_bytes -= entry.nbytes
                self._cond.notify_all()
