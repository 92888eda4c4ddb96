"""Fused indexer score for deepseek_v41 (DeepSeek V4 Flash): no per-head score tensor.

mlx-lm's `Indexer` scores every compressed KV entry for every query as
`sum_h w[h] * relu(q_h . k) * D^-1/2` by materializing a float32 [batch, length, heads,
entries] tensor and summing it over heads: at a 2048-token chunk and 1M context, 137 GB.
`kernels/indexer_score.cu` computes the [batch, length, entries] scores tile by tile.

`FusedIndexer` replaces each `Indexer` by name. It computes q and the head weights with
mlx-lm's own modules and functions, the scores with the kernel where `fusable` says its
result is the ops path's (else with `ops_scores`, mlx-lm's expression), then picks the
candidate blocks and the top-k entries exactly as mlx-lm's `Indexer.__call__` does
(`select_entries` restates those lines: mlx-lm has them inline, not as a function; the
tests check both against mlx-lm's module).
"""

import math

import mlx.core as mx
import mlx.nn as nn

from omlx_core.kernels.registry import HardwareMatch, KernelSpec, ModelMatch, Validation, kernel_source, replace_modules

HEADS = 64  # the kernel's head count (its in-register reduction is laid out for 64)
TILE_N = 256  # entries per block: 8 warps x 32
TARGET_BLOCKS = 264  # enough blocks for two per SM of an H200 (132 SMs)
BODY_MARKER = "// ---- body ----"

_kernel = None


def ops_scores(q: mx.array, keys: mx.array, weights: mx.array, head_dim: int, lens: mx.array) -> mx.array:
    """mlx-lm's score expression (deepseek_v41 `Indexer.__call__`): q [B, L, H, D], keys
    [B, N, D], weights [B, L, H] float32 (already times H^-1/2), lens [L]; returns the
    [B, L, N] float32 scores, -inf where an entry is not yet visible."""
    keys = keys.astype(mx.float32)
    scores = mx.matmul(q.astype(mx.float32), keys[:, None].swapaxes(-1, -2))
    scores = mx.maximum(scores, 0.0) * (head_dim**-0.5)
    scores = mx.sum(scores * weights[..., None], axis=2)
    visible = mx.arange(keys.shape[1])[None, :] < lens[:, None]
    return mx.where(visible[None], scores, -mx.inf)


def fusable(q: mx.array, keys: mx.array) -> str | None:
    """Why the kernel cannot give the ops path's scores for these inputs, or None."""
    from omlx_core.hardware import mlx_backend

    if mlx_backend() != "cuda":
        return "the kernel runs on CUDA only"
    heads, head_dim, entries = q.shape[2], q.shape[3], keys.shape[1]
    if heads != HEADS:
        return f"{heads} index heads (the kernel reduces exactly {HEADS} in MLX's order)"
    if head_dim % 16:
        return f"index head dim {head_dim} is not a multiple of 16"
    if q.dtype != mx.bfloat16 or keys.dtype != q.dtype:
        # The source has a float16 variant too; it stays off until validated like bf16.
        return f"q {q.dtype} / keys {keys.dtype} (validated for bfloat16 only)"
    if entries < 2:
        return "fewer than 2 entries (MLX then reduces the heads in another order)"
    return None


def _score_kernel():
    global _kernel
    if _kernel is None:
        header, body = kernel_source(SPEC.source).split(BODY_MARKER, 1)
        _kernel = mx.fast.cuda_kernel(name="omlx_indexer_score",
                                      input_names=["q", "keys", "weights", "lens", "scale"],
                                      output_names=["out"], source=body, header=header)
    return _kernel


def fused_scores(q: mx.array, keys: mx.array, weights: mx.array, head_dim: int, lens: mx.array) -> mx.array:
    """`ops_scores` computed by the kernel (inputs as `fusable` accepts them)."""
    batch, length, _, dim = q.shape
    entries = keys.shape[1]
    tiles = math.ceil(entries / TILE_N)
    splits = max(1, min(length, math.ceil(TARGET_BLOCKS / (tiles * batch))))
    (out,) = _score_kernel()(
        inputs=[q, keys, weights.astype(mx.float32), lens.astype(mx.int32),
                mx.array([head_dim**-0.5], dtype=mx.float32)],
        template=[("T", q.dtype), ("D", dim), ("IS_BF16", q.dtype == mx.bfloat16)],
        grid=(tiles * TILE_N, splits, batch), threadgroup=(TILE_N, 1, 1),
        output_shapes=[(batch, length, entries)], output_dtypes=[mx.float32])
    return out


def select_entries(indexer, scores: mx.array, lens: mx.array, candidates):
    """The candidate blocks and top-k entries from the scores, as mlx-lm's Indexer picks
    them (`lens` is [L, 1]); returns (top-k indices, -1 for none; candidate mask)."""
    batch, length, entries = scores.shape
    if indexer.is_candidate_source and indexer.candidate_topk_blocks > 0:
        block = indexer.candidate_block_size
        padded = mx.pad(scores, [(0, 0), (0, 0), (0, (-entries) % block)], constant_values=-mx.inf)
        block_scores = padded.reshape(batch, length, -1, block).max(axis=-1)
        blocks = block_scores.shape[-1]
        newest = mx.where(lens > 0, (lens - 1) // block, -1)  # partly full: always kept
        block_scores = mx.where(mx.arange(blocks) == newest, mx.inf, block_scores)
        keep = min(indexer.candidate_topk_blocks, blocks)
        picked = mx.argpartition(-block_scores, keep - 1, axis=-1)[..., :keep]
        reachable = mx.take_along_axis(block_scores, picked, axis=-1) > -mx.inf
        candidates = mx.put_along_axis(mx.zeros(block_scores.shape, dtype=mx.bool_), picked,
                                       reachable, axis=-1)
        candidates = mx.repeat(candidates, block, axis=-1)[..., :entries]
    elif candidates is not None:
        scores = mx.where(candidates, scores, -mx.inf)
    k = min(indexer.index_topk, entries)
    chosen = mx.argpartition(-scores, k - 1, axis=-1)[..., :k].astype(mx.int32)
    return mx.where(chosen < lens[None], chosen, -1), candidates


class FusedIndexer(nn.Module):
    """mlx-lm's deepseek_v41 Indexer with the fused score; same parameters, same names."""

    FIELDS = ("ratio", "is_candidate_source", "candidate_topk_blocks", "candidate_block_size",
              "num_heads", "head_dim", "index_topk", "rope_dim")

    def __init__(self, original):
        super().__init__()
        for name in self.FIELDS:
            setattr(self, name, getattr(original, name))
        # The original's modules, under their names: Attention._compress reads k_proj/k_norm.
        for name in ("q_b_proj", "weights_proj", "k_proj", "k_norm"):
            if name in original:
                setattr(self, name, original[name])
        self.fused_calls = 0
        self.ops_calls = 0

    def query(self, x, q_residual, *, rope, start_pos):
        """The score inputs, as mlx-lm makes them: q (roped, fp4 fake-quantized), the head
        weights (float32, times H^-1/2) and each query's visible entry count."""
        from mlx_lm.models.deepseek_v41 import _apply_rope, _fake_quant_fp4

        batch, length, _ = x.shape
        q = self.q_b_proj(q_residual).reshape(batch, length, self.num_heads, self.head_dim)
        q = _apply_rope(q, rope, rope_dim=self.rope_dim, offset=start_pos)
        q = _fake_quant_fp4(q, block_size=32)
        weights = self.weights_proj(x).astype(mx.float32) * (self.num_heads**-0.5)
        return q, weights, (start_pos + 1 + mx.arange(length)) // self.ratio

    def __call__(self, x, q_residual, *, index_k, candidates, rope, start_pos):
        batch, length, _ = x.shape
        if index_k is None or index_k.shape[1] == 0:
            return mx.zeros((batch, length, 0), dtype=mx.int32), candidates
        q, weights, lens = self.query(x, q_residual, rope=rope, start_pos=start_pos)
        if fusable(q, index_k) is None:
            self.fused_calls += 1
            scores = fused_scores(q, index_k, weights, self.head_dim, lens)
        else:
            self.ops_calls += 1
            scores = ops_scores(q, index_k, weights, self.head_dim, lens)
        return select_entries(self, scores, lens[:, None], candidates)


def is_indexer(module) -> bool:
    kind = type(module)
    return kind.__name__ == "Indexer" and kind.__module__.endswith(".deepseek_v41")


def indexer_paths(model) -> list[str]:
    return [path for path, module in model.named_modules() if is_indexer(module)]


def install(model) -> list[str]:
    """Replace every deepseek_v41 Indexer by a FusedIndexer; returns their paths."""
    return replace_modules(model, SPEC.source, indexer_paths(model), FusedIndexer)


SPEC = KernelSpec(
    name="indexer_score",
    replaces="deepseek_v41 Indexer score (the [batch, length, heads, entries] tensor summed over heads)",
    source="indexer_score.cu",
    # Architecture-level (registry docstring): the score depends on the index heads, the
    # head size and the activation dtype, not on the weights. Checked by
    # scripts/bench/indexer.py at V4 Flash's shapes: identical top-k, scores bit-exact.
    validated=(Validation(ModelMatch.architecture("deepseek_v41", index_n_heads=64, index_head_dim=128),
                          HardwareMatch("cuda", "sm_90", "NVIDIA H200"),
                          "docs/benchmarks/indexer-score-h200-v4-flash.json"),),
    applies=lambda model: bool(indexer_paths(model)),
    absent="deepseek_v41 Indexer",
    install=install,
)
