"""Prefill lanes and whether each can run on this machine, with the reason.

A lane computes an output-channel slice of a linear layer. This module answers only
"can it run here, and is it switched on?" so that `omlx status` never guesses.
"""

import platform
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from omlx_core.hardware import mlx_backend

LANES = ("gpu", "cpu", "ane")


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
    apple = platform.system() == "Darwin" and platform.machine() == "arm64"
    ane_reason = "the ANE lane is not built in this version" if apple else "requires Apple Silicon"
    return [
        LaneStatus("gpu", True, True, gpu_reason),
        LaneStatus("cpu", blas is not None, cpu_enabled, cpu_reason if blas else "numpy has no BLAS"),
        LaneStatus("ane", False, False, ane_reason),
    ]
