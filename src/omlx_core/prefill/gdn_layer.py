"""A qwen3_5 gated-delta layer whose prefill uses the chunked recurrence.

Installed by module replacement (`linear_attn` of each linear-attention decoder layer):
it keeps mlx-lm's layer, with all its weights and projections (split lanes included), and
for prefill-sized inputs runs the same steps in the same order (projections, causal conv
with its cache, q/k normalization, gates) but calls `chunked_gated_delta` for the
recurrence. Decode-sized inputs go to mlx-lm's layer untouched.
"""

import mlx.core as mx
import mlx.nn as nn

from omlx_core.prefill.gated_delta import chunked_gated_delta

DEFAULT_MIN_TOKENS = 64


class ChunkedGatedDeltaNet(nn.Module):
    def __init__(self, layer, min_tokens: int = DEFAULT_MIN_TOKENS):
        super().__init__()
        self.layer = layer
        self.min_tokens = min_tokens
        self.calls = 0

    def __call__(self, inputs: mx.array, mask=None, cache=None) -> mx.array:
        layer = self.layer
        batch, tokens, _ = inputs.shape
        if tokens < self.min_tokens or getattr(layer, "sharding_group", None) is not None:
            return layer(inputs, mask, cache)
        from mlx_lm.models.gated_delta import compute_g, normalize_qk

        self.calls += 1
        qkv = layer.in_proj_qkv(inputs)
        z = layer.in_proj_z(inputs).reshape(batch, tokens, layer.num_v_heads, layer.head_v_dim)
        b, a = layer.in_proj_b(inputs), layer.in_proj_a(inputs)
        keep = layer.conv_kernel_size - 1
        conv_state = cache[0] if cache is not None and cache[0] is not None else \
            mx.zeros((batch, keep, layer.conv_dim), dtype=inputs.dtype)
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        if cache is not None:
            if cache.lengths is not None:
                ends = mx.clip(cache.lengths, 0, tokens)
                cache[0] = mx.take_along_axis(conv_input, (ends[:, None] + mx.arange(keep))[..., None], axis=1)
            else:
                cache[0] = mx.contiguous(conv_input[:, -keep:, :])
        conv_out = nn.silu(layer.conv1d(conv_input))
        q, k, v = mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1)
        q = q.reshape(batch, tokens, layer.num_k_heads, layer.head_k_dim)
        k = k.reshape(batch, tokens, layer.num_k_heads, layer.head_k_dim)
        v = v.reshape(batch, tokens, layer.num_v_heads, layer.head_v_dim)
        q, k = normalize_qk(q, k, inv_scale=layer.head_k_dim ** -0.5, eps=1e-6)
        state = cache[1] if cache else None
        out, state = chunked_gated_delta(q, k, v, compute_g(layer.A_log, a, layer.dt_bias),
                                         mx.sigmoid(b), state, mask)
        if cache is not None:
            cache[1] = state
            cache.advance(tokens)
        out = layer.norm(out, z)
        return layer.out_proj(out.reshape(batch, tokens, -1))
