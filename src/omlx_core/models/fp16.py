"""Exact bf16/fp32 → fp16 conversion in numpy, fast enough to stream checkpoints.

numpy's own `astype(float16)` is a scalar loop on most builds (about 60 ns a value), so a
multi-GB checkpoint would take minutes. These functions build the fp16 bits with vector
integer ops instead, rounding to nearest-even like `astype`, and count what float16 cannot
hold: finite values beyond ±65504 (overflow: inf, or ±65504 with `clamp`) and non-zero
values too small for its smallest subnormal (underflow: they become ±0). Values near zero
or out of range are rare in weights, so they take a slower exact path on just those
elements. Arrays hold raw bits: uint16 for bf16 and fp16, uint32 for fp32.
"""

from dataclasses import dataclass

import numpy as np

FP16_MAX = 65504.0
FP16_INF, FP16_MAX_BITS, FP16_NAN = 0x7C00, 0x7BFF, 0x7E00

# Magnitude bit patterns (sign cleared) where the fast path stops being exact.
_BF16_SMALL, _BF16_BIG, _BF16_INF = 0x3880, 0x4780, 0x7F80  # 2**-14, 65536, inf
_F32_SMALL, _F32_BIG, _F32_INF = 0x38800000, 0x477FF000, 0x7F800000  # 2**-14, 65520, inf


@dataclass
class RangeCounts:
    """Per tensor: finite values beyond the fp16 range, non-zero values that became zero."""

    overflow: int = 0
    underflow: int = 0

    def add(self, other: "RangeCounts") -> None:
        self.overflow += other.overflow
        self.underflow += other.underflow


def _fix_edges(magnitude_as_f32: np.ndarray, sign: np.ndarray, small: np.ndarray,
               out: np.ndarray, idx: np.ndarray, clamp: bool) -> RangeCounts:
    """Exact fp16 bits for the elements `idx`, which are near zero or beyond the range.

    Below 2**-14 fp16 is fixed-point in steps of 2**-24, so rint(|x| * 2**24) is the
    answer (1024 is the smallest normal, which is the right bit pattern too).
    """
    counts = RangeCounts()
    values = magnitude_as_f32
    tiny = small
    if tiny.any():
        scaled = np.rint(values[tiny] * np.float32(2**24)).astype(np.uint16)
        counts.underflow = int(np.count_nonzero((scaled == 0) & (values[tiny] != 0)))
        out[idx[tiny]] = scaled | sign[tiny]
    large = ~tiny
    if large.any():
        big = values[large]
        finite = np.isfinite(big)
        counts.overflow = int(np.count_nonzero(finite))
        bits = np.where(finite, FP16_MAX_BITS if clamp else FP16_INF,
                        np.where(np.isnan(big), FP16_NAN, FP16_INF)).astype(np.uint16)
        out[idx[large]] = bits | sign[large]
    return counts


class Converter:
    """Reusable scratch buffers for converting chunks of up to `capacity` values."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._a16 = np.empty(capacity, np.uint16)
        self._b16 = np.empty(capacity, np.uint16)
        self._a32 = np.empty(capacity, np.uint32)
        self._b32 = np.empty(capacity, np.uint32)

    def bf16(self, src: np.ndarray, out: np.ndarray, clamp: bool) -> RangeCounts:
        """bf16 bits → fp16 bits. In the normal range it is exact: shift the 7-bit mantissa
        left by 3 and rebias the exponent by 127 - 15 (as 0xC000 after the shift, mod 2**16)."""
        n = len(src)
        magnitude, sign = self._a16[:n], self._b16[:n]
        np.bitwise_and(src, 0x7FFF, out=magnitude)
        np.left_shift(src, 3, out=out)
        np.subtract(out, 0xC000, out=out)
        np.bitwise_and(src, 0x8000, out=sign)
        np.bitwise_or(out, sign, out=out)
        if n == 0 or (magnitude.min() >= _BF16_SMALL and magnitude.max() < _BF16_BIG):
            return RangeCounts()
        edge = (magnitude < _BF16_SMALL) | (magnitude >= _BF16_BIG)
        idx = np.flatnonzero(edge)
        picked = magnitude[idx]
        as_f32 = (picked.astype(np.uint32) << 16).view(np.float32)
        return _fix_edges(as_f32, sign[idx], picked < _BF16_SMALL, out, idx, clamp)

    def f32(self, src: np.ndarray, out: np.ndarray, clamp: bool) -> RangeCounts:
        """fp32 bits → fp16 bits: rebias the exponent and round the 13 dropped mantissa
        bits to nearest-even by adding 0xFFF plus the lowest kept bit, then shift."""
        n = len(src)
        magnitude, scratch = self._a32[:n], self._b32[:n]
        np.bitwise_and(src, 0x7FFFFFFF, out=magnitude)
        np.right_shift(src, 13, out=scratch)
        np.bitwise_and(scratch, 1, out=scratch)
        np.add(scratch, magnitude, out=scratch)
        np.add(scratch, 0xC8000FFF, out=scratch)  # (15 - 127) << 23, mod 2**32, + 0xFFF
        np.right_shift(scratch, 13, out=scratch)
        np.copyto(out, scratch, casting="unsafe")
        np.right_shift(src, 16, out=scratch)
        np.bitwise_and(scratch, 0x8000, out=scratch)
        sign = self._a16[:n]
        np.copyto(sign, scratch, casting="unsafe")
        np.bitwise_or(out, sign, out=out)
        if n == 0 or (magnitude.min() >= _F32_SMALL and magnitude.max() < _F32_BIG):
            return RangeCounts()
        edge = (magnitude < _F32_SMALL) | (magnitude >= _F32_BIG)
        idx = np.flatnonzero(edge)
        picked = magnitude[idx]
        return _fix_edges(picked.view(np.float32), sign[idx], picked < _F32_SMALL, out, idx, clamp)


def f64_to_fp16(src: np.ndarray, out: np.ndarray, clamp: bool) -> RangeCounts:
    """float64 values → fp16 bits with numpy's own (slow, exact) cast; f64 checkpoints are rare."""
    finite = np.isfinite(src)
    beyond = finite & (np.abs(src) >= 65520.0)  # rounds to inf in fp16
    counts = RangeCounts(overflow=int(np.count_nonzero(beyond)))
    values = np.where(beyond, np.copysign(FP16_MAX, src), src) if clamp and counts.overflow else src
    with np.errstate(over="ignore", invalid="ignore"):
        half = values.astype(np.float16)
    counts.underflow = int(np.count_nonzero((half == 0) & (src != 0)))
    np.copyto(out, half.view(np.uint16))
    return counts
