"""A bench document as people read it: a rich table, Markdown or CSV.

JSON is the document itself (`schema.dumps`); these are views of it and carry no more.
Offline figures read `median ± stddev` over the repeats; ratios read `B/A [low, high]`.
"""

import csv
import io

from omlx_core.bench.schema import OFFLINE_METRICS, SERVING_LATENCIES
from omlx_core.units import format_bytes

_OFFLINE_COLUMNS = {
    "prefill_tps": "prefill tok/s",
    "ttft_s": "TTFT s",
    "decode_tps": "decode tok/s",
    "e2e_s": "end-to-end s",
    "peak_mlx_memory_bytes": "peak MLX",
    "peak_rss_bytes": "peak RSS",
}
_SERVING_COLUMNS = ("conc", "ctx", "done", "errors", "req/s", "gen tok/s",
                    "TTFT ms p50/90/99", "TPOT ms p50/90/99", "ITL ms p50/90/99")


def _number(value, metric: str) -> str:
    if value is None:
        return "-"
    if metric.endswith("_bytes"):
        return format_bytes(value)
    if metric.endswith("_s"):
        return f"{value:.3f}"
    return f"{value:.1f}"


def _summary(summary: dict, metric: str) -> str:
    if metric.endswith("_bytes"):
        return _number(summary["median"], metric)
    return f"{_number(summary['median'], metric)} ± {_number(summary['stddev'], metric)}"


def _ratio(found: dict | None) -> str:
    if not found or found["ratio"] is None:
        return "-"
    low, high = found["low"], found["high"]
    interval = f" [{low:.3f}, {high:.3f}]" if low is not None and high is not None else ""
    return f"{found['ratio']:.3f}{interval}"


def _ms(latency: dict) -> str:
    values = [latency.get(p) for p in ("p50", "p90", "p99")]
    return "/".join("-" if v is None else f"{v * 1000:.1f}" for v in values)


def _errors(errors: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in errors.items()) or "0"


def tables(document: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) for each table of the document: the shared view of every format."""
    if document["mode"] == "serving":
        rows = [[str(r["concurrency"]), str(r["ctx"]), f"{r['completed']}/{r['requests']}",
                 _errors(r["errors"]), _number(r["request_throughput_rps"], "rps"),
                 _number(r["generation_tps"], "tps"), *(_ms(r[k]) for k in SERVING_LATENCIES)]
                for r in document["results"]]
        return [(f"omlx bench {document['server']['url']}", list(_SERVING_COLUMNS), rows)]
    many = len(document["variants"]) > 1
    specs = {v["name"]: v["spec"] for v in document["variants"]}
    rows = [([f"{r['variant']} ({specs.get(r['variant']) or 'as set'})"] if many else [])
            + [str(r["ctx"]), str(r["batch"]), str(r["gen"])]
            + [_summary(r["metrics"][m], m) for m in OFFLINE_METRICS]
            for r in document["results"]]
    head = (["variant"] if many else []) + ["ctx", "batch", "gen"] + list(_OFFLINE_COLUMNS.values())
    title = f"omlx bench {document['model']['name']} ({document['hardware']['info']['backend']})"
    found = [(title, head, rows)]
    if document["comparisons"]:
        ratio_rows = [[f"{c['b']} / {c['a']}", str(c["ctx"])]
                      + [_ratio(c["metrics"].get(m)) for m in OFFLINE_METRICS]
                      for c in document["comparisons"]]
        found.append(("ratio B/A, bootstrap 95% interval", ["B / A", "ctx"]
                      + list(_OFFLINE_COLUMNS.values()), ratio_rows))
    return found


def context_line(document: dict) -> str:
    """Where and with what the figures were measured, in one line under the tables."""
    parts = [document["created"], f"hardware {document['hardware']['fingerprint']}",
             f"omlx {document['versions']['omlx']}, mlx {document['versions']['mlx']}"]
    if document["mode"] == "offline":
        parts.insert(1, f"model {document['model']['fingerprint']}")
        for key, found in document["settings"].items():
            value = found["value"]
            shown = ",".join(value) if isinstance(value, list) else value
            parts.append(f"{key}={shown} ({found['source']})")
        workload = document["workload"]
        parts.append(f"{workload['repeats']} repeats after {workload['warmup']} warm-up, "
                     f"seed {workload['seed']}")
    return " · ".join(parts)


def gate_line(document: dict) -> str | None:
    gate = document.get("gate")
    if not gate:
        return None
    verdict = "passed" if gate["passed"] else "FAILED"
    worst = "none measured" if gate["worst_ratio"] is None else \
        f"worst {gate['worst_ratio']:.3f} at ctx {gate['worst_ctx']}"
    return f"gate {verdict}: {gate['metric']} B/A {worst}, fail below {gate['fail_below']}"


def rich_tables(document: dict) -> list:
    from rich.table import Table

    found = []
    for title, head, rows in tables(document):
        table = Table(*head, title=title)
        for row in rows:
            table.add_row(*row)
        found.append(table)
    return found


def markdown(document: dict) -> str:
    lines = []
    for title, head, rows in tables(document):
        lines += [f"**{title}**", "", "| " + " | ".join(head) + " |",
                  "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines.append("")
    lines += [context_line(document), ""]
    line = gate_line(document)
    if line:
        lines += [line, ""]
    return "\n".join(lines)


def csv_text(document: dict) -> str:
    """Long format, one row per figure: easy to load into a spreadsheet or pandas."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    if document["mode"] == "serving":
        writer.writerow(["concurrency", "ctx", "gen", "metric", "p50", "p90", "p99", "mean",
                         "value"])
        for r in document["results"]:
            base = [r["concurrency"], r["ctx"], r["gen"]]
            for metric in ("completed", "request_throughput_rps", "generation_tps",
                           "prompt_tokens_mean", "completion_tokens_mean", "wall_s"):
                writer.writerow(base + [metric, "", "", "", "", r[metric]])
            for metric in SERVING_LATENCIES:
                latency = r[metric]
                writer.writerow(base + [metric, latency["p50"], latency["p90"], latency["p99"],
                                        latency["mean"], ""])
            for status, count in r["errors"].items():
                writer.writerow(base + [f"errors.{status}", "", "", "", "", count])
        return out.getvalue()
    writer.writerow(["kind", "variant", "ctx", "batch", "gen", "metric", "median", "mean",
                     "stddev", "min", "max", "n", "ratio", "low", "high"])
    for r in document["results"]:
        for metric in OFFLINE_METRICS:
            s = r["metrics"][metric]
            writer.writerow(["result", r["variant"], r["ctx"], r["batch"], r["gen"], metric,
                             s["median"], s["mean"], s["stddev"], s["min"], s["max"],
                             len(s["samples"]), "", "", ""])
    for c in document["comparisons"]:
        for metric, found in c["metrics"].items():
            found = found or {"ratio": None, "low": None, "high": None}
            writer.writerow(["ratio", f"{c['b']}/{c['a']}", c["ctx"], c["batch"], c["gen"], metric,
                             "", "", "", "", "", "", found["ratio"], found["low"], found["high"]])
    return out.getvalue()
