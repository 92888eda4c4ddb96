"""small_attention: MLX's unfused attention for small prefill steps, and its routing."""

import mlx.core as mx
import pytest

from omlx_core.prefill import small_attention


def inputs(dtype, heads: int, kv_heads: int, batch: int = 2, length: int = 5, keys: int = 9, dim: int = 64):
    q = mx.random.normal((batch, heads, length, dim), key=mx.random.key(1)).astype(dtype)
    k = mx.random.normal((batch, kv_heads, keys, dim), key=mx.random.key(2)).astype(dtype)
    v = mx.random.normal((batch, kv_heads, keys, dim), key=mx.random.key(3)).astype(dtype)
    return q, k, v


MASKS = {
    "none": lambda dtype: None,
    "causal": lambda dtype: "causal",
    "left padding (bool)": lambda dtype: mx.random.uniform(shape=(2, 1, 5, 9), key=mx.random.key(4)) > 0.3,
    "additive": lambda dtype: mx.random.normal((2, 1, 5, 9), key=mx.random.key(5)).astype(dtype),
    "one for all (bool)": lambda dtype: mx.random.uniform(shape=(5, 9), key=mx.random.key(6)) > 0.2,
}


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
@pytest.mark.parametrize("mask", list(MASKS))
def test_unfused_is_mlx_attention_bit_for_bit_on_the_cpu(dtype, heads, kv_heads, mask):
    q, k, v = inputs(dtype, heads, kv_heads)
    given = MASKS[mask](dtype)
    ours = small_attention.unfused(q, k, v, 0.125, given)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=given)
    assert ours.shape == theirs.shape == q.shape and ours.dtype == dtype
    assert mx.array_equal(ours, theirs)


def test_a_wrong_mask_would_be_caught():
    q, k, v = inputs(mx.float32, 4, 2)
    causal = small_attention.unfused(q, k, v, 0.125, "causal")
    assert not mx.array_equal(causal, small_attention.unfused(q, k, v, 0.125, None))
    with pytest.raises(ValueError, match="attention mask 'sliding'"):
        small_attention.unfused(q, k, v, 0.125, "sliding")


def test_small_scores_go_unfused_and_large_ones_to_mlx(monkeypatch):
    calls = []
    fused = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(small_attention, "unfused", lambda *a: calls.append("unfused") or fused(*a[:3], scale=a[3]))
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append("fused") or fused(*a, **kw))
    q, k, v = inputs(mx.bfloat16, 4, 2)
    assert small_attention.scores_size(q, k) == 2 * 4 * 5 * 9 <= small_attention.SMALL_SCORES
    small_attention.attention(q, k, v, 0.125)
    small_attention.attention(q, k, v, 0.125, None, 2 * 4 * 5 * 9)
    small_attention.attention(q, k, v, 0.125, None, 2 * 4 * 5 * 9 - 1)
    small_attention.attention(q, k, v, 0.125, None, 0)
    assert calls == ["unfused", "unfused", "fused", "fused"]
