"""Models: name, inspect, import, load and clone checkpoints."""

from omlx_core.models.clone_fp16 import CloneReport, clone_fp16, is_fp16_clone

__all__ = ["CloneReport", "clone_fp16", "is_fp16_clone"]
