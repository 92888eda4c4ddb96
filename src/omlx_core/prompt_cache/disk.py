"""The SSD tier: one safetensors file per cache entry, verified on read, LRU within a cap.

An entry is a block's KV rows (`<key>.kv.safetensors`) or the snapshot of fixed and
rotating layers at the block that ends a prefix (`<key>.state.safetensors`). The header
carries the format, the model identity, the block key, the kind and a CRC-32 of the
arrays; a read checks all of them, and a file that fails (truncated, flipped bits,
another model's) is deleted and counted, never handed out. Writes go to a temp file of
this process and are renamed into place after fsync, so a crash leaves either the old
state or the new, and temp files of dead processes are swept at start.
"""

import json
import os
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from omlx_core.processes import pid_alive

FORMAT = "omlx.prompt_cache/1"
SUFFIX = ".safetensors"
_TMP_TAG = ".tmp-"
_READERS = min(8, os.cpu_count() or 1)


@dataclass
class _File:
    nbytes: int
    used: float  # last write or hit, for LRU (the file's mtime across restarts)


def entry_name(key: str, kind: str) -> str:
    return f"{key}.{kind}"


def checksum(arrays: dict[str, mx.array]) -> str:
    """CRC-32 over the arrays' names and bytes, in name order."""
    return _buffers_checksum({name: np.asarray(a.reshape(-1).view(mx.uint8)).data
                              for name, a in arrays.items()})


def _buffers_checksum(buffers: dict) -> str:
    crc = 0
    for name in sorted(buffers):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(buffers[name], crc)
    return f"{crc:08x}"


# safetensors dtype -> (numpy dtype it is read as, MLX dtype it is viewed as)
_DTYPES = {"F32": (np.float32, None), "F16": (np.float16, None), "BF16": (np.uint16, mx.bfloat16),
           "F64": (np.float64, None), "I64": (np.int64, None), "I32": (np.int32, None),
           "I16": (np.int16, None), "I8": (np.int8, None), "U64": (np.uint64, None),
           "U32": (np.uint32, None), "U16": (np.uint16, None), "U8": (np.uint8, None),
           "BOOL": (np.bool_, None)}


def _read_safetensors(path: Path) -> tuple[dict[str, tuple], dict]:
    """name -> (dtype, shape, bytes) and the header metadata, read with plain file I/O.

    mx.save_safetensors writes the format; reading it here (not with mx.load) lets
    reader threads do the I/O and the checksum without touching MLX.
    """
    with open(path, "rb") as handle:
        data = handle.read()
    if len(data) < 8:
        raise ValueError("truncated header")
    (length,) = struct.unpack("<Q", data[:8])
    if 8 + length > len(data):
        raise ValueError("truncated header")
    header = json.loads(data[8:8 + length])
    metadata = header.pop("__metadata__", {}) or {}
    body = memoryview(data)[8 + length:]
    tensors = {}
    for name, info in header.items():
        start, stop = info["data_offsets"]
        if not 0 <= start <= stop <= len(body):
            raise ValueError(f"tensor {name} lies outside the file")
        tensors[name] = (info["dtype"], tuple(info["shape"]), body[start:stop])
    return tensors, metadata


def _to_mlx(dtype: str, shape: tuple, raw) -> mx.array:
    read_as, view_as = _DTYPES[dtype]
    array = mx.array(np.frombuffer(raw, dtype=read_as).reshape(shape))
    return array.view(view_as) if view_as is not None else array


class DiskTier:
    def __init__(self, directory: Path, identity: str, cap_bytes: int):
        self.directory = directory
        self.identity = identity
        self.cap_bytes = cap_bytes
        self.corrupt_files = 0
        self.evicted_files = 0
        self._files: dict[str, _File] = {}
        self._lock = threading.Lock()
        self._serial = 0
        self._pool: ThreadPoolExecutor | None = None
        directory.mkdir(parents=True, exist_ok=True)
        self._scan()

    # The index ------------------------------------------------------------------------

    def _scan(self) -> None:
        for path in self.directory.iterdir():
            name = path.name
            if _TMP_TAG in name:
                pid = name.split(_TMP_TAG, 1)[1].split("-", 1)[0]
                if pid.isdigit() and not pid_alive(int(pid)):
                    path.unlink(missing_ok=True)
            elif name.endswith(SUFFIX):
                stat = path.stat()
                self._files[name[:-len(SUFFIX)]] = _File(stat.st_size, stat.st_mtime)

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._files

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(f.nbytes for f in self._files.values())

    @property
    def files(self) -> int:
        with self._lock:
            return len(self._files)

    def _path(self, name: str) -> Path:
        return self.directory / f"{name}{SUFFIX}"

    # Writes (the writer thread) -----------------------------------------------------

    def write(self, name: str, arrays: dict[str, mx.array], header: dict[str, str]) -> None:
        """Write one entry atomically, then evict least recently used files over the cap."""
        key, kind = name.rsplit(".", 1)
        metadata = {**header, "format": FORMAT, "identity": self.identity, "key": key,
                    "kind": kind, "checksum": checksum(arrays)}
        with self._lock:
            self._serial += 1
            serial = self._serial
        tmp = self.directory / f".{name}{_TMP_TAG}{os.getpid()}-{serial}{SUFFIX}"
        self.directory.mkdir(parents=True, exist_ok=True)  # `omlx cache clear` may have removed it
        try:
            mx.save_safetensors(str(tmp), arrays, metadata)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self._path(name))
        finally:
            tmp.unlink(missing_ok=True)
        with self._lock:
            self._files[name] = _File(self._path(name).stat().st_size, time.time())
        self._evict()

    def _evict(self) -> None:
        with self._lock:
            total = sum(f.nbytes for f in self._files.values())
            victims = []
            for name, entry in sorted(self._files.items(), key=lambda item: item[1].used):
                if total <= self.cap_bytes:
                    break
                victims.append(name)
                total -= entry.nbytes
            for name in victims:
                del self._files[name]
        for name in victims:
            self._path(name).unlink(missing_ok=True)
        self.evicted_files += len(victims)

    # Reads (the engine thread, files read and checked by a small thread pool) -------

    def read(self, name: str) -> tuple[dict[str, mx.array], dict] | None:
        """An entry's arrays and header, or None when it is gone or fails verification."""
        return self.read_many([name])[name]

    def read_many(self, names: list[str]) -> dict[str, tuple[dict[str, mx.array], dict] | None]:
        """Several entries at once: the file reads and checksums run in parallel threads
        (both release the GIL), the MLX arrays are made on the calling thread."""
        if len(names) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=_READERS, thread_name_prefix="omlx-cache-read")
            raw = dict(zip(names, self._pool.map(self._read_verified, names)))
        else:
            raw = {name: self._read_verified(name) for name in names}
        found = {}
        for name, entry in raw.items():
            if entry is None:
                found[name] = None
                continue
            tensors, metadata = entry
            found[name] = ({key: _to_mlx(*tensor) for key, tensor in tensors.items()}, metadata)
        return found

    def _read_verified(self, name: str) -> tuple[dict, dict] | None:
        path = self._path(name)
        try:
            tensors, metadata = _read_safetensors(path)
            key, kind = name.rsplit(".", 1)
            expected = {"format": FORMAT, "identity": self.identity, "key": key, "kind": kind}
            if any(metadata.get(k) != v for k, v in expected.items()) or \
                    metadata.get("checksum") != _buffers_checksum({n: t[2] for n, t in tensors.items()}):
                raise ValueError("header or checksum mismatch")
        except FileNotFoundError:
            self._forget(name)
            return None
        except Exception:  # noqa: BLE001 - any unreadable file is corrupt: drop it, recompute
            with self._lock:
                self.corrupt_files += 1
            self._forget(name)
            path.unlink(missing_ok=True)
            return None
        now = time.time()
        with self._lock:
            if name in self._files:
                self._files[name].used = now
        try:
            os.utime(path, (now, now))
        except OSError:
            pass
        return tensors, metadata

    def _forget(self, name: str) -> None:
        with self._lock:
            self._files.pop(name, None)

    def clear(self) -> int:
        """Delete every entry; returns the bytes freed."""
        with self._lock:
            files, self._files = self._files, {}
        for name in files:
            self._path(name).unlink(missing_ok=True)
        return sum(f.nbytes for f in files.values())
