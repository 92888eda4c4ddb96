"""The collective check every rank runs under `mlx.launch`: one all-sum across the group.

Rank r contributes r + 1; every rank must read 1 + 2 + … + size. On NCCL the ranks also
log NCCL's channel setup, from which `verify` reads whether peers talk over a direct link. Each rank prints one JSON
line and exits within `--timeout` even if a peer never connects (SIGALRM), so a broken
group fails on time instead of hanging.
"""

import argparse
import json
import os
import signal
import socket
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="ring")
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    rank = int(os.environ.get("MLX_RANK", "0"))

    def give_up(*_):
        print(json.dumps({"rank": rank, "ok": False, "error": f"no all-sum within {args.timeout:g} s"}), flush=True)
        os._exit(3)
    signal.signal(signal.SIGALRM, give_up)
    signal.setitimer(signal.ITIMER_REAL, args.timeout)

    if args.backend == "nccl":
        os.environ.setdefault("NCCL_DEBUG", "INFO")  # its channel lines name the transport per peer
    import mlx.core as mx

    start = time.monotonic()
    group = mx.distributed.init(strict=True, backend=args.backend)
    total = mx.distributed.all_sum(mx.array([float(group.rank() + 1)]), group=group)
    mx.eval(total)
    size = group.size()
    ok = int(total.item()) == size * (size + 1) // 2
    signal.setitimer(signal.ITIMER_REAL, 0)
    print(json.dumps({"rank": group.rank(), "size": size, "sum": total.item(), "ok": ok,
                      "host": socket.gethostname(), "backend": args.backend,
                      "seconds": round(time.monotonic() - start, 3)}), flush=True)
    return 0 if ok else 4


if __name__ == "__main__":
    sys.exit(main())
