#!/usr/bin/env python
"""Decode attention: omlx's `sdpa_decode` kernel against MLX's, one query token per sequence.

Why: cuDNN's decode attention is 4.0 of a Qwen3-8B-shape batch-32 step's 11.2 ms of GPU time
on the H200 (docs/benchmarks/decode-h200-profile-grouped.json). This measures, in one run:

  exact  the kernel against mx.fast.scaled_dot_product_attention and an fp32 reference:
         bf16 and fp16, head size 64 and 128, 1 to 8 query heads per key/value head, one
         cache slice and several (lengths 1 to 5000), K/V as views of a larger cache
         buffer as mlx-lm's KVCache hands them over, left padding as BatchKVCache keeps
         it (whole slices of it too); the check is decode.py's `compare` (within 1/128 of
         the largest output)
  greedy 64-token greedy decode of a tiny fp16 llama (head size 64, 2 query heads per
         key/value head; 4-bit g64) from a 9-token prompt, stock against sdpa_decode
         installed with qk_norm_rope's prologue, on KVCache (two prompts) and on BatchKVCache with left padding:
         identical tokens, or a first difference at a near tie of the stock run (top two
         logits within one ulp)
  prologue  qk_norm_rope (the q/k norms and RoPE before the attention, one launch) against
         mlx-lm's ops (`compare` and bit for bit) and fp32: qwen3 norms and nn.RoPE, llama's
         nn.RoPE (one position for the batch, and linear scaling at 32k), Llama 3's
         frequency table, traditional pairs, head size 64 in fp16; then GPU time per call
         at Qwen3-8B heads, batch 1 and 32, chained as `time` chains: mlx-lm's 4 launches
         against one
  time   GPU time per call, chained in one CUDA graph, K/V of distinct layers (several
         times the L2 cache): MLX without a mask (cuDNN's decode path, as mlx-lm's KVCache
         decodes), MLX with an additive mask (its vector kernel, as `omlx serve`'s
         BatchKVCache decodes), and ours; Qwen3-8B shapes (32 query heads, 8 key/value
         heads, head size 128) at batch 1, 8, 32 and context 1k and 4k; effective GB/s
         of K/V read

    python scripts/bench/attention.py [--parts exact,greedy,prologue,time] [--reference] [--workdir DIR] [--repeats 5]
        [--save FILE] [--json]

`--reference` checks the harness where CUDA is absent: MLX's own attention stands in for the
kernel, mlx-lm's ops for the prologue's (exact, greedy and prologue; nothing timed).
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import mlx.core as mx

# A sibling bench script: this directory is on the path when a script in it runs.
from decode import L2_BYTES, ONE_GRAPH, bandwidth, chain_seconds, compare, copying_append, hardware, log
from omlx_core.kernels import qk_norm_rope, sdpa_decode

# MLX reads its graph limits when it first uses the GPU, not at import: each chain is one graph.
os.environ.update(ONE_GRAPH)

PARTS = ("exact", "greedy", "prologue", "time")
# (batch, query heads, key/value heads, head size, cached tokens, buffer length, dtype, left
# padding per sequence or None)
EXACT_CASES = ((1, 32, 8, 128, 1024, 1280, mx.bfloat16, None), (32, 32, 8, 128, 1024, 1280, mx.bfloat16, None),
               (3, 28, 4, 128, 77, 256, mx.bfloat16, None), (2, 16, 16, 64, 2049, 2304, mx.bfloat16, None),
               (4, 64, 8, 128, 300, 512, mx.float16, None), (1, 8, 1, 64, 5000, 5120, mx.bfloat16, None),
               (2, 4, 4, 128, 1, 256, mx.bfloat16, None), (3, 32, 8, 128, 300, 512, mx.bfloat16, (0, 7, 250)),
               (2, 16, 4, 64, 2100, 2304, mx.bfloat16, (0, 1500)))
TIME_SHAPES = ((1, 1024), (8, 1024), (32, 1024), (1, 4096), (8, 4096))  # (batch, context): Qwen3-8B heads
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def cache_views(batch: int, kv_heads: int, dim: int, tokens: int, length: int, dtype, seed: int):
    """K and V as mlx-lm's KVCache hands them over: [..., :tokens, :] views of its buffer."""
    key = mx.random.key(seed)
    k_all, v_all = (mx.random.normal((batch, kv_heads, length, dim), key=part).astype(dtype)
                    for part in mx.random.split(key))
    mx.eval(k_all, v_all)
    return k_all[..., :tokens, :], v_all[..., :tokens, :]


def padding_mask(starts, tokens: int, dtype) -> mx.array | None:
    """The additive mask that left padding stands for: -inf before each sequence's start."""
    if starts is None:
        return None
    visible = mx.arange(tokens)[None, :] >= mx.array(starts)[:, None]
    return mx.where(visible, 0.0, -mx.inf).astype(dtype)[:, None, None, :]


def poisoned(a: mx.array, starts) -> mx.array:
    """`a` with NaN in every padded row: the kernel must never read them (a padded query
    row of a prefill attends to nothing, and its keys and values may be NaN)."""
    if starts is None:
        return a
    visible = mx.arange(a.shape[2])[None, :] >= mx.array(starts)[:, None]
    return mx.where(visible[:, None, :, None], a, mx.nan).astype(a.dtype)


def fp32_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, starts=None) -> mx.array:
    group = q.shape[1] // k.shape[1]
    k32, v32 = (mx.repeat(a.astype(mx.float32), group, axis=1) for a in (k, v))
    scores = (q.astype(mx.float32) @ k32.swapaxes(-1, -2)) * scale
    mask = padding_mask(starts, k.shape[2], mx.float32)
    return mx.softmax(scores if mask is None else scores + mask, axis=-1) @ v32


def mlx_attention(q, k, v, scale, starts=None):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=padding_mask(starts, k.shape[2], q.dtype))


def kernel_attention(q, k, v, scale, starts=None):
    return sdpa_decode.decode_attention(q, k, v, scale, None if starts is None else mx.array(starts, dtype=mx.int32))


def run_exact(attention, cases=EXACT_CASES, poison: bool = True) -> dict:
    """`attention` against MLX's and fp32, padded rows NaN unless `poison` is off (MLX's
    own attention multiplies them by zero: it stands in only without)."""
    rows = []
    for batch, heads, kv_heads, dim, tokens, length, dtype, starts in cases:
        k, v = cache_views(batch, kv_heads, dim, tokens, length, dtype, seed=tokens + dim)
        q = mx.random.normal((batch, heads, 1, dim), key=mx.random.key(heads)).astype(dtype)
        scale = dim**-0.5
        given = (poisoned(k, starts), poisoned(v, starts)) if poison else (k, v)
        ours = attention(q, *given, scale, starts)
        row = {"batch": batch, "heads": heads, "kv_heads": kv_heads, "dim": dim, "tokens": tokens,
               "dtype": str(dtype).split(".")[-1], "padding": starts,
               "splits": sdpa_decode.splits_for(batch * kv_heads, tokens),
               **compare(ours, mlx_attention(q, k, v, scale, starts), fp32_attention(q, k, v, scale, starts))}
        rows.append(row)
        log(f"exact B={batch} H={heads}/{kv_heads} D={dim} T={tokens} {row['dtype']} padding {starts}: "
            f"rel {row['rel_max']:.2e} ok={row['ok']}")
    worst = max(rows, key=lambda r: r["rel_max"])
    return {"cases": len(rows), "failed": sum(not r["ok"] for r in rows), "worst": worst, "rows": rows}


GREEDY_SHAPE = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
GREEDY_PROMPT = (42, 7, 100, 300, 1, 250, 411, 77, 5)


def greedy_run(model, caches, prompts: mx.array, count: int) -> tuple[list[list[int]], list[list[float]]]:
    """`count` greedy tokens of every prompt row, decoded one step at a time on `caches`,
    and each step's margin in units in the last place of the top logit: how far the chosen
    logit stands above the runner-up (0: a tie, 1: one rounding step)."""
    logits = model(prompts, cache=caches)[:, -1, :]
    mantissa = mx.finfo(logits.dtype).eps
    tokens, margins = [], []
    for _ in range(count):
        token = mx.argmax(logits, axis=-1).astype(mx.int32)
        top2 = mx.topk(logits.astype(mx.float32), 2, axis=-1)
        ulp = mantissa * mx.power(2.0, mx.floor(mx.log2(mx.abs(top2[:, 1]))))
        tokens.append(token.tolist())
        margins.append((mx.abs(top2[:, 1] - top2[:, 0]) / ulp).tolist())
        logits = model(token[:, None], cache=caches)[:, -1, :]
    return [list(row) for row in zip(*tokens)], [list(row) for row in zip(*margins)]


NEAR_TIE_ULPS = 1  # a step whose top two logits are this close picks on rounding alone


def first_difference(ours: list[list[int]], theirs: list[list[int]], margins: list[list[float]]) -> list:
    """Per sequence: None where the tokens agree, else the first step that differs, the
    stock run's margin there (in ulps) and whether that step was a near tie."""
    found = []
    for row, (a, b) in enumerate(zip(ours, theirs)):
        step = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        found.append(None if step is None else {"step": step, "stock_margin_ulps": margins[row][step],
                                                 "near_tie": margins[row][step] <= NEAR_TIE_ULPS})
    return found


def fp32_launch(q, k, v, scale, starts, locks, written=None, keys=None):
    """The kernel's place taken by an fp32 attention (the greedy part's third opinion), over
    the first `keys` rows of k and v as the kernel reads them."""
    k, v = (k, v) if keys is None else (k[..., :keys, :], v[..., :keys, :])
    return fp32_attention(q, k, v, scale, None if starts is None else starts.tolist()).astype(q.dtype)


def run_greedy(workdir: Path, count: int = 64) -> list[dict]:
    """Stock against installed, on a plain cache (two sequences) and a left-padded batch
    cache (the prompt, and the same prompt shifted by 4 tokens of padding), an fp16 tiny
    llama (bf16 logits of a random model tie too often). They agree when the tokens are
    identical or first differ at a near tie of the stock run, which rounding alone decides;
    where they differ, a third run with an fp32 attention in the kernel's place shows
    whether exact attention sides with either."""
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
    from mlx_lm.utils import load

    from omlx_core.models.testing import build_tiny_model

    path = workdir / "attention-greedy-llama-d64-fp16"
    if not (path / "config.json").is_file():
        build_tiny_model("llama", path, quantized=True, bits=4, group_size=64, dtype="float16",
                         shape=GREEDY_SHAPE)
    model, _ = load(str(path))
    prompt = list(GREEDY_PROMPT)
    padded = mx.array([prompt, [0] * 4 + prompt[:-4]], dtype=mx.int32)
    runs = {"plain": (lambda: make_prompt_cache(model), mx.array([prompt, prompt[::-1]], dtype=mx.int32)),
            "batch": (lambda: [BatchKVCache([0, 4]) for _ in model.layers], padded)}
    stock = {name: greedy_run(model, make(), prompts, count) for name, (make, prompts) in runs.items()}
    paths = sdpa_decode.install(model)
    paths = qk_norm_rope.install(model) or paths  # the prologue's launch too (the same modules, replaced)
    modules = dict(model.named_modules())
    rows = []
    for name, (make, prompts) in runs.items():
        before = sum(modules[p].kernel_calls for p in paths)
        ours, _ = greedy_run(model, make(), prompts, count)
        row = {"cache": name, "tokens": count, "identical": ours == stock[name][0], "agrees": ours == stock[name][0],
               "kernel_calls": sum(modules[p].kernel_calls for p in paths) - before}
        if not row["identical"]:
            kernel, sdpa_decode.launch = sdpa_decode.launch, fp32_launch
            try:
                exact, _ = greedy_run(model, make(), prompts, count)
            finally:
                sdpa_decode.launch = kernel
            differs = first_difference(ours, stock[name][0], stock[name][1])
            row.update(agrees=all(d is None or d["near_tie"] for d in differs), differs=differs,
                       ours_matches_fp32=ours == exact, stock_matches_fp32=stock[name][0] == exact)
        rows.append(row)
        detail = "" if row["identical"] else (
            f"; differs {row['differs']}, ours as fp32 attention {row['ours_matches_fp32']}, "
            f"stock as fp32 attention {row['stock_matches_fp32']}")
        log(f"greedy {name}: identical={row['identical']} agrees={row['agrees']} "
            f"({row['kernel_calls']} kernel calls){detail}")
    return rows


# (norms, rope: (kind, traditional, base or scale), batch, query heads, key/value heads, head
# size, positions: one int for the batch or one per sequence, dtype)
PROLOGUE_CASES = ((True, ("rope", False, 1_000_000.0, 1.0), 32, 32, 8, 128, [1024 + 37 * i for i in range(32)],
                   mx.bfloat16),
                  (False, ("rope", False, 500_000.0, 1.0), 1, 32, 8, 128, 1023, mx.bfloat16),
                  (False, ("rope", False, 10_000.0, 0.25), 3, 32, 8, 128, 32_000, mx.bfloat16),
                  (False, ("llama3", False, 500_000.0, 1.0), 8, 32, 8, 128, [5, 900, 4000, 8191, 17, 0, 1, 2],
                   mx.bfloat16),
                  (True, ("rope", True, 10_000.0, 1.0), 5, 16, 4, 64, [3, 70, 700, 7000, 1], mx.float16))


def prologue_module(norms: bool, rope: tuple, heads: int, kv_heads: int, dim: int, dtype, seed: int):
    """An attention module as the prologue reads one: heads, rope, and the norms if any."""
    import mlx.nn as nn
    from mlx_lm.models.rope_utils import Llama3RoPE

    kind, traditional, base, scale = rope
    module = nn.Module()
    module.n_heads, module.n_kv_heads = heads, kv_heads
    if kind == "llama3":
        module.rope = Llama3RoPE(dim, traditional=traditional, base=base,
                                 scaling_config={"factor": 8.0, "original_max_position_embeddings": 8192})
    else:
        module.rope = nn.RoPE(dim, traditional=traditional, base=base, scale=scale)
    if norms:
        key_q, key_k = mx.random.split(mx.random.key(seed))
        module.q_norm, module.k_norm = nn.RMSNorm(dim, eps=1e-6), nn.RMSNorm(dim, eps=1e-6)
        module.q_norm.weight = (1 + 0.2 * mx.random.normal((dim,), key=key_q)).astype(dtype)
        module.k_norm.weight = (1 + 0.2 * mx.random.normal((dim,), key=key_k)).astype(dtype)
    mx.eval(module.parameters())
    return module


def fp32_prologue(module, queries: mx.array, keys: mx.array, offset) -> tuple[mx.array, mx.array]:
    """The prologue in fp32 throughout (the weights and the rope's tables as fp32)."""
    def norm(x, layer):
        x = x.astype(mx.float32)
        return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + layer.eps) * layer.weight.astype(mx.float32)

    batch = queries.shape[0]
    q = queries.astype(mx.float32).reshape(batch, 1, module.n_heads, -1)
    k = keys.astype(mx.float32).reshape(batch, 1, module.n_kv_heads, -1)
    if "q_norm" in module:
        q, k = norm(q, module.q_norm), norm(k, module.k_norm)
    q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
    return module.rope(q, offset=offset), module.rope(k, offset=offset)


def run_prologue(repeats: int, timed_too: bool, calls: int = 32) -> dict:
    """Each PROLOGUE_CASES case: ours against mlx-lm's ops (`compare`, and bit for bit) and
    fp32; then (`timed_too`) GPU time per call at Qwen3-8B heads."""
    rows = []
    for index, (norms, rope, batch, heads, kv_heads, dim, positions, dtype) in enumerate(PROLOGUE_CASES):
        module = prologue_module(norms, rope, heads, kv_heads, dim, dtype, seed=index)
        prologue = qk_norm_rope.Prologue.of(module)
        key_q, key_k = mx.random.split(mx.random.key(100 + index))
        queries = (3 * mx.random.normal((batch, 1, heads * dim), key=key_q)).astype(dtype)
        keys = (3 * mx.random.normal((batch, 1, kv_heads * dim), key=key_k)).astype(dtype)
        offset = mx.array(positions, dtype=mx.int32) if isinstance(positions, list) else positions
        ours = prologue(module, queries, keys, offset)
        stock = qk_norm_rope.reference(module, queries, keys, offset)
        truth = fp32_prologue(module, queries, keys, offset)
        for name, a, b, t in zip(("q", "k"), ours, stock, truth):
            row = {"case": index, "tensor": name, "norms": norms, "rope": list(rope), "batch": batch, "heads": heads,
                   "kv_heads": kv_heads, "dim": dim, "dtype": str(dtype).split(".")[-1],
                   "identical": bool(mx.array_equal(a, b)),
                   "mismatched": int(mx.sum(a != b).item()), **compare(a, b, t.astype(mx.float32))}
            rows.append(row)
        log(f"prologue case {index} ({'norms, ' if norms else ''}{rope[0]} d{dim} B={batch}): "
            + ", ".join(f"{r['tensor']} rel {r['rel_max']:.2e} identical={r['identical']} ok={r['ok']}"
                        for r in rows[-2:]))
    timed = []
    for batch in (1, 32) if timed_too else ():
        module = prologue_module(True, ("rope", False, 1_000_000.0, 1.0), HEADS, KV_HEADS, HEAD_DIM, mx.bfloat16, 0)
        prologue = qk_norm_rope.Prologue.of(module)
        keys = mx.random.normal((batch, 1, KV_HEADS * HEAD_DIM)).astype(mx.bfloat16)
        q0 = mx.random.normal((batch, 1, HEADS * HEAD_DIM)).astype(mx.bfloat16)
        offset = mx.array([1024] * batch, dtype=mx.int32)
        row = {"batch": batch}
        for name, run in (("mlx_lm", lambda q: qk_norm_rope.reference(module, q, keys, offset)),
                          ("ours", lambda q: prologue(module, q, keys, offset))):
            wall, gpu = chain_seconds(lambda i, q: run(q)[0].reshape(batch, 1, -1), q0, calls, repeats)
            row[f"{name}_us"] = gpu * 1e6
        timed.append(row)
        log(f"prologue time B={batch}: mlx-lm {row['mlx_lm_us']:.1f} us, ours {row['ours_us']:.1f} us per call")
    return {"cases": len(rows), "failed": sum(not r["ok"] for r in rows),
            "identical": sum(r["identical"] for r in rows), "worst": max(rows, key=lambda r: r["rel_max"]),
            "rows": rows, "time": timed,
            "time_method": f"{calls} dependent calls as one CUDA graph, median of {repeats}; GPU us per call "
                           "(qwen3: norms and RoPE of q and k)"}


def run_time(repeats: int, calls: int = 32) -> dict:
    rows = []
    for batch, context in TIME_SHAPES:
        length = math.ceil((context + 1) / 256) * 256  # a KVCache buffer: steps of 256
        nbytes = 2 * batch * KV_HEADS * context * HEAD_DIM * 2
        count = max(3, math.ceil(4 * L2_BYTES / nbytes))
        caches = [cache_views(batch, KV_HEADS, HEAD_DIM, context, length, mx.bfloat16, seed=i) for i in range(count)]
        locks = [mx.zeros((batch * KV_HEADS,), dtype=mx.int32) for _ in range(count)]
        mask = mx.zeros((batch, 1, 1, context), dtype=mx.bfloat16)  # additive, all visible
        q0 = mx.random.normal((batch, HEADS, 1, HEAD_DIM)).astype(mx.bfloat16)
        mx.eval(locks, mask, q0)
        scale = HEAD_DIM**-0.5

        def cudnn(i, q):
            k, v = caches[i % count]
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)

        def vector(i, q):
            k, v = caches[i % count]
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

        def ours(i, q):
            k, v = caches[i % count]
            return sdpa_decode.decode_attention(q, k, v, scale, locks=locks[i % count])  # no padding

        row = {"batch": batch, "context": context, "kv_bytes": nbytes,
               "splits": sdpa_decode.splits_for(batch * KV_HEADS, context)}
        variants = {"mlx_cudnn": cudnn, "mlx_masked": vector, "ours": ours}
        for name, step in variants.items():
            wall, gpu = chain_seconds(step, q0, calls, repeats)
            row[f"{name}_us"], row[f"{name}_gbps"] = gpu * 1e6, bandwidth(nbytes, gpu)
        rows.append(row)
        log(f"time B={batch} ctx={context}: " + ", ".join(
            f"{name} {row[name + '_us']:.1f} us ({row[name + '_gbps']:.0f} GB/s)"
            for name in variants))
        del caches
        mx.clear_cache()
    return {"method": f"{calls} dependent calls as one CUDA graph, median of {repeats}; us: GPU time per call; "
                      "GB/s: K and V bytes per call over it", "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--reference", action="store_true", help="MLX's attention stands in for the kernel")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", default="/tmp/omlx-bench-models")
    parser.add_argument("--save", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if unknown := [p for p in parts if p not in PARTS]:
        raise SystemExit(f"attention.py: unknown part {unknown[0]!r}; use {', '.join(PARTS)}")
    from omlx_core.hardware import mlx_backend

    if not args.reference and mlx_backend() != "cuda":
        raise SystemExit("attention.py: the sdpa_decode kernel needs MLX's CUDA backend; run it on the GPU "
                         "machine, or pass --reference to check the harness with MLX's attention")
    if args.reference and "time" in parts:
        raise SystemExit("attention.py: --reference checks the exact and greedy parts (it times nothing of ours)")
    if args.reference:  # MLX's attention, with the mask `starts` stands for, in the kernel's place
        sdpa_decode.launch = lambda q, k, v, scale, starts, locks, written=None, keys=None: mlx_attention(
            q, k[..., :keys, :], v[..., :keys, :], scale, None if starts is None else starts.tolist())
        sdpa_decode.append = copying_append  # mlx-lm's cache update: no in-place write on the CPU
        qk_norm_rope.Prologue.__call__ = lambda self, module, q, k, offset: qk_norm_rope.reference(module, q, k, offset)
    result = {"command": " ".join(sys.argv), "hardware": hardware(), "reference": args.reference}
    for part in parts:
        start = time.perf_counter()
        if part == "exact":
            result["exact"] = run_exact(mlx_attention if args.reference else kernel_attention,
                                        poison=not args.reference)
        elif part == "greedy":
            Path(args.workdir).mkdir(parents=True, exist_ok=True)
            result["greedy"] = run_greedy(Path(args.workdir))
        elif part == "prologue":
            result["prologue"] = run_prologue(args.repeats, timed_too=not args.reference)
        else:
            result["time"] = run_time(args.repeats)
        result.setdefault("seconds", {})[part] = round(time.perf_counter() - start, 1)
        if args.save:
            Path(args.save).write_text(json.dumps(result, indent=1))
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        if "exact" in result:
            print(f"exact: {result['exact']['cases'] - result['exact']['failed']}/{result['exact']['cases']} "
                  f"within 1/128; worst rel {result['exact']['worst']['rel_max']:.2e}")
        for row in result.get("greedy", []):
            print(f"greedy {row['cache']}: identical={row['identical']} agrees={row['agrees']} "
                  f"({row['kernel_calls']} kernel calls)")
        if "prologue" in result:
            p = result["prologue"]
            print(f"prologue: {p['cases'] - p['failed']}/{p['cases']} within 1/128, {p['identical']} bit for bit "
                  f"mlx-lm's ops; worst rel {p['worst']['rel_max']:.2e}")


if __name__ == "__main__":
    main()
