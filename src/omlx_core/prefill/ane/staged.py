"""The staged build: ane procedures made one at a time, never all layers in float32.

Procedures follow the split plan's ane slices, in module order: a layer's MLP gate and up
slices become one fused procedure (`mlp`, gate rows then up rows), its down slice another
(`mlp`), a gated-delta qkv slice one more (`gdn`). Each is built and released before the
next: its source rows are dequantized in row blocks (MLX, float32), requantized into the
INT8 bank (`banks.build_bank`), serialized as `.mlpackage` (`program.save_package`), and the
bank dropped; only its description (rows, error, paths, bytes) is kept.

Dual ANE (chips with two Neural Engines): the staged bank is cut into two halves of its
output rows, each its own package, views of the one staged array: built once, never twice.
A procedure that fails is recorded with its layer and cause; the others go on.
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from omlx_core.memory.peak import host_peak_extra_bytes, peak_extra_bytes
from omlx_core.prefill.ane.banks import BankError, Int8Bank, build_bank
from omlx_core.prefill.ane.program import preload, save_package
from omlx_core.prefill.plan import SplitPlan, Target
from omlx_core.prefill.split import dense_rows

log = logging.getLogger("omlx.prefill")

FP16 = 2


@dataclass(frozen=True)
class Segment:
    """Rows [offset, offset + rows) of a procedure's output: channels [start, start + rows)
    of the projection at `path`."""

    path: str
    offset: int
    start: int
    rows: int


@dataclass
class Procedure:
    name: str  # e.g. model.layers.0.mlp.gate_up
    kind: str  # mlp | gdn
    segments: list[Segment]
    in_features: int
    tokens: int  # the fixed prefill shape's rows
    packages: list[Path] = field(default_factory=list)  # one, or two halves (dual)
    bank_rows: list[int] = field(default_factory=list)  # output rows of each package
    error: BankError | None = None
    bank_bytes: int = 0
    staged_rows: int = 0  # source rows dequantized for it (once, dual or not)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments)

    @property
    def dual(self) -> bool:
        return len(self.packages) == 2

    @property
    def surface_bytes(self) -> int:
        """The fixed float16 input and output buffers every package keeps for one call."""
        return sum(self.tokens * (self.in_features + rows) * FP16 for rows in self.bank_rows)

    def slice_fp32_bytes(self) -> int:
        return self.rows * self.in_features * 4

    def as_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "rows": self.rows, "in_features": self.in_features,
                "tokens": self.tokens, "dual": self.dual, "bank_bytes": self.bank_bytes,
                "surface_bytes": self.surface_bytes,
                "error": self.error.as_dict() if self.error else None,
                "segments": [{"path": s.path, "start": s.start, "rows": s.rows} for s in self.segments]}


@dataclass(frozen=True)
class Failure:
    name: str  # the procedure, which names its layer
    cause: str

    @property
    def warning(self) -> str:
        return f"ane lane: {self.name} not built: {self.cause}"


@dataclass
class StagedBuild:
    procedures: list[Procedure] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    peak_extra_bytes: int = 0  # MLX memory above the model's during the build
    host_peak_extra_bytes: int = 0  # Python heap (numpy buffers included) above its start
    retained_cache_bytes: int = 0  # MLX buffer cache left after it
    build_s: float = 0.0

    @property
    def largest_slice_fp32_bytes(self) -> int:
        return max((p.slice_fp32_bytes() for p in self.procedures), default=0)


def plan_procedures(targets: list[Target], plan: SplitPlan, tokens: int) -> list[Procedure]:
    """The procedures the plan's ane slices make, in target order (gate and up fused)."""
    pieces = {t.path: (t, s) for t in targets for s in plan.slices(t) if s.lane == "ane"}
    procedures: list[Procedure] = []
    for path, (target, piece) in pieces.items():
        prefix, leaf = path.rsplit(".", 1)
        partner = {"gate_proj": f"{prefix}.up_proj", "up_proj": f"{prefix}.gate_proj"}.get(leaf)
        if partner in pieces:
            if leaf == "up_proj":
                continue  # made with its gate
            up, up_piece = pieces[partner]
            segments = [Segment(path, 0, piece.start, piece.size),
                        Segment(up.path, piece.size, up_piece.start, up_piece.size)]
            procedures.append(Procedure(f"{prefix}.gate_up", "mlp", segments, target.in_features, tokens))
            continue
        kind = "gdn" if target.kind == "gdn_qkv" else "mlp"
        procedures.append(Procedure(path, kind, [Segment(path, 0, piece.start, piece.size)],
                                    target.in_features, tokens))
    return procedures


def _row_reader(procedure: Procedure, modules: dict) -> Callable[[int, int], np.ndarray]:
    """Float32 rows [start, stop) of the procedure's concatenated source rows."""

    def read(start: int, stop: int) -> np.ndarray:
        parts = []
        for segment in procedure.segments:
            lo, hi = max(start, segment.offset), min(stop, segment.offset + segment.rows)
            if lo < hi:
                first = segment.start + lo - segment.offset
                rows = dense_rows(modules[segment.path], first, first + hi - lo)
                parts.append(np.array(rows))
                del rows
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    return read


def _bias(procedure: Procedure, modules: dict) -> np.ndarray | None:
    from omlx_core.prefill.fast_paths import unwrap

    biased = ["bias" in unwrap(modules[s.path]) for s in procedure.segments]
    if not any(biased):
        return None
    parts = [np.array(unwrap(modules[s.path]).bias[s.start:s.start + s.rows].astype(mx.float32))
             if has else np.zeros(s.rows, np.float32) for s, has in zip(procedure.segments, biased)]
    return np.concatenate(parts)


def halves(rows: int) -> list[tuple[int, int]]:
    """Two banks' row ranges for dual ANE: the first rounded to 32 rows (or 1 if smaller)."""
    half = rows // 2 // 32 * 32 or rows // 2
    return [(0, half), (half, rows)]


def build_one(procedure: Procedure, modules: dict, out_dir: Path, dual: bool,
              save: Callable[[Int8Bank, int, Path], Path] = save_package) -> None:
    """Stage, requantize, serialize one procedure and release its bank."""
    bank = build_bank(procedure.rows, procedure.in_features, _row_reader(procedure, modules),
                      _bias(procedure, modules))
    procedure.staged_rows = procedure.rows
    procedure.error = bank.error
    procedure.bank_bytes = bank.nbytes
    ranges = halves(procedure.rows) if dual and procedure.rows >= 2 else [(0, procedure.rows)]
    for index, (start, stop) in enumerate(ranges):
        suffix = f".bank{index}" if len(ranges) == 2 else ""
        path = save(bank.rows_of(start, stop), procedure.tokens, out_dir / f"{procedure.name}{suffix}.mlpackage")
        procedure.packages.append(path)
        procedure.bank_rows.append(stop - start)
    del bank


def staged_build(model, targets: list[Target], plan: SplitPlan, tokens: int, out_dir: Path, *,
                 dual: bool, save: Callable[[Int8Bank, int, Path], Path] = save_package) -> StagedBuild:
    """Build every ane procedure of the plan into `out_dir`, one at a time, measuring the
    build's peak extra memory (MLX and host) and the buffer cache it leaves behind."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    build = StagedBuild()
    modules = dict(model.named_modules())
    start = time.perf_counter()
    preload()  # coremltools' imports are not the build's memory

    def work() -> None:
        for procedure in plan_procedures(targets, plan, tokens):
            try:
                build_one(procedure, modules, out_dir, dual, save)
            except Exception as error:  # noqa: BLE001 - one layer's failure is reported, the rest go on
                failure = Failure(procedure.name, f"{type(error).__name__}: {error}")
                build.failures.append(failure)
                log.warning("prefill %s", failure.warning)
                continue
            build.procedures.append(procedure)
            mx.synchronize()

    def measured() -> None:
        _, build.host_peak_extra_bytes = host_peak_extra_bytes(work)

    build.peak_extra_bytes = peak_extra_bytes(measured)
    mx.clear_cache()
    build.retained_cache_bytes = mx.get_cache_memory()
    build.build_s = time.perf_counter() - start
    return build
