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


def model_cache_identity(ref) -> str:
    """The cache identity of a resolved model (`models.resolve.resolve`)."""
    from omlx_core.models.fingerprint import model_fingerprint

    return cache_identity(ref.path, model_fingerprint(ref.path))


def list_caches(home: Path) -> list[dict]:
    """Every model cache on disk: its identity, directory, files and bytes."""
    root = cache_root(home)
    if not root.is_dir():
        return []
    caches = []
    for directory in sorted(p for p in root.iterdir() if p.is_dir()):
        sizes = [p.stat().st_size for p in directory.glob("*.safetensors") if not p.name.startswith(".")]
        caches.append({"identity": directory.name, "directory": str(directory),
                       "files": len(sizes), "bytes": sum(sizes)})
    return caches


def clear_caches(home: Path, identity: str | None = None) -> list[dict]:
    """Delete one model's cache (or all of them); returns what was deleted."""
    removed = [c for c in list_caches(home) if identity is None or c["identity"] == identity]
    for cache in removed:
        shutil.rmtree(cache["directory"], ignore_errors=True)
    return removed
