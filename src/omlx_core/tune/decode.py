"""The decode half of `omlx tune`: keep a dense copy of the weights (`compute.dense_copy`) or not.

Why: batched decode of a quantized model runs the quantized matmul at 1-64 tokens, far below
memory bandwidth on some backends; a dense copy of every weight (charged to the memory guard)
makes it a plain GEMM at the price of that memory. Which wins depends on the machine and its
kernels (on the H200 the qmm_decode kernel beat the copy at 32 sequences; without the kernel
the copy was 6x faster than MLX's quantized matmul there), so it is measured, not assumed: the
decode tok/s of `batch` sequences with the copy off and on, in alternating rounds (each model
load's first run discarded), and the copy is recommended only when it wins beyond noise (the
bootstrap interval of on/off above 1, and at least MIN_GAIN) with its peak memory under the
hard watermark. Otherwise `off` is staged, and the report says why.
"""

from dataclasses import asdict, dataclass, field

from omlx_core.bench.stats import bootstrap_ratio
from omlx_core.tune.search import MIN_GAIN, VERIFY_ROUNDS

MIN_DECODE_TOKENS = 16  # steps a decode measurement times, at least: a few are all noise
CHOICES = ("off", "on")


@dataclass
class DenseCopyChoice:
    batch: int
    ctx: int  # prompt tokens before the decode measured
    tokens: int  # tokens generated per sequence
    samples: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in CHOICES})  # decode tok/s
    peak_bytes: dict[str, int] = field(default_factory=lambda: {c: 0 for c in CHOICES})
    ratio: dict | None = None  # on / off, with its bootstrap interval
    choice: str = "off"
    reason: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def tune_dense_copy(calibrator, sets: dict[str, str], batch: int, rounds: int = VERIFY_ROUNDS,
                    on_event=lambda what, result: None) -> DenseCopyChoice:
    """Decode tok/s with `sets` (the prefill recommendation) and the copy off, then on, ...;
    the choice and why."""
    workload = calibrator.workload
    found = DenseCopyChoice(batch, min(workload.ctx), max(workload.gen, MIN_DECODE_TOKENS))
    for round_ in range(rounds):
        for copy in (CHOICES if round_ % 2 == 0 else CHOICES[::-1]):
            on_event(f"decode at batch {batch}: dense copy {copy}", None)
            tps, peak = calibrator.measure_decode({**sets, "compute.dense_copy": copy}, batch,
                                                  found.ctx, found.tokens)
            found.samples[copy].append(tps)
            found.peak_bytes[copy] = max(found.peak_bytes[copy], peak)
    calibrator.release()
    ratio = bootstrap_ratio(found.samples["off"], found.samples["on"])
    found.ratio = ratio.as_dict()
    measured = f"{ratio.ratio:.3f}x the decode tok/s without it (95% interval {ratio.low:.3f}-{ratio.high:.3f})"
    if found.peak_bytes["on"] > calibrator.hard_bytes:
        found.reason = (f"the dense copy's peak memory {found.peak_bytes['on']} B crosses the hard watermark "
                        f"({calibrator.hard_bytes} B)")
    elif ratio.low > 1.0 and ratio.ratio >= 1.0 + MIN_GAIN:
        found.choice = "on"
        found.reason = f"the dense copy gave {measured} at batch {batch}"
    else:
        found.reason = f"the dense copy did not win beyond noise at batch {batch}: {measured}"
    return found
