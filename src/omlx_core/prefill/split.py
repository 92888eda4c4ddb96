"""Split linears: one projection computed as output-channel slices on several lanes at once.

This is the one way omlx changes a model: a target module is replaced, by name, with a
`SplitLinear` that keeps the original for decode and small inputs and, for prefill-sized
inputs, computes the gpu rows with MLX while the cpu lane computes its rows with host BLAS
and the ane lane its rows with Core ML, each on its own thread, then concatenates along the
output dimension in slice order. mlx-lm's functions are never patched.

The cpu lane holds its slice as float32 numpy (BLAS has no fast float16 GEMM), made once
at build time, dequantized when the layer is quantized; the ane lane's rows come from its
staged build (`prefill/ane`). If a host lane fails, the MLX work already queued for the
step is evaluated first, then the error is raised with the layer's name: no dangling GPU
work, never a partial result.
"""

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from omlx_core.decode.dense_copy import DenseCopyLinear
from omlx_core.errors import OmlxError
from omlx_core.prefill.fast_paths import DequantizedPrefill, unwrap
from omlx_core.prefill.plan import Slice

DEFAULT_MIN_TOKENS = 256
BUILD_BLOCKS = 8  # a cpu slice is converted in this many row blocks

_executors: dict[str, ThreadPoolExecutor] = {}
_executor_lock = threading.Lock()


def lane_thread(lane: str) -> ThreadPoolExecutor:
    """A host lane's one thread (cpu: BLAS threads itself; ane: Core ML queues its own
    work): one call at a time keeps order, and the lanes run beside each other."""
    with _executor_lock:
        if lane not in _executors:
            _executors[lane] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"omlx-{lane}-lane")
        return _executors[lane]


def dense_rows(module, start: int, stop: int, dtype=mx.float32) -> mx.array:
    """Rows [start, stop) of a linear's weight as `dtype` (dequantized if need be)."""
    module = unwrap(module)
    if isinstance(module, nn.QuantizedLinear):
        return mx.dequantize(module.weight[start:stop], module.scales[start:stop],
                             module.biases[start:stop] if module.biases is not None else None,
                             group_size=module.group_size, bits=module.bits, mode=module.mode,
                             dtype=dtype)
    return module.weight[start:stop].astype(dtype)


def rows_of(module, start: int, stop: int) -> nn.Module:
    """A linear computing rows [start, stop) only; its arrays are slices of the original's."""
    if isinstance(module, DequantizedPrefill):  # the gpu rows keep the dense prefill path
        return DequantizedPrefill(rows_of(module.quantized, start, stop), module.min_tokens, module.kernel)
    if isinstance(module, DenseCopyLinear):  # and the dense copy, sliced, not made again
        return module.rows(start, stop)
    if isinstance(module, nn.QuantizedLinear):
        part = type(module).__new__(type(module))  # keeps a float32-compute subclass (upcast)
        nn.Module.__init__(part)
        part.group_size, part.bits, part.mode = module.group_size, module.bits, module.mode
        part.weight, part.scales = module.weight[start:stop], module.scales[start:stop]
        if module.biases is not None:
            part.biases = module.biases[start:stop]
        else:
            part.biases = None
    else:
        part = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(part)
        part.weight = module.weight[start:stop]
    if "bias" in module:
        part.bias = module.bias[start:stop]
    part.freeze()
    return part


generation = 0  # replacements made so far: a compiled step that holds modules retraces after one


def replace_module(model, path: str, module) -> None:
    """Set the submodule at dotted `path` (list indices included) to `module`: the one way
    omlx changes a model (lanes and fast paths both go through it)."""
    global generation
    generation += 1
    *parents, last = path.split(".")
    owner = model
    for part in parents:
        owner = owner[int(part)] if isinstance(owner, list) else getattr(owner, part)
    if isinstance(owner, list):
        owner[int(last)] = module
    else:
        setattr(owner, last, module)


class CpuSlice:
    """The cpu lane's rows of one linear: float32 weight (out, in) and optional bias."""

    def __init__(self, module, piece: Slice):
        module = unwrap(module)
        # Converted in row blocks straight into the lane's array, so the build never holds
        # more than a fraction of one slice in MLX memory on top of the model.
        self.weight = np.empty((piece.size, module.weight.shape[1] * 32 // module.bits
                                if isinstance(module, nn.QuantizedLinear) else module.weight.shape[1]),
                               dtype=np.float32)
        step = -(-piece.size // BUILD_BLOCKS)
        for row in range(0, piece.size, step):
            block = dense_rows(module, piece.start + row, min(piece.start + row + step, piece.stop))
            self.weight[row:row + block.shape[0]] = np.array(block)
            del block
        self.bias = (np.array(module.bias[piece.start:piece.stop].astype(mx.float32))
                     if "bias" in module else None)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (self.bias.nbytes if self.bias is not None else 0)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        out = x @ self.weight.T
        if self.bias is not None:
            out += self.bias
        return out


class SplitLinear(nn.Module):
    """A linear whose prefill runs as gpu, cpu and ane slices at once."""

    def __init__(self, path: str, original, slices: list[Slice], min_tokens: int = DEFAULT_MIN_TOKENS,
                 ane=None):
        super().__init__()
        self.path = path
        self.original = original
        self.min_tokens = min_tokens
        if ane is None:  # no ane procedure for this layer: the gpu computes those rows too
            slices = [Slice("gpu", s.start, s.stop) if s.lane == "ane" else s for s in slices]
        self.slices = slices
        cpu = next((s for s in slices if s.lane == "cpu"), None)
        self.cpu = CpuSlice(original, cpu) if cpu else None
        self.ane = ane  # the ane lane's rows (prefill.ane.lane.AneRows), made by the staged build
        self.calls = 0  # prefill calls that took the split path
        self.freeze()

    @property
    def gpu_rows(self) -> tuple[int, int] | None:
        """The first gpu slice (the leading rows), None when the other lanes take them all."""
        return next(((s.start, s.stop) for s in self.slices if s.lane == "gpu"), None)

    @property
    def lane_bytes(self) -> int:
        return self.cpu.nbytes if self.cpu is not None else 0

    def __call__(self, x: mx.array) -> mx.array:
        tokens = x.size // x.shape[-1]
        if tokens < self.min_tokens or (self.cpu is None and self.ane is None):
            return self.original(x)
        self.calls += 1
        mx.eval(x)
        host = np.array(x.astype(mx.float32) if x.dtype != mx.float32 else x)
        # Host lanes start first, then the gpu slices are queued (views of the weights, no copy).
        futures: dict[str, Future] = {}
        if self.cpu is not None:
            futures["cpu"] = lane_thread("cpu").submit(self.cpu, host)
        if self.ane is not None:
            futures["ane"] = lane_thread("ane").submit(self.ane, host, x)
        gpu = {s.start: rows_of(self.original, s.start, s.stop)(x) for s in self.slices if s.lane == "gpu"}
        if gpu:
            mx.async_eval(list(gpu.values()))
        host_out = {}
        for lane, future in futures.items():
            try:
                host_out[lane] = mx.array(future.result()).astype(x.dtype)
            except Exception as error:
                if gpu:
                    mx.eval(list(gpu.values()))  # drain what was queued before reporting
                for other in futures.values():
                    other.exception()  # and let the other host lane finish
                raise OmlxError(f"prefill {lane} lane failed in {self.path}: "
                                f"{type(error).__name__}: {error}") from error
        parts = [gpu[s.start] if s.lane == "gpu" else host_out[s.lane] for s in self.slices]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
