"""Memory: KV accounting per cache kind, and the guard that admits requests by it."""

from omlx_core.memory.capacity import total_memory_bytes, watermark_bytes
from omlx_core.memory.guard import Admission, MemoryGuard, MemoryRefused
from omlx_core.memory.kv import (
    KVProfile,
    LayerKV,
    actual_kv_bytes,
    estimate_kv_bytes,
    kv_profile,
    worst_case_kv_bytes,
)
from omlx_core.memory.weights import weights_bytes

__all__ = [
    "Admission", "KVProfile", "LayerKV", "MemoryGuard", "MemoryRefused",
    "actual_kv_bytes", "estimate_kv_bytes", "kv_profile", "total_memory_bytes",
    "watermark_bytes", "weights_bytes", "worst_case_kv_bytes",
]
