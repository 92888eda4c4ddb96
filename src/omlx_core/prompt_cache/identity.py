"""Which cache a checkpoint's KV belongs to, and where that cache lives on disk.

The model fingerprint describes a checkpoint's layout only (names, shapes, dtypes), so
two fine-tunes of one base share it; their KV must not. The cache identity adds a digest
of each weight file's size and of three 1 MiB windows of its bytes (start, middle, end),
which tells different weights apart without reading a whole checkpoint.
"""

import hashlib
import shutil
from pathlib import Path

from omlx_core.models.checkpoint import weight_files

_WINDOW = 1 << 20


def cache_identity(path: Path, fingerprint: str) -> str:
    digest = hashlib.sha256(fingerprint.encode())
    for file in weight_files(path):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as handle:
            for offset in sorted({0, max(0, size // 2 - _WINDOW // 2), max(0, size - _WINDOW)}):
                handle.seek(offset)
                digest.update(handle.read(_WINDOW))
    return f"{fingerprint}-{digest.hexdigest()[:12]}"


def cache_root(home: Path) -> Path:
    return home / "cache"


def cache_dir(home: Path, identity: str) -> Path:
    return cache_root(home) / identity


def directory_bytes(directory: Path) -> tuple[int, int]:
    """(files, bytes) of the cache entries in a directory."""
    sizes = [p.stat().st_size for p in directory.glob("*.safetensors") if not p.name.startswith(".")]
    return len(sizes), sum(sizes)


def remove_dir(directory: Path) -> tuple[int, int]:
    """Delete one model's cache directory; returns the (files, bytes) it held."""
    if not directory.is_dir():
        return 0, 0
    held = directory_bytes(directory)
    shutil.rmtree(directory)
    return held
