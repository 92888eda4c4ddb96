#!/usr/bin/env python
"""Benchmark the fused deepseek_v41 indexer score against mlx-lm's ops, same run, and check it.

Why: mlx-lm's Indexer materializes a float32 [batch, length, heads, entries] tensor per
prefill chunk; `kernels/indexer_score.cu` computes the [batch, length, entries] scores
directly. This measures, at DeepSeek V4 Flash's indexer shapes (64 index heads of 128,
compression ratio 4, top-512, hidden 4096, q_lora_rank 1024, rope dim 64) and one
prefill chunk at the end of each context:

- the score op's time, ops (`indexer_score.ops_scores`, mlx-lm's expression) against the
  kernel, interleaved after a shared warm-up, median of the repeats; each sample loops
  the op enough times to last >= 50 ms, with mx.eval per call and a synchronize before
  the clock is read; and the peak MLX memory each takes beyond its inputs. The ops path
  is skipped ("does not fit") where its per-head tensor exceeds 3/4 of device memory;
- exactness: the whole Indexer (mlx-lm's module against ours wrapping it) must select
  identical top-k entries for every query; the scores' largest difference in ulps and
  how many differ. Where the ops path does not fit the whole chunk, it is checked on the
  chunk's first and last 64 queries (queries are independent). Extra shapes: the first
  chunk (most entries masked), decode (one query), batch 2, entries not a multiple of the
  kernel's tile, and a candidate-source layer (V4.1's candidate blocks).

    python scripts/bench/indexer.py [--ctx 32k,128k,512k,1m] [--chunk 2048] [--repeats 5]
        [--warmup 2] [--json] [--partial FILE]

Needs MLX on CUDA. Results go to stdout (--json: one document); --partial rewrites FILE
after each step, so a run cut short keeps what it measured.
"""

import argparse
import json
import math
import sys
import time

import mlx.core as mx

from omlx_core.units import parse_counts

V4_FLASH = {"hidden_size": 4096, "q_lora_rank": 1024, "head_dim": 512, "qk_rope_head_dim": 64,
            "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "compress_ratio": 4,
            "compress_rope_theta": 160000.0,
            "rope_scaling": {"factor": 16.0, "original_max_position_embeddings": 65536,
                             "beta_fast": 32, "beta_slow": 1}}
SLICE = 64  # queries per slice where the ops path cannot take the whole chunk
MIN_SAMPLE_S = 0.05


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_indexer(candidate_source: bool = False):
    from mlx_lm.models import deepseek_v41 as ds
    from mlx_lm.models.rope_utils import YarnRoPE

    c = V4_FLASH
    args = ds.ModelArgs(hidden_size=c["hidden_size"], q_lora_rank=c["q_lora_rank"], head_dim=c["head_dim"],
                        qk_rope_head_dim=c["qk_rope_head_dim"], compress_ratios=(c["compress_ratio"],),
                        kv_source_layer_ids=(0,), index_source_layer_ids=(0,),
                        candidate_source_layer_id=0 if candidate_source else -1,
                        index_n_heads=c["index_n_heads"], index_head_dim=c["index_head_dim"],
                        index_topk=c["index_topk"])
    indexer = ds.Indexer(args, 0)
    indexer.set_dtype(mx.bfloat16)
    mx.eval(indexer.parameters())
    scaling = c["rope_scaling"]
    rope = YarnRoPE(dims=c["qk_rope_head_dim"], traditional=True, base=c["compress_rope_theta"],
                    scaling_factor=scaling["factor"],
                    original_max_position_embeddings=scaling["original_max_position_embeddings"],
                    beta_fast=scaling["beta_fast"], beta_slow=scaling["beta_slow"], mscale=0.0,
                    mscale_all_dim=0.0)
    return indexer, rope


def make_inputs(batch: int, length: int, entries: int, seed: int):
    """Layer inputs as the model has them: the hidden state, the q_a_norm output (unit
    RMS) and fp4 fake-quantized index keys of unit RMS."""
    from mlx_lm.models.deepseek_v41 import _fake_quant_fp4

    mx.random.seed(seed)
    x = mx.random.normal((batch, length, V4_FLASH["hidden_size"])).astype(mx.bfloat16)
    q_residual = mx.random.normal((batch, length, V4_FLASH["q_lora_rank"])).astype(mx.bfloat16)
    keys = _fake_quant_fp4(mx.random.normal((batch, entries, V4_FLASH["index_head_dim"])).astype(mx.bfloat16),
                           block_size=32)
    mx.eval(x, q_residual, keys)
    return x, q_residual, keys


def ordered(scores: mx.array) -> mx.array:
    """float32 bits as integers whose difference counts ulps (-0 and +0 equal)."""
    bits = scores.view(mx.int32).astype(mx.int64)
    return mx.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def compare_scores(ops: mx.array, fused: mx.array) -> dict:
    ulps = mx.abs(ordered(ops) - ordered(fused))
    differing = (ulps > 0).sum()
    worst = mx.argmax(ulps.reshape(-1))
    mx.eval(ulps, differing, worst)
    report = {"max_ulp": int(ulps.max().item()), "differing_scores": int(differing.item()),
              "scores": int(ops.size), "bit_exact": int(differing.item()) == 0}
    if not report["bit_exact"]:
        index = int(worst.item())
        flat_ops, flat_fused = ops.reshape(-1), fused.reshape(-1)
        report["worst"] = {"flat_index": index, "position": list(_unravel(index, ops.shape)),
                           "ops": float(flat_ops[index].item()), "kernel": float(flat_fused[index].item())}
    return report


def _unravel(index: int, shape) -> tuple:
    out = []
    for size in reversed(shape):
        out.append(index % size)
        index //= size
    return tuple(reversed(out))


def compare_topk(original, fused, x, q_residual, keys, rope, start_pos, queries) -> dict:
    """Top-k entries of mlx-lm's Indexer against ours, for the given query slices."""
    rows = mismatched = 0
    candidates_equal = True
    for part in queries:
        kwargs = dict(index_k=keys, candidates=None, rope=rope, start_pos=start_pos + part.start)
        top_ops, cand_ops = original(x[:, part], q_residual[:, part], **kwargs)
        top_fused, cand_fused = fused(x[:, part], q_residual[:, part], **kwargs)
        same = mx.all(mx.sort(top_ops, axis=-1) == mx.sort(top_fused, axis=-1), axis=-1)
        mx.eval(same)
        rows += same.size
        mismatched += int((~same).sum().item())
        if cand_ops is not None:
            candidates_equal = candidates_equal and bool(mx.array_equal(cand_ops, cand_fused).item())
        del top_ops, top_fused, cand_ops, cand_fused
        mx.clear_cache()
    return {"topk_rows": rows, "topk_rows_differing": mismatched, "topk_identical": mismatched == 0,
            "candidates_identical": candidates_equal}


def per_head_bytes(batch: int, length: int, entries: int) -> int:
    return batch * length * V4_FLASH["index_n_heads"] * entries * 4


def device_memory() -> int:
    info = mx.device_info()
    return int(info.get("memory_size") or info.get("total_memory") or 0)


def fits(batch: int, length: int, entries: int) -> bool:
    return per_head_bytes(batch, length, entries) <= 0.75 * device_memory()


def query_slices(batch: int, length: int, entries: int) -> list[slice]:
    if fits(batch, length, entries):
        return [slice(0, length)]
    return [slice(0, SLICE), slice(length - SLICE, length)]


def check_shape(name: str, batch: int, length: int, ctx: int, start_pos: int, seed: int,
                candidate_source: bool = False) -> dict:
    """Exactness of one shape: scores (ulps) and the whole Indexer's top-k."""
    from omlx_core.kernels import indexer_score as ks

    entries = max(1, ctx // V4_FLASH["compress_ratio"])
    original, rope = make_indexer(candidate_source)
    fused = ks.FusedIndexer(original)
    x, q_residual, keys = make_inputs(batch, length, entries, seed)
    q, weights, lens = fused.query(x, q_residual, rope=rope, start_pos=start_pos)
    mx.eval(q, weights, lens)
    record = {"name": name, "batch": batch, "length": length, "context": ctx, "entries": entries,
              "start_pos": start_pos, "candidate_source": candidate_source,
              "fusable": ks.fusable(q, keys) or "yes"}
    parts = query_slices(batch, length, entries)
    record["checked_queries"] = "all" if parts == [slice(0, length)] else f"first and last {SLICE}"
    scores = {"max_ulp": 0, "differing_scores": 0, "scores": 0, "bit_exact": True}
    for part in parts:
        ops = ks.ops_scores(q[:, part], keys, weights[:, part], fused.head_dim, lens[part])
        mine = ks.fused_scores(q[:, part], keys, weights[:, part], fused.head_dim, lens[part])
        one = compare_scores(ops, mine)
        scores["max_ulp"] = max(scores["max_ulp"], one["max_ulp"])
        scores["differing_scores"] += one["differing_scores"]
        scores["scores"] += one["scores"]
        scores["bit_exact"] = scores["bit_exact"] and one["bit_exact"]
        if "worst" in one and "worst" not in scores:
            scores["worst"] = {**one["worst"], "query_offset": part.start}
        del ops, mine
        mx.clear_cache()
    record["scores"] = scores
    record.update(compare_topk(original, fused, x, q_residual, keys, rope, start_pos, parts))
    record["fused_calls"] = fused.fused_calls
    log(f"exact {name}: top-k {'identical' if record['topk_identical'] else 'DIFFERENT'} "
        f"({record['topk_rows_differing']}/{record['topk_rows']} rows differ), max ulp {scores['max_ulp']}, "
        f"{scores['differing_scores']} of {scores['scores']} scores differ")
    return record


def time_pair(functions: dict, repeats: int, warmup: int) -> dict:
    """Median seconds per call of each function, interleaved, looped >= MIN_SAMPLE_S."""
    inner = {}
    for name, fn in functions.items():
        for _ in range(warmup):
            mx.eval(fn())
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        inner[name] = max(1, math.ceil(MIN_SAMPLE_S / max(time.perf_counter() - start, 1e-6)))
    samples = {name: [] for name in functions}
    for _ in range(repeats):
        for name, fn in functions.items():
            mx.synchronize()
            start = time.perf_counter()
            for _ in range(inner[name]):
                mx.eval(fn())
            mx.synchronize()
            samples[name].append((time.perf_counter() - start) / inner[name])
    return {name: {"median_ms": round(1000 * sorted(s)[len(s) // 2], 3),
                   "samples_ms": [round(1000 * v, 3) for v in s], "calls_per_sample": inner[name]}
            for name, s in samples.items()}


def peak_extra(fn) -> int:
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    out = fn()
    mx.eval(out)
    mx.synchronize()
    extra = mx.get_peak_memory() - base
    del out
    mx.clear_cache()
    return int(extra)


def measure_context(ctx: int, chunk: int, repeats: int, warmup: int, seed: int) -> dict:
    from omlx_core.kernels import indexer_score as ks

    entries = ctx // V4_FLASH["compress_ratio"]
    start_pos = ctx - chunk
    original, rope = make_indexer()
    fused = ks.FusedIndexer(original)
    x, q_residual, keys = make_inputs(1, chunk, entries, seed)
    q, weights, lens = fused.query(x, q_residual, rope=rope, start_pos=start_pos)
    mx.eval(q, weights, lens)
    head = fused.head_dim

    def run_ops():
        return ks.ops_scores(q, keys, weights, head, lens)

    def run_kernel():
        return ks.fused_scores(q, keys, weights, head, lens)

    record = {"context": ctx, "chunk": chunk, "entries": entries, "start_pos": start_pos,
              "per_head_tensor_bytes": per_head_bytes(1, chunk, entries)}
    functions = {"kernel": run_kernel}
    if fits(1, chunk, entries):
        functions = {"ops": run_ops, "kernel": run_kernel}
    else:
        record["ops"] = {"fits": False, "reason": f"does not fit: its per-head tensor is "
                         f"{record['per_head_tensor_bytes'] / 1e9:.1f} GB of {device_memory() / 1e9:.1f} GB"}
    times = time_pair(functions, repeats, warmup)
    for name, timing in times.items():
        record[name] = {"fits": True, **timing, "peak_extra_bytes": peak_extra(functions[name])}
    if "median_ms" in record.get("ops", {}):
        record["speedup"] = round(record["ops"]["median_ms"] / record["kernel"]["median_ms"], 2)
    log(f"ctx {ctx}: ops {record['ops'].get('median_ms', 'does not fit')} ms, kernel "
        f"{record['kernel']['median_ms']} ms" + (f", {record['speedup']}x" if "speedup" in record else "")
        + f"; peak extra ops {record['ops'].get('peak_extra_bytes', '-')} / kernel "
        f"{record['kernel']['peak_extra_bytes']} bytes")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctx", default="32k,128k,512k,1m")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--partial", default=None, help="rewrite this file after each step")
    args = parser.parse_args()

    from omlx_core.hardware import hardware_info, kernel_hardware, mlx_backend

    if mlx_backend() != "cuda":
        raise SystemExit(f"indexer.py needs MLX on CUDA; this machine computes on {mlx_backend()}")
    contexts = parse_counts(args.ctx, "--ctx")
    document = {"command": " ".join(["scripts/bench/indexer.py", *sys.argv[1:]]),
                "mlx_version": mx.__version__, "hardware": kernel_hardware(),
                "gpu_memory_bytes": device_memory(), "cpu": hardware_info()["cpu"],
                "config": V4_FLASH, "chunk": args.chunk, "exactness": [], "timing": []}

    def save():
        if args.partial:
            with open(args.partial, "w", encoding="utf-8") as handle:
                json.dump(document, handle, indent=1)

    def step(section: str, fn, *a, **kw):
        try:
            document[section].append(fn(*a, **kw))
        except Exception as error:  # noqa: BLE001 - recorded, the battery goes on
            document[section].append({"args": repr(a), "error": f"{type(error).__name__}: {error}"})
            log(f"{section} {a}: {type(error).__name__}: {error}")
        mx.clear_cache()
        save()

    log(f"hardware {document['hardware']}, {device_memory() / 1e9:.0f} GB")
    step("exactness", check_shape, "small", 1, 256, 8192, 8192 - 256, args.seed)
    step("exactness", check_shape, "first chunk", 1, args.chunk, args.chunk, 0, args.seed + 1)
    step("exactness", check_shape, "decode", 1, 1, 131072, 131071, args.seed + 2)
    step("exactness", check_shape, "batch 2", 2, 256, 16384, 16384 - 256, args.seed + 3)
    step("exactness", check_shape, "ragged entries", 1, 128, 4 * 1001 + 2, 4 * 1001 + 2 - 128, args.seed + 4)
    step("exactness", check_shape, "candidate source", 1, args.chunk, 32768, 32768 - args.chunk,
         args.seed + 5, candidate_source=True)
    for ctx in contexts:
        step("exactness", check_shape, f"ctx {ctx}", 1, args.chunk, ctx, ctx - args.chunk, args.seed + 10)
    for ctx in contexts:
        step("timing", measure_context, ctx, args.chunk, args.repeats, args.warmup, args.seed + 10)

    exact = [r for r in document["exactness"] if "error" not in r]
    timed = [r for r in document["timing"] if "error" not in r]
    document["gate"] = {
        "topk_identical_everywhere": bool(exact) and all(r["topk_identical"] and r["candidates_identical"]
                                                         for r in exact),
        "scores_bit_exact_everywhere": bool(exact) and all(r["scores"]["bit_exact"] for r in exact),
        "max_ulp": max((r["scores"]["max_ulp"] for r in exact), default=None),
        "min_speedup_where_ops_fits": min((r["speedup"] for r in timed if "speedup" in r), default=None),
        "kernel_runs_where_ops_does_not_fit": [r["context"] for r in timed if not r["ops"].get("fits", True)],
        "errors": [r["error"] for r in document["exactness"] + document["timing"] if "error" in r],
    }
    save()
    log(f"gate {document['gate']}")
    if args.json:
        json.dump(document, sys.stdout, indent=1)
    else:
        for r in timed:
            print(f"ctx {r['context']:>8}: ops {r['ops'].get('median_ms', 'does not fit')} ms, "
                  f"kernel {r['kernel']['median_ms']} ms, speedup {r.get('speedup', '-')}")


if __name__ == "__main__":
    main()
