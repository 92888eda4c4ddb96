"""Quantized matmul at decode sizes (1..64 tokens) as an `mx.fast.cuda_kernel`.

Why: MLX's quantized matmul reads a layer's weights far below HBM bandwidth when only a
few tokens multiply them, so a decode step costs nearly as much per token at batch 32 as
at batch 1 times 32. `kernels/qmm_decode.cu` streams each weight byte once per call and
computes every token of the call from it on the tensor cores (see the file's comment).

- `quantized_matmul_decode(x, w, scales, biases, group_size, bits)`: MLX's
  `quantized_matmul(..., transpose=True)` for MLX's affine layout, 4 or 8 bits, group
  size 32, 64 or 128, bf16 or fp16 activations, 1..64 tokens.
- `DecodeQuantizedLinear`: an `nn.QuantizedLinear` (same arrays, nothing copied) whose
  batched-decode inputs (`MIN_TOKENS`..`MAX_TOKENS` tokens) run the kernel; every other
  input runs QuantizedLinear's own path.
  Being a QuantizedLinear, it composes with the prefill paths as any quantized linear
  does: `DequantizedPrefill` wraps it, split lanes slice it, `fast_paths.unwrap` returns it.
- `DecodeGroup`: linears of one input (q/k/v, gate/up) computed in one launch, each with
  its own output (`grouped_matmul_decode` is the function form).
- `DecodeQuantizedEmbedding`: a tied embedding whose use as the output head (`as_linear`)
  runs the kernel at the same sizes.
- `install(model)` replaces the eligible quantized linears (and a tied embedding) by module
  replacement and groups the siblings of one input.

The launch shape (`Config`) is chosen per token count and layer shape; the benchmark
(scripts/bench/decode.py) measured the candidates on the H200.
"""

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

from omlx_core.errors import OmlxError

SOURCE = "qmm_decode.cu"
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half"}
SHORT = {mx.bfloat16: "bf16", mx.float16: "f16"}
MAX_TOKENS = 64
# One token keeps MLX's qmv by default. A batch-1 step is bound by the host, and a custom
# kernel's call costs the host more than MLX's own (MLX builds its source string on every
# call); with grouped launches the kernel won at one token on one H200 machine (5.58 against
# 6.26 ms a step) and lost on a slower host (8.8 against 8.3 ms;
# docs/benchmarks/decode-h200-model-grouped.json). From 2 tokens the GPU bounds the step and
# the kernel wins on every machine (batch 8: 7.9 against 32.2 ms; batch 32: 11.7 against 105).
MIN_TOKENS = 2
# Formats (bits, group size, activation dtype) whose exactness scripts/bench/decode.py
# checked on the H200 (docs/benchmarks/decode-h200-qmm.json: every bf16 format, every
# token bucket, odd N, K off the tile, within 1/128 of the largest output); others (fp16)
# keep MLX's kernel.
VALIDATED: tuple = tuple((bits, group, mx.bfloat16) for bits in BITS for group in GROUP_SIZES)
ALL_FORMATS = tuple((bits, group, dtype) for bits in BITS for group in GROUP_SIZES for dtype in DTYPES)
SMS = 132  # H200 multiprocessors: the CTA count the split of K aims at


@dataclass(frozen=True)
class Config:
    """One launch shape (see the template parameters in kernels/qmm_decode.cu)."""

    tiles: int  # NT: token tiles of 8
    rows: int  # R: 16-row tiles per warp
    warps_n: int  # WR
    warps_k: int  # WK
    rounds: int  # U: 128-input blocks a warp loads at once (two rounds are in flight)
    slice_k: int  # KC: most inputs of one CTA's slice of K
    ctas: int = SMS  # the split of K aims at least at this many CTAs
    occupancy: int = 4  # most CTAs an SM holds: the register budget of the launch bounds
    stage_loads: int = 0  # SL: x loads a thread has in flight while staging (0: by block size)

    @property
    def loads_in_flight(self) -> int:
        """SL: as given, else 2 for blocks of 256+ threads (the register budget) and 8 below."""
        return self.stage_loads or (2 if self.threads >= 256 else 8)

    @property
    def threads(self) -> int:
        return 32 * self.warps_n * self.warps_k

    @property
    def block_n(self) -> int:
        return 16 * self.rows * self.warps_n

    @property
    def shared_bytes(self) -> int:
        """Staged x, then the sums in its place."""
        staged = 8 * self.tiles * self.slice_k * 2
        reduced = 8 * self.tiles * (self.block_n + 4) * 4
        return max(staged, reduced)

    def columns(self, *ns: int) -> int:
        """CTAs along N for linears of `ns` outputs launched together: one column tile each."""
        return sum(math.ceil(n / self.block_n) for n in ns)

    @property
    def per_sm(self) -> int:
        """CTAs one SM holds by shared memory (228 KiB, 1 KiB reserved each) and threads, at
        most `occupancy`."""
        return max(1, min(self.occupancy, (228 * 1024) // (self.shared_bytes + 1024), 2048 // self.threads))

    def splits(self, n: int, k: int) -> int:
        """CTAs along K: each slice fits `slice_k`, and the grid reaches `ctas` CTAs when
        the layer has enough blocks for every K-warp."""
        blocks = math.ceil(k / 128)
        fit = math.ceil(blocks / (self.slice_k // 128))
        wanted = math.ceil(self.ctas / self.columns(n))
        return max(fit, min(wanted, max(1, blocks // self.warps_k)))

    def name(self, dtype: mx.Dtype, bits: int, group_size: int) -> str:
        return (f"omlx_qmm_{SHORT[dtype]}_b{bits}_g{group_size}_t{self.tiles}_r{self.rows}"
                f"_n{self.warps_n}_k{self.warps_k}_u{self.rounds}_c{self.slice_k}_o{self.per_sm}"
                + (f"_l{self.stage_loads}" if self.stage_loads else ""))


def tiles_for(tokens: int) -> int:
    return 1 if tokens <= 8 else 2 if tokens <= 16 else 4 if tokens <= 32 else 8


def shape_changes(model, limit: int) -> list[int]:
    """The token counts up to `limit` at which the model's decode kernels take a new launch
    shape (none when no DecodeQuantizedLinear is installed): each shape is compiled the
    first time a batch of its size runs, so a server warms up with one batch of each."""
    if not any(isinstance(m, DecodeQuantizedLinear) for _, m in model.named_modules()):
        return []
    top = min(limit, MAX_TOKENS)
    return [t for t in range(MIN_TOKENS, top + 1) if t == MIN_TOKENS or tiles_for(t) != tiles_for(t - 1)]


# The launch shape of each token bucket (tiles of 8 tokens): (R, WR, WK, U, KC, occupancy[, SL]), the
# fastest of SWEEP in scripts/bench/decode.py by GPU time of the three Qwen3-8B layer shapes
# chained in one CUDA graph, weighted as a decoder layer uses them (docs/benchmarks/decode-h200-layers-sweep.json;
# the sweep of the current kernel, with 10 more candidates for 9-64 tokens, kept every one of them:
# decode-h200-staging.json, last run; several column tiles per CTA lost at every shape and were
# removed). SL = 8 from 9 tokens: the staging's wait on x was a quarter of the 32-token kernel
# (decode-h200-qmm-ncu.json); in the chained timings it won at 16 tokens and was within the
# run's noise at 64. At 17-32 tokens SL = 4 won two H100 sweeps over SL = 8 (weighted 166.4
# against 178.4 us, then 183.4 against 192.4: docs/benchmarks/decode-h100-scale-after-r2.json,
# decode-h100-sweep-32-tokens.json).
DEFAULTS = {1: (1, 2, 4, 2, 4096, 3), 2: (1, 4, 2, 2, 1024, 2, 8), 4: (1, 4, 2, 1, 1024, 3, 4),
            8: (1, 8, 1, 1, 512, 2, 8)}


def default_config(tokens: int, bits: int) -> Config:
    """The launch shape for `tokens` tokens (1..64), from DEFAULTS: the fastest of the
    candidates scripts/bench/decode.py timed on the H200, chained as a decode step runs
    them. 8-bit weights take twice the registers per block, so they load one block a round
    and keep at most two CTAs an SM (three would spill at 17-32 tokens)."""
    tiles = tiles_for(tokens)
    return config_of(tiles, DEFAULTS[tiles], bits)


def config_of(tiles: int, shape: tuple, bits: int = 4) -> Config:
    """The Config of a launch shape (R, WR, WK, U, KC, occupancy[, SL]) for `tiles` token tiles."""
    rows, warps_n, warps_k, rounds, slice_k, occupancy, *rest = shape
    if bits == 8:
        rounds, occupancy = 1, min(occupancy, 2)
    return Config(tiles, rows, warps_n, warps_k, rounds, slice_k, occupancy=occupancy,
                  stage_loads=rest[0] if rest else 0)


def supported(x_dtype: mx.Dtype, scales_dtype: mx.Dtype, bits: int, group_size: int, mode: str = "affine") -> str:
    """Empty when the kernel computes this layer, else why not (one line)."""
    if mode != "affine":
        return f"quantization mode {mode} (the kernel reads the affine layout)"
    if bits not in BITS:
        return f"{bits}-bit weights (the kernel reads {' or '.join(map(str, BITS))} bits)"
    if group_size not in GROUP_SIZES:
        return f"group size {group_size} (the kernel reads {', '.join(map(str, GROUP_SIZES))})"
    if x_dtype not in DTYPES or scales_dtype != x_dtype:
        return f"activations {x_dtype} with scales {scales_dtype} (the kernel needs both bf16 or both fp16)"
    return ""


def kernel_available() -> str:
    """Empty when MLX can run CUDA kernels here, else why not."""
    from omlx_core.hardware import mlx_backend

    backend = mlx_backend()
    return "" if backend == "cuda" else f"needs MLX's CUDA backend (mx.fast.cuda_kernel); this MLX runs on {backend}"


def segment_names(segments: int, name: str) -> list[str]:
    """`name` for one linear; name0, name1, ... for the linears of a grouped launch."""
    return [name] if segments == 1 else [f"{name}{s}" for s in range(segments)]


def inputs(split: bool, segments: int = 1, residual: bool = False) -> tuple:
    """The kernel's inputs: x, then each linear's weight, scales and biases, the residual
    added to the output if any; the split of K across CTAs also needs the row tiles'
    counters."""
    names = ["x"]
    for w, scales, biases in zip(*(segment_names(segments, n) for n in ("w", "scales", "biases"))):
        names += [w, scales, biases]
    names += ["residual"] if residual else []
    return tuple(names + ["locks"] if split else names)


def outputs(split: bool, segments: int = 1) -> tuple:
    """Its outputs: each linear's; split, also the slices' fp32 partial sums (one slice needs none)."""
    names = segment_names(segments, "out")
    return tuple(names + ["partial"] if split else names)


def kernel_name(config: Config, dtype: mx.Dtype, bits: int, group_size: int, split: bool, segments: int = 1,
                residual: bool = False) -> str:
    return (config.name(dtype, bits, group_size) + ("" if split else "_whole") + ("" if segments == 1 else f"_s{segments}")
            + ("_res" if residual else ""))


def body(config: Config, dtype: mx.Dtype, bits: int, group_size: int, split: bool = True, segments: int = 1,
         residual: bool = False) -> str:
    """The kernel body: M is every leading dimension of x (a [B, L, K] input is launched
    as it is, no reshape), K its last, N[s] the rows of linear s's weight."""
    c = config
    t = DTYPES[dtype]
    w, scales, biases, out = (segment_names(segments, n) for n in ("w", "scales", "biases", "out"))
    return ("int M = 1;\nfor (int i = 0; i + 1 < x_ndim; ++i) M *= x_shape[i];\n"
            f"const uint32_t* ws[] = {{{', '.join(w)}}};\n"
            f"const {t}* ss[] = {{{', '.join(scales)}}};\n"
            f"const {t}* bs[] = {{{', '.join(biases)}}};\n"
            f"const int ns[] = {{{', '.join(f'{name}_shape[0]' for name in w)}}};\n"
            f"{t}* os[] = {{{', '.join(out)}}};\n"
            f"omlx_qmm::qmm_decode_segments<{t}, {bits}, {group_size}, {c.tiles}, {c.rows}, {c.warps_n}, "
            f"{c.warps_k}, {c.rounds}, {c.slice_k}, {segments}, {c.loads_in_flight}, "
            f"{str(residual).lower()}>(x, ws, ss, bs, ns, "
            f"{'residual' if residual else 'nullptr'}, {'locks' if split else 'nullptr'}, os, "
            f"{'partial' if split else 'nullptr'}, M, x_shape[x_ndim - 1]);")


def parameters(dtype: mx.Dtype, split: bool, segments: int = 1, residual: bool = False) -> str:
    """The generated kernel's parameter list, as MLX 0.32 writes it for `body`."""
    t = DTYPES[dtype]
    text = f"    const {t}* x,\n    const __grid_constant__ Shape x_shape,\n    const __grid_constant__ int x_ndim,\n"
    for w, scales, biases in zip(*(segment_names(segments, n) for n in ("w", "scales", "biases"))):
        text += (f"    const uint32_t* {w},\n    const __grid_constant__ Shape {w}_shape,\n"
                 f"    const {t}* {scales},\n    const {t}* {biases},\n")
    text += f"    const {t}* residual,\n" if residual else ""
    if split:
        text += "    const int32_t* locks,\n"
    params = [f"    {t}* {name}" for name in segment_names(segments, "out")] + (["    float* partial"] if split else [])
    return text + ",\n".join(params) + ")"


def launch_bounds(config: Config, dtype: mx.Dtype, bits: int, group_size: int, split: bool = True,
                  segments: int = 1, residual: bool = False) -> str:
    """A declaration of MLX's generated kernel with launch bounds (MLX writes the
    definition without any): the register budget that lets several CTAs share an SM."""
    return ("namespace mlx::core::cu {\n"
            f"__global__ void __launch_bounds__({config.threads}, {config.per_sm}) "
            f"custom_kernel_{kernel_name(config, dtype, bits, group_size, split, segments, residual)}(\n"
            f"{parameters(dtype, split, segments, residual)};\n"
            "}  // namespace mlx::core::cu\n")


def source_text() -> str:
    """What the kernel's `header` carries of kernels/qmm_decode.cu (`registry.included_source`)."""
    from omlx_core.kernels.registry import included_source

    return included_source(SOURCE)


def header(config: Config, dtype: mx.Dtype, bits: int, group_size: int, split: bool = True, segments: int = 1,
           residual: bool = False) -> str:
    return source_text() + launch_bounds(config, dtype, bits, group_size, split, segments, residual)


STANDALONE_PRELUDE = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cooperative_groups.h>
namespace mlx::core::cu { using Shape = cuda::std::array<int32_t, 10>; }
"""


def generated_source(config: Config, dtype: mx.Dtype, bits: int, group_size: int, split: bool = True,
                     prelude: str = STANDALONE_PRELUDE, segments: int = 1, residual: bool = False) -> str:
    """The translation unit mx.fast.cuda_kernel compiles (its wrapper written out the way
    MLX 0.32 writes it), with `prelude` for MLX's device header: for `nvcc -arch=sm_90a`
    on a machine with no GPU."""
    variant = (config, dtype, bits, group_size, split, segments, residual)
    return (prelude + header(*variant)
            + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            + f"__global__ void custom_kernel_{kernel_name(*variant)}(\n"
            + parameters(dtype, split, segments, residual) + " {\n"
            + body(*variant) + "\n}\n\n} // namespace mlx::core::cu\n")


@lru_cache(maxsize=None)
def _kernel(config: Config, dtype: mx.Dtype, bits: int, group_size: int, split: bool, segments: int = 1,
            residual: bool = False):
    variant = (config, dtype, bits, group_size, split, segments, residual)
    return mx.fast.cuda_kernel(
        name=kernel_name(*variant), input_names=list(inputs(split, segments, residual)),
        output_names=list(outputs(split, segments)), source=body(*variant), header=header(*variant),
        ensure_row_contiguous=True, shared_memory=config.shared_bytes)


def lock_count(*ns: int) -> int:
    """Counters one launch over linears of `ns` outputs needs (one per CTA column, for any Config)."""
    return sum(math.ceil(n / 16) for n in ns)


@dataclass(frozen=True)
class Launch:
    """Everything one call of a layer shape (or a group of linears of one input) and token
    count needs, worked out once: the per-call Python is what a decode step of a few
    hundred linears pays for each of them."""

    kernel: object
    grid: tuple
    threadgroup: tuple
    out_shapes: tuple  # each linear's output, after x's leading dimensions: (n0,), (n1,), ...
    out_dtypes: list
    partial: int  # floats of the split-K partial sums; 0: one slice, no counters, no partials

    def __call__(self, x: mx.array, weights: list, locks, residual: mx.array | None = None) -> list[mx.array]:
        """`weights`: each linear's weight, scales and biases, one after another; `residual`
        exactly when the launch was made for one (`launch_for`)."""
        lead = x.shape[:-1]
        shapes = [lead + n for n in self.out_shapes]
        args = [x] + weights + ([residual] if residual is not None else [])
        if self.partial:
            return self.kernel(inputs=args + [locks], output_shapes=shapes + [(self.partial,)],
                               output_dtypes=self.out_dtypes, grid=self.grid, threadgroup=self.threadgroup)[:-1]
        return self.kernel(inputs=args, output_shapes=shapes, output_dtypes=self.out_dtypes,
                           grid=self.grid, threadgroup=self.threadgroup)


@lru_cache(maxsize=4096)
def launch_for(ns: tuple, k: int, tokens: int, dtype: mx.Dtype, bits: int, group_size: int,
               config: Config | None = None, residual: bool = False) -> Launch:
    """The launch of linears with `ns` outputs (one, or a group of one input) for `tokens`
    tokens; `residual`: the output plus a residual (one linear)."""
    if why := kernel_available():  # checked once per shape: launches are cached
        raise OmlxError(f"qmm_decode {why}")
    config = config or default_config(tokens, bits)
    if 8 * config.tiles < tokens:
        raise OmlxError(f"qmm_decode: config for {8 * config.tiles} tokens given {tokens}")
    splits = config.splits(sum(ns), k)
    split = splits > 1
    return Launch(_kernel(config, dtype, bits, group_size, split, len(ns), residual),
                  (config.columns(*ns) * config.threads, splits, 1), (config.threads, 1, 1), tuple((n,) for n in ns),
                  [dtype] * len(ns) + ([mx.float32] if split else []), splits * tokens * sum(ns) if split else 0)


def quantized_matmul_decode(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                            group_size: int, bits: int, *, residual: mx.array | None = None,
                            locks: mx.array | None = None, config: Config | None = None,
                            ctas: int | None = None) -> mx.array:
    """`mx.quantized_matmul(x, w, scales, biases, transpose=True, ...)` for 1..64 tokens,
    with every argument checked (DecodeQuantizedLinear checks its layer once instead).

    `residual`: returns `residual + product`, added in the kernel and rounded as MLX's
    separate add rounds. `locks`: int32 zeros, `lock_count(N)` of them, owned by the caller
    and never used by two calls at once (the kernel leaves them zero); without it a fresh
    zero buffer is made per call. `config` / `ctas` override the launch shape (the
    benchmark's sweep).
    """
    return grouped_matmul_decode(x, [(w, scales, biases)], group_size, bits, residual=residual, locks=locks,
                                 config=config, ctas=ctas)[0]


def grouped_matmul_decode(x: mx.array, layers: list, group_size: int, bits: int, *,
                          residual: mx.array | None = None,
                          locks: mx.array | None = None, config: Config | None = None,
                          ctas: int | None = None) -> list[mx.array]:
    """`quantized_matmul_decode` of one input by several linears ((w, scales, biases)
    triples of one format) in one launch: their outputs, in order (a `residual` takes
    one linear). `locks`: `lock_count(N0, N1, ...)` zeros."""
    if why := kernel_available():
        raise OmlxError(f"qmm_decode {why}")
    k = x.shape[-1]
    tokens = x.size // k if k else 0
    if not 1 <= tokens <= MAX_TOKENS:
        raise OmlxError(f"qmm_decode computes 1..{MAX_TOKENS} tokens, not {tokens}")
    if residual is not None and len(layers) != 1:
        raise OmlxError(f"qmm_decode: a residual takes one linear, not {len(layers)}")
    if residual is not None and (residual.shape != x.shape[:-1] + (layers[0][0].shape[0],)
                                 or residual.dtype != x.dtype):
        raise OmlxError(f"qmm_decode: residual {residual.shape} {residual.dtype} must match the output "
                        f"{x.shape[:-1] + (layers[0][0].shape[0],)} {x.dtype}")
    for w, scales, biases in layers:
        n = w.shape[0]
        if biases is None:
            raise OmlxError("qmm_decode needs the affine layout's biases")
        if why := supported(x.dtype, scales.dtype, bits, group_size):
            raise OmlxError(f"qmm_decode cannot compute {why}")
        if w.shape[1] * 32 // bits != k or k % group_size or scales.shape != (n, k // group_size):
            raise OmlxError(f"qmm_decode: weight {w.shape}, scales {scales.shape} do not fit {k} inputs "
                            f"at {bits} bits, group size {group_size}")
    ns = tuple(w.shape[0] for w, _, _ in layers)
    if ctas is not None:
        config = replace(config or default_config(tokens, bits), ctas=ctas)
    if locks is None:
        locks = mx.zeros((lock_count(*ns),), dtype=mx.int32)
    launch = launch_for(ns, k, tokens, x.dtype, bits, group_size, config, residual is not None)
    return launch(x, [a for layer in layers for a in layer], locks, residual)


def _adopt(module, layer, max_tokens: int, min_tokens: int) -> None:
    """Fill a new kernel module from a quantized `layer`: the same arrays and format, the
    token range it computes, the activation dtype it checked once (None: the kernel cannot
    read this layer, which keeps MLX's path) and its split-K counters."""
    nn.Module.__init__(module)
    for key, value in layer.items():  # weight, scales, biases (and bias): the same arrays
        module[key] = value
    module.group_size, module.bits, module.mode = layer.group_size, layer.bits, layer.mode
    module.max_tokens, module.min_tokens = max_tokens, min_tokens
    module.calls = 0  # inputs that took the kernel
    module._dtype = None if supported(layer.scales.dtype, layer.scales.dtype, layer.bits, layer.group_size,
                                      layer.mode) or layer.get("biases") is None else layer.scales.dtype
    # Underscored: not a parameter (not saved, not counted as weights).
    module._locks = mx.zeros((lock_count(layer.weight.shape[0]),), dtype=mx.int32)
    mx.eval(module._locks)
    # Launches by token count (and (count, "residual") for `with_residual`), a plain
    # attribute (outside the module tree).
    object.__setattr__(module, "_launches", {})


def _takes(module, x: mx.array) -> bool:
    return (module._dtype is not None and module.min_tokens <= x.size // x.shape[-1] <= module.max_tokens
            and x.dtype == module._dtype)


def _product(module, x: mx.array, tokens: int, residual: mx.array | None = None) -> mx.array:
    """x @ the module's quantized weight^T on the kernel, plus `residual` in the same launch
    if given (its launch made once per token count and form)."""
    object.__setattr__(module, "calls", module.calls + 1)  # Module.__setattr__ costs microseconds
    w = module["weight"]
    key = tokens if residual is None else (tokens, "residual")
    launch = module._launches.get(key)
    if launch is None:
        launch = module._launches[key] = launch_for((w.shape[0],), x.shape[-1], tokens, x.dtype, module.bits,
                                                    module.group_size, residual=residual is not None)
    return launch(x, [w, module["scales"], module["biases"]], module["_locks"], residual)[0]


class DecodeQuantizedLinear(nn.QuantizedLinear):
    """A QuantizedLinear whose inputs of 1..`max_tokens` tokens run the decode kernel.

    Linears of one input (q/k/v, gate/up) may share a `DecodeGroup`: the first of them
    called with an input computes all of them in one launch. A row slice made by the
    split lanes (`split.rows_of`, which keeps the class, for prefill) has the class
    defaults: no checked dtype, no group and no counters, so it computes through
    QuantizedLinear's own path."""

    max_tokens = MAX_TOKENS
    min_tokens = MIN_TOKENS
    calls = 0
    _dtype = None  # the activation dtype the kernel computes for this layer (None: never)
    _group = None  # the DecodeGroup this linear is computed with, if any
    _group_index = 0  # its place in the group

    @classmethod
    def of(cls, layer: nn.QuantizedLinear, max_tokens: int = MAX_TOKENS,
           min_tokens: int = MIN_TOKENS) -> "DecodeQuantizedLinear":
        module = cls.__new__(cls)
        _adopt(module, layer, max_tokens, min_tokens)
        module.freeze()
        return module

    def uses_kernel(self, x: mx.array) -> bool:
        return _takes(self, x)

    def __call__(self, x: mx.array) -> mx.array:
        # The layer was checked when it was built, the kernel's availability with the first
        # launch of a shape; per call only the token count and the activation dtype are (a
        # decode step makes a few hundred of these calls: their Python is on its critical path).
        k = x.shape[-1]
        tokens = x.size // k
        if self._dtype is None or tokens > self.max_tokens or tokens < self.min_tokens or x.dtype != self._dtype:
            return super().__call__(x)
        if self._group is not None:
            object.__setattr__(self, "calls", self.calls + 1)
            out = self._group.output(self._group_index, x, tokens)
        else:
            out = _product(self, x, tokens)
        return out + self["bias"] if "bias" in self else out

    def with_residual(self, x: mx.array, residual: mx.array) -> mx.array:
        """`residual + self(x)` in one launch where the kernel takes x (this linear alone, no
        bias, a residual of the output's shape and x's type), else MLX's add. Why: a decoder
        layer's two output projections (attention's, the MLP's down) each save the add's
        launch and a round trip of their activations."""
        if (not self.uses_kernel(x) or self._group is not None or "bias" in self or residual.dtype != x.dtype
                or residual.shape != x.shape[:-1] + (self["weight"].shape[0],)):
            return residual + self(x)
        return _product(self, x, x.size // x.shape[-1], residual)


class DecodeQuantizedEmbedding(nn.QuantizedEmbedding):
    """A tied quantized embedding whose use as the output head (`as_linear`) runs the decode
    kernel for `min_tokens`..`max_tokens` tokens; lookups read the packed table as before.

    Why: a model with tied embeddings multiplies its largest matrix (vocabulary x hidden)
    through `as_linear`, MLX's quantized matmul, which runs far below bandwidth from two
    tokens on CUDA (the reason for this kernel): on a small model that head is a tenth to a
    quarter of the weights a decode step reads."""

    max_tokens = MAX_TOKENS
    min_tokens = MIN_TOKENS
    calls = 0
    _dtype = None

    @classmethod
    def of(cls, layer: nn.QuantizedEmbedding, max_tokens: int = MAX_TOKENS,
           min_tokens: int = MIN_TOKENS) -> "DecodeQuantizedEmbedding":
        module = cls.__new__(cls)
        _adopt(module, layer, max_tokens, min_tokens)
        module.num_embeddings, module.dims = layer.num_embeddings, layer.dims
        module.freeze()
        return module

    def as_linear(self, x: mx.array) -> mx.array:
        if not _takes(self, x):
            return super().as_linear(x)
        return _product(self, x, x.size // x.shape[-1])


class DecodeGroup:
    """Linears of one input and one format computed in one launch.

    Why: a decode step pays the host for every launch (Python, then MLX's encoding: more
    than a small layer's GPU time on the H200 machine), and the GPU for each launch's ramp
    and tail; attention's q/k/v and the MLP's gate/up take the same input. The first
    member called with an input `x` launches all of them and keeps the others' outputs for
    that same `x` object (the same input, so the same results); each is handed out once,
    and a call with any other input launches again. A model that calls the members with
    different inputs gets correct results at the cost of extra launches."""

    def __init__(self, members: list[DecodeQuantizedLinear]):
        self.members = members
        self.locks = mx.zeros((lock_count(*(m["weight"].shape[0] for m in members)),), dtype=mx.int32)
        mx.eval(self.locks)
        self.launches = {}  # by token count
        self.x = None  # the input of the kept outputs
        self.kept = []  # per member: its output for self.x, None once handed out
        for index, member in enumerate(members):
            object.__setattr__(member, "_group", self)
            object.__setattr__(member, "_group_index", index)

    def output(self, index: int, x: mx.array, tokens: int) -> mx.array:
        """Member `index`'s output for `x`: kept from the launch for this same `x`, or launched."""
        if self.x is x and self.kept[index] is not None:
            out, self.kept[index] = self.kept[index], None
            if not any(o is not None for o in self.kept):
                self.x, self.kept = None, []
            return out
        launch = self.launches.get(tokens)
        if launch is None:
            first = self.members[0]
            launch = self.launches[tokens] = launch_for(tuple(m["weight"].shape[0] for m in self.members),
                                                        x.shape[-1], tokens, x.dtype, first.bits, first.group_size)
        outs = launch(x, [m[key] for m in self.members for key in ("weight", "scales", "biases")], self.locks)
        self.x, self.kept = x, list(outs)
        self.kept[index] = None
        return outs[index]


# Sibling linears that models call with one input: grouped into one launch when all are installed.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def group_siblings(built: dict) -> list[DecodeGroup]:
    """DecodeGroups of the installed linears (`built`: path -> module) that GROUPS names
    under one parent (a prefill wrapper between them and the parent is looked through),
    with one format and one input width."""
    named = {}  # (parent path, linear name) -> module
    for path, module in built.items():
        parts = path.split(".")
        for i in range(len(parts) - 1, -1, -1):
            if any(parts[i] in names for names in GROUPS):
                named[(".".join(parts[:i]), parts[i])] = module
                break
    groups = []
    for parent, name in named:
        for names in GROUPS:
            if name != names[0]:
                continue
            members = [named.get((parent, n)) for n in names]
            if any(m is None or m._dtype is None for m in members):
                continue
            key = [(m.bits, m.group_size, m._dtype, m["weight"].shape[1]) for m in members]
            if key.count(key[0]) == len(key):
                groups.append(DecodeGroup(members))
    return groups


def plain(module) -> nn.Module:
    """A plain QuantizedLinear (QuantizedEmbedding) of the same arrays for any subclass of
    one (undoes `install`, and the dense copy's install too); any other module as given."""
    for kind, keys in ((nn.QuantizedLinear, ("weight", "scales", "biases", "bias")),
                       (nn.QuantizedEmbedding, ("weight", "scales", "biases"))):
        if isinstance(module, kind) and type(module) is not kind:
            layer = kind.__new__(kind)
            nn.Module.__init__(layer)
            for key in keys:
                if key in module:
                    layer[key] = module[key]
            layer.group_size, layer.bits, layer.mode = module.group_size, module.bits, module.mode
            if kind is nn.QuantizedEmbedding:
                layer.num_embeddings, layer.dims = module.num_embeddings, module.dims
            layer.freeze()
            return layer
    return module


def readable(module, formats: tuple) -> bool:
    """Affine quantized arrays (with biases) the kernel reads, in one of `formats`
    ((bits, group size, scales dtype) triples)."""
    if getattr(module, "biases", None) is None:
        return False
    if supported(module.scales.dtype, module.scales.dtype, module.bits, module.group_size, module.mode):
        return False
    return (module.bits, module.group_size, module.scales.dtype) in formats


def eligible(module, formats: tuple) -> bool:
    """A plain affine quantized linear the kernel computes, in one of `formats`."""
    return type(module) is nn.QuantizedLinear and readable(module, formats)


def tied_head(model, path: str, module, formats: tuple) -> bool:
    """The plain quantized input embedding of a model with tied embeddings (which also
    multiplies it as its output head), in one of `formats`."""
    from omlx_core.models.tied import tied_embedding

    return tied_embedding(model, path) and type(module) is nn.QuantizedEmbedding and readable(module, formats)


def applies(model) -> bool:
    return any(eligible(module, VALIDATED) for _, module in model.named_modules())


def install(model, max_tokens: int = MAX_TOKENS, formats: tuple | None = None,
            min_tokens: int = MIN_TOKENS, group: bool = True) -> list[str]:
    """Replace every eligible quantized linear (also inside prefill wrappers) by a
    DecodeQuantizedLinear for `min_tokens`..`max_tokens` tokens, siblings of one input
    grouped into one launch (GROUPS), and a tied embedding by a DecodeQuantizedEmbedding
    (its output head); returns their paths. All are built before any is replaced. `formats`
    defaults to those that passed the exactness check on the device (`ALL_FORMATS` for the
    check itself); `group=False` launches each linear alone."""
    from omlx_core.prefill.split import replace_module

    formats = VALIDATED if formats is None else formats
    modules = list(model.named_modules())
    built = {path: DecodeQuantizedLinear.of(module, max_tokens, min_tokens)
             for path, module in modules if eligible(module, formats)}
    if group:
        group_siblings(built)
    built.update({path: DecodeQuantizedEmbedding.of(module, max_tokens, min_tokens)
                  for path, module in modules if tied_head(model, path, module, formats)})
    for path, module in built.items():
        replace_module(model, path, module)
    return list(built)


def _spec():
    from omlx_core.kernels.registry import HardwareMatch, KernelSpec, ModelMatch, Validation

    # On the H200, for llama-architecture models: every bf16 format within 1/128 of MLX's
    # result, grouped launches included (docs/benchmarks/decode-h200-exact.json), 64 greedy
    # tokens of a tiny llama identical to stock (decode-h200-greedy.json), and batched decode
    # of a Qwen3-8B-shape llama 4.1x stock at batch 8 and 8.2-9.4x at 32
    # (decode-h200-model-grouped.json). Not qwen3_5: its tiny model's greedy tokens part from
    # stock at step 5, which looks like a near-tie (MLX's own dequantized-bf16 path parts from
    # stock on every prompt too, decode-cpu-margins.json) but is not shown to be one on the GPU.
    h200 = Validation(ModelMatch.architecture("llama"), HardwareMatch("cuda", "sm_90", "NVIDIA H200"),
                      "docs/benchmarks/decode-h200-exact.json, decode-h200-greedy.json, "
                      "decode-h200-model-grouped.json")
    return KernelSpec(
        name="qmm_decode",
        replaces=f"mx.quantized_matmul of affine 4/8-bit quantized linears (group 32/64/128), and of a tied "
                 f"embedding as the output head, at {MIN_TOKENS}..{MAX_TOKENS} tokens (batched decode)",
        source=SOURCE,
        validated=(h200,),
        applies=applies,
        absent="affine 4- or 8-bit quantized linears with bf16 scales (group 32, 64 or 128)",
        install=install,
    )


SPEC = _spec()
