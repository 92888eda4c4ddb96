"""Summaries of repeated measurements, and how sure a ratio between two of them is.

A benchmark figure is never one number: it is the median of several repeats, reported
with the mean, the sample standard deviation (n - 1) and the range, so a reader can tell
a real change from noise. A ratio between two variants comes with a bootstrap 95%
interval, resampled from the repeats with a fixed seed so the same data give the same
interval every time.
"""

import math
import statistics
from dataclasses import asdict, dataclass

import numpy as np

BOOTSTRAP_RESAMPLES = 4000
BOOTSTRAP_SEED = 0


@dataclass(frozen=True)
class Summary:
    median: float
    mean: float
    stddev: float  # sample standard deviation; 0 for a single sample
    min: float
    max: float
    samples: tuple[float, ...]

    def as_dict(self) -> dict:
        document = asdict(self)
        document["samples"] = list(self.samples)
        return document


def summarize(samples) -> Summary:
    values = [float(value) for value in samples]
    if not values:
        raise ValueError("no samples to summarize")
    return Summary(
        median=statistics.median(values),
        mean=statistics.fmean(values),
        stddev=statistics.stdev(values) if len(values) > 1 else 0.0,
        min=min(values),
        max=max(values),
        samples=tuple(values),
    )


def percentiles(samples, points=(50, 90, 99)) -> dict:
    """`{"p50": …, "p90": …, "p99": …, "mean": …}` (linear interpolation); None when empty."""
    values = np.asarray([float(value) for value in samples], dtype=np.float64)
    if values.size == 0:
        return {**{f"p{p}": None for p in points}, "mean": None}
    found = {f"p{p}": float(np.percentile(values, p)) for p in points}
    found["mean"] = float(values.mean())
    return found


@dataclass(frozen=True)
class Ratio:
    """median(b) / median(a), and the bootstrap interval [low, high] at confidence `level`."""

    ratio: float
    low: float
    high: float
    level: float = 0.95

    def as_dict(self) -> dict:
        return asdict(self)


def bootstrap_ratio(a, b, *, level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                    seed: int = BOOTSTRAP_SEED) -> Ratio:
    """How much larger b is than a, from their medians, and a percentile bootstrap interval.

    a and b are resampled independently (with replacement), since their repeats are separate
    runs; the interval is the central `level` share of the resampled median ratios.
    """
    a = np.asarray([float(value) for value in a], dtype=np.float64)
    b = np.asarray([float(value) for value in b], dtype=np.float64)
    if a.size == 0 or b.size == 0:
        raise ValueError("a ratio needs samples on both sides")
    point = _ratio(np.median(b), np.median(a))
    rng = np.random.default_rng(seed)
    a_medians = np.median(a[rng.integers(0, a.size, (resamples, a.size))], axis=1)
    b_medians = np.median(b[rng.integers(0, b.size, (resamples, b.size))], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = b_medians / a_medians
    ratios = ratios[np.isfinite(ratios)]
    if ratios.size == 0:
        return Ratio(point, math.nan, math.nan, level)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return Ratio(point, float(low), float(high), level)


def _ratio(numerator: float, denominator: float) -> float:
    return float(numerator / denominator) if denominator else math.nan
