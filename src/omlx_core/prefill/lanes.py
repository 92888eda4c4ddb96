"""Prefill lanes and whether each can run on this machine, with the reason.

A lane computes an output-channel slice of a linear layer. This module answers only
"can it run here, and is it switched on?" so that `omlx status` never guesses.
"""

import importlib.util
import platform
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from omlx_core.hardware import mlx_backend

LANES = ("gpu", "cpu", "ane")
ANE_NOT_APPLE = "requires macOS on Apple Silicon"
ANE_NO_COREMLTOOLS = "pip install coremltools"


@dataclass(frozen=True)
class LaneStatus:
    name: str
    eligible: bool
    enabled: bool
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


def _blas_name() -> str | None:
    try:
        import numpy

        config = numpy.show_config(mode="dicts")
        return config["Build Dependencies"]["blas"]["name"]
    except Exception:  # noqa: BLE001 - any failure means no usable BLAS report
        return None


def on_apple_silicon() -> bool:
    return platform.system() == "Darwin" and platform.machine() == "arm64"


def coremltools_installed() -> bool:
    """Without importing it (seconds): `omlx status` stays snappy."""
    if "coremltools" in sys.modules:
        return sys.modules["coremltools"] is not None  # None: imports of it are blocked
    return importlib.util.find_spec("coremltools") is not None


def ane_eligibility() -> tuple[bool, str]:
    """Whether the ane lane can run here (Core ML through coremltools), with the reason."""
    if not on_apple_silicon():
        return False, ANE_NOT_APPLE
    if not coremltools_installed():
        return False, ANE_NO_COREMLTOOLS
    return True, "Core ML on the Neural Engine (CPU_AND_NE), per-channel INT8 weights (approximate)"


def lane_statuses(settings: Mapping) -> list[LaneStatus]:
    backend = mlx_backend()
    lanes = settings["prefill.lanes"]
    gpu_reason = {"metal": "MLX on Metal", "cuda": "MLX on CUDA"}.get(
        backend, "MLX's CPU device (no GPU backend on this machine)"
    )
    blas = _blas_name()
    cpu_enabled = "cpu" in lanes and settings["prefill.cpu_sharing.enabled"]
    cpu_reason = f"host BLAS through numpy ({blas}); " + (
        "on for FP16 clones" if cpu_enabled else
        "off: experimental, set prefill.cpu_sharing.enabled and add cpu to prefill.lanes")
    ane_eligible, ane_reason = ane_eligibility()
    ane_enabled = ane_eligible and "ane" in lanes
    if ane_eligible:
        ane_reason += "; on" if ane_enabled else "; off: experimental, add ane to prefill.lanes"
    return [
        LaneStatus("gpu", True, True, gpu_reason),
        LaneStatus("cpu", blas is not None, cpu_enabled, cpu_reason if blas else "numpy has no BLAS"),
        LaneStatus("ane", ane_eligible, ane_enabled, ane_reason),
    ]
