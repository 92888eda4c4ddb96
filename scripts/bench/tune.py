#!/usr/bin/env python
"""Run `omlx tune` on a benchmark model and check what it recommends against what it measured.

Why: the tuner's promise is that its recommendation is real: verified on fresh loads,
within 3% of the best candidate it measured, and never below the default. This runs the
whole procedure (`omlx_core.tune.run.run_tune`, what `omlx tune` runs) and prints the
candidate table with those checks.

Models: `--model M` (a path or a name under $OMLX_HOME/models, e.g. an FP16 clone of the
embedded model made with `omlx clone-fp16 default sm-fp16`), or `--shape dense` for a
generated Qwen3-8B-shape 4-bit g64 checkpoint (random weights, built once under
--workdir, as scripts/bench/prefill_paths.py builds it), `--tiny` for a tiny one.

    .venv/bin/python scripts/bench/tune.py [--model M | --shape dense [--tiny]] [--ctx 4k,16k]
        [--gen 8] [--repeats 3] [--budget-s 900] [--decode-batch N] [--json]
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--shape", default="dense", choices=("dense",))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--workdir", default="/tmp/omlx-bench-models")
    parser.add_argument("--home", default=None)
    parser.add_argument("--ctx", default="4k,16k")
    parser.add_argument("--gen", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=900)
    parser.add_argument("--decode-batch", type=int, default=None,
                        help="sequences of the dense-copy decode measurement (default server.max_concurrency; 0 skips)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from omlx_core.bench.workload import Workload
    from omlx_core.home import resolve_home
    from omlx_core.models.resolve import ModelRef, resolve
    from omlx_core.tune.run import run_tune
    from omlx_core.units import parse_counts

    home = resolve_home(args.home)
    if args.model:
        ref = resolve(args.model, home)
    else:
        from prefill_paths import checkpoint  # noqa: E402 - a sibling bench script

        path = checkpoint(args.shape, Path(args.workdir), args.tiny)
        ref = ModelRef(path.name, path.name, path)
        home = Path(args.workdir) / "home"
    workload = Workload(tuple(parse_counts(args.ctx, "--ctx")), args.gen, 1, args.repeats, 1)

    def progress(what, result):
        line = what if result is None else f"  {result.label}: {result.prefill_tps:,.1f} tok/s"
        print(line, file=sys.stderr, flush=True)

    document = run_tune(ref, home, workload, args.budget_s, progress, decode_batch=args.decode_batch)
    rec = document["recommendation"]
    measured_best = document["best"]["prefill_tps"]
    verified = rec["verified_prefill_tps"]
    default = document["default"]["prefill_tps"]
    finalists = [f["prefill_tps"] for f in document["verification"].get("finalists", [])]
    document["checks"] = {
        "verified_over_best_measured": verified / measured_best,
        "verified_over_best_verified": verified / max(finalists + [verified]),
        "verified_over_default": verified / default,
        "within_3pct_of_best": verified >= 0.97 * measured_best,
        "not_below_default": rec["is_default"] or verified >= default,
    }
    if args.json:
        print(json.dumps(document, indent=2))
        return
    print(f"{ref.path}: ctx {args.ctx}, {len(document['candidates'])} candidates")
    for c in document["candidates"]:
        per = "  ".join(f"{k}: {v:,.0f}" for k, v in c["per_ctx"].items())
        print(f"  {c['prefill_tps']:>10,.1f} tok/s  {per:30s}  {c['label']}"
              + (f"  [rejected: {c['rejected']}]" if c["rejected"] else ""))
    print(f"recommendation: {rec['label']} ({'default' if rec['is_default'] else 'changed'}); {rec['reason']}")
    if rec["decode_reason"]:
        print(f"decode: compute.dense_copy={rec['settings']['compute.dense_copy']}; {rec['decode_reason']}")
    print(f"checks: {json.dumps(document['checks'])}")
    for note in document["notes"]:
        print(f"note: {note}")


if __name__ == "__main__":
    main()
