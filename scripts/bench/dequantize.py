#!/usr/bin/env python
"""Measure the dequantize kernel (kernels/dequantize.cu) against MLX's `mx.dequantize`.

Why: the dequantize-to-dense prefill path makes every layer's dense weight once per
chunk; this says what that costs with MLX's dequantize and with ours, beside the chunk's
GEMM, and whether ours gives MLX's values.

  exact   every format (4/8 bits x groups 32/64/128 x bf16/fp16) on odd and real shapes:
          values that differ from mx.dequantize, and from the fp32 value rounded once
  layers  Qwen3-8B layer shapes, chained calls: mx.dequantize, the kernel, the dense GEMM
          at --tokens, and dequantize + GEMM both ways (µs per layer, dequantize GB/s)

    python scripts/bench/dequantize.py [--parts exact,layers] [--tokens 2048,4096] [--json]

CUDA only (the kernel is an mx.fast.cuda_kernel). Save the JSON under docs/benchmarks/.
"""

import argparse
import json
import sys
import time

import mlx.core as mx

from omlx_core.kernels.dequantize import BITS, GROUP_SIZES, dequantize

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="exact,layers")
    parser.add_argument("--tokens", default="2048,4096")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    result = {"command": " ".join(sys.argv), "device": str(mx.default_device()),
              "versions": {"mlx": mx.__version__}}
    for part in args.parts.split(","):
        result[part] = {"exact": exact, "layers": layers}[part](args)
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
