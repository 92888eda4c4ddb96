"""The ane lane at prefill time: loaded procedures, and the rows each projection takes.

A `LoadedProcedure` holds the compiled bank(s) of one procedure and runs inputs of any
length through the fixed prefill shape: rows are cut into chunks of `tokens`, the last
one zero-padded, each chunk sent to its bank(s) (both at once on dual ANE, each computing
its half of the output channels) and the results concatenated. `AneRows` is what a
`SplitLinear` calls for its ane slice: its segment of the procedure's output. The fused
gate/up procedure runs once per input: the gate's call computes both halves and the up
projection's call, given the same MLX input, takes its half from the cache.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from omlx_core.prefill.ane.program import INPUT, OUTPUT
from omlx_core.prefill.ane.runtime import Predictor
from omlx_core.prefill.ane.staged import Procedure, Segment


class LoadedProcedure:
    def __init__(self, procedure: Procedure, banks: list[Predictor]):
        if len(banks) != len(procedure.bank_rows):
            raise ValueError(f"{procedure.name}: {len(banks)} loaded banks for {len(procedure.bank_rows)} packages")
        self.procedure = procedure
        self.banks = banks
        self.calls = 0
        self._pair = ThreadPoolExecutor(max_workers=2, thread_name_prefix="omlx-ane-dual") if len(banks) == 2 else None
        self._lock = threading.Lock()
        self._cached: tuple[object, np.ndarray, set[str]] | None = None  # (source, output, paths not read yet)

    def warm(self) -> None:
        """One prediction per bank on the fixed shape, so the first prefill runs at speed."""
        zeros = np.zeros((self.procedure.tokens, self.procedure.in_features), dtype=np.float16)
        for bank, rows in zip(self.banks, self.procedure.bank_rows):
            out = np.asarray(bank.predict({INPUT: zeros})[OUTPUT])
            if out.shape != (self.procedure.tokens, rows):
                raise ValueError(f"{self.procedure.name}: warm-up gave shape {out.shape}, "
                                 f"expected {(self.procedure.tokens, rows)}")

    def _chunk(self, chunk: np.ndarray) -> np.ndarray:
        def run(bank: Predictor) -> np.ndarray:
            return np.asarray(bank.predict({INPUT: chunk})[OUTPUT])

        if self._pair is not None:
            return np.concatenate(list(self._pair.map(run, self.banks)), axis=-1)
        return run(self.banks[0])

    def run(self, x: np.ndarray) -> np.ndarray:
        """(n, in_features) -> (n, rows) float32, any n, through the fixed (tokens, in) shape."""
        tokens = self.procedure.tokens
        n = x.shape[0]
        out = np.empty((n, self.procedure.rows), dtype=np.float32)
        chunk = np.zeros((tokens, self.procedure.in_features), dtype=np.float16)
        for start in range(0, n, tokens):
            stop = min(start + tokens, n)
            chunk[:stop - start] = x[start:stop]
            chunk[stop - start:] = 0
            out[start:stop] = self._chunk(chunk)[:stop - start]
        self.calls += 1
        return out

    def rows_for(self, segment: Segment, x: np.ndarray, source: object) -> np.ndarray:
        """The segment's rows for input `x` (whose MLX original is `source`), running the
        procedure only if this input's output is not cached from a sibling segment."""
        with self._lock:
            cached = self._cached
            if cached is None or cached[0] is not source or segment.path not in cached[2]:
                output = self.run(x)
                cached = (source, output, {s.path for s in self.procedure.segments})
            cached[2].discard(segment.path)
            self._cached = cached if cached[2] else None  # every sibling read: drop it
            return cached[1][:, segment.offset:segment.offset + segment.rows]


class AneRows:
    """A projection's ane slice: its segment of one loaded procedure."""

    nbytes = 0  # Core ML holds the weights; charged through the lane's resident bytes

    def __init__(self, procedure: LoadedProcedure, segment: Segment):
        self.procedure = procedure
        self.segment = segment

    def __call__(self, x: np.ndarray, source: object = None) -> np.ndarray:
        flat = x.reshape(-1, x.shape[-1])
        out = self.procedure.rows_for(self.segment, flat, source if source is not None else x)
        return out.reshape(*x.shape[:-1], self.segment.rows)
