#!/usr/bin/env python
"""Time to first token for a repeated long prefix: cold vs memory hit vs SSD hit, one run.

Why: the tiered prompt cache exists so a resent prefix (an agent's system prompt and
tools, a long document) costs a read instead of a prefill, even after a restart. This
measures exactly that on a real `omlx serve`, as ratios against the cold figure of the
same run.

How: a fresh $OMLX_HOME (its `models/` linked to the real one, so the model is not
imported again) and a real server subprocess on a loopback port. Server 1, per repeat r:
a new random prefix P_r of --prefix tokens plus a suffix, first cold (nothing cached),
then P_r plus another suffix (a memory hit: only the suffix and the part of the prefix
past the last whole block are prefilled). Once the writer queue has put every block on
SSD, server 1 stops and server 2 starts on the same home (empty memory tier), and asks
P_r plus a third suffix (an SSD hit). After each repeat the writer queue is let drain, as
when prefixes come back later rather than in one burst (the queue's drops are reported). Each request is non-streaming with max_tokens 1,
so its latency is the client-side time to first token. One short warm-up request per
server is not counted. Figures are medians over --repeats; `cached_tokens` from the
server's usage and its /api/status hit counters confirm which tier served each hit.

The embedded model's context is 8192 tokens, so the default prefix is 8000 tokens
(+ a 64-token suffix and one generated token).

    .venv/bin/python scripts/bench/prompt_cache.py [--model default] [--prefix 8000]
        [--suffix 64] [--repeats 3] [--json]
"""

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serve import Subprocess, free_port, omlx_command  # noqa: E402 - a sibling bench script


def random_tokens(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def first_token(url: str, model: str, prompt: list[int], timeout: float) -> tuple[float, int]:
    """(seconds to the first token, cached prompt tokens) of one request."""
    started = time.perf_counter()
    response = httpx.post(url + "/v1/completions", timeout=timeout, json={
        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True})
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise SystemExit(f"request failed: {response.status_code} {response.text[:300]}")
    return elapsed, response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def cache_status(url: str) -> dict:
    models = httpx.get(url + "/api/status", timeout=30).json()["models"]
    return models[0]["prompt_cache"]  # the one model this bench serves


def drain(url: str, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = cache_status(url)
        if not stats["writer"]["pending_entries"]:
            return stats
        time.sleep(0.5)
    raise SystemExit("the writer queue did not drain")


def run(args) -> dict:
    from omlx_core.home import resolve_home
    from omlx_core.models.resolve import resolve
    from omlx_core.prompt_cache.chain import cacheable_tokens

    real_home = resolve_home(args.home)
    ref = resolve(args.model, real_home)  # imports `default` from its GGUF on first use
    config = json.loads((ref.path / "config.json").read_text())
    vocab = int(config.get("vocab_size") or config["text_config"]["vocab_size"])
    home = Path(tempfile.mkdtemp(prefix="omlx-bench-cache-"))
    (home / "models").symlink_to(real_home / "models")
    prefixes = [random_tokens(1000 + r, args.prefix, vocab) for r in range(args.repeats)]
    suffixes = [[random_tokens(2000 + 10 * r + k, args.suffix, vocab) for k in range(3)]
                for r in range(args.repeats)]
    expected = cacheable_tokens(args.prefix + args.suffix, args.block)
    rows = {"cold": [], "memory": [], "ssd": []}
    cached = {"cold": [], "memory": [], "ssd": []}
    statuses = {}
    os.environ["OMLX_PROMPT_CACHE_BLOCK_TOKENS"] = str(args.block)  # the servers inherit it
    phases = {"first": (("cold", 0), ("memory", 1)), "restart": (("ssd", 2),)}
    try:
        for phase, tiers in phases.items():
            port = free_port()
            server = Subprocess("omlx", omlx_command(home, args.model, port, 1), port,
                                home / f"serve-{phase}.log")
            print(f"{phase} server: starting", file=sys.stderr)
            server.start(args.startup_timeout)
            try:
                first_token(server.url, args.model, random_tokens(7, 16, vocab), args.timeout)
                for r in range(args.repeats):
                    for tier, k in tiers:
                        seconds, hit = first_token(server.url, args.model,
                                                   prefixes[r] + suffixes[r][k], args.timeout)
                        rows[tier].append(seconds)
                        cached[tier].append(hit)
                        print(f"  repeat {r + 1}/{args.repeats} {tier}: {seconds:.3f} s, "
                              f"{hit} cached tokens", file=sys.stderr)
                    drain(server.url)  # as when prefixes come back later, not in one burst
                statuses[phase] = drain(server.url)
            finally:
                server.stop(30)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    medians = {tier: statistics.median(values) for tier, values in rows.items()}
    return {
        "model": str(ref.path), "prefix_tokens": args.prefix, "suffix_tokens": args.suffix,
        "block_tokens": args.block, "expected_cached_tokens": expected, "repeats": args.repeats,
        "ttft_s": {tier: {"median": medians[tier], "samples": rows[tier]} for tier in rows},
        "cached_tokens": cached,
        "speedup": {"memory": medians["cold"] / medians["memory"], "ssd": medians["cold"] / medians["ssd"]},
        "hit_tokens": {phase: s["hit_tokens"] for phase, s in statuses.items()},
        "disk": statuses["restart"]["disk"],
        "writer": {phase: s["writer"] for phase, s in statuses.items()},
        "all_hits_as_expected": all(c == expected for t in ("memory", "ssd") for c in cached[t])
        and all(c == 0 for c in cached["cold"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--home", default=None, help="Where the model lives (default $OMLX_HOME or ~/.omlx).")
    parser.add_argument("--prefix", type=int, default=8000)
    parser.add_argument("--suffix", type=int, default=64)
    parser.add_argument("--block", type=int, default=256, help="prompt_cache.block_tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{report['model']}: prefix {args.prefix} + suffix {args.suffix} tokens, "
          f"{report['expected_cached_tokens']} cacheable, {args.repeats} repeats")
    for tier in ("cold", "memory", "ssd"):
        ratio = "" if tier == "cold" else f"  ({report['speedup'][tier]:.1f}x faster than cold)"
        print(f"  {tier:7s} TTFT median {report['ttft_s'][tier]['median']:.3f} s{ratio}")
    print(f"  hits as expected: {report['all_hits_as_expected']}; SSD tier "
          f"{report['disk']['files']} files, {report['disk']['bytes'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
