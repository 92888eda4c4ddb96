"""The `omlx bench` JSON document, schema `omlx.bench/1`: what scripts and CI may rely on.

Stable and versioned: fields may be added within version 1; renaming or removing one,
or changing its meaning or unit, makes it `omlx.bench/2`. `--output FILE` appends the
same document, compacted to one line, per run (JSON Lines), so a file is a history.

Common to both modes (all required):

    schema         "omlx.bench/1"
    mode           "offline" | "serving"
    created        UTC time the run started, ISO 8601 ("2025-01-31T12:00:00Z")
    versions       {"omlx", "mlx", "mlx_lm"}: version strings
    hardware       {"fingerprint": "hw-…", "info": {os, machine, cpu, cpu_count,
                    memory_bytes, backend, device, gpu, mlx_version}}
    workload       what was run (below)
    results        list of measurements (below)

Offline mode (`omlx bench`, in-process):

    model          {"name", "path", "fingerprint": "mf-…"}
    settings       the effective `prefill.*` settings before any variant:
                   {"prefill.chunk_size": {"value": 2048, "source": "default", "where": ""}, …}
                   (source: default | file | model | env | cli)
    workload       {"ctx": [512, …], "gen": 128, "batch": 1, "repeats": 3, "warmup": 1,
                    "seed": 0}
    variants       [{"name": "omlx" | "A" | "B" | "mlx-lm", "runner": "omlx" | "mlx-lm",
                     "spec": "prefill.chunk_size=512", "settings": {same shape as above},
                     "lanes": null | {"lanes": [{"name", "configured", "attempted", "reason",
                                                 "procedures", "resident_bytes"}], "plan",
                                      "min_tokens", "build_s", "build_peak_extra_bytes",
                                      "retained_cache_bytes", "warmup_s", "extra_bytes",
                                      "split_calls"}}]
    results        [{"variant": name, "ctx": 512, "batch": 1, "gen": 128,
                     "tokens": {"prompt": 512, "generated": 128, "cache": 639 | null},
                     "rss_scope": "run" | "process",
                     "metrics": {metric: {"median", "mean", "stddev", "min", "max",
                                          "samples": [...]}}}]
                   tokens are per sequence and counted during the run (fed to the model,
                   read back, and the KV cache's own count where it keeps one).
                   stddev is the sample standard deviation (n - 1), 0 for one repeat.
    comparisons    [{"a": name, "b": name, "ctx": 512,
                     "metrics": {metric: {"ratio", "low", "high", "level": 0.95}}}]
                   ratio = median(b) / median(a); [low, high] is a seeded bootstrap
                   interval. `a` is "baseline:<file>" for --against. Empty if one variant.
    gate           null, or {"metric": "prefill_tps", "fail_below": 0.9,
                   "worst_ratio": 0.97, "worst_ctx": 512, "passed": true}

    Offline metrics (OFFLINE_METRICS): prefill_tps (tok/s, batch x prompt / TTFT),
    ttft_s, decode_tps (tok/s, batch x (gen - 1) / decode time), e2e_s,
    peak_mlx_memory_bytes (mx.get_peak_memory), peak_rss_bytes (process peak RSS).

Serving mode (`omlx bench --url URL`):

    server         {"url", "model": name sent or null, "endpoint": "completions" | "chat"}
    workload       {"ctx": [...], "gen": 128, "concurrency": [1, 4], "requests": 8 | null,
                    "warmup": 1, "seed": 0}
    results        [{"concurrency": 4, "ctx": 512, "gen": 128, "requests": 8,
                     "completed": 8, "errors": {"503": 1, "ConnectError": 0, …},
                     "wall_s", "request_throughput_rps", "generation_tps",
                     "prompt_tokens_mean", "completion_tokens_mean",
                     "ttft_s": {"p50", "p90", "p99", "mean"},
                     "tpot_s": {…}, "itl_s": {…}}]
                   token counts come from the server's usage report when it sends one,
                   else from the streamed chunks; prompt lengths are approximate.
"""

import json
from pathlib import Path

from omlx_core.errors import InputError

SCHEMA = "omlx.bench/1"

OFFLINE_METRICS = {
    "prefill_tps": "tok/s",
    "ttft_s": "s",
    "decode_tps": "tok/s",
    "e2e_s": "s",
    "peak_mlx_memory_bytes": "bytes",
    "peak_rss_bytes": "bytes",
}
SERVING_LATENCIES = ("ttft_s", "tpot_s", "itl_s")
SUMMARY_KEYS = ("median", "mean", "stddev", "min", "max", "samples")

COMMON_KEYS = ("schema", "mode", "created", "versions", "hardware", "workload", "results")
MODE_KEYS = {
    "offline": ("model", "settings", "variants", "comparisons", "gate"),
    "serving": ("server",),
}
OFFLINE_RESULT_KEYS = ("variant", "ctx", "batch", "gen", "tokens", "metrics")
SERVING_RESULT_KEYS = ("concurrency", "ctx", "gen", "requests", "completed", "errors",
                       "wall_s", "request_throughput_rps", "generation_tps", *SERVING_LATENCIES)


def _require(node: dict, keys, where: str) -> None:
    if not isinstance(node, dict):
        raise InputError(f"{where}: expected a JSON object")
    missing = [key for key in keys if key not in node]
    if missing:
        raise InputError(f"{where}: missing {', '.join(missing)} (not an {SCHEMA} document?)")


def validate(document: dict, where: str = "bench document") -> dict:
    """The document itself if it has every required key of its mode; InputError otherwise."""
    _require(document, COMMON_KEYS, where)
    if document["schema"] != SCHEMA:
        raise InputError(f"{where}: schema {document['schema']!r} is not {SCHEMA!r}")
    mode = document["mode"]
    if mode not in MODE_KEYS:
        raise InputError(f"{where}: mode {mode!r} is neither offline nor serving")
    _require(document, MODE_KEYS[mode], where)
    for i, result in enumerate(document["results"]):
        if mode == "offline":
            _require(result, OFFLINE_RESULT_KEYS, f"{where}: results[{i}]")
            for metric in OFFLINE_METRICS:
                _require(result["metrics"].get(metric), SUMMARY_KEYS,
                         f"{where}: results[{i}].metrics.{metric}")
        else:
            _require(result, SERVING_RESULT_KEYS, f"{where}: results[{i}]")
    return document


def dumps(document: dict, *, line: bool = False) -> str:
    """Pretty JSON for stdout, or one compact line for a history file."""
    if line:
        return json.dumps(document, separators=(",", ":"), allow_nan=True)
    return json.dumps(document, indent=2)


def loads(text: str, where: str = "bench document") -> dict:
    """A document from JSON text, or the last run of a JSON Lines history."""
    text = text.strip()
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        lines = [line for line in text.splitlines() if line.strip()]
        try:
            document = json.loads(lines[-1]) if lines else None
        except json.JSONDecodeError as error:
            raise InputError(f"{where}: not JSON or JSON Lines ({error})") from None
    if document is None:
        raise InputError(f"{where}: empty file")
    return validate(document, where)


def load(path: Path) -> dict:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: no such file; write one with `omlx bench --format json > {path}`") from None
    return loads(text, str(path))
