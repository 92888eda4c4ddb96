#!/usr/bin/env python
"""Measure the ane lane's staged build on a generated checkpoint: time, peak extra memory
(MLX and host) against one layer's float32 slice and against every layer's, the buffer
cache left behind, the packages' bytes and every procedure's INT8 error.

Why: the build must never hold all layers in float32 and must stay near one slice
whatever the model's depth; this says how near, at real widths. Runs anywhere coremltools
builds packages (Linux included); loading them on the Neural Engine is macOS only and not
part of this script.

    python scripts/bench/ane_build.py [--arch llama|qwen3_5] [--hidden 4096] [--intermediate 12288]
        [--layers 2] [--share 0.25] [--tokens 512] [--dual] [--workdir DIR] [--json]

Save the JSON under docs/benchmarks/ with the command that made it.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama", choices=("llama", "qwen3_5"))
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=12288)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--share", type=float, default=0.25)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--dual", action="store_true")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import mlx.core as mx
    from mlx_lm.utils import load

    from omlx_core.bench.report import header
    from omlx_core.models.testing import build_tiny_model
    from omlx_core.prefill.ane.staged import staged_build
    from omlx_core.prefill.plan import SplitPlan, find_targets

    work = args.workdir or Path(tempfile.mkdtemp(prefix="omlx-ane-bench-"))
    shape = {"hidden_size": args.hidden, "intermediate_size": args.intermediate, "num_hidden_layers": args.layers}
    if args.arch == "qwen3_5":
        shape["layer_types"] = ["linear_attention"] * args.layers
    checkpoint = work / f"{args.arch}-{args.hidden}x{args.intermediate}x{args.layers}"
    if not (checkpoint / "config.json").is_file():
        build_tiny_model(args.arch, checkpoint, quantized=True, dtype="float16", shape=shape)
    model, _ = load(str(checkpoint))
    plan = SplitPlan({kind: {"ane": args.share} for kind in ("mlp_gate_up", "mlp_down", "gdn_qkv")})
    started = time.perf_counter()
    build = staged_build(model, find_targets(model), plan, args.tokens, work / "packages", dual=args.dual)
    seconds = time.perf_counter() - started
    every = sum(p.slice_fp32_bytes() for p in build.procedures)
    peak = build.peak_extra_bytes + build.host_peak_extra_bytes
    disk = sum(f.stat().st_size for p in build.procedures for pkg in p.packages for f in pkg.rglob("*") if f.is_file())
    document = header("ane_build")
    document.update({
        "command": " ".join(["python", "scripts/bench/ane_build.py", *sys.argv[1:]]),
        "shape": shape, "arch": args.arch, "share": args.share, "tokens": args.tokens, "dual": args.dual,
        "procedures": len(build.procedures), "failures": [f.warning for f in build.failures],
        "build_s": round(seconds, 3),
        "peak_extra_bytes": {"mlx": build.peak_extra_bytes, "host": build.host_peak_extra_bytes, "total": peak},
        "largest_slice_fp32_bytes": build.largest_slice_fp32_bytes, "all_slices_fp32_bytes": every,
        "peak_vs_one_slice": round(peak / build.largest_slice_fp32_bytes, 3),
        "peak_vs_all_slices": round(peak / every, 3),
        "retained_cache_bytes": build.retained_cache_bytes, "mlx_active_bytes_after": mx.get_active_memory(),
        "package_bytes_on_disk": disk, "bank_bytes": sum(p.bank_bytes for p in build.procedures),
        "errors": {p.name: p.error.as_dict() for p in build.procedures},
    })
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print(f"{len(build.procedures)} procedures in {seconds:.1f} s; peak extra {peak / 2**20:.1f} MiB = "
              f"{document['peak_vs_one_slice']}x one slice, {document['peak_vs_all_slices']}x all slices; "
              f"cache left {build.retained_cache_bytes} B; worst output error "
              f"{max(e['output_rel_rms'] for e in document['errors'].values()):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
