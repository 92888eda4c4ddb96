"""Chunked gated-delta prefill: the per-token recurrence as matmuls over chunks of tokens.

The gated delta rule keeps a state S (Dv x Dk) per head and, per token t,

    S_t = g_t S_{t-1} + b_t (v_t - g_t S_{t-1} k_t) k_t^T,      o_t = S_t q_t.

Within a chunk, with G_t the cumulative log decay from the chunk's start, the state is
S_t = e^{G_t} S_0 + sum_{j<=t} e^{G_t - G_j} u_j k_j^T for pseudo-values u that solve a
unit lower-triangular system (the WY / UT form): (I + A) u = b (v - e^G K S_0^T), with
A_tj = b_t e^{G_t - G_j} k_t.k_j for j < t. Everything that does not involve S_0 is
computed for all chunks at once (A's inverse by the nilpotent product
(I + A)^-1 = prod_k (I + (-A)^(2^k))); only the state is carried from chunk to chunk:

    U' = U - W S^T,  O = (e^G Q) S^T + (M * Q K^T) U',  S <- e^{G_C} S + U'^T (e^{G_C - G} K).

Same inputs and outputs as mlx-lm's `gated_delta_ops` (q, k, v, g, beta, state, mask);
pure MLX ops, so it runs on CPU, CUDA and Metal. Decode keeps the recurrent step.
"""

import math

import mlx.core as mx

CHUNK = 64


def _nilpotent_inverse(a: mx.array) -> mx.array:
    """(I + a)^-1 for strictly lower-triangular a (..., C, C), C a power of two."""
    size = a.shape[-1]
    eye = mx.eye(size, dtype=a.dtype)
    inverse = eye - a
    power = a
    for _ in range(int(math.log2(size)) - 1):
        power = power @ power
        inverse = inverse @ (eye + power)
    return inverse


def chunked_gated_delta(q, k, v, g, beta, state=None, mask=None, chunk: int = CHUNK):
    """y [B, T, Hv, Dv] and the final state [B, Hv, Dv, Dk], like `gated_delta_ops`.

    q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g, beta: [B, T, Hv] (scalar gates); state:
    [B, Hv, Dv, Dk] float32 or None; mask: [B, T] (False = padding: the state skips it).
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if g.ndim != 3:
        raise ValueError("chunked_gated_delta takes scalar gates [B, T, Hv]")
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if Hv // Hk > 1:
        q, k = mx.repeat(q, Hv // Hk, -2), mx.repeat(k, Hv // Hk, -2)
    f32, out_dtype = mx.float32, q.dtype
    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
    if mask is not None:  # a padding step neither decays nor writes the state
        g = mx.where(mask[..., None], g, 1.0)
        beta = mx.where(mask[..., None], beta, 0.0)
    pad = (-T) % chunk
    if pad:
        q, k, v = (mx.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (q, k, v))
        g = mx.pad(g, [(0, 0), (0, pad), (0, 0)], constant_values=1.0)
        beta = mx.pad(beta, [(0, 0), (0, pad), (0, 0)])
    n = (T + pad) // chunk

    def chunks(x):  # [B, N*C, H, D] -> [B, H, N, C, D]
        return x.reshape(B, n, chunk, Hv, -1).transpose(0, 3, 1, 2, 4)

    q, k, v = chunks(q), chunks(k), chunks(v)
    g, beta = chunks(g[..., None])[..., 0], chunks(beta[..., None])[..., 0]  # [B, H, N, C]
    G = mx.cumsum(mx.log(g), axis=-1)
    lower = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_), -1)
    causal = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_))
    gap = G[..., :, None] - G[..., None, :]  # G_t - G_j
    decay_strict = mx.where(lower, mx.exp(mx.where(lower, gap, 0.0)), 0.0)
    decay_causal = mx.where(causal, mx.exp(mx.where(causal, gap, 0.0)), 0.0)

    a = beta[..., None] * decay_strict * (k @ k.swapaxes(-1, -2))
    t_inv = _nilpotent_inverse(a)
    u = t_inv @ (beta[..., None] * v)  # [B, H, N, C, Dv]
    w = t_inv @ (beta[..., None] * mx.exp(G)[..., None] * k)  # [B, H, N, C, Dk]
    attend = decay_causal * (q @ k.swapaxes(-1, -2))  # [B, H, N, C, C]
    q_decayed = mx.exp(G)[..., None] * q
    tail = mx.exp(G[..., -1:] - G)[..., None] * k  # e^{G_C - G_j} k_j
    end_decay = mx.exp(G[..., -1])  # [B, H, N]

    outputs = []
    for i in range(n):
        s_t = state.swapaxes(-1, -2)  # [B, H, Dk, Dv]
        u_i = u[:, :, i] - w[:, :, i] @ s_t
        outputs.append(q_decayed[:, :, i] @ s_t + attend[:, :, i] @ u_i)
        state = end_decay[:, :, i, None, None] * state + u_i.swapaxes(-1, -2) @ tail[:, :, i]
    y = mx.stack(outputs, axis=2).transpose(0, 2, 3, 1, 4).reshape(B, n * chunk, Hv, Dv)
    return y[:, :T].astype(out_dtype), state
