"""Installing the ane lane on a loaded model: staged build, load, warm-up, counts, warnings.

`install_ane` is called by `prefill.install.install_lanes` when the ane lane is enabled
and eligible. It builds the plan's ane procedures (`staged`), loads each package with Core
ML (`runtime.load_package`, macOS only), warms every compiled procedure once, and counts
what is resident for /api/status: `mlp` and `gdn` procedures, `dual` (those split over
two banks, one per Neural Engine) and `resident` (loaded and warmed). A procedure that
fails to build or load is a warning naming its layer and cause; its rows stay on the gpu.
Bytes charged to the memory guard: the INT8 banks Core ML holds, and each package's fixed
float16 input and output surfaces.
"""

import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from omlx_core.hardware import hardware_info
from omlx_core.prefill.ane import runtime
from omlx_core.prefill.ane.banks import BankError
from omlx_core.prefill.ane.lane import AneRows, LoadedProcedure
from omlx_core.prefill.ane.staged import Failure, StagedBuild, staged_build
from omlx_core.prefill.plan import SplitPlan, Target

log = logging.getLogger("omlx.prefill")


def dual_ane(setting: str, cpu_name: str) -> bool:
    """Two banks per procedure? auto: on the chips with two Neural Engines (Ultra)."""
    if setting in ("on", "off"):
        return setting == "on"
    return "ultra" in cpu_name.lower()


@dataclass
class AneInstall:
    build: StagedBuild
    dual: bool
    tokens: int
    rows: dict[str, AneRows] = field(default_factory=dict)  # projection path -> its ane rows
    loaded: list[LoadedProcedure] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)  # build and load failures
    directory: object = None  # the packages' TemporaryDirectory, removed with this object

    @property
    def bank_bytes(self) -> int:
        return sum(p.procedure.bank_bytes for p in self.loaded)

    @property
    def surface_bytes(self) -> int:
        return sum(p.procedure.surface_bytes for p in self.loaded)

    @property
    def warnings(self) -> list[str]:
        return [f.warning for f in self.failures]

    def as_dict(self) -> dict:
        errors = [p.procedure.error for p in self.loaded if p.procedure.error]
        return {"dual": self.dual, "tokens": self.tokens, "bank_bytes": self.bank_bytes,
                "surface_bytes": self.surface_bytes,
                "build_s": round(self.build.build_s, 3),
                "build_peak_extra_bytes": self.build.peak_extra_bytes,
                "build_host_peak_extra_bytes": self.build.host_peak_extra_bytes,
                "retained_cache_bytes": self.build.retained_cache_bytes,
                "largest_slice_fp32_bytes": self.build.largest_slice_fp32_bytes,
                "worst_error": BankError.worst(errors).as_dict() if errors else None,
                "calls": sum(p.calls for p in self.loaded),
                "procedures": [p.procedure.as_dict() for p in self.loaded],
                "warnings": self.warnings}


def install_ane(model, targets: list[Target], plan: SplitPlan, settings, state, *,
                out_dir: Path | None = None,
                load: Callable[[Path], runtime.Predictor] | None = None) -> AneInstall:
    """Build, load and warm the plan's ane procedures; counts go to `state` (a LaneState)."""
    load = load or runtime.load_package
    tokens = int(settings["prefill.ane.tokens"])
    dual = dual_ane(settings["prefill.ane.dual"], hardware_info().get("cpu", ""))
    directory = None
    if out_dir is None:
        directory = tempfile.TemporaryDirectory(prefix="omlx-ane-")
        out_dir = Path(directory.name)
    build = staged_build(model, targets, plan, tokens, out_dir, dual=dual)
    result = AneInstall(build, dual, tokens, failures=list(build.failures), directory=directory)
    for procedure in build.procedures:
        try:
            loaded = LoadedProcedure(procedure, [load(path) for path in procedure.packages])
            loaded.warm()
        except Exception as error:  # noqa: BLE001 - reported per layer; its rows stay on the gpu
            failure = Failure(procedure.name, f"load failed: {type(error).__name__}: {error}")
            result.failures.append(failure)
            log.warning("prefill %s", failure.warning)
            continue
        result.loaded.append(loaded)
        state.procedures[procedure.kind] += 1
        state.procedures["dual"] += int(procedure.dual)
        state.procedures["resident"] += 1
        for segment in procedure.segments:
            result.rows[segment.path] = AneRows(loaded, segment)
    state.resident_bytes += result.bank_bytes + result.surface_bytes
    state.warnings.extend(result.warnings)
    if not result.loaded:
        cause = result.failures[0].warning if result.failures else "the plan gave the ane lane no rows"
        state.warnings.append(f"ane lane: zero procedures ({cause})")
        log.warning("prefill ane lane: zero procedures (%s)", cause)
    return result
