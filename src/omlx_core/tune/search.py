"""The tuning procedure: coarse grid, refinement, release, fresh-load verification.

1. Coarse: coordinate descent from the default, one control at a time over its grid,
   keeping the best candidate so far; 2. refinement: values between the best value of
   each numeric control and its grid neighbours. Both stop when `budget_s` is spent.
   Candidates that run the same work here (`space.effective_key`) are measured once,
   and ones whose peak memory crosses the hard watermark are rejected.
3. Verification: every calibration engine is released (references dropped,
   `gc.collect()`, MLX's cache cleared; the memory left is recorded against the
   baseline), then the default, the best candidate and its nearest rival (if within 5%:
   one calibration run cannot tell near ties apart) are loaded fresh and measured in
   alternating rounds. The fastest of them is recommended only if it beats the default
   beyond noise: the bootstrap interval of its ratio lies above 1 and the ratio is at least
   1 + MIN_GAIN. Otherwise the recommendation is the default, and the report says so.
"""

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from omlx_core.bench.stats import bootstrap_ratio
from omlx_core.tune.measure import Calibrator, Result
from omlx_core.tune.space import Candidate, SearchSpace, effective_key, refinements

MIN_GAIN = 0.02
VERIFY_ROUNDS = 3
FINALISTS = 2  # candidates re-measured on fresh loads: the best and its nearest rival
NEAR_TIE = 0.05  # a rival within this share of the best is a finalist too

Event = Callable[[str, Result | None], None]  # (what happens, the result it produced)


@dataclass
class Outcome:
    candidates: list[Result] = field(default_factory=list)
    best: Result | None = None
    default: Result | None = None
    verification: dict = field(default_factory=dict)
    recommended: Candidate | None = None
    is_default: bool = True
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    budget_exhausted: bool = False


def tune(space: SearchSpace, calibrator: Calibrator, max_ctx: int, budget_s: float,
         on_event: Event = lambda what, result: None) -> Outcome:
    outcome = Outcome(notes=list(space.notes))
    baseline = mx.get_active_memory()
    started = time.monotonic()
    measured: dict[tuple, tuple[Candidate, Result]] = {}

    def over_budget() -> bool:
        if time.monotonic() - started > budget_s:
            outcome.budget_exhausted = True
        return outcome.budget_exhausted

    def measure(candidate: Candidate) -> Result:
        key = effective_key(candidate, max_ctx)
        if key not in measured:
            on_event(f"measuring {candidate.label}", None)
            result = calibrator.measure(candidate.label, candidate.settings())
            measured[key] = (candidate, result)
            outcome.candidates.append(result)
            on_event("measured", result)
        return measured[key][1]

    def better(a: Result, b: Result) -> bool:
        return a.rejected is None and (b.rejected is not None or a.prefill_tps > b.prefill_tps)

    default = space.default()
    best, best_result = default, measure(default)
    passes = [("coarse", lambda control, value: control.values),
              ("refine", lambda control, value: refinements(control, value))]
    for _, values_of in passes:
        for control in list(space.controls):
            if control not in space.controls:
                continue  # dropped during this pass
            for value in values_of(control, best.get(control.name)):
                if over_budget():
                    break
                candidate = best.with_value(control.name, value)
                result = measure(candidate)
                if control.name == "cpu_share.gdn_qkv" and value and result.gdn_calls == 0:
                    space.drop(control.name, "cpu_share.gdn_qkv: left out, no gated-delta "
                               "projection ran on the cpu lane during calibration")
                    outcome.notes.append(space.notes[-1])
                    break
                if better(result, best_result):
                    best, best_result = candidate, result
    outcome.best = best_result
    if outcome.budget_exhausted:
        outcome.notes.append(f"the search stopped at its budget of {budget_s:g} s")

    calibrator.release()
    outcome.memory = {"baseline_bytes": baseline, "after_release_bytes": mx.get_active_memory()}
    on_event("released calibration engines; verifying with fresh loads", None)
    ranked = sorted((pair for pair in measured.values() if pair[0] != default and pair[1].rejected is None),
                    key=lambda pair: -pair[1].prefill_tps)
    finalists = [c for c, r in ranked if r.prefill_tps >= (1 - NEAR_TIE) * best_result.prefill_tps]
    _verify(outcome, default, finalists[:FINALISTS] if best != default else [], calibrator, on_event)
    return outcome


def _verify(outcome: Outcome, default: Candidate, finalists: list[Candidate], calibrator: Calibrator,
            on_event: Event) -> None:
    if not finalists:
        outcome.recommended, outcome.is_default = default, True
        outcome.reason = "no candidate beat the default during calibration"
        outcome.default = outcome.best
        return
    sides = [("default", default)] + [(f"finalist {i + 1}", c) for i, c in enumerate(finalists)]
    runs: dict[str, list[Result]] = {name: [] for name, _ in sides}
    for round_ in range(VERIFY_ROUNDS):
        for name, candidate in (sides if round_ % 2 == 0 else sides[::-1]):
            calibrator.release()  # a fresh load for every verification run
            result = calibrator.measure(f"verify {name}: {candidate.label}", candidate.settings())
            runs[name].append(result)
            on_event(f"verify {name}", result)
    calibrator.release()
    merged = {name: _merged(results) for name, results in runs.items()}
    outcome.default = merged["default"]
    contenders = [(name, c) for name, c in sides[1:] if merged[name].rejected is None]
    outcome.verification = {"rounds": VERIFY_ROUNDS,
                            "default": outcome.default.as_dict(),
                            "finalists": [merged[name].as_dict() for name, _ in sides[1:]]}
    if not contenders:
        outcome.recommended, outcome.is_default = default, True
        outcome.reason = "every finalist was rejected on a fresh load: " + "; ".join(
            merged[name].rejected for name, _ in sides[1:])
        return
    name, best = max(contenders, key=lambda pair: merged[pair[0]].prefill_tps)
    ratio = bootstrap_ratio(merged["default"].samples, merged[name].samples)
    outcome.verification.update({"recommended": merged[name].as_dict(), "ratio": ratio.as_dict()})
    if ratio.low > 1.0 and ratio.ratio >= 1.0 + MIN_GAIN:
        outcome.recommended, outcome.is_default = best, False
        outcome.reason = (f"verified {ratio.ratio:.3f}x the default's prefill tok/s "
                          f"(95% interval {ratio.low:.3f}-{ratio.high:.3f}), the fastest of "
                          f"{len(contenders)} finalist(s) on fresh loads")
    else:
        outcome.recommended, outcome.is_default = default, True
        outcome.reason = (f"the best candidate did not beat the default beyond noise on fresh loads "
                          f"({ratio.ratio:.3f}x, 95% interval {ratio.low:.3f}-{ratio.high:.3f})")


def _merged(results: list[Result]) -> Result:
    """One result for several verification runs of one candidate: pooled samples, medians."""
    merged = Result(results[0].label.split(": ", 1)[-1], results[0].settings)
    merged.samples = [s for r in results for s in r.samples]
    merged.prefill_tps = statistics.median(merged.samples)
    merged.per_ctx = {ctx: statistics.median(r.per_ctx[ctx] for r in results) for ctx in results[0].per_ctx}
    merged.peak_bytes = max(r.peak_bytes for r in results)
    merged.rejected = next((r.rejected for r in results if r.rejected), None)
    merged.seconds = sum(r.seconds for r in results)
    return merged
