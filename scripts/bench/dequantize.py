#!/usr/bin/env python
"""Measure the dequantize kernel (kernels/dequantize.cu) against MLX's `mx.dequantize`.

Why: the dequantize-to-dense prefill path makes every layer's dense weight once per
chunk; this says what that costs with MLX's dequantize and with ours, beside the chunk's
GEMM, and whether ours gives MLX's values.

  exact   every format (4/8 bits x groups 32/64/128 x bf16/fp16) on odd and real shapes:
          values that differ from mx.dequantize, and from the fp32 value rounded once
  layers  Qwen3-8B layer shapes, chained calls: mx.dequantize, the kernel, the dense GEMM
          at --tokens, and dequantize + GEMM both ways (µs per layer, dequantize GB/s)
  model   whole-model prefill of --ctx tokens in --chunks pieces on the Qwen3-8B-shape 4-bit
          checkpoint (scripts/bench/prefill_paths.py builds it): MLX's quantized matmul, the
          dense path with mx.dequantize, with the kernel, and a resident bf16 copy of every
          weight (the ceiling: no dequantize at all); tok/s and peak memory

    python scripts/bench/dequantize.py [--parts exact,layers,model] [--tokens 2048,4096]
        [--ctx 4k,16k] [--chunks 2048,4096,8192] [--workdir DIR] [--tiny] [--json]

CUDA only (the kernel is an mx.fast.cuda_kernel). Save the JSON under docs/benchmarks/.
"""

import argparse
import json
import sys
import time

import mlx.core as mx

from omlx_core.kernels.dequantize import BITS, GROUP_SIZES, dequantize
from omlx_core.units import parse_counts

SHAPES = ((4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288))  # (out, in): q/o, k/v, gate/up, down
ODD = ((17, 4096), (1001, 384), (3, 128))


def quantized(out_features: int, in_features: int, bits: int, group: int, dtype, seed: int = 0):
    mx.random.seed(seed)
    weight = (mx.random.normal((out_features, in_features)) * 0.02).astype(dtype)
    w, scales, biases = mx.quantize(weight, group_size=group, bits=bits)
    mx.eval(w, scales, biases)
    return w, scales, biases


def exact_case(shape, bits, group, dtype) -> dict:
    w, scales, biases = quantized(*shape, bits, group, dtype)
    ours = dequantize(w, scales, biases, group, bits, dtype)
    mlx = mx.dequantize(w, scales, biases, group_size=group, bits=bits, dtype=dtype)
    once = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group,
                         bits=bits, dtype=mx.float32).astype(dtype)
    mx.eval(ours, mlx, once)
    largest = mx.max(mx.abs(mlx.astype(mx.float32))).item()
    return {"shape": list(shape), "bits": bits, "group": group, "dtype": str(dtype),
            "differ_from_mlx": int(mx.sum(ours != mlx).item()),
            "differ_from_fp32_rounded": int(mx.sum(ours != once).item()),
            "mlx_differ_from_fp32_rounded": int(mx.sum(mlx != once).item()),
            "max_abs_diff_vs_mlx": mx.max(mx.abs(ours.astype(mx.float32) - mlx.astype(mx.float32))).item(),
            "largest": largest, "values": ours.size}


def exact(_args) -> list:
    cases = []
    for dtype in (mx.bfloat16, mx.float16):
        for bits in BITS:
            for group in GROUP_SIZES:
                for shape in SHAPES[:1] + ODD:
                    if shape[1] % group == 0:
                        cases.append(exact_case(shape, bits, group, dtype))
    return cases


def chained(fn, calls: int = 20, repeats: int = 5) -> float:
    """Median seconds per call over `repeats` chains of `calls` evaluated calls."""
    mx.eval(fn())
    mx.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            mx.eval(fn())
        mx.synchronize()
        times.append((time.perf_counter() - start) / calls)
    return sorted(times)[len(times) // 2]


def layers(args) -> list:
    rows = []
    for out_features, in_features in SHAPES:
        w, scales, biases = quantized(out_features, in_features, 4, 64, mx.bfloat16)
        dense = mx.dequantize(w, scales, biases, group_size=64, bits=4, dtype=mx.bfloat16)
        mx.eval(dense)
        moved = w.nbytes + scales.nbytes + biases.nbytes + dense.nbytes
        row = {"shape": [out_features, in_features], "bits": 4, "group": 64,
               "mlx_dequantize_us": 1e6 * chained(lambda: mx.dequantize(w, scales, biases, group_size=64, bits=4,
                                                                        dtype=mx.bfloat16)),
               "kernel_dequantize_us": 1e6 * chained(lambda: dequantize(w, scales, biases, 64, 4, mx.bfloat16))}
        row["mlx_dequantize_gbs"] = moved / row["mlx_dequantize_us"] / 1e3
        row["kernel_dequantize_gbs"] = moved / row["kernel_dequantize_us"] / 1e3
        for tokens in args.tokens:
            x = (mx.random.normal((tokens, in_features)) * 0.1).astype(mx.bfloat16)
            mx.eval(x)
            row[f"t{tokens}"] = {
                "qmm_us": 1e6 * chained(lambda: mx.quantized_matmul(x, w, scales, biases, transpose=True,
                                                                    group_size=64, bits=4)),
                "dense_gemm_us": 1e6 * chained(lambda: x @ dense.T),
                "mlx_dequantize_gemm_us": 1e6 * chained(lambda: x @ mx.dequantize(
                    w, scales, biases, group_size=64, bits=4, dtype=mx.bfloat16).T),
                "kernel_dequantize_gemm_us": 1e6 * chained(
                    lambda: x @ dequantize(w, scales, biases, 64, 4, mx.bfloat16).T)}
        rows.append(row)
    return rows


def prefill_seconds(model, tokens: mx.array, chunk: int) -> float:
    """One prefill as omlx and mlx-lm run it: `chunk`-token pieces, the cache evaluated and
    the buffer cache cleared after each."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.synchronize()
    start = time.perf_counter()
    for first in range(0, tokens.size, chunk):
        model(tokens[None, first:first + chunk], cache=cache)
        mx.eval([c.state for c in cache])
        mx.clear_cache()
    mx.synchronize()
    return time.perf_counter() - start


def model_prefill(args) -> list:
    from pathlib import Path

    import mlx.nn as nn
    from mlx_lm.utils import load

    from omlx_core.prefill.fast_paths import DequantizedPrefill
    from omlx_core.prefill.split import replace_module

    sys.path.insert(0, str(Path(__file__).parent))
    from prefill_paths import checkpoint

    path = checkpoint("dense", Path(args.workdir), tiny=args.tiny)
    model, _ = load(str(path))
    quantized = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.QuantizedLinear) and p != "lm_head"]

    def variant(name):
        for p, m in quantized:
            if name == "qmm":
                replace_module(model, p, m)
            elif name == "resident_bf16":
                dense = nn.Linear(1, 1, bias=False)
                dense.weight = mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits,
                                             dtype=mx.bfloat16)
                replace_module(model, p, dense)
            else:
                replace_module(model, p, DequantizedPrefill(m, 256, kernel=name == "dense_kernel"))
        mx.eval(model.parameters())
        mx.clear_cache()

    rows = []
    for name in ("qmm", "dense_mlx_dequantize", "dense_kernel", "resident_bf16"):
        variant(name)
        for ctx in args.ctx:
            tokens = mx.random.randint(0, 1000, (ctx,)).astype(mx.int32)
            for chunk in args.chunks:
                if chunk > 2 * ctx:
                    continue
                prefill_seconds(model, tokens[:chunk], chunk)  # warm-up
                mx.reset_peak_memory()
                base = mx.get_active_memory()
                times = [prefill_seconds(model, tokens, chunk) for _ in range(3)]
                seconds = sorted(times)[1]
                rows.append({"variant": name, "ctx": ctx, "chunk": chunk, "prefill_tps": ctx / seconds,
                             "seconds": times, "peak_extra_bytes": mx.get_peak_memory() - base})
                print(f"{name:>22} ctx {ctx:>6} chunk {chunk:>5}: {ctx / seconds:9.0f} tok/s, peak extra "
                      f"{(mx.get_peak_memory() - base) / 1e9:.2f} GB", file=sys.stderr)
    variant("qmm")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="exact,layers")
    parser.add_argument("--tokens", default="2048,4096")
    parser.add_argument("--ctx", default="4k,16k")
    parser.add_argument("--chunks", default="2048,4096,8192")
    parser.add_argument("--workdir", default="/tmp/omlx-prefill-paths")
    parser.add_argument("--tiny", action="store_true", help="model part on a tiny checkpoint (a quick check)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.ctx = parse_counts(args.ctx, "--ctx")
    args.chunks = parse_counts(args.chunks, "--chunks")
    result = {"command": " ".join(sys.argv), "device": str(mx.default_device()),
              "versions": {"mlx": mx.__version__}}
    for part in args.parts.split(","):
        result[part] = {"exact": exact, "layers": layers, "model": model_prefill}[part](args)
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
        return
    for case in result.get("exact", []):
        print(f"exact {case['dtype']:>9} b{case['bits']} g{case['group']:<3} {str(case['shape']):>13}: "
              f"{case['differ_from_mlx']} differ from MLX, {case['differ_from_fp32_rounded']} from fp32 rounded once")
    for row in result.get("layers", []):
        print(f"{row['shape']}: dequantize MLX {row['mlx_dequantize_us']:.1f} µs ({row['mlx_dequantize_gbs']:.0f} GB/s), "
              f"kernel {row['kernel_dequantize_us']:.1f} µs ({row['kernel_dequantize_gbs']:.0f} GB/s)")
        for tokens in args.tokens:
            t = row[f"t{tokens}"]
            print(f"  {tokens} tokens: qmm {t['qmm_us']:.0f}, dense {t['dense_gemm_us']:.0f}, "
                  f"MLX dequant+gemm {t['mlx_dequantize_gemm_us']:.0f}, kernel dequant+gemm "
                  f"{t['kernel_dequantize_gemm_us']:.0f} µs")


if __name__ == "__main__":
    main()
