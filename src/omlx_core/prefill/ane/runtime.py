"""Apple only: load a saved ane package with Core ML on the Neural Engine.

Core ML compiles an `.mlpackage` when `coremltools.models.MLModel` loads it; with compute
units CPU_AND_NE it schedules the program on the Neural Engine (and the CPU for what the
ANE cannot run), never on the GPU, which the gpu lane keeps. Only public interfaces:
coremltools' `MLModel` and `predict`. Everywhere but macOS on Apple Silicon with
coremltools installed, `load_package` refuses with the lane's reason before touching
Core ML; the tests that run it are marked macOS-only.
"""

from pathlib import Path
from typing import Protocol

import numpy as np

from omlx_core.errors import OmlxError
from omlx_core.prefill.ane.program import coremltools


class Predictor(Protocol):
    """A loaded procedure: coremltools' MLModel, or a stand-in where the ANE is absent."""

    def predict(self, data: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


def require_apple_silicon() -> None:
    from omlx_core.prefill.lanes import ane_eligibility

    eligible, reason = ane_eligibility()
    if not eligible:
        raise OmlxError(f"ane lane: cannot load Core ML packages here: {reason}")


def load_package(path: Path) -> Predictor:
    """Compile and load one package for CPU_AND_NE (macOS on Apple Silicon only)."""
    require_apple_silicon()
    ct = coremltools()
    return ct.models.MLModel(str(path), compute_units=ct.ComputeUnit.CPU_AND_NE)
