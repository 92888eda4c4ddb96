"""What the tuner may change, for this model on this machine, and how a choice becomes settings.

The controls: the CPU lane's share of MLP gate/up, of MLP down and of the gated-delta
qkv projection, the same three shares for the ANE lane (Apple Silicon only), the prefill
chunk size, and the token count from which quantized linears take the dequantize-to-dense
path ("off" = never). A control that cannot matter here is left out with the reason: CPU
shares need an FP16 clone and an eligible cpu lane, ANE shares an eligible ane lane (any
checkpoint: its banks are INT8 requantized, and the calibrator rejects shares whose error
exceeds prefill.ane.max_error), the GDN share needs gated-delta layers (and is never below
their structural floor), the dense path needs a quantized checkpoint. The default
candidate is what `omlx tune` verifies against: every channel on the gpu lane, no
dequantize-to-dense, the default chunk.
"""

import math
from dataclasses import dataclass, field

from omlx_core.settings import BY_KEY

SHARES = ("mlp_gate_up", "mlp_down", "gdn_qkv")
SHARE_GRID = (0.0, 0.0625, 0.125, 0.25, 0.375)
# With no accelerator MLX's "gpu" lane is the CPU itself, whose matmul is far slower than host
# BLAS: there the cpu lane may be worth any share, all of it included.
CPU_ONLY_SHARE_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)
CHUNK_GRID = (512, 1024, 2048, 4096, 8192)
DENSE_GRID = ("off", 65, 256, 512, 1024, 2048)  # 65: the default, above the decode kernel's 64
OFF = "off"


@dataclass(frozen=True)
class Control:
    name: str  # cpu_share.<kind> | ane_share.<kind> | chunk_size | dense_min_tokens
    values: tuple  # the coarse grid; the default first
    minimum: float | None = None  # refinement never goes below (the GDN floor)


@dataclass(frozen=True)
class Candidate:
    values: tuple[tuple[str, object], ...]  # (control, value), in control order

    def get(self, name: str):
        return dict(self.values)[name]

    def with_value(self, name: str, value) -> "Candidate":
        return Candidate(tuple((n, value if n == name else v) for n, v in self.values))

    @property
    def label(self) -> str:
        return " ".join(f"{name}={_show(value)}" for name, value in self.values)

    def settings(self) -> dict[str, str]:
        """The settings (key -> text, as `--set` takes them) that give this candidate."""
        values = dict(self.values)
        sets = {}
        shares = {kind: values.get(f"cpu_share.{kind}", 0.0) for kind in SHARES}
        ane = {kind: values[f"ane_share.{kind}"] for kind in SHARES if f"ane_share.{kind}" in values}
        lanes = ["gpu"] + (["cpu"] if any(shares.values()) else []) + (["ane"] if any(ane.values()) else [])
        if len(lanes) > 1:
            sets["prefill.lanes"] = ",".join(lanes)
        sets["prefill.cpu_sharing.enabled"] = "true" if any(shares.values()) else "false"
        for kind, share in shares.items():
            sets[f"prefill.cpu_share.{kind}"] = f"{share:g}"
        for kind, share in ane.items():
            sets[f"prefill.ane_share.{kind}"] = f"{share:g}"
        sets["prefill.chunk_size"] = str(values["chunk_size"])
        dense = values.get("dense_min_tokens", OFF)
        sets["prefill.dense"] = "off" if dense == OFF else "on"
        if dense != OFF:
            sets["prefill.dense_min_tokens"] = str(dense)
        return sets


def _show(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass
class SearchSpace:
    controls: list[Control]
    notes: list[str] = field(default_factory=list)  # what was left out, and why
    gdn_floor_share: float = 0.0

    def default(self) -> Candidate:
        return Candidate(tuple((c.name, c.values[0]) for c in self.controls))

    def drop(self, name: str, note: str) -> None:
        self.controls = [c for c in self.controls if c.name != name]
        self.notes.append(note)


def search_space(targets, *, cpu_lane: tuple[bool, str], fp16_clone: bool, quantized: bool,
                 max_ctx: int, accelerator: bool = True,
                 ane_lane: tuple[bool, str] = (False, "not asked")) -> SearchSpace:
    """The controls for a model with split `targets` (prefill.plan.find_targets)."""
    default_chunk = int(BY_KEY["prefill.chunk_size"].default)
    chunks = tuple(dict.fromkeys([default_chunk] + [c for c in CHUNK_GRID if c < max_ctx]))
    space = SearchSpace([])
    kinds = {t.kind for t in targets}
    cpu_ok, cpu_reason = cpu_lane
    share_grid = SHARE_GRID if accelerator else CPU_ONLY_SHARE_GRID
    for kind in SHARES:
        name = f"cpu_share.{kind}"
        if kind not in kinds:
            what = "gated-delta (GDN) layers" if kind == "gdn_qkv" else f"{kind} projections"
            space.notes.append(f"{name}: left out, this model has no {what}")
        elif not cpu_ok:
            space.notes.append(f"{name}: stays 0, the cpu lane is ineligible ({cpu_reason})")
        elif not fp16_clone:
            space.notes.append(f"{name}: stays 0, CPU sharing needs an FP16 clone (omlx clone-fp16)")
        elif kind == "gdn_qkv":
            floor = max(t.floor / t.out_features for t in targets if t.kind == kind)
            space.gdn_floor_share = floor
            grid = sorted({0.0, *(max(s, _ceil_share(floor)) for s in share_grid if s)})
            space.controls.append(Control(name, tuple(grid), minimum=_ceil_share(floor)))
        else:
            space.controls.append(Control(name, share_grid))
    ane_ok, ane_reason = ane_lane
    for kind in SHARES:
        name = f"ane_share.{kind}"
        if not ane_ok:
            space.notes.append(f"{name}: not searched, the ane lane is ineligible ({ane_reason})")
        elif kind in kinds:
            floor = max((t.floor / t.out_features for t in targets if t.kind == kind), default=0.0)
            grid = sorted({0.0, *(max(s, _ceil_share(floor)) for s in SHARE_GRID if s)})
            space.controls.append(Control(name, tuple(grid), minimum=_ceil_share(floor) or None))
    space.controls.append(Control("chunk_size", chunks))
    if quantized:
        dense = tuple(v for v in DENSE_GRID if v == OFF or v < max_ctx)
        space.controls.append(Control("dense_min_tokens", dense))
    else:
        space.notes.append("dense_min_tokens: left out, the checkpoint is not quantized")
    return space


def _ceil_share(share: float) -> float:
    """A share rounded up to 1/1024, so it never lands below the floor it stands for."""
    return math.ceil(share * 1024) / 1024


def effective_key(candidate: Candidate, max_ctx: int) -> tuple:
    """Candidates that run the same work on this workload share a key (measure once).

    A chunk at least the longest prompt is one chunk whatever its size; a dense threshold
    above every chunk the prompt is cut into is the same as off.
    """
    values = dict(candidate.values)
    chunk = min(int(values["chunk_size"]), max_ctx)
    values["chunk_size"] = chunk
    dense = values.get("dense_min_tokens", OFF)
    if dense != OFF and int(dense) > chunk:
        values["dense_min_tokens"] = OFF
    return tuple(sorted(values.items(), key=lambda item: item[0]))


def refinements(control: Control, best) -> list:
    """Values between the best one and its grid neighbours, for a second, finer pass."""
    numeric = [v for v in control.values if v != OFF]
    if best == OFF or best not in numeric or len(numeric) < 2:
        return []
    index = numeric.index(best)
    neighbours = [numeric[i] for i in (index - 1, index + 1) if 0 <= i < len(numeric)]
    found = []
    for other in neighbours:
        if isinstance(best, float):
            value = round((best + other) / 2, 4)
            if control.minimum and 0 < value < control.minimum:
                continue
        else:
            value = int(round(math.sqrt(best * other) / 64) * 64)
        if value not in control.values and value != best:
            found.append(value)
    return found
