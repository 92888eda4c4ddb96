"""A small prefill's attention in MLX's unfused form, so that no cuDNN graph is built for it.

Why: on CUDA, MLX computes a prefill's attention with cuDNN, which builds a graph the first
time it meets each shape (batch, heads, query length, key length). A server admitting
prompts meets a new shape in nearly every prefill step: the batch is however many prompts
arrived, and the length is that of the longest. On an H100, the first forward of a shape
took 50-110 ms longer than its repeats, for a Qwen3-8B-shape forward of 14-29 prompts of
128-150 tokens. The repeats themselves took 56-108 ms
(docs/benchmarks/admission-h100-qwen3-8b-shape-cudnn.json).

The unfused form (scores, softmax, weighted sum) builds nothing. It costs more per call the
larger the scores are, so only attention whose scores hold at most SMALL_SCORES elements
takes it. Larger attention keeps cuDNN's fused kernel, where one graph build is small
beside the work.

- `attention(queries, keys, values, scale, mask, limit)`: what
  mx.fast.scaled_dot_product_attention gives, computed unfused where the scores hold at most
  `limit` elements (SMALL_SCORES by default; the setting prefill.small_attention_scores).
- `configure(model, limit)`: that limit for every attention module of the model that takes
  one (sdpa_decode's DecodeAttention, whose prefill comes here).
- `unfused(...)`: the fallback MLX itself runs when cuDNN is off, op for op. On the CPU,
  where MLX always runs its fallback, the two agree bit for bit.
"""

import mlx.core as mx

SMALL_SCORES = 1 << 25  # batch x query heads x queries x keys: 32 prompts of 176 tokens, 32 heads
LIMIT = "small_scores"  # the attribute of a module whose prefill attention comes here


def scores_size(queries: mx.array, keys: mx.array) -> int:
    batch, heads, length, _ = queries.shape
    return batch * heads * length * keys.shape[2]


def configure(model, limit: int) -> int:
    """Set `limit` on every module of `model` that takes one; how many there are."""
    modules = [module for _, module in model.named_modules() if hasattr(module, LIMIT)]
    for module in modules:
        object.__setattr__(module, LIMIT, int(limit))
    return len(modules)


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask=None,
              limit: int = SMALL_SCORES) -> mx.array:
    """softmax(scale * q k^T + mask) v for q [B, Hq, L, D] and k, v [B, Hkv, T, D]. `mask`:
    None, "causal", or an array (boolean: keep where true; otherwise added to the scores)."""
    if scores_size(queries, keys) <= limit:
        return unfused(queries, keys, values, scale, mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def unfused(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask=None) -> mx.array:
    """MLX's fallback for scaled_dot_product_attention (mlx/fast.cpp), op for op: grouped
    query heads share their key/value head through a broadcast, and the softmax runs in
    float32."""
    batch, heads, length, dim = queries.shape
    kv_heads, total = keys.shape[1], keys.shape[2]
    repeats = heads // kv_heads
    dtype = queries.dtype  # mlx-lm's attention gives q, k and v in one dtype
    q = mx.array(scale, dtype=dtype) * queries
    k, v = keys.astype(dtype), values.astype(dtype)
    if repeats > 1:
        q = q.reshape(batch, kv_heads, repeats, length, dim)
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = q @ k.swapaxes(-1, -2)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"attention mask {mask!r}: expected 'causal', an array or None")
        mask = mx.arange(total - length, total)[:, None] >= mx.arange(0, total)[None]
    elif mask is not None:
        if mask.dtype != mx.bool_:
            mask = mask.astype(dtype)
        mask = mx.broadcast_to(mask, (batch, heads, length, total))
        if repeats > 1:
            mask = mask.reshape(batch, kv_heads, repeats, length, total)
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, dtype=scores.dtype))
        else:
            scores = scores + mask
    out = mx.softmax(scores, axis=-1, precise=True) @ v
    return out.reshape(batch, heads, length, dim) if repeats > 1 else out
