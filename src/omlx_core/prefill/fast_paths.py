"""Fast prefill paths that keep parity with the reference: dequantize-to-dense, chunked GDN,
small attention.

The first two are installed by module replacement, like the lanes, and only change how
large inputs are computed; decode-sized inputs run mlx-lm's own modules.

- Dequantize-to-dense: for an input of at least `prefill.dense_min_tokens` tokens a
  quantized linear dequantizes its weight to the activation dtype and runs the dense GEMM
  (quantized matmul at large token counts is far slower than dense GEMM on some
  backends). The dense weight is transient: made per layer per call, after the layer's
  input (so the graph never dequantizes every layer up front), and freed once its product
  is computed. The host encodes far ahead of an asynchronous GPU, and a weight allocated
  before the earlier ones are freed is a fresh allocation: left alone, a chunk held every
  layer's dense weight at once (16 GB on an 8B model) and paid the allocator for each.
  So each product is handed to the GPU as it is made, and the call waits for the product
  `IN_FLIGHT` calls back: at most that many transients live, and each reuses a freed
  buffer. What that costs is measured, not assumed: one call of the largest layer at
  install, and, at load, a whole prefill chunk with the path on against off; the larger
  figure is what the memory guard is charged. `prefill.dense` is `auto` by default: on
  where it was measured to win (CUDA), off elsewhere until measured there. Where the kernel registry
  activates `dequantize` (kernels/dequantize.cu), the dense weight is made by that kernel
  instead of `mx.dequantize`.
- Chunked gated delta: qwen3_5's linear-attention layers prefill with
  `gated_delta.chunked_gated_delta` instead of the per-token recurrence.
- Small prefill attention (`small_attention`): the attention modules that prefill through
  it (sdpa_decode's, on CUDA) get `prefill.small_attention_scores` as their limit: small
  attention runs unfused, so cuDNN builds no graph for each new admission shape.
- Float32 quantized compute (`upcast`): on MLX's CPU backend, 16-bit quantized layers
  multiply in float32, prefill and decode alike (MLX's 16-bit CPU kernel is 10-50× slower).
  Installed first, as subclasses of MLX's quantized layers, so the dense path wraps them.
"""

from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from omlx_core.kernels.dequantize import dequantize as kernel_dequantize
from omlx_core.kernels.dequantize import supported as kernel_unsupported
from omlx_core.memory.peak import peak_extra_bytes
from omlx_core.prefill import small_attention
from omlx_core.prefill.gdn_layer import ChunkedGatedDeltaNet
from omlx_core.prefill.upcast import rehome, upcast_candidates


IN_FLIGHT = 4  # dense products the GPU may have queued: a few layers' worth, so it never waits


class DequantizedPrefill(nn.Module):
    """A quantized linear whose large inputs run as a dense GEMM on a transient weight."""

    _queued: deque = deque()  # shared by every layer: the products handed to the GPU, oldest first

    def __init__(self, quantized: nn.QuantizedLinear, min_tokens: int, kernel: bool = False):
        super().__init__()
        self.quantized = quantized
        self.min_tokens = min_tokens
        self.calls = 0
        self.kernel = kernel and not kernel_unsupported(quantized.bits, quantized.group_size, quantized.mode,
                                                        quantized.scales.dtype)  # kernels/dequantize.cu

    @property
    def dense_bytes(self) -> int:
        """Bytes of the transient dense weight in a 16-bit activation dtype."""
        out_features, packed = self.quantized.weight.shape
        return out_features * packed * (32 // self.quantized.bits) * 2

    def __call__(self, x: mx.array) -> mx.array:
        if x.size // x.shape[-1] < self.min_tokens:
            if self._queued:  # a prefill ended: keep none of its products alive
                self._queued.clear()
            return self.quantized(x)
        self.calls += 1
        layer = self.quantized
        # Depending on x makes the dense weight wait for this layer's input, so the graph
        # never dequantizes every layer up front: one transient weight at a time.
        packed = mx.depends(layer.weight, x)
        if self.kernel and x.dtype == layer.scales.dtype:
            weight = kernel_dequantize(packed, layer.scales, layer.biases, layer.group_size, layer.bits, x.dtype)
        else:
            weight = mx.dequantize(packed, layer.scales, layer.biases, group_size=layer.group_size,
                                   bits=layer.bits, mode=layer.mode, dtype=x.dtype)
        out = x @ weight.T
        out = out + layer.bias if "bias" in layer else out
        self._bound(out)
        return out

    @classmethod
    def _bound(cls, out: mx.array) -> None:
        """Start `out` on the GPU now and wait for the product IN_FLIGHT calls back."""
        mx.async_eval(out)
        cls._queued.append(out)
        while len(cls._queued) > IN_FLIGHT:
            mx.eval(cls._queued.popleft())


@dataclass
class FastPathReport:
    dense_layers: list = field(default_factory=list, repr=False)
    gdn_layers: list = field(default_factory=list, repr=False)
    dense_min_tokens: int | None = None
    gdn_min_tokens: int | None = None
    reasons: dict = field(default_factory=dict)

    upcast_layers: int = 0
    small_attention_layers: int = 0  # attention modules whose small prefill attention runs unfused
    small_attention_scores: int = 0  # their limit (prefill.small_attention_scores)
    dense_kernel: bool = False  # the dense weights come from kernels/dequantize.cu
    dense_layer_bytes: int = 0  # measured at install: one call of the largest dense layer
    dense_chunk_bytes: int = 0  # measured at load: a whole prefill chunk, on against off

    @property
    def dense_transient_bytes(self) -> int:
        return max(self.dense_layer_bytes, self.dense_chunk_bytes)

    @property
    def extra_bytes(self) -> int:
        return self.dense_transient_bytes

    def as_dict(self) -> dict:
        return {"dequantize_to_dense": {"layers": len(self.dense_layers), "min_tokens": self.dense_min_tokens,
                                        "peak_extra_bytes": self.dense_transient_bytes,
                                        "layer_extra_bytes": self.dense_layer_bytes,
                                        "chunk_extra_bytes": self.dense_chunk_bytes,
                                        "calls": sum(layer.calls for layer in self.dense_layers),
                                        "kernel_layers": sum(layer.kernel for layer in self.dense_layers),
                                        "reason": self.reasons.get("dense", "")},
                "small_attention": {"layers": self.small_attention_layers, "max_scores": self.small_attention_scores,
                                    "reason": self.reasons.get("small_attention", "")},
                "chunked_gdn": {"layers": len(self.gdn_layers), "min_tokens": self.gdn_min_tokens,
                                "calls": sum(layer.calls for layer in self.gdn_layers),
                                "reason": self.reasons.get("gdn", "")},
                "float32_quantized": {"layers": self.upcast_layers, "reason": self.reasons.get("upcast", "")}}


def install_fast_paths(model, settings, kernels=None) -> FastPathReport:
    """Install the paths the settings enable, by module replacement. `kernels`: the kernel
    registry's report for this model (`install_kernels`), naming the kernels the paths may use."""
    from omlx_core.prefill.split import replace_module  # split.py builds on this module

    report = FastPathReport()
    if upcast_enabled(settings):
        candidates = upcast_candidates(model)
        for path, module, cls in candidates:
            replace_module(model, path, rehome(module, cls))
        report.upcast_layers = len(candidates)
        report.reasons["upcast"] = ("16-bit quantized layers multiply in float32 on the CPU backend" if candidates
                                    else "no 16-bit affine-quantized layers in this model")
    else:
        report.reasons["upcast"] = ("off: compute.upcast_quantized is auto and this is not MLX's CPU backend"
                                    if settings["compute.upcast_quantized"] == "auto"
                                    else "off: compute.upcast_quantized is off")
    if dense_enabled(settings):
        report.dense_min_tokens = int(settings["prefill.dense_min_tokens"])
        report.dense_kernel = kernels is not None and "dequantize" in kernels.active
        for path, module in list(model.named_modules()):
            if isinstance(module, nn.QuantizedLinear) and module.mode == "affine":
                layer = DequantizedPrefill(module, report.dense_min_tokens, report.dense_kernel)
                replace_module(model, path, layer)
                report.dense_layers.append(layer)
        if report.dense_layers:
            largest = max(report.dense_layers, key=lambda layer: layer.dense_bytes)
            report.dense_layer_bytes = measure_transient(largest, report.dense_min_tokens)
        report.reasons["dense"] = (f"quantized linears dequantize for inputs of >= {report.dense_min_tokens} tokens"
                                   if report.dense_layers else "no affine-quantized linears in this model")
    else:
        report.reasons["dense"] = ("off: prefill.dense is auto and not measured to win on this backend"
                                   if settings["prefill.dense"] == "auto" else "off: prefill.dense is off")
    report.small_attention_scores = int(settings["prefill.small_attention_scores"])
    report.small_attention_layers = small_attention.configure(model, report.small_attention_scores)
    report.reasons["small_attention"] = (
        "no attention of this model prefills here (kernels.sdpa_decode's llama/qwen2/qwen3 attention does)"
        if not report.small_attention_layers else "off: prefill.small_attention_scores is 0"
        if not report.small_attention_scores else
        f"prefill attention of at most {report.small_attention_scores} scores runs unfused (no cuDNN graph per shape)")
    if settings["prefill.chunked_gdn"]:
        report.gdn_min_tokens = int(settings["prefill.chunked_gdn_min_tokens"])
        for path, module in list(model.named_modules()):
            if type(module).__name__ == "GatedDeltaNet" and hasattr(module, "in_proj_qkv"):
                layer = ChunkedGatedDeltaNet(module, report.gdn_min_tokens)
                replace_module(model, path, layer)
                report.gdn_layers.append(layer)
        report.reasons["gdn"] = ("gated-delta layers prefill in chunks" if report.gdn_layers else
                                 "no qwen3_5 gated-delta layers in this model")
    else:
        report.reasons["gdn"] = "off: set prefill.chunked_gdn"
    return report


def upcast_enabled(settings) -> bool:
    from omlx_core.hardware import mlx_backend

    choice = settings["compute.upcast_quantized"]
    return choice == "on" or (choice == "auto" and mlx_backend() == "cpu")


def dense_enabled(settings) -> bool:
    from omlx_core.hardware import mlx_backend

    choice = settings["prefill.dense"]
    return choice == "on" or (choice == "auto" and mlx_backend() == "cuda")


def measure_forward_extra(model, layers: list[DequantizedPrefill], tokens: int) -> int:
    """Peak MLX memory a `tokens`-token prefill takes with the dense path beyond without it."""
    from mlx_lm.models.cache import make_prompt_cache

    def prefill():
        mx.clear_cache()
        return model(mx.zeros((1, tokens), dtype=mx.int32), cache=make_prompt_cache(model))

    thresholds = [layer.min_tokens for layer in layers]
    calls = [layer.calls for layer in layers]
    for layer in layers:
        layer.min_tokens = tokens + 1  # off for this one forward
    without = peak_extra_bytes(prefill)
    for layer, threshold in zip(layers, thresholds):
        layer.min_tokens = threshold
    with_dense = peak_extra_bytes(prefill)
    for layer, count in zip(layers, calls):
        layer.calls = count
    mx.clear_cache()
    return max(0, with_dense - without)


def measure_transient(layer: DequantizedPrefill, tokens: int) -> int:
    """Peak MLX memory one dense call of `layer` takes beyond its quantized call."""
    in_features = layer.quantized.weight.shape[1] * (32 // layer.quantized.bits)
    x = mx.zeros((1, tokens, in_features), dtype=layer.quantized.scales.dtype)
    mx.eval(x)
    calls = layer.calls
    extra = max(0, peak_extra_bytes(lambda: layer(x)) - peak_extra_bytes(lambda: layer.quantized(x)))
    layer.calls = calls  # the measurement is not a prefill call
    mx.clear_cache()
    return extra


def unwrap(module):
    """The plain linear under a fast-path wrapper (the lanes split that)."""
    return module.quantized if isinstance(module, DequantizedPrefill) else module
