#!/usr/bin/env python
"""Benchmark `omlx clone-fp16` against load-everything-then-save, in the same run.

Builds a llama-shaped multi-shard bf16 checkpoint of about --size-gb (random weights, a
few big layers; valid for the clone, never run), then times both as subprocesses and
reads each one's peak RSS from wait4(). The goal: peak RSS <= 3 x the largest tensor +
the base (the same command cloning a tiny checkpoint), and throughput not below the
baseline's.

    .venv/bin/python scripts/bench/clone.py [--size-gb 2.2] [--repeats 3] [--json]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASELINE = """
import sys, mlx.core as mx
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dst.mkdir()
shards = {f.name: mx.load(str(f)) for f in sorted(src.glob("*.safetensors"))}
for tensors in shards.values():
    for name, value in tensors.items():
        if mx.issubdtype(value.dtype, mx.floating):
            tensors[name] = value.astype(mx.float16)
    mx.eval(list(tensors.values()))
for file, tensors in shards.items():
    mx.save_safetensors(str(dst / file), tensors, metadata={"format": "mlx"})
"""


def llama_config(hidden: int, intermediate: int, layers: int, vocab: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": hidden // 128,
        "num_key_value_heads": hidden // 128, "head_dim": 128, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 4096, "vocab_size": vocab,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }


def tensor_shapes(config: dict) -> dict[str, tuple]:
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, h)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}.self_attn.{proj}.weight"] = (h, h)
        shapes[f"{p}.mlp.gate_proj.weight"] = (i, h)
        shapes[f"{p}.mlp.up_proj.weight"] = (i, h)
        shapes[f"{p}.mlp.down_proj.weight"] = (h, i)
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


def build_checkpoint(dest: Path, size_gb: float, shards: int) -> dict:
    """Random bf16 tensors in `shards` files with an index, like mlx_lm.convert writes."""
    import mlx.core as mx
    import numpy as np

    hidden, intermediate, vocab = 4096, 11008, 32000
    per_layer = 2 * (4 * hidden * hidden + 3 * hidden * intermediate)
    fixed = 2 * 2 * vocab * hidden
    layers = max(1, round((size_gb * 1e9 - fixed) / per_layer))
    config = llama_config(hidden, intermediate, layers, vocab)
    shapes = list(tensor_shapes(config).items())
    dest.mkdir(parents=True)
    (dest / "config.json").write_text(json.dumps(config, indent=4))
    total = sum(2 * _count(shape) for _, shape in shapes)
    weight_map, written, part, files = {}, 0, [], []

    # Drawing 1G normal values takes MLX's CPU backend ~30 s; tiling a 4M-value random
    # block, rotated differently for each tensor, takes a second and is just as valid here.
    rng = np.random.default_rng(0)
    block = ((rng.standard_normal(1 << 22, np.float32) * 0.02).view(np.uint32) >> 16).astype(np.uint16)

    def random_bf16(shape, seed: int):
        bits = np.resize(np.roll(block, seed * 7919), _count(shape))
        return mx.array(bits).view(mx.bfloat16).reshape(shape)

    def flush():
        name = f"model-{len(files) + 1:05d}-of-{shards:05d}.safetensors"
        arrays = {key: (random_bf16(shape, len(weight_map) + i)
                        if len(shape) > 1 else mx.ones(shape, dtype=mx.bfloat16))
                  for i, (key, shape) in enumerate(part)}
        mx.save_safetensors(str(dest / name), arrays, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(arrays, name))
        files.append(name)
        part.clear()

    for key, shape in shapes:
        part.append((key, shape))
        written += 2 * _count(shape)
        if written >= total * (len(files) + 1) / shards and len(files) < shards - 1:
            flush()
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    return {"bytes": total, "largest_tensor": max(2 * _count(s) for _, s in shapes),
            "tensors": len(shapes), "shards": len(files), "layers": layers}


def _count(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def measure(command: list[str]) -> dict:
    """Wall time and peak RSS of one subprocess (wait4 gives this child's own rusage)."""
    with tempfile.TemporaryFile() as errors:
        started = time.perf_counter()
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            errors.seek(0)
            raise SystemExit(f"{command[:4]} exited {proc.returncode}: {errors.read().decode()[-2000:]}")
    return {"seconds": wall, "peak_rss": usage.ru_maxrss * 1024}


def clone_command(src: Path, dst: Path) -> list[str]:
    return [sys.executable, "-m", "omlx_cli", "-q", "clone-fp16", str(src), str(dst), "--no-verify"]


def run(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="omlx-bench-clone-", dir=args.workdir))
    try:
        # Everything that needs MLX runs in a child: a forked child starts with its
        # parent's RSS as its peak, so this process stays small to keep wait4's numbers true.
        src, tiny = work / "src", work / "tiny"
        started = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--build", str(src), "--size-gb", str(args.size_gb),
                        "--shards", str(args.shards)], check=True)
        shape = json.loads((work / "shape.json").read_text())
        shape["build_seconds"] = round(time.perf_counter() - started, 1)
        subprocess.run([sys.executable, "-c", "import sys; from omlx_core.models.testing import "
                        "build_tiny_model as b; b('llama', sys.argv[1])", str(tiny)], check=True)
        base = measure(clone_command(tiny, work / "tiny-clone"))["peak_rss"]

        results = {"clone-fp16": [], "baseline": []}
        for repeat in range(args.warmup + args.repeats):
            for name, command in (("clone-fp16", clone_command(src, work / "dst")),
                                  ("baseline", [sys.executable, "-c", BASELINE, str(src), str(work / "dst")])):
                sample = measure(command)
                shutil.rmtree(work / "dst")
                if repeat >= args.warmup:
                    results[name].append(sample)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    report = {"checkpoint": shape, "base_rss": base, "repeats": args.repeats, "warmup": args.warmup}
    for name, samples in results.items():
        seconds = statistics.median(s["seconds"] for s in samples)
        report[name] = {
            "median_seconds": round(seconds, 2),
            "throughput_mb_s": round(shape["bytes"] / seconds / 1e6, 1),
            "peak_rss": max(s["peak_rss"] for s in samples),
            "samples": samples,
        }
    limit = 3 * shape["largest_tensor"] + base
    report["goals"] = {
        "peak_rss_limit": limit,
        "peak_rss_ok": report["clone-fp16"]["peak_rss"] <= limit,
        "throughput_ratio": round(report["clone-fp16"]["throughput_mb_s"]
                                  / report["baseline"]["throughput_mb_s"], 2),
    }
    report["goals"]["throughput_ok"] = report["goals"]["throughput_ratio"] >= 1.0
    return report


def print_table(report: dict) -> None:
    mib = lambda n: f"{n / 2**20:,.0f} MiB"  # noqa: E731
    shape, goals = report["checkpoint"], report["goals"]
    print(f"checkpoint: {shape['bytes'] / 1e9:.2f} GB bf16, {shape['tensors']} tensors in "
          f"{shape['shards']} shards, largest tensor {mib(shape['largest_tensor'])}; "
          f"median of {report['repeats']} after {report['warmup']} warm-up")
    print(f"{'':12} {'seconds':>8} {'MB/s':>8} {'peak RSS':>11}")
    for name in ("clone-fp16", "baseline"):
        r = report[name]
        print(f"{name:12} {r['median_seconds']:8.2f} {r['throughput_mb_s']:8.1f} {mib(r['peak_rss']):>11}")
    print(f"peak RSS limit 3 x largest + base ({mib(report['base_rss'])}) = "
          f"{mib(goals['peak_rss_limit'])}: {'ok' if goals['peak_rss_ok'] else 'MISSED'}; "
          f"throughput {goals['throughput_ratio']}x baseline: "
          f"{'ok' if goals['throughput_ok'] else 'MISSED'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=2.2, help="checkpoint size (default 2.2)")
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--workdir", default=None, help="where to build (default: $TMPDIR)")
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    parser.add_argument("--json", action="store_true", help="print one JSON report")
    parser.add_argument("--build", metavar="DIR", help=argparse.SUPPRESS)  # the child's job
    args = parser.parse_args()
    if args.build:
        shape = build_checkpoint(Path(args.build), args.size_gb, args.shards)
        (Path(args.build).parent / "shape.json").write_text(json.dumps(shape))
        return
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)


if __name__ == "__main__":
    main()
