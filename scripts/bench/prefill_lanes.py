#!/usr/bin/env python
"""Benchmark heterogeneous prefill: lanes off, gpu+cpu at several CPU shares, stock mlx-lm.

Why: the cpu lane's host BLAS can be far faster than MLX's matmul on some machines (MLX's
CPU device here) and slower on others (an H200); the split is only worth it where it
pays, and the tuner relies on this being measurable. One run, one process per model:
every setup prefills the same synthetic prompts (omlx bench's workload and timing loop,
`bench.runs.run_generation`, with one generated token), median of --repeats after a
warm-up. Every omlx setup is what `omlx serve` would install (`install_prefill`: the fast
paths, e.g. float32 compute of 16-bit quantized layers on MLX's CPU backend, then the
lanes). Stock mlx-lm is `stream_generate` with its defaults on a fresh, untouched load of
the clone (at --stock-ctx lengths: on MLX's CPU backend its fp16 quantized matmul is 10-50×
slower, so a long prompt can take hours) and, with --source, of the checkpoint the clone
was made from (what a user would otherwise serve).

Models: FP16 clones (the cpu lane needs one), made in a temporary directory: the embedded
SmolLM2's clone and a tiny qwen3_5 hybrid's, or --model PATH (cloned unless already fp16).
Also reported per share: the staged build's time and peak extra MLX memory, the lane's
resident bytes, the warm-up's cost and the first prefill after load without a warm-up
against the steady state.

    .venv/bin/python scripts/bench/prefill_lanes.py [--ctx 512,2k] [--shares 0.25,0.5,0.75,1]
        [--repeats 3] [--model PATH …] [--json]
"""

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from omlx_core.bench.runs import run_generation, run_mlx_lm
from omlx_core.bench.workload import ordinary_token_ids, synthetic_prompts
from omlx_core.home import resolve_home
from omlx_core.models.clone_fp16 import clone_fp16, is_fp16_clone
from omlx_core.models.load import load_model
from omlx_core.models.resolve import ModelRef, resolve
from omlx_core.models.testing import build_tiny_model
from omlx_core.prefill.install import install_prefill
from omlx_core.settings import load_settings
from omlx_core.units import parse_counts

KINDS = ("mlp_gate_up", "mlp_down", "gdn_qkv")


def lane_settings(home: Path, share: float | None, min_tokens: int):
    """Lanes off (share None) or gpu+cpu with every target kind at `share`."""
    if share is None:
        return load_settings(home, cli={"prefill.lanes": ["gpu"]})
    return load_settings(home, cli={"prefill.lanes": ["gpu", "cpu"], "prefill.cpu_sharing.enabled": True,
                                    "prefill.split_min_tokens": min_tokens,
                                    **{f"prefill.cpu_share.{kind}": share for kind in KINDS}})


def prefill_tps(model, prompts, chunk: int) -> float:
    return run_generation(model, prompts, 1, chunk, set()).prefill_tps


def measure(path: Path, home: Path, args, source: Path | None = None) -> dict:
    ref = ModelRef(path.name, path.name, path)
    lengths = parse_counts(args.ctx, "--ctx")
    setups = [("lanes off", None)] + [(f"gpu+cpu {share:g}", share) for share in args.shares]
    rows = {name: {} for name, _ in setups}
    builds = {}
    for name, share in setups:
        started = time.perf_counter()
        model, tokenizer = load_model(ref)
        report = install_prefill(model, lane_settings(home, share, args.min_tokens), fp16_clone=True)
        load_s = time.perf_counter() - started
        vocabulary = ordinary_token_ids(tokenizer, len(tokenizer))
        first_prompt = synthetic_prompts(vocabulary, lengths[0], 1, 99)
        first = prefill_tps(model, first_prompt, args.chunk) if args.first else None  # the first request
        for ctx in lengths:
            prompts = synthetic_prompts(vocabulary, ctx, 1, 0)
            for _ in range(args.warmup):
                prefill_tps(model, prompts, args.chunk)
            rows[name][ctx] = statistics.median(prefill_tps(model, prompts, args.chunk)
                                                for _ in range(args.repeats))
        print(f"{path.name}: {name}: " + ", ".join(f"{ctx} tokens {rows[name][ctx]:.1f} tok/s"
                                                  for ctx in lengths), file=sys.stderr, flush=True)
        builds[name] = {"load_s": round(load_s, 3), **{k: v for k, v in report.as_dict().items()
                                                       if k in ("build_s", "build_peak_extra_bytes",
                                                                "retained_cache_bytes", "extra_bytes")},
                        "first_prefill_tps": round(first, 1) if first is not None else None,
                        "steady_prefill_tps": round(rows[name][lengths[0]], 1)}
        if share is not None:
            builds[name]["warmup_s"] = round(_warmup_cost(model, args.min_tokens), 3)
        del model, tokenizer, report
        gc.collect()
        mx.clear_cache()
    stock_lengths = parse_counts(args.stock_ctx, "--stock-ctx") if args.stock_ctx else lengths
    rows["stock mlx-lm"] = stock_rows(ref, stock_lengths, args)
    if source is not None:
        rows["stock mlx-lm, source"] = stock_rows(ModelRef(source.name, source.name, source), lengths, args)
    off = rows["lanes off"]
    best = max((name for name, share in setups if share is not None),
               key=lambda name: statistics.fmean(rows[name][ctx] / off[ctx] for ctx in lengths))
    return {"model": str(path), "ctx": lengths, "prefill_tps": rows, "best": best,
            "best_vs_off": {ctx: round(rows[best][ctx] / off[ctx], 2) for ctx in lengths},
            "best_vs_stock": {ctx: round(rows[best][ctx] / rows["stock mlx-lm"][ctx], 2)
                              for ctx in lengths if ctx in rows["stock mlx-lm"]},
            "best_vs_stock_source": ({ctx: round(rows[best][ctx] / rows["stock mlx-lm, source"][ctx], 2)
                                      for ctx in lengths} if source is not None else None),
            "builds": builds}


def stock_rows(ref: ModelRef, lengths: list[int], args) -> dict:
    """Stock mlx-lm prefill tok/s per length on a fresh load of `ref` (nothing installed)."""
    if not lengths:
        return {}
    model, tokenizer = load_model(ref)
    vocabulary = ordinary_token_ids(tokenizer, len(tokenizer))
    row = {}
    for ctx in lengths:
        prompts = synthetic_prompts(vocabulary, ctx, 1, 0)
        runs = [run_mlx_lm(model, tokenizer, prompts, 1) for _ in range(args.warmup + args.repeats)]
        row[ctx] = statistics.median(m.prefill_tps for m in runs[args.warmup:])
        print(f"{ref.path.name}: stock mlx-lm: {ctx} tokens {row[ctx]:.1f} tok/s", file=sys.stderr, flush=True)
    del model, tokenizer
    gc.collect()
    mx.clear_cache()
    return row


def _warmup_cost(model, tokens: int) -> float:
    from omlx_core.prefill.install import warm_up

    return warm_up(model, tokens)


def models(args, work: Path) -> list[tuple[Path, Path | None]]:
    """(FP16 clone, the checkpoint it was made from or None) for each model to measure."""
    if args.model:
        pairs = []
        for given in args.model:
            path = Path(given)
            if is_fp16_clone(path):
                pairs.append((path, None))
            else:
                clone_fp16(path, work / f"{path.name}-fp16")
                pairs.append((work / f"{path.name}-fp16", path))
        return pairs
    embedded = resolve("default", resolve_home(args.home)).path
    clone_fp16(resolve("default", resolve_home(args.home)), work / "SmolLM2-135M-fp16")
    build_tiny_model("qwen3_5", work / "tiny-qwen3_5", quantized=True)
    clone_fp16(work / "tiny-qwen3_5", work / "tiny-qwen3_5-fp16")
    return [(work / "SmolLM2-135M-fp16", embedded), (work / "tiny-qwen3_5-fp16", work / "tiny-qwen3_5")]


def print_table(report: dict) -> None:
    for result in report["results"]:
        lengths = sorted({ctx for row in result["prefill_tps"].values() for ctx in row})
        print(f"\n{result['model']}  (prefill tok/s, median of {report['repeats']})")
        print(f"{'setup':16}" + "".join(f"{ctx:>10}" for ctx in lengths))
        for name, row in result["prefill_tps"].items():
            print(f"{name:16}" + "".join(f"{row[ctx]:>10.1f}" if ctx in row else f"{'-':>10}" for ctx in lengths))
        print(f"best: {result['best']}; vs lanes off {result['best_vs_off']}, vs stock mlx-lm "
              f"{result['best_vs_stock']}, vs stock mlx-lm on the source {result['best_vs_stock_source']}")
        for name, build in result["builds"].items():
            print(f"  {name:14} {json.dumps(build)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="checkpoint path (repeatable)")
    parser.add_argument("--home", help="OMLX_HOME for the embedded model")
    parser.add_argument("--ctx", default="512,2k")
    parser.add_argument("--shares", default="0.25,0.5,0.75,1",
                        type=lambda text: [float(x) for x in text.split(",")])
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk size")
    parser.add_argument("--min-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-first", dest="first", action="store_false",
                        help="skip timing the first (cold) prefill after load")
    parser.add_argument("--stock-ctx", help="lengths stock mlx-lm runs on the clone (default: --ctx)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="omlx-bench-lanes-") as work:
        paths = models(args, Path(work))
        results = [measure(path, Path(work) / "home", args, source) for path, source in paths]
    report = {"device": str(mx.default_device()), "repeats": args.repeats, "results": results}
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print_table(report)


if __name__ == "__main__":
    main()
