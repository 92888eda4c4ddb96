"""INT8 banks: the ane lane's rows of a projection, requantized per output channel.

The Neural Engine takes INT8 weights with one float16 scale per output channel. The rows
are symmetric (no zero point): q = round(w / scale) in [-127, 127], scale = max|w| / 127
rounded to float16 first, so that q * scale is exactly what the ANE computes. This is
approximate by design: every bank carries its error against the source rows (weights and
the layer's output on sample activations), and the tuner weighs it.

Rows are converted in blocks, straight into the bank, so requantizing never holds more
than a block of the slice in float32 (a row's scale only depends on that row).
"""

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

QMAX = 127
SAMPLE_TOKENS = 64  # rows of sample activations for the output error
_SMALLEST_SCALE = float(np.finfo(np.float16).smallest_subnormal)


@dataclass(frozen=True)
class BankError:
    """A bank against its source rows: `max_abs`/`rel_rms` of the weights, and of the
    layer's output on sample activations."""

    max_abs: float
    rel_rms: float
    output_max_abs: float
    output_rel_rms: float

    def as_dict(self) -> dict:
        return {k: float(f"{v:.6g}") for k, v in asdict(self).items()}

    @staticmethod
    def worst(errors: list["BankError"]) -> "BankError":
        return BankError(*(max(getattr(e, name) for e in errors) for name in
                           ("max_abs", "rel_rms", "output_max_abs", "output_rel_rms")))


@dataclass
class Int8Bank:
    """Rows of one projection (or several, concatenated) as INT8 with float16 scales."""

    q: np.ndarray  # int8 (rows, in_features)
    scales: np.ndarray  # float16 (rows,)
    bias: np.ndarray | None  # float16 (rows,) or None
    error: BankError

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes + (self.bias.nbytes if self.bias is not None else 0)

    def dequantized(self) -> np.ndarray:
        return self.q.astype(np.float32) * self.scales.astype(np.float32)[:, None]

    def rows_of(self, start: int, stop: int) -> "Int8Bank":
        """Rows [start, stop) as views of this bank (dual banks share the staged arrays)."""
        return Int8Bank(self.q[start:stop], self.scales[start:stop],
                        None if self.bias is None else self.bias[start:stop], self.error)


def row_scales(weight: np.ndarray) -> np.ndarray:
    """Float16 per-row scales of a float32 (rows, in) block: max|w| / 127."""
    amax = np.maximum(weight.max(axis=1), -weight.min(axis=1))  # no |w| temporary
    return np.maximum(amax / QMAX, _SMALLEST_SCALE).astype(np.float16)


def quantize_rows(weight: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-row INT8 of a float32 (rows, in) block: (q int8, scales float16).
    With `out` (float32, the block's shape) the rounding happens there and `out` is left
    holding q * scale, the values the ANE computes with."""
    scales = row_scales(weight)
    wide = scales.astype(np.float32)[:, None]
    buffer = np.divide(weight, wide, out=out)
    np.rint(buffer, out=buffer)
    np.clip(buffer, -QMAX, QMAX, out=buffer)
    q = buffer.astype(np.int8)
    np.multiply(buffer, wide, out=buffer)
    return q, scales


def sample_activations(in_features: int, tokens: int = SAMPLE_TOKENS, seed: int = 0) -> np.ndarray:
    """Seeded unit-variance activations, the scale a normed hidden state has."""
    return np.random.default_rng(seed).standard_normal((tokens, in_features), dtype=np.float32)


def _max_abs(values: np.ndarray) -> float:
    return float(max(values.max(initial=0.0), -values.min(initial=0.0)))


class _ErrorSums:
    """Running sums for the error metrics, one block of rows at a time."""

    def __init__(self):
        self.max_abs = self.out_max = 0.0
        self.err2 = self.ref2 = self.out_err2 = self.out_ref2 = 0.0

    def add(self, weight: np.ndarray, approx: np.ndarray, activations: np.ndarray) -> None:
        """Accumulate one block; `approx` is overwritten with the difference."""
        out = activations @ weight.T
        out_diff = out - activations @ approx.T
        diff = np.subtract(weight, approx, out=approx)
        self.max_abs = max(self.max_abs, _max_abs(diff))
        self.err2 += float(np.dot(diff.ravel(), diff.ravel()))
        self.ref2 += float(np.dot(weight.ravel(), weight.ravel()))
        self.out_max = max(self.out_max, _max_abs(out_diff))
        self.out_err2 += float(np.dot(out_diff.ravel(), out_diff.ravel()))
        self.out_ref2 += float(np.dot(out.ravel(), out.ravel()))

    def result(self) -> BankError:
        def rel(err: float, ref: float) -> float:
            return float(np.sqrt(err / ref)) if ref > 0 else 0.0

        return BankError(self.max_abs, rel(self.err2, self.ref2), self.out_max, rel(self.out_err2, self.out_ref2))


def build_bank(rows: int, in_features: int, read_rows: Callable[[int, int], np.ndarray],
               bias: np.ndarray | None = None, activations: np.ndarray | None = None,
               blocks: int = 16) -> Int8Bank:
    """Requantize `rows` source rows, read as float32 blocks by `read_rows(start, stop)`."""
    if activations is None:
        activations = sample_activations(in_features)
    q = np.empty((rows, in_features), dtype=np.int8)
    scales = np.empty((rows,), dtype=np.float16)
    sums = _ErrorSums()
    step = max(1, -(-rows // blocks))
    buffer = np.empty((step, in_features), dtype=np.float32)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        weight = np.asarray(read_rows(start, stop), dtype=np.float32)
        approx = buffer[:stop - start]
        q[start:stop], scales[start:stop] = quantize_rows(weight, out=approx)
        sums.add(weight, approx, activations)
        del weight
    del buffer
    return Int8Bank(q, scales, None if bias is None else np.asarray(bias, dtype=np.float16), sums.result())
