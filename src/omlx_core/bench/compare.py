"""How two sets of results relate: per-metric ratios B/A with intervals, and the CI gate.

A is the reference (the first `--compare` variant, stock mlx-lm for `--baseline`, the
stored document for `--against`), B the candidate. Every ratio is median(B)/median(A) of
the raw repeats; for tok/s above 1 means B is faster, for seconds and bytes above 1 means
B takes more. The gate looks at one metric (prefill tok/s) at every context length and
fails when any ratio is below the threshold: a regression at one length is a regression.
"""

import math

from omlx_core.bench.schema import OFFLINE_METRICS
from omlx_core.bench.stats import bootstrap_ratio

GATE_METRIC = "prefill_tps"


def _key(result: dict) -> tuple:
    return (result["ctx"], result["batch"], result["gen"])


def compare_results(a_results: list[dict], b_results: list[dict], a_name: str,
                    b_name: str) -> list[dict]:
    """One comparison per workload (ctx, batch, gen) present in both lists."""
    by_key = {_key(result): result for result in a_results}
    comparisons = []
    for b in b_results:
        a = by_key.get(_key(b))
        if a is None:
            continue
        metrics = {}
        for metric in OFFLINE_METRICS:
            a_samples = [s for s in a["metrics"][metric]["samples"] if s is not None]
            b_samples = [s for s in b["metrics"][metric]["samples"] if s is not None]
            metrics[metric] = (bootstrap_ratio(a_samples, b_samples).as_dict()
                               if a_samples and b_samples else None)
        comparisons.append({"a": a_name, "b": b_name, "ctx": b["ctx"], "batch": b["batch"],
                            "gen": b["gen"], "metrics": metrics})
    return comparisons


def workload_mismatch(a_results: list[dict], b_results: list[dict]) -> list[tuple]:
    """Workloads (ctx, batch, gen) that B ran and A has no result for."""
    present = {_key(result) for result in a_results}
    return [_key(result) for result in b_results if _key(result) not in present]


def gate(comparisons: list[dict], fail_below: float, metric: str = GATE_METRIC) -> dict:
    """Passed unless some B/A ratio of `metric` is below `fail_below` (or none could be taken)."""
    worst_ratio, worst_ctx = math.inf, None
    for comparison in comparisons:
        found = comparison["metrics"].get(metric)
        ratio = found["ratio"] if found else None
        if ratio is None or not math.isfinite(ratio):
            continue
        if ratio < worst_ratio:
            worst_ratio, worst_ctx = ratio, comparison["ctx"]
    measured = worst_ctx is not None
    return {"metric": metric, "fail_below": fail_below,
            "worst_ratio": worst_ratio if measured else None, "worst_ctx": worst_ctx,
            "passed": measured and worst_ratio >= fail_below}


def compare_against(document: dict, baseline: dict, label: str) -> tuple[list[dict], list[str]]:
    """This run (B) against a stored offline document (A); returns comparisons and warnings.

    A is the stored document's first omlx variant, B this run's first. Every workload this
    run measured must be in the stored one; a different model or machine is only a warning,
    since a CI job may mean exactly that, but the reader should know.
    """
    from omlx_core.errors import InputError

    if baseline["mode"] != "offline":
        raise InputError(f"{label}: a {baseline['mode']} document; --against needs an offline one")
    reference = next((v["name"] for v in baseline["variants"] if v["runner"] == "omlx"), None)
    if reference is None:
        raise InputError(f"{label}: has no omlx variant to compare against")
    a_results = [r for r in baseline["results"] if r["variant"] == reference]
    b_name = document["variants"][0]["name"]
    b_results = [r for r in document["results"] if r["variant"] == b_name]
    missing = workload_mismatch(a_results, b_results)
    if missing:
        have = sorted({_key(r) for r in a_results})
        raise InputError(f"{label}: no result for (ctx, batch, gen) {missing}; it has {have}. "
                         "Run with the same --ctx, --batch and --gen as the stored baseline")
    warnings = []
    if baseline["model"]["fingerprint"] != document["model"]["fingerprint"]:
        warnings.append(f"{label} measured a different model ({baseline['model']['name']}, "
                        f"{baseline['model']['fingerprint']})")
    if baseline["hardware"]["fingerprint"] != document["hardware"]["fingerprint"]:
        warnings.append(f"{label} was measured on different hardware "
                        f"({baseline['hardware']['fingerprint']}); ratios mix machines")
    return compare_results(a_results, b_results, f"baseline:{label}", b_name), warnings
