#!/usr/bin/env python
"""Where the decode kernel's time goes: Nsight Compute on one quantized layer.

Why: chained timings (decode.py --parts layers) say how long qmm_decode takes, not why.
This runs one 4-bit g64 layer (--shape, in x out) at the default launch shape of each
--tokens count (or at --config, one launch shape for all), two calls each, under ncu three
times:

  sections  duration, DRAM, L2 and L1 throughput, IPC, executed instructions, registers,
            occupancy
  stalls    the stall reasons: cycles per issued instruction each, as ncu averages them
  parts     warp stall samples per part of the kernel, the SASS split at its barriers:
            the prologue with the staging of x, the main loop, then the reductions and
            the split-K sum (source page, one call per token count)

    python scripts/bench/qmm_profile.py [--tokens 1,32] [--shape 4096x12288]
        [--config R,WR,WK,U,KC,OCC[,SL]] [--save FILE] [--json]

On the GPU machine only: it needs MLX's CUDA backend and ncu (found as decode.py finds it).
"""

import argparse
import csv
import io
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

KERNEL = "regex:omlx_qmm"
SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "WarpStateStats", "Occupancy", "LaunchStats",
            "SchedulerStats", "ComputeWorkloadAnalysis", "InstructionStats")
SECTION_FIGURES = {"duration_us": "Duration", "dram_pct": "DRAM Throughput", "l2_pct": "L2 Cache Throughput",
                   "l1_pct": "L1/TEX Cache Throughput", "ipc": "Executed Ipc Active",
                   "instructions": "Executed Instructions", "registers": "Registers Per Thread",
                   "achieved_occupancy_pct": "Achieved Occupancy"}
STALLS = r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"


def launch_shape(text: str | None) -> tuple | None:
    """--config's launch shape as qmm_decode.config_of takes it (integers); None for the defaults."""
    if not text:
        return None
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        sys.exit(f"qmm_profile.py: --config {text!r}: give integers R,WR,WK,U,KC,OCC[,SL], e.g. 1,4,2,1,1024,3,8")


def child(tokens: list[int], k: int, n: int, shape: tuple | None = None) -> None:
    """The profiled work: two calls of the layer per token count, in order (at `shape` if given)."""
    import mlx.core as mx

    from decode import quantized_layer
    from omlx_core.kernels import qmm_decode

    wq, scales, biases = quantized_layer(k, n, 4, 64)
    locks = mx.zeros((qmm_decode.lock_count(n),), dtype=mx.int32)
    for m in tokens:
        x = mx.random.normal((m, k)).astype(mx.bfloat16)
        config = qmm_decode.config_of(qmm_decode.tiles_for(m), shape) if shape else None
        for _ in range(2):
            mx.eval(qmm_decode.quantized_matmul_decode(x, wq, scales, biases, 64, 4, locks=locks, config=config))
    mx.synchronize()


def kernel_blocks(text: str) -> list[tuple[str, str]]:
    """(kernel name, its report) for each profiled launch in ncu's text output."""
    blocks = text.split("\n  custom_kernel_")[1:]
    return [(block.split("(")[0], block) for block in blocks]


def sections(text: str) -> list[dict]:
    rows = []
    for name, block in kernel_blocks(text):
        grid = re.search(r"\) \((\d+), (\d+), 1\)x\((\d+), 1, 1\)", block)
        row = {"kernel": name, "grid": [int(grid[1]), int(grid[2])] if grid else None,
               "threads": int(grid[3]) if grid else None}
        for key, label in SECTION_FIGURES.items():
            found = re.search(r"\n\s+" + re.escape(label) + r"\s+\S+\s+([\d,.]+)", block)
            row[key] = float(found[1].replace(",", "")) if found else None
        rows.append(row)
    return rows


def stalls(text: str) -> list[dict]:
    """Each launch's stall reasons of at least 0.2 cycles per issued instruction."""
    rows = []
    for name, block in kernel_blocks(text):
        found = re.findall(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio\s+\S+\s+([\d.]+)", block)
        rows.append({"kernel": name, "cycles_per_issue": {reason: float(v) for reason, v in found if float(v) >= 0.2}})
    return rows


def parts(report: str) -> list[dict]:
    """Warp stall samples per part of the kernel (SASS between barriers), from ncu's source
    page as CSV: share of all samples, and of those waiting on global memory."""
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))

    def number(text: str) -> float:
        try:
            return float(text.replace(",", ""))
        except ValueError:
            return 0.0

    total = sum(number(r["Warp Stall Sampling (All Samples)"]) for r in rows) or 1.0
    pieces, current = [], []
    for row in rows:
        current.append(row)
        if "BAR." in row["Source"]:
            pieces.append(current)
            current = []
    pieces.append(current)
    names = ["prologue, first weight loads, staging of x", "main loop"]
    out = []
    for i, piece in enumerate(pieces):
        samples = sum(number(r["Warp Stall Sampling (All Samples)"]) for r in piece)
        if samples / total >= 0.01:
            out.append({"part": names[i] if i < len(names) else f"after barrier {i} (reductions, split-K sum)",
                        "samples_pct": round(100 * samples / total, 1),
                        "long_scoreboard_pct": round(100 * sum(number(r["stall_long_sb"]) for r in piece) / total, 1)})
    return out


def run_ncu(ncu: str, options: list[str], tokens: list[int], k: int, n: int, config: str | None = None,
            timeout: float = 300) -> str:
    command = [ncu, "--clock-control", "none", "--kernel-name", KERNEL, *options, sys.executable, __file__,
               "--child", "--tokens", ",".join(map(str, tokens)), "--shape", f"{k}x{n}"]
    command += ["--config", config] if config else []
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"ncu exited {done.returncode}: {(done.stderr or done.stdout)[-600:]}")
    return done.stdout


def profile(tokens: list[int], k: int, n: int, config: str | None = None) -> dict:
    from decode import find_ncu

    ncu = find_ncu()
    if ncu is None:
        return {"skipped": "Nsight Compute (ncu) not found"}
    section_options = [option for name in SECTIONS for option in ("--section", name)]
    result = {"shape": [k, n], "tokens": tokens, "config": config or "default",
              "sections": sections(run_ncu(ncu, section_options, tokens, k, n, config)),
              "stalls": stalls(run_ncu(ncu, ["--metrics", STALLS], tokens, k, n, config)), "parts": {}}
    for index, m in enumerate(tokens):
        source = ["--launch-skip", str(2 * index), "--launch-count", "1", "--set", "full", "--import-source", "no",
                  "--page", "source", "--print-source", "sass", "--csv"]
        result["parts"][str(m)] = parts(run_ncu(ncu, source, tokens, k, n, config))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,32")
    parser.add_argument("--shape", default="4096x12288", help="in x out of the layer")
    parser.add_argument("--config", default=None,
                        help="one launch shape for every token count (qmm_decode.config_of's tuple, comma-separated)")
    parser.add_argument("--save", default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    k, n = (int(v) for v in args.shape.lower().split("x"))
    if args.child:
        child(tokens, k, n, launch_shape(args.config))
        return
    from omlx_core.kernels.qmm_decode import kernel_available

    launch_shape(args.config)  # a bad --config fails here, not in ncu's child
    if why := kernel_available():
        sys.exit(f"qmm_profile.py: the qmm_decode kernel is not available here: {why}")
    result = profile(tokens, k, n, args.config)
    if args.save:
        Path(args.save).write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for row in result.get("sections", []):
        print(f"{row['kernel']}: {row['duration_us']} us, DRAM {row['dram_pct']}%, L2 {row['l2_pct']}%, "
              f"L1 {row['l1_pct']}%, IPC {row['ipc']}, "
              f"{row['instructions']} instructions, {row['registers']} registers")
    for m, pieces in result.get("parts", {}).items():
        for piece in pieces:
            print(f"{m} tokens: {piece['part']}: {piece['samples_pct']}% of stall samples "
                  f"({piece['long_scoreboard_pct']}% waiting on memory)")
    if "skipped" in result:
        print(result["skipped"])


if __name__ == "__main__":
    main()
