#!/usr/bin/env python
"""Benchmark the fast prefill paths against stock mlx-lm, in the same run.

Why: dequantize-to-dense and chunked gated-delta are worth turning on where they beat
mlx-lm's own prefill; this measures that ratio (and decode, and peak memory) on generated
checkpoints of real shapes. It is `omlx bench --baseline mlx-lm` (the same workload,
timing loop and statistics: interleaved runs after a shared warm-up, medians) with the
fast paths set for omlx's variant:

  dense   Qwen3-8B shape, 4-bit g64: prefill.dense=on (dequantize-to-dense)
  hybrid  Qwen3.5-27B shape with 16 layers, 4-bit g64: chunked gated delta (on by default)

    python scripts/bench/prefill_paths.py [--models dense,hybrid] [--ctx 4k,16k] [--gen 32]
        [--repeats 3] [--workdir DIR] [--tiny] [--set KEY=VALUE ...] [--json]

`--set` adds settings to omlx's variant (e.g. kernels.dequantize=on, prefill.chunk_size=4096).

Results go to stdout (table or --json); save them under docs/benchmarks/ with the command.
"""

import argparse
import json
import sys
from pathlib import Path

from omlx_core.bench.offline import run_offline
from omlx_core.bench.variants import MLX_LM, OMLX, Variant, parse_set
from omlx_core.bench.workload import Workload
from omlx_core.models.resolve import ModelRef
from omlx_core.models.testing import build_tiny_model
from omlx_core.settings import load_settings
from omlx_core.settings.schema import lookup
from omlx_core.units import parse_counts

SHAPES = {
    "dense": ("llama", {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                        "max_position_embeddings": 32768},
              {"prefill.dense": "on"}),
    "hybrid": ("qwen3_5", {"hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 16,
                           "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
                           "linear_num_key_heads": 16, "linear_num_value_heads": 48,
                           "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                           "max_position_embeddings": 32768},
               {"prefill.chunked_gdn": True, "prefill.dense": "on"}),
}


def checkpoint(name: str, workdir: Path, tiny: bool) -> Path:
    arch, shape, _ = SHAPES[name]
    path = workdir / f"{name}-{'tiny-' if tiny else ''}4bit"
    if not (path / "config.json").is_file():
        build_tiny_model(arch, path, quantized=True, group_size=64, shape=None if tiny else shape)
    return path


def measure(name: str, args) -> dict:
    path = checkpoint(name, Path(args.workdir), args.tiny)
    chosen = {**SHAPES[name][2], **{key: lookup(key).parse(value) for key, value in map(parse_set, args.set)}}
    settings = load_settings(Path(args.workdir) / "home", cli=chosen)
    variants = [Variant(MLX_LM, MLX_LM, "stock stream_generate, default settings"),
                Variant(OMLX, OMLX, " ".join(f"{k}={v}" for k, v in chosen.items()), settings)]
    workload = Workload(tuple(parse_counts(args.ctx, "--ctx")), args.gen, 1, args.repeats, 1)
    document = run_offline(ModelRef(path.name, path.name, path), workload, variants, settings)
    rows = []
    for comparison in document["comparisons"]:
        stock = next(r for r in document["results"] if r["variant"] == MLX_LM and r["ctx"] == comparison["ctx"])
        ours = next(r for r in document["results"] if r["variant"] == OMLX and r["ctx"] == comparison["ctx"])
        rows.append({"ctx": comparison["ctx"],
                     **{f"{who}_{metric}": r["metrics"][metric]["median"] for who, r in (("stock", stock), ("omlx", ours))
                        for metric in ("prefill_tps", "decode_tps", "peak_mlx_memory_bytes")},
                     "prefill_ratio": comparison["metrics"]["prefill_tps"],
                     "decode_ratio": comparison["metrics"]["decode_tps"]})
    return {"model": name, "path": str(path), "fast_paths": document["variants"][1].get("lanes"),
            "rows": rows, "document": document}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="dense,hybrid")
    parser.add_argument("--ctx", default="4k,16k")
    parser.add_argument("--gen", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/omlx-prefill-paths")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a quick check on any machine")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting for omlx's variant (repeatable)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    results = [measure(name, args) for name in args.models.split(",")]
    if args.json:
        json.dump({"command": " ".join(sys.argv), "results": results}, sys.stdout, indent=1)
        print()
        return
    for result in results:
        print(f"\n{result['model']} ({result['path']})")
        for row in result["rows"]:
            gib = 2 ** 30
            print(f"  ctx {row['ctx']:>6}: prefill {row['stock_prefill_tps']:9.1f} -> {row['omlx_prefill_tps']:9.1f} tok/s "
                  f"({row['prefill_ratio']['ratio']:.2f}x [{row['prefill_ratio']['low']:.2f}, "
                  f"{row['prefill_ratio']['high']:.2f}]); decode {row['stock_decode_tps']:.1f} -> "
                  f"{row['omlx_decode_tps']:.1f} ({row['decode_ratio']['ratio']:.2f}x); peak "
                  f"{row['stock_peak_mlx_memory_bytes'] / gib:.2f} -> {row['omlx_peak_mlx_memory_bytes'] / gib:.2f} GiB")


if __name__ == "__main__":
    main()
