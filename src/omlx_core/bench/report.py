"""The parts of a bench document that say where and when it was measured."""

import math
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version

from omlx_core.bench.schema import SCHEMA

_HARDWARE_KEYS = ("os", "machine", "cpu", "cpu_count", "memory_bytes", "backend", "device",
                  "gpu", "mlx_version")


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def now_utc() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def header(mode: str, created: str | None = None) -> dict:
    """schema, mode, date, versions and the hardware fingerprint: the start of every document."""
    import mlx.core as mx

    from omlx_core import __version__
    from omlx_core.hardware import hardware_fingerprint, hardware_info

    info = hardware_info()
    return {
        "schema": SCHEMA,
        "mode": mode,
        "created": created or now_utc(),
        "versions": {"omlx": __version__, "mlx": mx.__version__, "mlx_lm": _version("mlx-lm")},
        "hardware": {"fingerprint": hardware_fingerprint(info),
                     "info": {key: info.get(key) for key in _HARDWARE_KEYS}},
    }


def finite(node):
    """A copy with NaN and infinities as None, so the document is strict JSON."""
    if isinstance(node, float):
        return node if math.isfinite(node) else None
    if isinstance(node, dict):
        return {key: finite(value) for key, value in node.items()}
    if isinstance(node, (list, tuple)):
        return [finite(value) for value in node]
    return node
