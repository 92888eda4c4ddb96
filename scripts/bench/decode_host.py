#!/usr/bin/env python
"""The host's share of a batched decode step: where its milliseconds go before the GPU runs.

Why: at 32 sequences the Qwen3-8B-shape decode step on the H200 takes as long on the host
(Python building the graph, then MLX encoding it) as on the GPU (about 10.7 ms each,
docs/benchmarks/decode-h200-model-graphs.json), so a faster kernel alone does not make
`omlx serve` faster. This times the host on a model with the real layer count and head
layout but small matrices (the host's work does not grow with them), decoding on
BatchKVCache as `omlx serve` does:

  build      the step's Python (the graph built, nothing run)
  encode     what mx.async_eval takes to hand the step to the GPU
  wait       the rest of a waited-for step: the GPU's time after the encoding
  pipelined  a step while the next one is built and encoded (mlx-lm's generators)

for `stock` (mlx-lm's modules), `kernels` (qmm_decode's grouped launches and sdpa_decode
installed: CUDA only, reported as skipped elsewhere), `prologue` (also qk_norm_rope's
prologue), `residual` (kernels and decode_block: the residual adds in the output
projections, each layer's one-token step compiled around its attention),
`residual_copying` (the same on mlx-lm's cache update, which copies the cache while the
previous step runs) and `fused` (residual and prologue), as decode.py's model part measures them
(`decode_step_seconds`) on this smaller model. For the last variant run:

  --python-profile   cProfile over pipelined steps: each Python function's own
                     microseconds a step (where `build` goes)
  --native-profile   py-spy --native attached to a warmed-up pipelined loop (MLX's C++
                     frames too: where `encode` goes), the frames that hold the host longest
  --primitives       each variant's step graph counted by primitive (mx.export_to_dot): the
                     nodes MLX encodes one by one, so encode / count is a node's host cost

    python scripts/bench/decode_host.py [--variants stock,kernels] [--batch 32] [--layers 36]
        [--hidden 1024] [--ctx 128] [--steps 32] [--python-profile] [--native-profile FILE]
        [--seconds 10] [--primitives] [--json]
"""

import argparse
import collections
import cProfile
import json
import pstats
import shutil
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("stock", "kernels", "prologue", "residual", "residual_copying", "fused")


def build_model(layers: int, hidden: int):
    """A random 4-bit g64 bf16 Qwen3 model: `layers` layers, Qwen3-8B's head layout
    (head dim 128, 4 query heads per key/value head) on `hidden` channels."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import qwen3

    heads = max(hidden // 128, 4)
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=hidden, num_hidden_layers=layers,
                           intermediate_size=3 * hidden, num_attention_heads=heads,
                           num_key_value_heads=max(heads // 4, 1), rms_norm_eps=1e-6, vocab_size=4096,
                           max_position_embeddings=32768, rope_theta=1e6, head_dim=128, tie_word_embeddings=False)
    mx.random.seed(0)
    model = qwen3.Model(args)
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    return model


def install(model, variant: str) -> str:
    """Put `variant` in place; empty, or why it cannot run here."""
    if variant == "stock":
        return ""
    from decode import install_variant

    from omlx_core.kernels import qmm_decode

    if why := qmm_decode.kernel_available():
        return why
    install_variant(model, "kernel_attention" if variant == "kernels" else variant)  # decode.py's variants
    return ""


def prefilled(model, batch: int, ctx: int):
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    cache = [BatchKVCache(left_padding=[0] * batch) for _ in model.layers]
    mx.eval(model(mx.zeros((batch, ctx), dtype=mx.int32), cache=cache))
    return cache


def host_times(model, batch: int, ctx: int, steps: int) -> dict:
    """decode.py's measure of a step (`decode_step_seconds`, median of 3 repeats of `steps`
    steps) in milliseconds, the wait for the GPU apart: what is left of the waited-for step
    once its Python and MLX's encoding are taken out."""
    from decode import decode_step_seconds

    seconds = decode_step_seconds(model, prefilled(model, batch, ctx), batch, steps, repeats=3)
    seconds["wait"] = seconds.pop("sync") - seconds["build"] - seconds["encode"]
    return {f"{name}_ms": round(seconds[name] * 1e3, 3) for name in ("build", "encode", "wait", "pipelined")}


def step_primitives(model, batch: int, ctx: int, warm_steps: int = 4) -> dict:
    """One decode step's graph (built after `warm_steps` evaluated steps, never run) counted
    by primitive: `total` nodes and the count of each primitive name, most first."""
    import re
    import tempfile

    import mlx.core as mx
    from decode import greedy_step

    cache = prefilled(model, batch, ctx)
    tokens = mx.zeros((batch, 1), dtype=mx.int32)
    for _ in range(warm_steps):
        tokens = greedy_step(model, cache, tokens)
        mx.eval(tokens)
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as dot:
        mx.export_to_dot(dot.name, greedy_step(model, cache, tokens))
        names = collections.Counter(re.findall(r'label ="([^"]+)"', dot.read()))
    return {"total": sum(names.values()), "by_name": dict(names.most_common())}


def loop(model, batch: int, ctx: int, seconds: float, warm_steps: int = 8) -> int:
    """Pipelined steps for `seconds` after `warm_steps` (the kernels compiled), announced
    by a `ready` line on stdout (when a profiler may attach); the cache is trimmed back
    every 256 steps so it stays near `ctx`. Returns the steps run."""
    import mlx.core as mx
    from decode import greedy_step

    cache = prefilled(model, batch, ctx)
    tokens = mx.zeros((batch, 1), dtype=mx.int32)
    for _ in range(warm_steps):
        tokens = greedy_step(model, cache, tokens)
    mx.eval(tokens)
    print("ready", flush=True)
    end, count = time.time() + seconds, 0
    while time.time() < end:
        following = greedy_step(model, cache, tokens)
        mx.async_eval(following)
        mx.eval(tokens)
        tokens, count = following, count + 1
        if count % 256 == 0:
            mx.eval(tokens)
            for layer_cache in cache:
                layer_cache.trim(256)
    mx.eval(tokens)
    return count


def python_profile(model, batch: int, ctx: int, steps: int, top: int = 25) -> dict:
    """cProfile over `steps` pipelined steps (after a warm-up): per Python function its own
    time (`self_us`) and with its callees (`total_us`), in microseconds a step, ranked by
    own time. cProfile does not see into MLX's (nanobind) calls: an op's time is its
    caller's own, and mx.async_eval and mx.eval, called here, are left out (`step_us` is
    the step's build)."""
    import mlx.core as mx
    from decode import greedy_step

    cache = prefilled(model, batch, ctx)
    tokens = greedy_step(model, cache, mx.zeros((batch, 1), dtype=mx.int32))
    mx.eval(tokens)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        following = greedy_step(model, cache, tokens)
        mx.async_eval(following)
        mx.eval(tokens)
        tokens = following
    mx.eval(tokens)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive, own s, total s, callers)
    rows = [{"function": function_label(key), "calls": calls / steps, "self_us": own * 1e6 / steps,
             "total_us": total * 1e6 / steps} for key, (calls, _, own, total, _) in stats.items()]
    rows.sort(key=lambda row: -row["self_us"])
    return {"steps": steps, "step_us": sum(row["self_us"] for row in rows),
            "functions": [{k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}
                          for row in rows[:top]]}


def function_label(key: tuple) -> str:
    """`name (file:line)` of a pstats key, the file as its last two path parts."""
    file, line, name = key
    if file == "~":
        return name  # a built-in (len, dict.get): pstats names it "<built-in method ...>"
    return f"{name} ({'/'.join(Path(file).parts[-2:])}:{line})"


def summarize(raw: str, within: str = "loop (", top: int = 25) -> dict:
    """py-spy's raw output (one `frame;frame;... count` line per stack) as the share of
    samples each frame holds: `leaf` (where the host is) and `inclusive` (under which call),
    of the samples under a frame starting with `within` (the decode loop, not the imports
    and the model's making before it)."""
    leaf, inclusive, total, everything = collections.Counter(), collections.Counter(), 0, 0
    for line in raw.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        everything += int(count)
        frames = stack.split(";")
        if not any(frame.startswith(within) for frame in frames):
            continue
        total += int(count)
        leaf[frames[-1]] += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)

    def shares(counter):
        return [{"frame": frame, "pct": round(100 * n / total, 1)} for frame, n in counter.most_common(top)]

    return {"samples": total, "all_samples": everything, "leaf": shares(leaf) if total else [],
            "inclusive": shares(inclusive) if total else []}


def native_profile(args, variant: str, out: Path) -> dict:
    """py-spy --native attached to a pipelined loop of `variant` in a child process once it
    is warm: sampling from the start would also sample the imports, the model's making and
    NVRTC's compiles, which native unwinding slows many times over."""
    spy = shutil.which("py-spy")
    if spy is None:
        return {"skipped": "py-spy not found (pip install py-spy)"}
    child = subprocess.Popen([sys.executable, __file__, "--loop", variant, "--batch", str(args.batch),
                              "--layers", str(args.layers), "--hidden", str(args.hidden), "--ctx", str(args.ctx),
                              "--seconds", str(args.seconds + 5)], stdout=subprocess.PIPE, text=True)
    try:
        if child.stdout.readline().strip() != "ready":
            return {"skipped": f"the profiled loop exited {child.wait()} before it was ready"}
        done = subprocess.run([spy, "record", "--native", "--rate", "200", "--format", "raw", "--pid",
                               str(child.pid), "--duration", str(int(args.seconds)), "-o", str(out)],
                              capture_output=True, text=True, timeout=args.seconds + 120)
    finally:
        child.kill()
        child.wait()
    if done.returncode != 0 or not out.is_file():
        return {"skipped": f"py-spy exited {done.returncode}: {(done.stderr or done.stdout)[-600:]}"}
    return {"variant": variant, "file": str(out), **summarize(out.read_text())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ctx", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--python-profile", action="store_true")
    parser.add_argument("--native-profile", default=None, metavar="FILE")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--primitives", action="store_true", help="count each variant's step graph by primitive")
    parser.add_argument("--loop", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.loop:
        model = build_model(args.layers, args.hidden)
        install(model, args.loop)
        print(f"steps {loop(model, args.batch, args.ctx, args.seconds)}")
        return
    variants = [v for v in args.variants.split(",") if v]
    if unknown := [v for v in variants if v not in VARIANTS]:
        parser.error(f"--variants: unknown {', '.join(unknown)} (choose from {', '.join(VARIANTS)})")
    from omlx_core.hardware import mlx_backend

    result = {"batch": args.batch, "layers": args.layers, "hidden": args.hidden, "ctx": args.ctx,
              "backend": mlx_backend(), "rows": []}
    ran = None
    for variant in variants:
        model = build_model(args.layers, args.hidden)
        if why := install(model, variant):
            result["rows"].append({"variant": variant, "skipped": why})
            continue
        result["rows"].append({"variant": variant, **host_times(model, args.batch, args.ctx, args.steps)})
        if args.primitives:
            result["rows"][-1]["primitives"] = step_primitives(model, args.batch, args.ctx)
        if args.python_profile:
            result["python_profile"] = {"variant": variant,
                                        **python_profile(model, args.batch, args.ctx, args.steps)}
        ran = variant
        del model
    if args.native_profile and ran:
        result["native_profile"] = native_profile(args, ran, Path(args.native_profile))
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for row in result["rows"]:
        if "skipped" in row:
            print(f"{row['variant']:8} skipped: {row['skipped']}")
        else:
            print(f"{row['variant']:8} build {row['build_ms']:.2f} ms, encode {row['encode_ms']:.2f}, "
                  f"wait {row['wait_ms']:.2f}; pipelined {row['pipelined_ms']:.2f} ms a step")
            if counted := row.get("primitives"):
                print(f"         {counted['total']} primitives: " + ", ".join(
                    f"{name} {n}" for name, n in list(counted["by_name"].items())[:12]))
    if profile := result.get("python_profile"):
        print(f"python profile of {profile['variant']} ({profile['step_us']:.0f} us a step in "
              f"{profile['steps']} steps; own time, with callees):")
        for row in profile["functions"]:
            print(f"  {row['self_us']:8.1f} {row['total_us']:8.1f} us  {row['calls']:6.1f}x  {row['function'][:100]}")
    profile = result.get("native_profile")
    if profile:
        if "skipped" in profile:
            print(f"native profile skipped: {profile['skipped']}")
        else:
            print(f"native profile of {profile['variant']} ({profile['samples']} samples, {profile['file']}):")
            for entry in profile["inclusive"]:
                print(f"  {entry['pct']:5.1f}%  {entry['frame'][:120]}")


if __name__ == "__main__":
    main()
