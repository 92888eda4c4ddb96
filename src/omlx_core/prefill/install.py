"""Prepare a loaded model's prefill: fast paths, then the split plan, then a warm-up.

`install_prefill` is what every caller runs after loading (serve, bench, tune). It
installs the parity-keeping fast paths the settings enable (`fast_paths`), then decides
from the settings and the checkpoint whether any lane besides gpu may take work, builds the
ane lane's procedures first when it is on (`prefill.ane.install`: staged INT8 banks, Core
ML packages, loaded and warmed), replaces the target modules by name with `SplitLinear`s
one layer at a time (each layer's cpu slice is converted, kept by the lane, and its
intermediates released before the next; MLX's buffer cache is cleared at the end),
optionally runs one warm-up prefill, and returns a
`LaneReport` for /api/status, `omlx status` and the memory guard (`extra_bytes`).
"""

import logging
import time
from dataclasses import dataclass, field

import mlx.core as mx

from omlx_core.hardware import mlx_backend
from omlx_core.memory.peak import peak_extra_bytes
from omlx_core.prefill.ane.install import AneInstall, install_ane
from omlx_core.prefill.fast_paths import FastPathReport, install_fast_paths, measure_forward_extra
from omlx_core.prefill.lanes import lane_statuses
from omlx_core.prefill.plan import TARGET_KINDS, SplitPlan, find_targets
from omlx_core.prefill.split import SplitLinear, replace_module

log = logging.getLogger("omlx.prefill")

PROCEDURES = ("mlp", "gdn", "dual", "resident")
FP16_NEEDED = "CPU sharing needs an FP16 clone: run omlx clone-fp16 SRC DST and serve the clone"


@dataclass
class LaneState:
    name: str
    configured: bool  # the settings ask for it
    attempted: bool = False  # installation was tried
    reason: str = ""
    procedures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PROCEDURES, 0))
    resident_bytes: int = 0
    warnings: list[str] = field(default_factory=list)  # per layer: what failed, and why

    def as_dict(self) -> dict:
        return {"name": self.name, "configured": self.configured, "attempted": self.attempted,
                "reason": self.reason, "procedures": dict(self.procedures),
                "resident_bytes": self.resident_bytes, "warnings": list(self.warnings)}


@dataclass
class LaneReport:
    lanes: list[LaneState]
    plan: dict
    min_tokens: int
    build_s: float = 0.0
    build_peak_extra_bytes: int = 0  # MLX memory above the model's during the staged build
    retained_cache_bytes: int = 0  # MLX buffer cache left after it
    warmup_s: float = 0.0
    split_layers: list[SplitLinear] = field(default_factory=list, repr=False)
    fast_paths: FastPathReport = field(default_factory=FastPathReport)
    ane: AneInstall | None = field(default=None, repr=False)  # the ane lane's build and procedures

    @property
    def extra_bytes(self) -> int:
        """Beyond the model's own weights (charged to the memory guard): lane-resident
        slices plus the dense path's largest transient weight."""
        return sum(lane.resident_bytes for lane in self.lanes) + self.fast_paths.extra_bytes

    def as_dict(self) -> dict:
        return {"lanes": [lane.as_dict() for lane in self.lanes], "plan": self.plan,
                "min_tokens": self.min_tokens, "build_s": round(self.build_s, 3),
                "build_peak_extra_bytes": self.build_peak_extra_bytes,
                "retained_cache_bytes": self.retained_cache_bytes,
                "warmup_s": round(self.warmup_s, 3), "extra_bytes": self.extra_bytes,
                "split_calls": sum(layer.calls for layer in self.split_layers),
                "fast_paths": self.fast_paths.as_dict(),
                "ane": self.ane.as_dict() if self.ane else None}


def plan_from_settings(settings, lanes=("cpu",)) -> SplitPlan:
    """The shares of `lanes` (those being installed) from prefill.<lane>_share.<kind>."""
    return SplitPlan({kind: {lane: float(settings[f"prefill.{lane}_share.{kind}"]) for lane in lanes}
                      for kind in TARGET_KINDS})


def install_prefill(model, settings, *, fp16_clone: bool, warmup_tokens: int = 0,
                    kernels=None) -> LaneReport:
    """Fast paths and lanes as the settings ask, then a warm-up prefill of `warmup_tokens`
    (on GPU backends always; on the CPU device only when something was installed).
    `kernels`: the model's kernel registry report (the fast paths use the active ones)."""
    fast = install_fast_paths(model, settings, kernels)
    report = install_lanes(model, settings, fp16_clone=fp16_clone)
    report.fast_paths = fast
    installed = report.split_layers or fast.dense_layers or fast.gdn_layers
    # GPU backends compile kernels on first use: warm up even with nothing installed there.
    if warmup_tokens and (installed or mlx_backend() != "cpu"):
        tokens = max(warmup_tokens, fast.dense_min_tokens or 0, fast.gdn_min_tokens or 0)
        report.warmup_s = warm_up(model, tokens)
        if fast.dense_layers:  # the charge covers a whole chunk, as the backend runs it
            chunk = max(tokens, int(settings["prefill.chunk_size"]))
            fast.dense_chunk_bytes = measure_forward_extra(model, fast.dense_layers, chunk)
    return report


def install_lanes(model, settings, *, fp16_clone: bool) -> LaneReport:
    """Split `model`'s targets across the lanes the settings enable; returns what happened."""
    statuses = {lane.name: lane for lane in lane_statuses(settings)}
    min_tokens = int(settings["prefill.split_min_tokens"])
    states = {name: LaneState(name, status.enabled, reason=status.reason) for name, status in statuses.items()}
    states["ane"].configured = "ane" in settings["prefill.lanes"]  # asked for, eligible or not
    states["gpu"].reason = statuses["gpu"].reason + "; computes every channel no other lane takes"
    cpu, ane = states["cpu"], states["ane"]
    lanes = [name for name, ready in (("cpu", _cpu_ready(cpu, statuses["cpu"], fp16_clone)),
                                      ("ane", _ane_ready(ane, statuses["ane"]))) if ready]
    plan = plan_from_settings(settings, lanes)
    report = LaneReport(list(states.values()), {k: dict(v) for k, v in plan.shares.items()}, min_tokens)
    if not lanes:
        return report
    targets = find_targets(model)
    for name in list(lanes):
        if not any(s.lane == name for t in targets for s in plan.slices(t)):
            state = states[name]
            state.reason = (f"no {name} share: set prefill.{name}_share.mlp_gate_up / mlp_down / gdn_qkv "
                            "(or run omlx tune)" if targets else "this model has no split targets")
            state.warnings.append(f"{name} lane: zero procedures ({state.reason})")
            log.warning("prefill %s lane installed nothing: %s", name, state.reason)
            lanes.remove(name)
    if "ane" in lanes:
        report.ane = install_ane(model, targets, plan, settings, ane)
        ane.reason = (f"Core ML on the Neural Engine, INT8 per channel; {ane.procedures['resident']} "
                      f"procedures resident ({ane.procedures['dual']} dual) at >= {min_tokens} tokens")
        if ane.warnings:
            ane.reason += f"; {len(ane.warnings)} warning(s)"
    if lanes:
        _build(model, targets, plan, min_tokens, report, cpu if "cpu" in lanes else None,
               report.ane.rows if report.ane else {})
    if "cpu" in lanes:
        cpu.reason = (f"host BLAS through numpy, float32; {sum(cpu.procedures[p] for p in ('mlp', 'gdn'))} "
                      f"projections split at >= {min_tokens} tokens")
    return report


def _cpu_ready(cpu: LaneState, status, fp16_clone: bool) -> bool:
    if not cpu.configured:
        return False
    cpu.attempted = True
    if not status.eligible:
        return False
    if not fp16_clone:
        cpu.reason = FP16_NEEDED
        log.warning("prefill cpu lane not installed: %s", FP16_NEEDED)
        return False
    return True


def _ane_ready(ane: LaneState, status) -> bool:
    """Any checkpoint will do (the banks are requantized to INT8 from whatever it holds)."""
    if not ane.configured:
        return False
    ane.attempted = True
    if not status.eligible:
        log.warning("prefill ane lane not installed: ineligible (%s)", status.reason)
        return False
    return True


def _build(model, targets, plan, min_tokens, report: LaneReport, cpu: LaneState | None,
           ane_rows: dict) -> None:
    """Replace targets layer by layer, measuring the build's transient MLX memory."""
    start = time.perf_counter()
    modules = dict(model.named_modules())

    def build() -> None:
        for target in targets:
            slices = plan.slices(target)
            ane = ane_rows.get(target.path)
            if not any(s.lane == "cpu" for s in slices) and ane is None:
                continue
            split = SplitLinear(target.path, modules[target.path], slices, min_tokens, ane=ane)
            replace_module(model, target.path, split)
            report.split_layers.append(split)
            if split.cpu is not None:
                cpu.procedures["gdn" if target.kind == "gdn_qkv" else "mlp"] += 1
                cpu.procedures["resident"] += 1
                cpu.resident_bytes += split.lane_bytes
            mx.synchronize()

    report.build_peak_extra_bytes = peak_extra_bytes(build)
    mx.clear_cache()
    report.retained_cache_bytes = mx.get_cache_memory()
    report.build_s = time.perf_counter() - start + (report.ane.build.build_s if report.ane else 0.0)


def warm_up(model, tokens: int) -> float:
    """One throwaway prefill of `tokens` tokens, so the first request runs at steady speed."""
    from mlx_lm.models.cache import make_prompt_cache

    start = time.perf_counter()
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, tokens), dtype=mx.int32), cache=cache))
    del cache
    mx.clear_cache()
    return time.perf_counter() - start
