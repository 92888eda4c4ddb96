"""A decoder layer's batched-decode step with fewer launches and less Python: the residual
adds inside qmm_decode's output projections, and the step around the attention compiled.

Why: a decode step pays the host (Python, then MLX's encoding) and the GPU (each kernel's
ramp and tail) for every launch, and at 32 sequences the step is a few hundred small
launches (docs/benchmarks/decode-h100-host-profile.json). mlx-lm's layer computes
`h = x + o_proj(attention)` and `out = h + down(swiglu(gate, up))`: the two residual adds
are launches of their own, each reading and writing its activations once more. Here both
output projections add the residual in their epilogue: two launches fewer per layer, the
same roundings as MLX's separate add. (The down projection computing swiglu itself, while
it staged its input, was tried and measured: as fast at one token, twice as slow from 8,
every CTA recomputing it for the whole input: docs/benchmarks/decode-h100-fused.json.)

At one token per sequence the host, not the GPU, bounds a batched step on the H100 (the
Python building it about as long as MLX encoding it, each about the GPU's time: the same
profile). Everything in a layer but the cache update and the attention over it is the
same graph every step, so it runs as two `mx.compile`'d functions (traced once per batch
size, then replayed by MLX: no Python per operation, no kernel source built per launch);
the cache update and the attention kernel run between them as DecodeAttention runs them.

- `DecodeBlock`: mlx-lm's llama/qwen2/qwen3 `TransformerBlock` whose one-token steps (on
  a DecodeAttention over a KVCache or BatchKVCache) run compiled, and whose other inputs
  of the kernel's token counts take the residual forms (`DecodeQuantizedLinear.with_residual`;
  attention's through `DecodeAttention`'s `residual`); every other input runs mlx-lm's
  forward on this module. Its linears take qmm_decode's kernel from one token.
- `install(model)` replaces the blocks whose down projection is a DecodeQuantizedLinear
  (a registered kernel of its own, after qmm_decode; not validated, so `auto` leaves it
  off and `on` tries it); `plain(module)` undoes it.
"""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from omlx_core.kernels import qk_norm_rope
from omlx_core.kernels.qmm_decode import SOURCE, DecodeQuantizedLinear
from omlx_core.kernels.registry import KernelSpec, replace_modules
from omlx_core.kernels.restated import Restated
from omlx_core.kernels.sdpa_decode import DecodeAttention
from omlx_core.prefill import split
from omlx_core.prefill.fast_paths import unwrap

ARCHITECTURES = ("llama", "qwen2", "qwen3")  # whose block and MLP DecodeBlock restates


def is_block(module) -> bool:
    kind = type(module)
    return kind.__name__ == "TransformerBlock" and kind.__module__.rsplit(".", 1)[-1] in ARCHITECTURES


def down_projection(block) -> DecodeQuantizedLinear | None:
    """The block's down projection as the decode kernel's linear (looked for under a
    prefill wrapper), or None."""
    mlp = block.get("mlp") if isinstance(block, nn.Module) else None
    down = unwrap(mlp.get("down_proj")) if isinstance(mlp, nn.Module) else None
    return down if isinstance(down, DecodeQuantizedLinear) else None


def decode_linears(tree: nn.Module) -> list[DecodeQuantizedLinear]:
    """The decode kernel's linears in a block or a model (prefill wrappers looked through)."""
    return [module for _, module in tree.named_modules() if isinstance(module, DecodeQuantizedLinear)]


class DecodeBlock(Restated):
    """mlx-lm's TransformerBlock of ARCHITECTURES, its decode-sized steps with the residual
    adds in the output projections, compiled around the attention where it is a
    DecodeAttention (a Restated module: every other call runs mlx-lm's forward)."""

    def __init__(self, original):
        super().__init__(original)
        object.__setattr__(self, "_compiled", None)  # (split.generation, before, after)
        # One token per sequence runs the compiled step, whose replay costs the host the same
        # for qmm_decode's launches as for MLX's qmv, so its linears take the kernel from one
        # token (faster on the GPU: docs/benchmarks/decode-h200-layers.json); `original()`
        # gives them their own threshold back.
        lowered = []
        if isinstance(self.get("self_attn"), DecodeAttention):
            lowered = [(linear, linear.min_tokens) for linear in decode_linears(self)]
            for linear, _ in lowered:
                linear.min_tokens = 1
        object.__setattr__(self, "_lowered", lowered)  # (linear, its own threshold)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        down = down_projection(self)  # looked up per call: a later install may replace it
        attention = self.self_attn
        if down is not None and isinstance(attention, DecodeAttention) and attention.decodes(x, cache):
            return self.compiled_step(x, mask, cache)  # one sequence too: the host's share is all the same
        if down is None or not down.uses_kernel(x):
            return self._forward(self, x, mask, cache)
        normed = self.input_layernorm(x)
        if isinstance(attention, DecodeAttention):
            h = attention(normed, mask, cache, residual=x)
        else:
            h = x + attention(normed, mask, cache)
        return self.after_attention(h, down=down)

    def before_attention(self, x: mx.array, offset: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return self.self_attn.project(self.input_layernorm(x), offset)

    def after_attention(self, h: mx.array, attended: mx.array | None = None,
                        down: DecodeQuantizedLinear | None = None) -> mx.array:
        """The layer's output from the residual stream `h` (its input, plus the attention
        if `attended` is not given); `down`: the down projection where the caller has it."""
        if attended is not None:
            h = self.self_attn.output(attended, residual=h)
        mlp, down = self.mlp, down if down is not None else down_projection(self)
        n = self.post_attention_layernorm(h)
        return down.with_residual(swiglu(mlp.gate_proj(n), mlp.up_proj(n)), h)

    def original(self) -> nn.Module:
        for linear, min_tokens in self._lowered:
            linear.min_tokens = min_tokens
        return super().original()

    def compiled_step(self, x: mx.array, mask, cache) -> mx.array:
        """One token per sequence: `before_attention` and `after_attention` as mx.compile'd
        functions (traced once per batch size, then replayed: no Python per operation and
        no kernel source built per launch), the cache update and the attention between
        them as DecodeAttention runs them. Retraced after any module replacement in the
        model (`split.generation`): a trace holds the modules it saw."""
        compiled = self._compiled
        if compiled is None or compiled[0] != split.generation:
            compiled = (split.generation, mx.compile(self.before_attention), mx.compile(self.after_attention))
            object.__setattr__(self, "_compiled", compiled)
        offset = cache.offset if isinstance(cache.offset, mx.array) else qk_norm_rope.position(cache.offset)
        queries, keys, values = compiled[1](x, offset)
        return compiled[2](x, self.self_attn.attend(queries, keys, values, mask, cache))


def plain(module) -> nn.Module:
    """mlx-lm's TransformerBlock of the same modules and attributes for a DecodeBlock
    (undoes `install`); any other module as given."""
    return module.original() if isinstance(module, DecodeBlock) else module


def block_paths(model) -> list[str]:
    return [path for path, module in model.named_modules() if is_block(module) and down_projection(module) is not None]


def install(model) -> list[str]:
    """Replace every block of ARCHITECTURES whose down projection is a DecodeQuantizedLinear
    by a DecodeBlock; their paths."""
    return replace_modules(model, SOURCE, block_paths(model), DecodeBlock)


SPEC = KernelSpec(
    name="decode_block",
    replaces="mlx-lm's llama/qwen2/qwen3 decoder layer at decode sizes: its residual adds inside "
             "qmm_decode's output projections",
    source=SOURCE,
    validated=(),
    applies=lambda model: bool(block_paths(model)),
    absent="llama, qwen2 or qwen3 layers on qmm_decode's linears (kernels.qmm_decode active)",
    install=install,
)
