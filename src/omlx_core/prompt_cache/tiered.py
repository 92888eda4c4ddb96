"""The tiered prompt cache of one model: hot entries in memory, cold ones on SSD.

`lookup(prompt)` finds the longest cached prefix that can end a hit (every block's KV
present and, for models with fixed or rotating layers, a state snapshot at its last
block), reading missing entries from SSD into memory, and rebuilds a per-sequence cache
from it. A file that fails verification is dropped and the lookup tries again with what
is left, so a bad file costs a recompute, never an error. `store(tokens, cache)` keeps
the blocks of a cache that holds exactly `tokens` (the engine extracts it at a block
boundary): new entries go into memory (LRU within its budget) and to the writer queue.
"""

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx

from omlx_core.prompt_cache.chain import block_keys, cacheable_tokens
from omlx_core.prompt_cache.disk import DiskTier, entry_name
from omlx_core.prompt_cache.layout import CacheLayout, block_arrays, rebuild, snapshot
from omlx_core.prompt_cache.writer import WriteQueue

KV, STATE = "kv", "state"
log = logging.getLogger("omlx.prompt_cache")


@dataclass
class Hit:
    cache: list | None  # a per-sequence cache holding `tokens` tokens, or None on a miss
    tokens: int = 0
    memory_tokens: int = 0
    disk_tokens: int = 0


@dataclass
class _Entry:
    arrays: dict
    scalars: dict
    nbytes: int


class TieredPromptCache:
    def __init__(self, identity: str, layout: CacheLayout, block_tokens: int, memory_bytes: int,
                 disk: DiskTier | None = None, writer: WriteQueue | None = None):
        self.identity = identity
        self.layout = layout
        self.block_tokens = block_tokens
        self.memory_budget = memory_bytes
        self.disk = disk
        self.writer = writer
        self.memory_bytes = 0
        self.lookups = self.hits = self.prompt_tokens = 0
        self.memory_tokens = self.disk_tokens = 0
        self.stored_entries = 0
        self._memory: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()  # the engine thread works it; status reads it

    @property
    def enabled(self) -> bool:
        return self.layout.unsupported is None

    def boundary(self, prompt_tokens: int) -> int:
        """How many leading tokens of a prompt a lookup may serve and a store keeps (0: none)."""
        return cacheable_tokens(prompt_tokens, self.block_tokens) if self.enabled else 0

    # Lookup ---------------------------------------------------------------------------

    def lookup(self, prompt: list[int]) -> Hit:
        """The longest usable cached prefix of `prompt` (never all of it)."""
        if not self.enabled:
            return Hit(None)
        self.lookups += 1
        self.prompt_tokens += len(prompt)
        keys = block_keys(self.identity, prompt[:self.boundary(len(prompt))], self.block_tokens)
        while True:
            blocks = self._usable_blocks(keys)
            if not blocks:
                return Hit(None)
            try:
                loaded = self._load(keys[:blocks])
                if loaded is None:
                    continue  # a file failed verification and is gone: look again
                hit = self._rebuild(*loaded, blocks)
            except Exception:  # noqa: BLE001 - a cache that cannot be used is a miss, never an error
                log.exception("prompt cache: reusing %d blocks failed; prefilling instead", blocks)
                return Hit(None)
            self.hits += 1
            self.memory_tokens += hit.memory_tokens
            self.disk_tokens += hit.disk_tokens
            return hit

    def _present(self, name: str) -> bool:
        return name in self._memory or (self.disk is not None and name in self.disk)

    def _usable_blocks(self, keys: list[str]) -> int:
        """How many leading blocks a hit can cover, from the indexes alone (no I/O)."""
        usable = 0
        for i, key in enumerate(keys):
            if self.layout.sliced and not self._present(entry_name(key, KV)):
                break
            if not self.layout.snapshotted or self._present(entry_name(key, STATE)):
                usable = i + 1
        return usable

    def _load(self, keys: list[str]) -> tuple[dict[str, _Entry], set[str]] | None:
        names = [entry_name(key, KV) for key in keys] if self.layout.sliced else []
        if self.layout.snapshotted:
            names.append(entry_name(keys[-1], STATE))
        entries = {}
        with self._lock:
            for name in names:
                entry = self._memory.get(name)
                if entry is not None:
                    self._memory.move_to_end(name)
                    entries[name] = entry
        from_disk = [name for name in names if name not in entries]
        if from_disk:
            if self.disk is None:  # cannot happen: what is present is in memory or on disk
                raise RuntimeError(f"{from_disk[0]} is neither in memory nor on disk")
            read = self.disk.read_many(from_disk)
            for name, found in read.items():
                if found is not None:
                    arrays, metadata = found
                    entries[name] = _Entry(arrays, json.loads(metadata.get("scalars", "{}")),
                                           sum(a.nbytes for a in arrays.values()))
                    self._remember(name, entries[name])
            if len(entries) < len(names):
                return None  # a file was gone or corrupt; what was read stays in memory
        return {name: entries[name] for name in names}, set(from_disk)

    def _rebuild(self, entries: dict[str, _Entry], from_disk: set[str], blocks: int) -> Hit:
        kv = [entry for name, entry in entries.items() if name.endswith("." + KV)]
        state = next((entry for name, entry in entries.items() if name.endswith("." + STATE)), None)
        tokens = blocks * self.block_tokens
        cache = rebuild(self.layout, [e.arrays for e in kv],
                        (state.arrays, state.scalars) if state else None, tokens)
        if self.layout.sliced:
            disk_blocks = sum(1 for name in entries if name.endswith("." + KV) and name in from_disk)
        else:
            disk_blocks = blocks if from_disk else 0
        disk_tokens = disk_blocks * self.block_tokens
        return Hit(cache, tokens, tokens - disk_tokens, disk_tokens)

    # Store ----------------------------------------------------------------------------

    def store(self, tokens: list[int], cache: list) -> int:
        """Keep the whole blocks of `cache`, which holds exactly `tokens`; returns entries added."""
        if not self.enabled:
            return 0
        keys = block_keys(self.identity, tokens, self.block_tokens)
        if not keys or len(keys) * self.block_tokens != len(tokens):
            return 0  # a snapshot is only true at the block boundary it was taken at
        new: list[tuple[str, _Entry]] = []
        if self.layout.sliced:
            for i, key in enumerate(keys):
                name = entry_name(key, KV)
                if not self._present(name):
                    start = i * self.block_tokens
                    arrays = block_arrays(cache, self.layout, start, start + self.block_tokens)
                    new.append((name, _Entry(arrays, {}, 0)))
        if self.layout.snapshotted:
            name = entry_name(keys[-1], STATE)
            if not self._present(name):
                arrays, scalars = snapshot(cache, self.layout)
                new.append((name, _Entry(arrays, scalars, 0)))
        mx.eval([a for _, entry in new for a in entry.arrays.values()])
        for name, entry in new:
            entry.nbytes = sum(a.nbytes for a in entry.arrays.values())
            self._remember(name, entry)
            if self.writer is not None:
                self.writer.offer(name, entry.arrays, {"scalars": json.dumps(entry.scalars)})
        self.stored_entries += len(new)
        return len(new)

    def _remember(self, name: str, entry: _Entry) -> None:
        """Put an entry in the memory tier, evicting least recently used ones over budget."""
        with self._lock:
            if name in self._memory:
                return
            self._memory[name] = entry
            self.memory_bytes += entry.nbytes
            while self.memory_bytes > self.memory_budget and self._memory:
                _, old = self._memory.popitem(last=False)
                self.memory_bytes -= old.nbytes

    # Housekeeping ---------------------------------------------------------------------

    def held_bytes(self) -> int:
        """Memory the cache holds: its memory tier and pending writes not also in it."""
        with self._lock:
            held = self.memory_bytes
            names = set(self._memory)
        return held + (self.writer.bytes_outside(names) if self.writer else 0)

    def drop_memory(self) -> int:
        """Empty the memory tier (the guard needs room); SSD entries stay. Returns bytes freed."""
        with self._lock:
            freed, self.memory_bytes = self.memory_bytes, 0
            self._memory.clear()
        return freed

    def clear(self) -> int:
        """Forget everything, in memory, pending and on SSD; returns the bytes freed."""
        freed = self.drop_memory()
        if self.writer is not None:
            with self.writer.paused():
                self.writer.discard()
                freed += self.disk.clear()
        elif self.disk is not None:
            freed += self.disk.clear()
        return freed

    def close(self, timeout: float | None = 30.0) -> None:
        if self.writer is not None:
            self.writer.close(timeout)

    def stats(self) -> dict:
        looked = max(1, self.prompt_tokens)
        stats = {
            "enabled": self.enabled, "unsupported": self.layout.unsupported,
            "identity": self.identity, "block_tokens": self.block_tokens,
            "lookups": self.lookups, "hits": self.hits, "prompt_tokens": self.prompt_tokens,
            "hit_tokens": {"memory": self.memory_tokens, "disk": self.disk_tokens},
            "hit_rate": {"memory": self.memory_tokens / looked, "disk": self.disk_tokens / looked},
            "stored_entries": self.stored_entries,
            "memory": {"bytes": self.memory_bytes, "budget_bytes": self.memory_budget,
                       "entries": len(self._memory)},
            "disk": None, "writer": None,
        }
        if self.disk is not None:
            stats["disk"] = {"directory": str(self.disk.directory), "bytes": self.disk.nbytes,
                             "cap_bytes": self.disk.cap_bytes, "files": self.disk.files,
                             "corrupt_files": self.disk.corrupt_files,
                             "evicted_files": self.disk.evicted_files}
        if self.writer is not None:
            w = self.writer
            stats["writer"] = {"pending_entries": w.depth, "pending_bytes": w.pending_bytes,
                               "max_bytes": w.max_bytes, "min_entries": w.min_entries,
                               "max_entries": w.max_entries, "written": w.written,
                               "dropped": w.dropped, "failed": w.failed,
                               "peak_pending_bytes": w.peak_pending_bytes}
        return stats


def open_prompt_cache(model, checkpoint, fingerprint: str, home, settings,
                      total_memory: int) -> TieredPromptCache:
    """A model's prompt cache as its settings ask: memory tier, SSD tier and writer queue."""
    import shutil

    from omlx_core.memory.capacity import watermark_bytes
    from omlx_core.prompt_cache.identity import cache_dir, cache_identity
    from omlx_core.prompt_cache.layout import cache_layout

    layout = cache_layout(model)
    if not settings["prompt_cache.enabled"]:
        layout = CacheLayout(layout.classes, "disabled by prompt_cache.enabled")
    identity = cache_identity(checkpoint, fingerprint)
    memory = watermark_bytes(settings["prompt_cache.memory_bytes"], total_memory,
                             "prompt_cache.memory_bytes")
    disk = writer = None
    if layout.unsupported is None and settings["prompt_cache.disk"]:
        directory = cache_dir(home, identity)
        directory.mkdir(parents=True, exist_ok=True)
        cap = watermark_bytes(settings["prompt_cache.disk_bytes"],
                              shutil.disk_usage(directory).total, "prompt_cache.disk_bytes")
        disk = DiskTier(directory, identity, cap)
        writer = WriteQueue(disk, watermark_bytes(settings["prompt_cache.writer_memory"], total_memory,
                                                  "prompt_cache.writer_memory"),
                            settings["prompt_cache.writer_min_blocks"],
                            settings["prompt_cache.writer_max_blocks"])
    return TieredPromptCache(identity, layout, int(settings["prompt_cache.block_tokens"]), memory,
                             disk, writer)
