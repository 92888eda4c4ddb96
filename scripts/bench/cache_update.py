#!/usr/bin/env python
"""What a decode step's KV-cache write costs when steps are pipelined.

Why: mlx-lm's caches write a step's key/value row with a slice update, which reuses the
cache's buffer only when nothing else holds it. mlx-lm's generators (and so `omlx serve`)
build and hand over step n+1 while step n still runs, and step n's attention holds the
buffer until the GPU has run it: the update then copies the whole buffer, every layer,
every step. This times one layer's cache (batch x 8 heads x ctx+256 rows x 128, bf16):
per step, the new row written and the attention over the rows so far (sdpa_decode's
kernel on CUDA, MLX's elsewhere), waited for (`waited`) or pipelined (`pipelined`), by

  stock     mlx-lm's slice update (the cache's `keys[..., i, :] = row`)
  in_place  sdpa_decode's `write_rows` (the row written into the buffer; CUDA only)

    python scripts/bench/cache_update.py [--batch 32] [--ctx 1024] [--steps 64] [--json]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

HEADS, DIM, GROUP = 8, 128, 4  # Qwen3-8B's key/value heads, head size, query heads per key/value head


def step_ms(method: str, pipelined: bool, batch: int, ctx: int, steps: int) -> float:
    """Milliseconds a step, the median of 3 runs of `steps` steps from row `ctx`."""
    import mlx.core as mx

    from omlx_core.hardware import mlx_backend
    from omlx_core.kernels import sdpa_decode

    cuda = mlx_backend() == "cuda"
    locks = mx.zeros((batch * HEADS,), dtype=mx.int32)
    runs = []
    for _ in range(4):  # the first warms up
        k = mx.zeros((batch, HEADS, ctx + 256, DIM), dtype=mx.bfloat16)
        v = mx.zeros_like(k)
        q = mx.ones((batch, HEADS * GROUP, 1, DIM), dtype=mx.bfloat16)
        mx.eval(k, v, q, locks)
        out = q
        start = time.perf_counter()
        for i in range(ctx, ctx + steps):
            new = out[:, ::GROUP]  # the step depends on the last
            written = None
            if method == "stock":
                k[..., i:i + 1, :] = new
                v[..., i:i + 1, :] = new
            else:
                written, _ = sdpa_decode.write_rows(k, v, new, new, i)
            keys, values = k[..., :i + 1, :], v[..., :i + 1, :]
            if cuda:  # the decode attention kernel: it reads the rows after the write
                following = sdpa_decode.launch(q, keys, values, DIM ** -0.5, None, locks, written)
            else:
                following = mx.fast.scaled_dot_product_attention(q, keys, values, scale=DIM ** -0.5)
            if pipelined:
                mx.async_eval(following)
                mx.eval(out)
            else:
                mx.eval(following)
            out = following
        mx.eval(out)
        runs.append((time.perf_counter() - start) / steps * 1e3)
    return round(statistics.median(runs[1:]), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from omlx_core.hardware import mlx_backend

    methods = ["stock"] + (["in_place"] if mlx_backend() == "cuda" else [])
    rows = [{"method": m, "mode": mode, "step_ms": step_ms(m, mode == "pipelined", args.batch, args.ctx, args.steps)}
            for m in methods for mode in ("waited", "pipelined")]
    result = {"command": " ".join(["python", *sys.argv]), "backend": mlx_backend(), "batch": args.batch,
              "ctx": args.ctx, "buffer_mb": round(2 * args.batch * HEADS * (args.ctx + 256) * DIM * 2 / 2**20, 1),
              "rows": rows}
    if "in_place" not in methods:
        result["skipped"] = "in_place: sdpa_decode's write needs MLX's CUDA backend"
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for row in rows:
        print(f"{row['method']:>8} {row['mode']:>9}: {row['step_ms']:.3f} ms a step")
    if "skipped" in result:
        print(result["skipped"])


if __name__ == "__main__":
    main()
