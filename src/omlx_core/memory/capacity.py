"""How much memory there is to guard, and watermarks turned from settings into bytes."""

import mlx.core as mx
import psutil

from omlx_core.errors import InputError
from omlx_core.units import parse_memory

# On Metal the working set the driver recommends is the real ceiling; CUDA reports the
# card's memory. Anywhere else weights and KV live in RAM.
_DEVICE_KEYS = ("max_recommended_working_set_size", "memory_size")


def total_memory_bytes() -> int:
    """The memory weights and KV share: the GPU's when MLX computes there, else RAM."""
    if mx.default_device().type == mx.DeviceType.gpu:
        info = mx.device_info()
        for key in _DEVICE_KEYS:
            if info.get(key):
                return int(info[key])
    return int(psutil.virtual_memory().total)


def watermark_bytes(value: int | float | str, total: int, what: str = "watermark") -> int:
    """A watermark as bytes: an int of bytes, a fraction of `total`, or text like 8GB / 0.9."""
    parsed = parse_memory(value, what)
    if isinstance(parsed, float):
        return int(parsed * total)
    if parsed <= 0:
        raise InputError(f"{what}: {value!r} must be more than 0 bytes")
    return parsed
