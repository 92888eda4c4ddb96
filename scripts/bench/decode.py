#!/usr/bin/env python
"""Decode speed: the quantized matmul at 1..64 tokens, and the whole decode step.

Why: at decode sizes MLX's quantized matmul runs far below memory bandwidth, so batching
barely helps; omlx's `qmm_decode` kernel (kernels/qmm_decode.cu) and the dense-copy path
(compute.dense_copy) are meant to fix that. This measures, in one run:

  exact    the kernel against mx.quantized_matmul: 4/8 bits x group 32/64/128, bf16 (and
           fp16), odd N, K not a multiple of the 128-input tile, 1..64 tokens; the check
           is max |ours - mlx| / max |mlx| <= 1/128 (two bf16 roundings of the largest output);
           --sweep (or a run without --quick) also checks every launch shape of SWEEP
  greedy   64-token greedy decode of tiny llama (one with tied embeddings: the head on the
           kernel too) and qwen3_5 models, stock against the kernel installed: identical tokens
  margins  whether greedy differences are near-ties: 8 fixed prompts x tiny llama (also tied) and
           qwen3_5 (4-bit g64), stock vs kernel vs dense copy (MLX's own dequantized bf16
           arithmetic, the control), and at the kernel's first difference the logit
           margins against a fp32 reference model (dequantized weights, fp32 activations)
  layers   per layer, chained in one CUDA graph (as a decode step runs them), GPU time per
           call and wall time: 4096x4096, 4096x12288 and 12288x4096 (in x out) at M = 1..64 tokens
           (more with --tokens): MLX qmm, ours (to 64), dense bf16, and the dense prefill path
           (dequantize per call + dense); 12288x4096 is measured as (up, down) pairs minus up;
           --sweep also times every launch shape of SWEEP (how DEFAULTS were chosen)
  kernels  the same layers' GPU time alone, per kernel, under Nsight Compute (caches
           flushed before each kernel, so weights come from HBM), with a sweep of the
           kernel's launch shapes (--quick: the default only, unless --sweep); skipped
           with the reason where ncu is absent
  model    a generated Qwen3-8B-shape 4-bit g64 model: one decode step at batch 1, 8, 32
           after a 1k-token context: stock, kernel, dense copy; each waited for (with its
           Python and MLX's encoding apart) and pipelined, as mlx-lm's generators run it;
           --variants picks what it times, --cache batch decodes on BatchKVCache as
           `omlx serve` does (an array mask, so MLX's vector attention instead of cuDNN's),
           --sdpa-min-batch 2 keeps a single sequence on MLX's attention (the control),
           --qmm-min-tokens 2 a single token on MLX's quantized matmul everywhere (the control)
  profile  the same step's GPU time by kernel family under Nsight Compute, stock and
           kernel: what the GPU spends against the wall clock

Whatever parts ran, the summary (and the JSON's `goals`) ends with issue 15's goals met or
not from the layers part at 1 and 32 tokens and the model part at batches 1 and 32
(`--parts layers,model --tokens 1,32 --batches 1,32` measures them all; the 32-stream goal
through `omlx serve` is scripts/bench/serve.py's).

    python scripts/bench/decode.py [--parts exact,greedy,margins,layers,kernels,model,profile]
        [--tokens 1,2,4,8,16,32,64] [--batches 1,8,32] [--variants stock,kernel,...] [--cache plain|batch]
        [--sdpa-min-batch N] [--qmm-min-tokens N] [--matmul kernel|dense] [--quick] [--sweep] [--repeats 5]
        [--workdir DIR] [--save FILE] [--json]

MLX compiles its CUDA quantized matmul for 8+ tokens at run time (CUTLASS, per shape and
format: minutes for the whole matrix); `--quick` uses MLX's result only below 8 tokens
(its precompiled kernel) and the fp32 result everywhere, and skips the launch-shape sweep.
On the GPU machine run parts as separate processes under `timeout`, so one slow part
cannot take the others' time (each writes its own --save file).

`--matmul dense` runs exact, greedy and margins with the dense-copy arithmetic instead of the
kernel (a check of the harness on machines without CUDA); with the kernel unavailable
the script refuses. Results: stdout (summary, or one JSON document with --json);
`--save FILE` also writes the JSON after every part.
"""

import argparse
import csv
import glob
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import mlx.core as mx  # noqa: E402

from omlx_core.kernels import qmm_decode, sdpa_decode  # noqa: E402
from omlx_core.kernels.dequantize import dequantize as kernel_dequantize  # noqa: E402

IN_PLACE_APPEND = sdpa_decode.append  # what install_variant and restore put back after `residual_copying`
PARTS = ("exact", "greedy", "margins", "layers", "kernels", "model", "profile")
TOKENS = (1, 2, 4, 8, 16, 32, 64)
LAYERS = ((4096, 4096), (4096, 12288), (12288, 4096))  # (in, out)
EXACT_TOKENS = (1, 3, 8, 9, 16, 17, 32, 33, 64)
TOLERANCE = 1 / 128
L2_BYTES = 60 * 2**20
BITS, GROUP = 4, 64  # the timed format: the benchmark model's


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def quantized_layer(k: int, n: int, bits: int, group: int, dtype=mx.bfloat16, seed: int = 0):
    key = mx.random.key(seed)
    w = 0.02 * mx.random.normal((n, k), key=key)
    wq, scales, biases = mx.quantize(w.astype(dtype), group_size=group, bits=bits)
    mx.eval(wq, scales, biases)
    return wq, scales, biases


def layer_bytes(layer) -> int:
    return sum(a.nbytes for a in layer)


def dense_matmul(x, wq, scales, biases, group_size, bits, **_):
    """The dense-copy path's arithmetic: x @ dequantize(w).T in the scales' dtype."""
    w = mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits, dtype=scales.dtype)
    return x @ w.T


def matmul_of(name: str):
    if name == "dense":
        return dense_matmul
    if why := qmm_decode.kernel_available():
        raise SystemExit(f"decode.py: the qmm_decode kernel is not available here: {why}. Run it on the "
                         "GPU machine, or pass --matmul dense to check the harness with the dense path.")
    return qmm_decode.quantized_matmul_decode


# -- exact ---------------------------------------------------------------------------------

def exact_cases(quick: bool = False):
    """(bits, group, dtype, k, n, tokens): odd N, N below one CTA tile, K not a multiple of
    the 128-input tile, every token bucket (1-8, 9-16, 17-32, 33-64)."""
    odd_k = {32: 1056, 64: 1088, 128: 1152}
    tokens = (1, 3, 9, 17, 33, 64) if quick else EXACT_TOKENS
    for bits in (4, 8):
        for group in (32, 64, 128):
            for k, n in ((odd_k[group], 1001), (odd_k[group], 17)):
                yield bits, group, mx.bfloat16, k, n, tokens
    yield 4, 64, mx.bfloat16, 4096, 4096, (1, 8, 32, 64)
    if not quick:
        for bits, group in ((4, 64), (8, 128)):
            yield bits, group, mx.float16, odd_k[group], 1001, tokens


def compare(ours: mx.array, ref: mx.array | None, truth: mx.array) -> dict:
    """Differences relative to the largest output. With MLX's result (`ref`), `ok`: ours
    is within bf16 rounding (TOLERANCE) of it, or of it plus MLX's own distance from the
    fp32 result (MLX accumulates 4-bit products in bf16 on some paths), and never farther
    from the fp32 result than MLX is plus that rounding. Without it (`ref` None: MLX's
    kernel for that size is compiled at run time, minutes for the whole matrix), ours
    against the fp32 result within that rounding."""
    ours = ours.astype(mx.float32)
    scale = mx.max(mx.abs(truth)).item() or 1.0
    ours_err = mx.max(mx.abs(ours - truth)).item() / scale
    row = {"ours_vs_fp32": ours_err, "reference": "fp32" if ref is None else "mlx"}
    if ref is None:
        row.update(rel_max=ours_err, strict=ours_err <= TOLERANCE, ok=bool(ours_err <= TOLERANCE))
        return row
    ref = ref.astype(mx.float32)
    diff = mx.max(mx.abs(ours - ref)).item() / scale
    mlx_err = mx.max(mx.abs(ref - truth)).item() / scale
    row.update(rel_max=diff, mlx_vs_fp32=mlx_err, strict=diff <= TOLERANCE,
               ok=bool(ours.shape == ref.shape and diff <= TOLERANCE + mlx_err and ours_err <= mlx_err + TOLERANCE))
    return row


def checked(ours: mx.array, x: mx.array, layer, bits: int, group: int, with_mlx: bool) -> dict:
    """`ours` (x times one layer) as `compare` judges it against MLX's result (`with_mlx`)
    and the fp32 one."""
    wq, scales, biases = layer
    w32 = mx.dequantize(wq, scales, biases, group_size=group, bits=bits, dtype=mx.float32)
    ref = (mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group, bits=bits)
           if with_mlx else None)
    return {"bits": bits, "group": group, "dtype": str(x.dtype).split(".")[-1], "k": x.shape[-1],
            "n": wq.shape[0], "m": x.shape[0], **compare(ours, ref, x.astype(mx.float32) @ w32.T)}


def exact_row(matmul, layer, bits, group, dtype, k, n, m, with_mlx: bool, **options) -> dict:
    x = mx.random.normal((m, k), key=mx.random.key(m)).astype(dtype)
    return checked(matmul(x, *layer, group, bits, **options), x, layer, bits, group, with_mlx)


def run_exact(matmul, cases=None, quick: bool = False, sweep: bool = False) -> dict:
    """`quick`: MLX's result only below 8 tokens (its precompiled kernel), the fp32 result
    everywhere; no sweep of launch shapes unless `sweep` (then against those results too)."""
    rows = []
    for bits, group, dtype, k, n, counts in cases or exact_cases(quick):
        layer = quantized_layer(k, n, bits, group, dtype, seed=bits * 1000 + group + n)
        for m in counts:
            start = time.perf_counter()
            rows.append(exact_row(matmul, layer, bits, group, dtype, k, n, m, with_mlx=not quick or m < 8))
            log(f"exact {bits}-bit g{group} {k}x{n} M={m}: rel {rows[-1]['rel_max']:.2e} "
                f"ok={rows[-1]['ok']} ({time.perf_counter() - start:.1f} s)")
    sweep = matmul is qmm_decode.quantized_matmul_decode and (sweep or not quick)  # the shapes the sweep times
    for config in {c for m in (1, 9, 17, 33) for c in sweep_configs(m)} if sweep else ():
        for ctas in CTAS:
            for k, n in ((1088, 1001), (4096, 4096)):
                layer = quantized_layer(k, n, 4, 64, seed=n)
                for m in {1, 8 * config.tiles - 5, 8 * config.tiles}:
                    row = exact_row(matmul, layer, 4, 64, mx.bfloat16, k, n, m, not quick or m < 8, config=config,
                                    ctas=ctas)
                    rows.append({**row, "config": config.__dict__ | {"ctas": ctas}})
    if matmul is qmm_decode.quantized_matmul_decode:
        rows += grouped_rows(quick) + residual_rows(quick)
    formats = {}
    for row in rows:
        key = f"{row['dtype']}/{row['bits']}bit/g{row['group']}"
        formats[key] = formats.get(key, True) and row["ok"]
    worst = max(rows, key=lambda r: r["rel_max"])
    return {"tolerance": TOLERANCE, "cases": len(rows), "failed": sum(not r["ok"] for r in rows),
            "strict_failed": sum(not r["strict"] for r in rows),
            "formats": formats, "worst": worst, "rows": rows}


GROUPED_CASES = ((4, 64, 1088, (1001, 17, 256)), (8, 32, 1056, (17, 1001)), (4, 128, 1152, (256, 1001, 17)),
                 (4, 64, 4096, (4096, 1024, 1024)), (4, 64, 4096, (12288, 12288)))


def grouped_rows(quick: bool) -> list[dict]:
    """One launch over several linears of one input (q/k/v, gate/up): every output against
    MLX's (below 8 tokens, or without --quick) and the fp32 result, as `compare` checks one
    linear's; segments of odd sizes and below one CTA tile."""
    rows = []
    for bits, group, k, ns in GROUPED_CASES:
        layers = [quantized_layer(k, n, bits, group, seed=bits * 1000 + group + n + i) for i, n in enumerate(ns)]
        for m in (1, 9, 17, 33, 64):
            x = mx.random.normal((m, k), key=mx.random.key(m + 7)).astype(mx.bfloat16)
            outs = qmm_decode.grouped_matmul_decode(x, layers, group, bits)
            for layer, ours in zip(layers, outs):
                rows.append({**checked(ours, x, layer, bits, group, not quick or m < 8), "segments": list(ns)})
            log(f"exact grouped {bits}-bit g{group} {k}x{ns} M={m}: worst rel "
                f"{max(r['rel_max'] for r in rows[-len(ns):]):.2e} ok={all(r['ok'] for r in rows[-len(ns):])}")
    return rows


# (bits, group, K, N): odd N, K off the tile, a segment below one CTA tile, the down projection's shape.
RESIDUAL_CASES = ((4, 64, 1088, 1001), (8, 32, 1056, 17), (4, 128, 1152, 256), (4, 64, 12288, 4096))


def residual_rows(quick: bool) -> list[dict]:
    """The residual form (decode_block's output projections): the residual added in the
    kernel, against MLX's product plus the residual (below 8 tokens, or without --quick)
    and the fp32 sum, as `compare` checks one linear's, and `identical`: bit for bit our
    plain product plus MLX's separate add, as the same roundings should give."""
    rows = []
    for bits, group, k, n in RESIDUAL_CASES:
        layer = quantized_layer(k, n, bits, group, seed=bits * 1000 + group + n + 5)
        w32 = mx.dequantize(*layer, group_size=group, bits=bits, dtype=mx.float32)
        for m in (1, 9, 17, 33, 64):
            x = (3 * mx.random.normal((m, k), key=mx.random.key(m + 11))).astype(mx.bfloat16)
            residual = mx.random.normal((m, n), key=mx.random.key(m + 17)).astype(mx.bfloat16)
            ours = qmm_decode.quantized_matmul_decode(x, *layer, group, bits, residual=residual)
            unfused = residual + qmm_decode.quantized_matmul_decode(x, *layer, group, bits)
            ref = None
            if not quick or m < 8:
                ref = residual + mx.quantized_matmul(x, *layer, transpose=True, group_size=group, bits=bits)
            truth = x.astype(mx.float32) @ w32.T + residual.astype(mx.float32)
            rows.append({"bits": bits, "group": group, "dtype": "bfloat16", "k": k, "n": n, "m": m,
                         "residual": True, "identical": bool(mx.array_equal(ours, unfused)),
                         **compare(ours, ref, truth)})
            log(f"exact residual {bits}-bit g{group} {k}x{n} M={m}: rel {rows[-1]['rel_max']:.2e} "
                f"ok={rows[-1]['ok']} identical={rows[-1]['identical']}")
    return rows


# -- greedy --------------------------------------------------------------------------------

def greedy_tokens(model, prompt: mx.array, count: int) -> list[int]:
    from mlx_lm.generate import generate_step

    return [int(token) for token, _ in generate_step(prompt, model, max_tokens=count)]


def tiny_checkpoint(workdir: Path, arch: str, bits: int, group: int, tied: bool = False) -> Path:
    """The greedy and margins parts' tiny model (built once under `workdir`); `tied`: its
    output head is the embedding's as_linear."""
    from omlx_core.models.testing import build_tiny_model

    path = workdir / f"greedy-{arch}-{bits}bit-g{group}{'-tied' if tied else ''}"
    if not (path / "config.json").is_file():
        build_tiny_model(arch, path, quantized=True, bits=bits, group_size=group,
                         shape={"tie_word_embeddings": True} if tied else None)
    return path


def run_greedy(matmul_name: str, workdir: Path, count: int = 64, quick: bool = False) -> list[dict]:
    """One prompt token, so every step (stock and ours) multiplies one token: MLX's
    precompiled kernel, no run-time compile of its larger ones."""
    from mlx_lm.utils import load

    from omlx_core.decode.dense_copy import install_dense_copy

    results = []
    # (arch, bits, group, tied embeddings: the head is the embedding's as_linear)
    models = ((("llama", 4, 64, False), ("llama", 4, 64, True), ("qwen3_5", 4, 64, False)) if quick else
              (("llama", 4, 32, False), ("llama", 8, 64, False), ("llama", 4, 64, True), ("qwen3_5", 4, 64, False)))
    for arch, bits, group, tied in models:
        start = time.perf_counter()
        model, _ = load(str(tiny_checkpoint(workdir, arch, bits, group, tied)))
        log(f"greedy {arch}: built and loaded in {time.perf_counter() - start:.1f} s")
        prompt = mx.array([42], dtype=mx.int32)
        stock = greedy_tokens(model, prompt, count)
        if matmul_name == "dense":
            layers = install_dense_copy(model, {"compute.dense_copy": "on"}, backend="cuda").layers
        else:
            from omlx_core.kernels import decode_block

            paths = qmm_decode.install(model, formats=qmm_decode.ALL_FORMATS, min_tokens=1)
            sdpa_decode.install(model)  # and decode_block's compiled step with the residual adds, where they apply
            decode_block.install(model)
            modules = dict(model.named_modules())
            layers = [modules[p] for p in paths]
        ours = greedy_tokens(model, prompt, count)
        first = next((i for i, (a, b) in enumerate(zip(stock, ours)) if a != b), None)
        results.append({"arch": arch, "bits": bits, "group": group, "tied": tied, "tokens": count,
                        "identical": stock == ours,
                        "first_difference": first, "layers": len(layers),
                        "kernel_calls": sum(layer.calls for layer in layers),
                        "decode_blocks": sum(type(m).__name__ == "DecodeBlock" for _, m in model.named_modules())})
        log(f"greedy {arch} {bits}-bit g{group}{' tied' if tied else ''}: identical={stock == ours} "
            f"({results[-1]['kernel_calls']} calls on our path)")
    return results


# -- margins: is a greedy difference a near-tie within rounding? ----------------------------

PROMPTS = (42, 7, 100, 300, 1, 250, 411, 77)  # fixed in advance: every one is reported


def forced_logits(model, prompt: int, tokens: list[int]) -> mx.array:
    """fp32 logits of every decode step along `tokens` (one token per step, as decode)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    rows = []
    for token in [prompt] + tokens[:-1]:
        logits = model(mx.array([[token]], dtype=mx.int32), cache=cache)[0, -1].astype(mx.float32)
        mx.eval(logits)
        rows.append(logits)
    return mx.stack(rows)


def fp32_reference(model) -> None:
    """The same model in fp32 with every quantized weight dequantized to fp32: the
    arithmetic both bf16 paths approximate."""
    import mlx.nn as nn

    from omlx_core.prefill.split import replace_module

    for path, module in list(model.named_modules()):
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w = mx.dequantize(module.weight, module.scales, module.get("biases"), group_size=module.group_size,
                              bits=module.bits, mode=module.mode, dtype=mx.float32)
            if isinstance(module, nn.QuantizedEmbedding):
                dense = nn.Embedding(*w.shape)
            else:
                dense = nn.Linear(w.shape[1], w.shape[0], bias="bias" in module)
                if "bias" in module:
                    dense.bias = module.bias
            dense.weight = w
            replace_module(model, path, dense)
    model.set_dtype(mx.float32)


def run_margins(workdir: Path, matmul_name: str = "kernel", count: int = 64) -> list[dict]:
    """For each tiny model and each of PROMPTS (chosen before any run): greedy tokens of
    stock, the kernel and the dense copy (MLX's own dequantized bf16 arithmetic, a control:
    no new kernel in it). At the kernel's first difference, along stock's tokens: stock's
    top-2 margin, the kernel's and stock's largest logit distance from the fp32 reference
    before that step, and which of the two tokens the fp32 reference prefers. With
    `--matmul dense` (no CUDA) the dense copy takes the kernel's place ("kernel_*" fields)."""
    from mlx_lm.utils import load

    from omlx_core.decode.dense_copy import install_dense_copy

    results = []
    for arch, tied in (("llama", False), ("llama", True), ("qwen3_5", False)):  # tied: the head is the embedding
        path = tiny_checkpoint(workdir, arch, 4, 64, tied)
        model, _ = load(str(path))
        reference, _ = load(str(path))
        fp32_reference(reference)
        for prompt in PROMPTS:
            restore(model)
            stock = greedy_tokens(model, mx.array([prompt], dtype=mx.int32), count)
            if matmul_name == "dense":
                install_dense_copy(model, {"compute.dense_copy": "on"}, backend="cuda")
            else:
                qmm_decode.install(model, formats=qmm_decode.ALL_FORMATS, min_tokens=1)
            ours = greedy_tokens(model, mx.array([prompt], dtype=mx.int32), count)
            forced_ours = forced_logits(model, prompt, stock)
            restore(model)
            install_dense_copy(model, {"compute.dense_copy": "on"}, backend="cuda")
            dense = greedy_tokens(model, mx.array([prompt], dtype=mx.int32), count)
            restore(model)
            forced_stock = forced_logits(model, prompt, stock)
            truth = forced_logits(reference, prompt, stock)

            def first(other):
                return next((i for i, (a, b) in enumerate(zip(stock, other)) if a != b), None)

            row = {"arch": arch, "tied": tied, "prompt": prompt, "kernel_identical": ours == stock,
                   "kernel_first_difference": first(ours),
                   "dense_copy_identical": dense == stock, "dense_copy_first_difference": first(dense),
                   "kernel_vs_fp32_max": mx.max(mx.abs(forced_ours - truth)).item(),
                   "stock_vs_fp32_max": mx.max(mx.abs(forced_stock - truth)).item(),
                   "kernel_vs_stock_max": mx.max(mx.abs(forced_ours - forced_stock)).item()}
            if (d := row["kernel_first_difference"]) is not None:
                top = mx.sort(forced_stock[d])[-2:].tolist()
                a, b = stock[d], ours[d]
                row.update(step=d, stock_token=a, kernel_token=b, stock_margin=top[1] - top[0],
                           kernel_margin=(forced_ours[d, b] - forced_ours[d, a]).item(),
                           fp32_prefers=a if truth[d, a].item() >= truth[d, b].item() else b,
                           fp32_margin=abs(truth[d, a].item() - truth[d, b].item()),
                           kernel_vs_fp32_at_step=mx.max(mx.abs(forced_ours[d] - truth[d])).item(),
                           stock_vs_fp32_at_step=mx.max(mx.abs(forced_stock[d] - truth[d])).item())
            results.append(row)
            log(f"margins {arch} prompt {prompt}: " + json.dumps(row))
    return results


# -- timing helpers ------------------------------------------------------------------------

# The layers part's process commits each chain to the GPU as one CUDA graph (MLX on sm_90
# commits every 100 kernels or 1000 MB by default): see chain_seconds.
ONE_GRAPH = {"MLX_MAX_OPS_PER_BUFFER": "100000", "MLX_MAX_MB_PER_BUFFER": "1000000"}


def chain_seconds(step, x0: mx.array, calls: int, repeats: int) -> tuple[float, float]:
    """(wall, GPU) seconds per call of `calls` dependent calls evaluated as one graph (medians).

    Wall: the host's encoding included; on the H200 machine the host spends ~10 us on every
    op, more than a small layer's GPU time. GPU: from the return of `mx.async_eval` (the
    graph encoded, committed and launched) to the end of `mx.synchronize`; with ONE_GRAPH in
    the environment the graph holds the whole chain, so this is the GPU running the calls
    back to back (the kernels and the gaps between them), as a decode step's graph does."""
    def once() -> tuple[float, float]:
        mx.synchronize()
        start = time.perf_counter()
        y = x0
        for i in range(calls):
            y = step(i, y)
        mx.async_eval(y)
        launched = time.perf_counter()
        mx.synchronize()
        end = time.perf_counter()
        return (end - start) / calls, (end - launched) / calls

    once()  # compile and warm up
    timings = [once() for _ in range(repeats)]
    return statistics.median(t[0] for t in timings), statistics.median(t[1] for t in timings)


def prefix(y: mx.array, k: int) -> mx.array:
    """A contiguous [M, k] view of y's first M*k values: the next call depends on y."""
    m = y.shape[0]
    return y.reshape(-1)[: m * k].reshape(m, k)


def make_layers(k: int, n: int, budget: int = 4 * L2_BYTES):
    """Enough distinct layers that their weights are several times the L2 cache."""
    first = quantized_layer(k, n, BITS, GROUP)
    count = max(3, math.ceil(budget / layer_bytes(first)))
    layers = [first] + [quantized_layer(k, n, BITS, GROUP, seed=i) for i in range(1, count)]
    dense_count = max(2, math.ceil(budget / (k * n * 2)))
    dense = [mx.dequantize(*layers[i % count], group_size=GROUP, bits=BITS) for i in range(dense_count)]
    mx.eval(dense)
    locks = [mx.zeros((qmm_decode.lock_count(n),), dtype=mx.int32) for _ in range(count)]
    mx.eval(locks)
    return layers, dense, locks


def variants(layers, dense, locks, configs=(), with_mlx: bool = True, tokens: int = 1):
    """name -> step(i, x): MLX's qmm (unless `with_mlx` is false), ours at its default launch
    shape and at each of `configs` (name "ours <config>") up to its MAX_TOKENS, the dense bf16
    matmul on a resident copy, and the dense prefill path's route (the weight dequantized by
    kernels/dequantize.cu per call, then the dense matmul): what inputs above MAX_TOKENS choose
    between."""
    def mlx(i, x):
        wq, s, b = layers[i % len(layers)]
        return mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=GROUP, bits=BITS)

    def ours(config=None):
        def step(i, x):
            wq, s, b = layers[i % len(layers)]
            return qmm_decode.quantized_matmul_decode(x, wq, s, b, GROUP, BITS, locks=locks[i % len(layers)],
                                                      config=config)
        return step

    def bf16(i, x):
        return x @ dense[i % len(dense)].T

    def dequantized(i, x):
        wq, s, b = layers[i % len(layers)]
        return x @ kernel_dequantize(wq, s, b, GROUP, BITS, x.dtype).T

    steps = {"mlx_qmm": mlx} if with_mlx else {}
    if tokens <= qmm_decode.MAX_TOKENS:
        steps["ours"] = ours()
        steps.update({f"ours {config_label(config)}": ours(config) for config in configs})
    steps["dense_bf16"] = bf16
    steps["dequantize_dense"] = dequantized
    return steps


def mlp_tail(up_step, down_layers, residual: bool):
    """step(i, y): an MLP's up projection h, then its tail as decode_block runs it: the
    down projection of swiglu(h, h) plus the residual y, added in our launch (`residual`)
    or by MLX's add."""
    from mlx_lm.models.activations import swiglu

    layers, _, locks = down_layers

    def step(i, y):
        h = up_step(i, y)
        wq, s, b = layers[i % len(layers)]
        lock = locks[i % len(layers)]
        x = swiglu(h, h)
        if residual:
            return qmm_decode.quantized_matmul_decode(x, wq, s, b, GROUP, BITS, residual=y, locks=lock)
        return y + qmm_decode.quantized_matmul_decode(x, wq, s, b, GROUP, BITS, locks=lock)
    return step


def config_label(config) -> str:
    c = config
    return (f"t{c.tiles} r{c.rows} n{c.warps_n} k{c.warps_k} u{c.rounds} c{c.slice_k} o{c.occupancy}"
            + f" l{c.loads_in_flight} ctas{c.ctas}")


def bandwidth(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


# -- layers (chained in one graph) ---------------------------------------------------------

def run_layers(tokens, repeats: int, quick: bool = False, sweep: bool = False, timeout: float = 900) -> dict:
    """The layers part in a child process with ONE_GRAPH set (MLX reads the limits when it
    first uses the GPU). `quick`: MLX's qmm only below 8 tokens (no run-time compiles);
    `sweep`: also every launch shape of SWEEP at each CTA target."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "layers.json"
        command = [sys.executable, __file__, "--layers-child", str(out), "--tokens", ",".join(map(str, tokens)),
                   "--repeats", str(repeats)] + (["--quick"] if quick else []) + (["--sweep"] if sweep else [])
        done = subprocess.run(command, env=os.environ | ONE_GRAPH, timeout=timeout)
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(f"layers child exited {done.returncode}")
        return json.loads(out.read_text())


def layers_child(tokens, repeats: int, quick: bool, sweep: bool, out: Path, calls: int = 48) -> None:
    up_k, up_n = LAYERS[1]
    built = {shape: make_layers(*shape) for shape in LAYERS}
    floor = {}
    rows = []
    for m in tokens:
        configs = ([replace(c, ctas=ctas) for c in sweep_configs(m) for ctas in CTAS]
                   if sweep and m <= qmm_decode.MAX_TOKENS else ())
        with_mlx = not quick or m < 8
        x_small = mx.random.normal((m, 4096)).astype(mx.bfloat16)
        floor[m] = chain_seconds(lambda i, x: x + 1, x_small, calls, repeats)
        timed = {}
        for k, n in LAYERS[:2]:
            layers, dense, locks = built[(k, n)]
            x = mx.random.normal((m, k)).astype(mx.bfloat16)
            for name, step in variants(layers, dense, locks, configs, with_mlx, m).items():
                chained = step if n == k else (lambda s: lambda i, y: s(i, prefix(y, k) if y.shape[1] != k else y))(step)
                timed[(k, n, name)] = chain_seconds(chained, x, calls, repeats)
        x = mx.random.normal((m, up_k)).astype(mx.bfloat16)
        up = variants(*built[LAYERS[1]], configs, with_mlx, m)
        down = variants(*built[LAYERS[2]], configs, with_mlx, m)
        def after_up(name: str, pair_step, up_name: str) -> None:
            """`name`'s time: the chained (up, then pair_step's rest) pair minus up_name's up."""
            pair = chain_seconds(pair_step, x, calls // 2, repeats)
            timed[(*LAYERS[2], name)] = tuple(max(0.0, p - u) for p, u in zip(pair, timed[(up_k, up_n, up_name)]))

        for name in up:
            after_up(name, (lambda u, d: lambda i, y: d(i, u(i, y)))(up[name], down[name]), name)
        if m <= qmm_decode.MAX_TOKENS:
            for name, residual in (("mlp_tail", False), ("mlp_tail_residual", True)):
                after_up(name, mlp_tail(up["ours"], built[LAYERS[2]], residual), "ours")
        for (k, n, name), (wall, gpu) in timed.items():
            nbytes = k * n * 2 if name == "dense_bf16" else layer_bytes(built[(k, n)][0][0])
            rows.append({"k": k, "n": n, "m": m, "variant": name, "us": gpu * 1e6, "wall_us": wall * 1e6,
                         "gbps": bandwidth(nbytes, gpu), "derived": (k, n) == LAYERS[2]})
        log(f"layers M={m}: " + ", ".join(f"{k}x{n} {name} {gpu * 1e6:.1f}us" for (k, n, name), (_, gpu) in timed.items()
                                          if not name.startswith("ours ")))
    out.write_text(json.dumps({
        "method": f"{calls} dependent calls as one CUDA graph, median of {repeats}: us = GPU time per call (from "
                  "the graph's launch to its end), wall_us = with the host's encoding; 12288x4096 = (up, down) "
                  "pair minus up; 'ours <shape>' rows: the launch-shape sweep",
        "floor_us": {str(m): {"wall": w * 1e6, "gpu": g * 1e6} for m, (w, g) in floor.items()}, "rows": rows,
        "best": best_configs([r for r in rows if r["variant"].startswith("ours")])}))


# -- kernels (GPU time per kernel under ncu) ------------------------------------------------

SWEEP = {  # (R, WR, WK, U, KC, occupancy[, SL]) per token bucket; the default (DEFAULTS) is first
    1: [(1, 2, 4, 2, 4096, 3), (1, 8, 1, 2, 1024, 2), (1, 8, 1, 1, 1024, 4), (1, 4, 2, 2, 2048, 2),
        (1, 8, 1, 2, 2048, 2), (1, 2, 4, 2, 4096, 3, 4)],
    2: [(1, 4, 2, 2, 1024, 2, 8), (1, 4, 2, 2, 1024, 2, 2), (1, 4, 2, 2, 1024, 2, 4),
        (2, 2, 2, 1, 1024, 3, 8), (1, 8, 1, 1, 2048, 2, 8)],
    4: [(1, 4, 2, 1, 1024, 3, 4), (1, 4, 2, 1, 1024, 3, 2), (1, 4, 2, 1, 1024, 3, 8),
        (2, 2, 2, 1, 1024, 3, 8), (1, 8, 1, 1, 512, 2, 8), (2, 4, 1, 1, 1024, 2, 8)],
    8: [(1, 8, 1, 1, 512, 2, 8), (1, 8, 1, 1, 512, 2, 2), (1, 8, 1, 1, 512, 2, 4),
        (1, 4, 1, 1, 512, 3, 8), (1, 4, 2, 1, 512, 2, 8), (1, 8, 1, 1, 1024, 1, 8)],
}
CTAS = (qmm_decode.SMS, qmm_decode.SMS * 2, qmm_decode.SMS * 4)


def sweep_configs(m: int) -> list:
    tiles = qmm_decode.tiles_for(m)
    return [qmm_decode.config_of(tiles, shape) for shape in SWEEP[tiles]]


def kernel_blocks(tokens, quick: bool = False, sweep: bool = False) -> list[dict]:
    """`quick`: MLX's kernel only below 8 tokens (precompiled), the default launch shape only
    (every shape of SWEEP with `sweep`)."""
    blocks = []
    for k, n in LAYERS:
        for m in tokens:
            if not quick or m < 8:
                blocks.append({"k": k, "n": n, "m": m, "variant": "mlx_qmm"})
            blocks.append({"k": k, "n": n, "m": m, "variant": "dense_bf16"})
            for config in sweep_configs(m)[:1] if quick and not sweep else sweep_configs(m):
                for ctas in CTAS:
                    blocks.append({"k": k, "n": n, "m": m, "variant": "ours", "config": config.__dict__ | {"ctas": ctas}})
    return blocks


def build_blocks(tokens, calls: int):
    built = {}
    for k, n in LAYERS:
        layers = [quantized_layer(k, n, BITS, GROUP, seed=i) for i in range(calls)]
        dense = [mx.dequantize(*layer, group_size=GROUP, bits=BITS) for layer in layers]
        locks = [mx.zeros((qmm_decode.lock_count(n),), dtype=mx.int32) for _ in layers]
        xs = {m: mx.random.normal((m, k)).astype(mx.bfloat16) for m in tokens}
        mx.eval(dense, locks, list(xs.values()))
        built[(k, n)] = (layers, dense, locks, xs)
    return built


def compile_blocks(tokens, quick: bool, sweep: bool, calls: int = 3) -> None:
    built = build_blocks(tokens, calls)
    for block in kernel_blocks(tokens, quick, sweep):
        run_block(block, built, 1)
    marker_kernel()
    mx.synchronize()


def marker_kernel():
    """One launch of the marker: its input is made once, so no other kernel comes with it."""
    kernel, one = _marker()
    return mx.eval(kernel(inputs=[one], output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(1, 1, 1),
                          threadgroup=(1, 1, 1))[0])


@lru_cache(maxsize=1)
def _marker():
    one = mx.zeros((1,), dtype=mx.float32)
    mx.eval(one)
    return mx.fast.cuda_kernel("omlx_bench_marker", ["x"], ["out"], "out[0] = x[0];"), one


def kernels_child(tokens, blocks_file: Path, quick: bool, sweep: bool, calls: int = 3) -> None:
    """Run every block after a marker kernel (ncu's output is split at the markers)."""
    blocks = kernel_blocks(tokens, quick, sweep)
    built = build_blocks(tokens, calls)
    mx.synchronize()
    for block in blocks:
        marker_kernel()
        mx.synchronize()
        run_block(block, built, calls)
        mx.synchronize()
    blocks_file.write_text(json.dumps({"blocks": blocks, "calls": calls}))


def run_block(block: dict, built, calls: int) -> None:
    layers, dense, locks, xs = built[(block["k"], block["n"])]
    x = xs[block["m"]]
    outs = []
    for i in range(calls):
        wq, s, b = layers[i]
        if block["variant"] == "mlx_qmm":
            outs.append(mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=GROUP, bits=BITS))
        elif block["variant"] == "dense_bf16":
            outs.append(x @ dense[i].T)
        else:
            config = qmm_decode.Config(**block["config"])
            outs.append(qmm_decode.quantized_matmul_decode(x, wq, s, b, GROUP, BITS, locks=locks[i], config=config))
        mx.eval(outs[-1])  # one call at a time: the kernels of a block never overlap


NS = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9, "s": 1e9}


def find_ncu() -> str | None:
    return shutil.which("ncu") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/ncu"))
                                            + sorted(glob.glob("/opt/nvidia/nsight-compute*/ncu"))), None)


def marked_kernel_times(report: Path) -> list[list[tuple[str, float]]]:
    """(kernel name, ns) of an ncu CSV report, in blocks that each start at a marker kernel."""
    blocks: list[list[tuple[str, float]]] = []
    with open(report, newline="") as handle:
        lines = [line for line in handle if line.startswith('"')]
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = row.get("Kernel Name", "")
        value = float(row["Metric Value"].replace(",", "")) * NS.get(row.get("Metric Unit", "ns"), 1.0)
        if "omlx_bench_marker" in name:
            blocks.append([])
        elif blocks:
            blocks[-1].append((name, value))
    return blocks


def run_kernels(tokens, quick: bool = False, sweep: bool = False, timeout: float = 240) -> dict:
    ncu = find_ncu()
    if ncu is None:
        return {"skipped": "Nsight Compute (ncu) not found: kernel GPU times not measured"}
    compile_blocks(tokens, quick, sweep)  # the child finds every kernel in MLX's compiled-kernel cache
    with tempfile.TemporaryDirectory() as tmp:
        blocks_file, report = Path(tmp) / "blocks.json", Path(tmp) / "ncu.csv"
        command = [ncu, "--clock-control", "none", "--metrics", "gpu__time_duration.sum", "--csv",
                   "--log-file", str(report), sys.executable, __file__, "--kernels-child", str(blocks_file),
                   "--tokens", ",".join(map(str, tokens))]
        command += (["--quick"] if quick else []) + (["--sweep"] if sweep else [])
        start = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"skipped": f"ncu run took more than {timeout} s"}
        if done.returncode != 0 or not blocks_file.is_file():
            return {"skipped": f"ncu run failed (exit {done.returncode}): {(done.stderr or done.stdout)[-800:]}"}
        plan = json.loads(blocks_file.read_text())
        times = [[ns for _, ns in block] for block in marked_kernel_times(report)]
        elapsed = time.perf_counter() - start
    if len(times) != len(plan["blocks"]):
        return {"skipped": f"ncu gave {len(times)} marked blocks for {len(plan['blocks'])} planned"}
    rows = []
    for block, kernels in zip(plan["blocks"], times):
        seconds = sum(kernels) / plan["calls"] / 1e9
        k, n = block["k"], block["n"]
        nbytes = k * n * 2 if block["variant"] == "dense_bf16" else quantized_bytes(k, n)
        rows.append({**block, "us": seconds * 1e6, "gbps": bandwidth(nbytes, seconds),
                     "kernels_per_call": len(kernels) / plan["calls"]})
    return {"method": "ncu gpu__time_duration, caches flushed before each kernel, mean of "
                      f"{plan['calls']} calls on distinct weights", "ncu_seconds": round(elapsed, 1),
            "rows": rows, "best": best_configs(rows)}


def quantized_bytes(k: int, n: int) -> int:
    return n * k * BITS // 8 + 2 * n * (k // GROUP) * 2


def best_configs(rows: list[dict]) -> list[dict]:
    best = {}
    for row in rows:
        key = (row["k"], row["n"], row["m"])
        if row["variant"].startswith("ours") and (key not in best or row["us"] < best[key]["us"]):
            best[key] = row
    return list(best.values())


# -- model (whole decode step) -------------------------------------------------------------

def greedy_step(model, cache, token: mx.array) -> mx.array:
    """One greedy decode step of every sequence: the next [batch, 1] tokens (lazy)."""
    return mx.argmax(model(token, cache=cache)[:, -1:, :], axis=-1).astype(mx.int32)


def decode_step_seconds(model, cache, batch: int, steps: int, repeats: int) -> dict:
    """Median seconds of one greedy decode step at `batch` (the cache is trimmed back):
    `sync`, each step waited for before the next is built, split into its Python
    (`build`: graph construction, the GPU idles) and MLX's encoding (`encode`: what
    mx.async_eval takes to hand the step's kernels to CUDA); and `pipelined`, the next
    step built and encoded while the GPU runs this one, as mlx-lm's generators (and so
    `omlx serve`) run decode. Pipelined time near build + encode means the host bounds
    the step; near sync - build - encode, the GPU does."""
    first = mx.zeros((batch, 1), dtype=mx.int32)
    timings = {"sync": [], "build": [], "encode": [], "pipelined": []}
    for repeat in range(repeats + 1):  # the first compiles and warms up
        token = first
        mx.synchronize()
        start = time.perf_counter()
        build = encode = 0.0
        for _ in range(steps):
            begin = time.perf_counter()
            token = greedy_step(model, cache, token)
            built = time.perf_counter()
            mx.async_eval(token)
            build, encode = build + built - begin, encode + time.perf_counter() - built
            mx.eval(token)
        mx.synchronize()
        sync = (time.perf_counter() - start) / steps
        for layer_cache in cache:
            layer_cache.trim(steps)
        token = greedy_step(model, cache, first)
        mx.async_eval(token)
        mx.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            following = greedy_step(model, cache, token)
            mx.async_eval(following)
            mx.eval(token)
            token = following
        mx.eval(token)
        pipelined = (time.perf_counter() - start) / steps
        for layer_cache in cache:
            layer_cache.trim(steps + 1)
        if repeat:
            for name, value in (("sync", sync), ("build", build / steps), ("encode", encode / steps),
                                ("pipelined", pipelined)):
                timings[name].append(value)
    return {name: statistics.median(values) for name, values in timings.items()}


# The model part's: kernel = grouped launches; kernel_attention = that and sdpa_decode's attention;
# prologue = that and qk_norm_rope's prologue; residual = kernel_attention and decode_block's residual
# adds in the output projections; fused = both.
VARIANTS = ("stock", "kernel_ungrouped", "kernel", "kernel_attention", "prologue", "residual", "residual_copying",
            "fused", "dense_copy")


# The model part's kernel variants: tokens from which qmm_decode computes (--qmm-min-tokens;
# above 1 it also undoes decode_block's lowering of its blocks' linears to one token).
QMM_MIN_TOKENS = 1


def copying_append(cache, keys, values):
    """mlx-lm's cache update in place of sdpa_decode's in-place row (`residual_copying`: the
    control that shows what the write in place saves)."""
    k, v = cache.update_and_fetch(keys, values)
    return k, v, None, k.shape[2]


def install_variant(model, name: str) -> dict:
    """Put variant `name` of VARIANTS in place (restore() takes it out): what it reports."""
    from omlx_core.decode.dense_copy import install_dense_copy

    sdpa_decode.append = copying_append if name == "residual_copying" else IN_PLACE_APPEND  # restore() resets it
    name = "residual" if name == "residual_copying" else name
    if name == "kernel_ungrouped":
        qmm_decode.install(model, formats=qmm_decode.ALL_FORMATS, min_tokens=QMM_MIN_TOKENS, group=False)
    elif name in ("kernel", "kernel_attention", "prologue", "residual", "fused"):
        from omlx_core.kernels import decode_block, qk_norm_rope

        report = {"layers": len(qmm_decode.install(model, formats=qmm_decode.ALL_FORMATS,
                                                   min_tokens=QMM_MIN_TOKENS))}
        if name != "kernel":
            sdpa_decode.install(model)
        if name in ("prologue", "fused"):
            report["prologues"] = len(qk_norm_rope.install(model))
        if name in ("residual", "fused"):
            report["blocks"] = len(decode_block.install(model))
            for linear in decode_block.decode_linears(model):  # the control: the blocks' lowering undone
                linear.min_tokens = QMM_MIN_TOKENS
        return report
    elif name == "dense_copy":
        return {"extra_bytes": install_dense_copy(model, {"compute.dense_copy": "on"}, backend="cuda").extra_bytes}
    return {}


def run_model(workdir: Path, tiny: bool, batches=(1, 8, 32), ctx: int = 1024, steps: int = 8,
              repeats: int = 3, variants=VARIANTS, cache: str = "plain") -> dict:
    """Each variant's step at each batch, as `decode_step_seconds` measures it (the row keys
    are named in the result's `method`), on a `cache` of CACHES."""
    from mlx_lm.utils import load

    from prefill_paths import checkpoint  # a sibling bench script: the generated model shapes

    path = checkpoint("dense", workdir, tiny)
    model, _ = load(str(path))
    rows = []
    kind = cache
    for batch in batches:
        cache = prefilled(model, batch, ctx, kind)
        row = {"batch": batch, "ctx": ctx}

        def timed(name):
            seconds = decode_step_seconds(model, cache, batch, steps, repeats)
            row[f"{name}_ms"] = seconds["sync"] * 1e3
            for part in ("build", "encode", "pipelined"):
                row[f"{name}_{part}_ms"] = seconds[part] * 1e3

        for name in variants:
            extra = install_variant(model, name)
            timed(name)
            row.update({f"{name}_{key}": value for key, value in extra.items()})
            restore(model)
        for name in variants:
            row[f"{name}_tps"] = batch / row[f"{name}_pipelined_ms"] * 1e3
        rows.append(row)
        log(f"model batch {batch}: " + ", ".join(
            f"{name} {row[name + '_pipelined_ms']:.2f} ms pipelined ({row[name + '_ms']:.2f} sync: Python "
            f"{row[name + '_build_ms']:.2f}, encode {row[name + '_encode_ms']:.2f})"
            for name in variants) + " per step")
        del cache
        mx.clear_cache()
    return {"model": str(path), "ctx": ctx, "steps": steps, "repeats": repeats, "cache": kind,
            "method": "greedy steps after a ctx-token prefill, median of repeats; *_ms: each step waited "
                      "for; *_build_ms (the step's Python) and *_encode_ms (mx.async_eval's return) are "
                      "parts of it; *_pipelined_ms: the next step built while the GPU runs this one "
                      "(mlx-lm's generators); *_tps from the pipelined step",
            "env": {key: value for key, value in os.environ.items() if key.startswith("MLX_")}, "rows": rows}


# The model part's caches: mlx-lm's KVCache (one offset for the batch, no mask at decode: MLX
# runs cuDNN's decode attention), or BatchKVCache as `omlx serve`'s BatchGenerator decodes
# (an offset per sequence, left padding, an array mask: MLX's own vector attention).
CACHES = ("plain", "batch")


def prefilled(model, batch: int, ctx: int, kind: str = "plain"):
    """A prompt cache of `kind` (CACHES) holding `ctx` random tokens for each of `batch` sequences."""
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    cache = make_prompt_cache(model) if kind == "plain" else [BatchKVCache([0] * batch) for _ in model.layers]
    prompt = mx.random.randint(0, 500, (batch, ctx)).astype(mx.int32)
    for start in range(0, ctx, 256):
        model(prompt[:, start:start + 256], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def profiler(on: bool) -> None:
    """cuProfilerStart/Stop: ncu (run with --profile-from-start off) records only between them."""
    import ctypes

    getattr(ctypes.CDLL("libcuda.so.1"), "cuProfilerStart" if on else "cuProfilerStop")()


def profile_child(workdir: Path, tiny: bool, batches, ctx: int = 1024) -> None:
    """One decode step per (batch, variant), each between two markers, under the profiler."""
    from mlx_lm.utils import load

    from prefill_paths import checkpoint

    model, _ = load(str(checkpoint("dense", workdir, tiny)))
    marker_kernel()  # its input is made here, outside the profiled ranges
    for batch in batches:
        cache = prefilled(model, batch, ctx)
        token = mx.zeros((batch, 1), dtype=mx.int32)
        for variant in ("stock", "kernel"):
            if variant == "kernel":
                qmm_decode.install(model, formats=qmm_decode.ALL_FORMATS, min_tokens=1)
            for _ in range(3):  # compiles and warms up
                mx.eval(greedy_step(model, cache, token))
            mx.synchronize()
            profiler(True)
            marker_kernel()
            mx.synchronize()
            mx.eval(greedy_step(model, cache, token))
            mx.synchronize()
            marker_kernel()
            mx.synchronize()
            profiler(False)
            for layer_cache in cache:
                layer_cache.trim(4)
        restore(model)
        del cache
        mx.clear_cache()


def kernel_family(name: str) -> str:
    """A kernel's name without template arguments and parameters (groups a step's kernels)."""
    name = name.split("(")[0]
    depth, out = 0, []
    for char in name:
        depth += char == "<"
        if depth == 0:
            out.append(char)
        depth -= char == ">"
    return "".join(out).replace("void ", "").strip()[-80:]


def run_profile(workdir: Path, tiny: bool, batches, timeout: float = 400) -> dict:
    """GPU time of one whole decode step by kernel family, under Nsight Compute (no cache
    flush, clocks left alone): what the GPU spends against the wall-clock step."""
    ncu = find_ncu()
    if ncu is None:
        return {"skipped": "Nsight Compute (ncu) not found: the step's GPU time not measured"}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "ncu.csv"
        command = [ncu, "--clock-control", "none", "--cache-control", "none", "--profile-from-start", "off",
                   "--metrics", "gpu__time_duration.sum", "--csv", "--log-file", str(report), sys.executable,
                   __file__, "--profile-child", "--workdir", str(workdir), "--batches", ",".join(map(str, batches))]
        command += ["--tiny"] if tiny else []
        start = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"skipped": f"ncu did not finish in {timeout:.0f} s"}
        if done.returncode:
            return {"skipped": f"ncu exited {done.returncode}: {(done.stderr or done.stdout)[-600:]}"}
        steps = marked_kernel_times(report)[0::2]  # each step is followed by a closing marker
    labels = [(batch, variant) for batch in batches for variant in ("stock", "kernel")]
    if len(steps) != len(labels):
        return {"skipped": f"ncu gave {len(steps)} marked steps for {len(labels)} planned"}
    rows = []
    for (batch, variant), kernels in zip(labels, steps):
        families: dict = {}
        for name, ns in kernels:
            entry = families.setdefault(kernel_family(name), [0, 0.0])
            entry[0] += 1
            entry[1] += ns / 1e3
        top = sorted(families.items(), key=lambda item: -item[1][1])
        rows.append({"batch": batch, "variant": variant, "kernels": len(kernels),
                     "gpu_ms": sum(ns for _, ns in kernels) / 1e6,
                     "families": [{"name": name, "count": count, "us": round(us, 1)} for name, (count, us) in top]})
        log(f"profile batch {batch} {variant}: {len(kernels)} kernels, GPU {rows[-1]['gpu_ms']:.2f} ms; top: "
            + ", ".join(f"{f['name']} x{f['count']} {f['us']:.0f} us" for f in rows[-1]["families"][:4]))
    return {"method": "ncu gpu__time_duration of every kernel of one decode step (ctx 1024), no cache flush; "
                      "sum of kernel times, gaps between kernels not included",
            "ncu_seconds": round(time.perf_counter() - start, 1), "rows": rows}


def restore(model) -> None:
    """Plain QuantizedLinears (same arrays), mlx-lm's attention and blocks back wherever
    a subclass was installed."""
    from omlx_core.kernels import decode_block
    from omlx_core.prefill.split import replace_module

    sdpa_decode.append = IN_PLACE_APPEND
    for path, module in list(model.named_modules()):
        for plain in (qmm_decode.plain, sdpa_decode.plain, decode_block.plain):
            if plain(module) is not module:
                replace_module(model, path, plain(module))


# -- main ----------------------------------------------------------------------------------

def hardware() -> dict:
    from omlx_core.hardware import kernel_hardware

    return {**kernel_hardware(), "mlx": mx.__version__}


# Issue 15's goals for decode on CUDA: (name, what is compared, bound, True when the bound is a floor).
GOALS = (("M=1 effective bandwidth", "GB/s of ours at 1 token, per layer", 2000.0, True),
         ("M=32 time over M=1", "ours at 32 tokens / at 1, per layer", 1.3, False),
         ("batch-1 decode", "tok/s, the fastest variant (and >= 2x stock)", 330.0, True),
         ("batch-32 aggregate", "tok/s, the fastest variant", 3000.0, True))


def goals(result: dict) -> list[dict]:
    """Issue 15's goals against what this run measured: the layers part at 1 and 32 tokens
    (each LAYERS shape) and the model part at batches 1 and 32; a goal without its rows is left out."""
    rows = []

    def goal(index: int, label: str, value: float, also: bool = True) -> None:
        name, what, bound, floor = GOALS[index]
        met = (value >= bound if floor else value <= bound) and also
        rows.append({"goal": name, "what": what, "case": label, "measured": value, "bound": bound, "met": met})

    ours = {(r["k"], r["n"], r["m"]): r for r in result.get("layers", {}).get("rows", []) if r["variant"] == "ours"}
    for k, n in LAYERS:
        one, many = ours.get((k, n, 1)), ours.get((k, n, 32))
        if one is not None:
            goal(0, f"{k}x{n}", one["gbps"])
        if one is not None and many is not None and one["us"] > 0:
            goal(1, f"{k}x{n}", many["us"] / one["us"])
    for row in result.get("model", {}).get("rows", []):
        rates = {key[:-4]: value for key, value in row.items() if key.endswith("_tps")}
        best = max((name for name in rates if name != "stock"), key=rates.get, default=None)
        if best is None or row["batch"] not in (1, 32):
            continue
        if row["batch"] == 1:
            goal(2, best, rates[best], "stock" not in rates or rates[best] >= 2 * rates["stock"])
        else:
            goal(3, best, rates[best])
    return rows


def summary(result: dict) -> None:
    for part in PARTS:
        if "error" in result.get(part, {}):
            print(f"{part}: failed: {result[part]['error']}")
            result.pop(part)
    if "exact" in result:
        e = result["exact"]
        print(f"exact: {e['cases'] - e['failed']}/{e['cases']} within {e['tolerance']:.4f}; worst rel "
              f"{e['worst']['rel_max']:.2e} ({e['worst']['dtype']} {e['worst']['bits']}-bit g{e['worst']['group']} "
              f"k={e['worst']['k']} n={e['worst']['n']} m={e['worst']['m']})")
        added = [r for r in e["rows"] if "residual" in r]
        if added:
            print(f"exact residual: {sum(r['ok'] for r in added)}/{len(added)} within the tolerance, "
                  f"{sum(r['identical'] for r in added)}/{len(added)} bit for bit our product plus MLX's add")
    for g in result.get("greedy", []):
        print(f"greedy {g['arch']} {g['bits']}-bit g{g['group']}{' tied' if g.get('tied') else ''}: "
              f"identical={g['identical']} "
              f"({g['kernel_calls']} calls)")
    if "layers" in result:
        print(f"layers (chained, GPU time per call; floor per op {result['layers']['floor_us']} us):")
        for row in result["layers"]["rows"]:
            if not row["variant"].startswith("ours "):
                print(f"  {row['k']:>5}x{row['n']:<5} M={row['m']:<2} {row['variant']:<10} {row['us']:8.1f} us "
                      f"{row['gbps']:7.0f} GB/s")
        for row in result["layers"]["best"]:
            print(f"  {row['k']:>5}x{row['n']:<5} M={row['m']:<2} best: {row['variant']:<10} {row['us']:8.1f} us "
                  f"{row['gbps']:7.0f} GB/s")
    if "kernels" in result:
        k = result["kernels"]
        if "skipped" in k:
            print(f"kernels: skipped: {k['skipped']}")
        else:
            print("kernels (GPU time under ncu):")
            for row in k["rows"]:
                if row["variant"] != "ours":
                    print(f"  {row['k']:>5}x{row['n']:<5} M={row['m']:<2} {row['variant']:<10} {row['us']:8.2f} us "
                          f"{row['gbps']:7.0f} GB/s")
            for row in k["best"]:
                print(f"  {row['k']:>5}x{row['n']:<5} M={row['m']:<2} ours best  {row['us']:8.2f} us "
                      f"{row['gbps']:7.0f} GB/s {row['config']}")
    for row in result.get("model", {}).get("rows", []):
        print(f"model batch {row['batch']}: " + ", ".join(f"{name} {row[name + '_tps']:.0f}" for name in VARIANTS
                                                           if name + "_tps" in row)
              + " tok/s")
    for row in result.get("goals", []):
        print(f"goal {row['goal']} ({row['case']}): {row['measured']:.2f} against {row['bound']:g}: "
              + ("met" if row["met"] else "not met"))


def main() -> None:
    global QMM_MIN_TOKENS  # --qmm-min-tokens sets it for the model part
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--matmul", default="kernel", choices=("kernel", "dense"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", default="/tmp/omlx-bench-models")
    parser.add_argument("--tiny", action="store_true", help="tiny model for the model part (a quick check)")
    parser.add_argument("--quick", action="store_true",
                        help="no run-time compiles of MLX's larger quantized kernels, no launch-shape sweep")
    parser.add_argument("--sweep", action="store_true", help="layers: also time every launch shape of SWEEP")
    parser.add_argument("--batches", default="1,8,32", help="batch sizes of the model part")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="what the model part times")
    parser.add_argument("--cache", default="plain", choices=CACHES,
                        help="the model part's cache: plain (mlx-lm's KVCache) or batch (BatchKVCache, as omlx serve)")
    parser.add_argument("--sdpa-min-batch", type=int, default=None,
                        help="sequences from which sdpa_decode's kernel attends (default: its MIN_BATCH; 2 keeps one "
                             "sequence on MLX's attention, the control of a batch-1 step)")
    parser.add_argument("--qmm-min-tokens", type=int, default=None,
                        help="tokens from which the model part's kernel variants run qmm_decode (default 1; "
                             "2: MLX's qmv for one token everywhere, decode_block's blocks too)")
    parser.add_argument("--save", default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--kernels-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--profile-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layers-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    tokens = tuple(int(t) for t in args.tokens.split(","))
    batches = tuple(int(b) for b in args.batches.split(","))
    if args.kernels_child:
        kernels_child(tokens, Path(args.kernels_child), args.quick, args.sweep)
        return
    if args.layers_child:
        layers_child(tokens, args.repeats, args.quick, args.sweep, Path(args.layers_child))
        return
    if args.profile_child:
        profile_child(Path(args.workdir), args.tiny, batches)
        return
    parts = args.parts.split(",")
    if unknown := [p for p in parts if p not in PARTS]:
        raise SystemExit(f"decode.py: unknown part {unknown[0]!r}; use {', '.join(PARTS)}")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    matmul = matmul_of(args.matmul)
    if args.matmul != "kernel" and (timed := [p for p in parts if p in ("layers", "kernels", "model", "profile")]):
        raise SystemExit(f"decode.py: --parts {','.join(timed)} time the kernel itself; --matmul dense "
                         "checks exact, greedy and margins only")
    result = {"command": " ".join(sys.argv), "hardware": hardware(), "matmul": args.matmul}

    def save() -> None:
        if args.save:
            Path(args.save).write_text(json.dumps(result, indent=1))

    for part in parts:
        start = time.perf_counter()
        try:
            if part == "exact":
                result["exact"] = run_exact(matmul, quick=args.quick, sweep=args.sweep)
            elif part == "greedy":
                result["greedy"] = run_greedy(args.matmul, workdir, quick=args.quick)
            elif part == "margins":
                result["margins"] = run_margins(workdir, args.matmul)
            elif part == "layers":
                result["layers"] = run_layers(tokens, args.repeats, args.quick, args.sweep)
            elif part == "kernels":
                result["kernels"] = run_kernels(tokens, args.quick, args.sweep)
            elif part == "model":
                if args.sdpa_min_batch is not None:
                    sdpa_decode.MIN_BATCH = args.sdpa_min_batch
                if args.qmm_min_tokens is not None:
                    QMM_MIN_TOKENS = args.qmm_min_tokens
                result["model"] = run_model(workdir, args.tiny, batches, repeats=args.repeats,
                                            variants=tuple(args.variants.split(",")), cache=args.cache)
                result["model"]["sdpa_min_batch"] = sdpa_decode.MIN_BATCH
                result["model"]["qmm_min_tokens"] = QMM_MIN_TOKENS
            elif part == "profile":
                result["profile"] = run_profile(workdir, args.tiny, batches)
        except Exception as error:  # noqa: BLE001 - one failed part must not lose the others
            result[part] = {"error": f"{type(error).__name__}: {error}"}
            log(f"{part} failed: {type(error).__name__}: {error}")
        result.setdefault("seconds", {})[part] = round(time.perf_counter() - start, 1)
        log(f"{part}: {result['seconds'][part]} s")
        save()
    result["goals"] = goals(result)
    save()
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        summary(result)


if __name__ == "__main__":
    main()
