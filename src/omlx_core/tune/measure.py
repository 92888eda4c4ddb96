"""Measuring one candidate: its prefill tok/s on the calibration prompts, and its peak memory.

The model is loaded and prepared (`bench.offline.prepare_model`) once per distinct
prefill install (lanes and fast paths); candidates that differ only in chunk size reuse
it. Only one prepared model is held at a time: switching, or `release()`, drops every
reference, collects and clears MLX's buffer cache before the next load, so candidates
never stack up in memory. A run is the bench's own loop (`bench.runs.run_generation`):
the first `warmup` runs at each length are discarded, then the median of `repeats`.
"""

import gc
import statistics
import time
from dataclasses import dataclass, field

import mlx.core as mx

from omlx_core.bench.memory import PeakMemory
from omlx_core.bench.offline import install_key, prepare_model
from omlx_core.bench.runs import run_generation
from omlx_core.bench.workload import synthetic_prompts


@dataclass
class Result:
    label: str
    settings: dict[str, str]
    prefill_tps: float | None = None  # all prompt tokens / all prefill time, medians per length
    per_ctx: dict[int, float] = field(default_factory=dict)  # median prefill tok/s per length
    samples: list[float] = field(default_factory=list)  # per repeat, over every length
    peak_bytes: int = 0
    rejected: str | None = None  # why it may not be recommended
    gdn_calls: int = 0  # split gated-delta projections that ran (0: the GDN share did nothing)
    ane_error: float = 0.0  # worst output relative RMS of the ane lane's INT8 banks (0: no ane)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"label": self.label, "settings": self.settings, "prefill_tps": self.prefill_tps,
                "per_ctx": {str(k): v for k, v in self.per_ctx.items()}, "samples": self.samples,
                "peak_bytes": self.peak_bytes, "rejected": self.rejected, "ane_error": self.ane_error,
                "seconds": round(self.seconds, 3)}


def ane_output_error(lanes) -> float:
    """The approximate lane's cost the tuner weighs: its worst bank's output error."""
    ane = getattr(lanes, "ane", None)
    errors = [p.procedure.error.output_rel_rms for p in (ane.loaded if ane else []) if p.procedure.error]
    return max(errors, default=0.0)


class Calibrator:
    def __init__(self, ref, settings_for, workload, hard_bytes: int):
        self.ref = ref
        self.settings_for = settings_for  # dict of --set texts -> EffectiveSettings
        self.workload = workload
        self.hard_bytes = hard_bytes
        self.loads = 0
        self._prepared = None
        self._key = None

    def _model(self, sets: dict[str, str]):
        settings = self.settings_for(sets)
        key = install_key(settings)
        if key != self._key:
            self.release()
            self._prepared = prepare_model(self.ref, settings)
            self._key = key
            self.loads += 1
        return self._prepared

    def measure_decode(self, sets: dict[str, str], batch: int, ctx: int, tokens: int) -> tuple[float, int]:
        """(decode tok/s, peak bytes) of `batch` sequences of `ctx` prompt tokens generating
        `tokens` each; a fresh load's first run (its compiles) is run and discarded."""
        loads = self.loads
        prepared = self._model(sets)
        prompts = synthetic_prompts(prepared.vocabulary, ctx, batch, self.workload.seed)
        chunk = int(sets["prefill.chunk_size"])
        for _ in range(2 if self.loads != loads else 1):
            memory = PeakMemory()
            run = run_generation(prepared.model, prompts, tokens, chunk, prepared.suppress, memory)
        return run.decode_tps, run.peak_mlx_memory_bytes

    def release(self) -> None:
        """Drop the prepared model and give MLX's memory back."""
        self._prepared = None
        self._key = None
        gc.collect()
        mx.clear_cache()

    def measure(self, label: str, sets: dict[str, str]) -> Result:
        started = time.perf_counter()
        result = Result(label, dict(sets))
        prepared = self._model(sets)
        chunk = int(sets["prefill.chunk_size"])
        memory = PeakMemory()
        tokens, per_repeat = 0, [0.0] * self.workload.repeats
        for ctx in self.workload.ctx:
            prompts = synthetic_prompts(prepared.vocabulary, ctx, 1, self.workload.seed)
            times = []
            for round_ in range(self.workload.warmup + self.workload.repeats):
                run = run_generation(prepared.model, prompts, self.workload.gen, chunk,
                                     prepared.suppress, memory)
                result.peak_bytes = max(result.peak_bytes, run.peak_mlx_memory_bytes)
                if round_ >= self.workload.warmup:
                    times.append(run.ttft_s)
            result.per_ctx[ctx] = ctx / statistics.median(times)
            tokens += ctx
            for i, seconds in enumerate(times):
                per_repeat[i] += seconds
        result.prefill_tps = tokens / sum(ctx / tps for ctx, tps in result.per_ctx.items())
        result.samples = [tokens / seconds for seconds in per_repeat]
        lanes = prepared.lanes
        result.gdn_calls = sum(layer.calls for layer in (lanes.split_layers if lanes else [])
                               if ".linear_attn." in layer.path)
        if result.peak_bytes > self.hard_bytes:
            result.rejected = (f"peak memory {result.peak_bytes} B crosses the hard watermark "
                               f"({self.hard_bytes} B)")
        result.ane_error = ane_output_error(lanes)
        limit = float(self.settings_for(sets)["prefill.ane.max_error"])
        if result.ane_error > limit and result.rejected is None:
            result.rejected = (f"the ane lane's INT8 output error {result.ane_error:.4g} (relative RMS) "
                               f"exceeds prefill.ane.max_error {limit:g}")
        result.seconds = time.perf_counter() - started
        return result
