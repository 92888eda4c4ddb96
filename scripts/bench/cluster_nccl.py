#!/usr/bin/env python
"""What the cluster's CUDA path can show on one GPU: NCCL through `mlx.launch`, and the bound.

Why: `omlx cluster verify` runs an all-sum across the group with NCCL on CUDA workers; a
one-GPU machine can still show that NCCL initialises through `mlx.launch` and sums on one
rank, and that a group with a missing peer fails within the timeout instead of hanging.

    python scripts/bench/cluster_nccl.py [--timeout 10] [--json]
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

from omlx_core.cluster.launch import MLX_LAUNCH


def one_rank(timeout_s: float) -> dict:
    argv = [sys.executable, "-c", MLX_LAUNCH, "--backend", "nccl", "--hosts", "127.0.0.1", "--",
            sys.executable, "-m", "omlx_core.cluster.collective", "--backend", "nccl", "--timeout", str(timeout_s)]
    start = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s + 30, stdin=subprocess.DEVNULL)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {"exit": done.returncode, "ranks": lines, "seconds": round(time.monotonic() - start, 2),
            "ok": done.returncode == 0 and len(lines) == 1 and lines[0]["ok"],
            "stderr_tail": done.stderr[-600:]}


def missing_peer(timeout_s: float) -> dict:
    """Rank 0 of a two-rank NCCL group whose rank 1 never starts."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "MLX_RANK": "0", "MLX_WORLD_SIZE": "2", "NCCL_HOST_IP": "127.0.0.1",
           "NCCL_PORT": str(port), "CUDA_VISIBLE_DEVICES": "0"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "omlx_core.cluster.collective", "--backend", "nccl",
                           "--timeout", str(timeout_s)], capture_output=True, text=True, env=env,
                          timeout=timeout_s + 30)
    elapsed = time.monotonic() - start
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {"exit": done.returncode, "ranks": lines, "seconds": round(elapsed, 2), "timeout_s": timeout_s,
            "ok": done.returncode != 0 and elapsed < timeout_s + 5 and bool(lines) and not lines[0]["ok"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import mlx.core as mx

    report = {"mlx_version": mx.__version__, "cuda": bool(mx.cuda.is_available()),
              "one_rank_nccl_all_sum": one_rank(args.timeout), "missing_peer_bounded": missing_peer(args.timeout)}
    report["ok"] = report["one_rank_nccl_all_sum"]["ok"] and report["missing_peer_bounded"]["ok"]
    print(json.dumps(report, indent=2) if args.json else
          f"1-rank NCCL all-sum: {report['one_rank_nccl_all_sum']['ok']}; "
          f"missing peer fails in {report['missing_peer_bounded']['seconds']} s: {report['missing_peer_bounded']['ok']}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
