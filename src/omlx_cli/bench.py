"""`omlx bench`: offline (in-process) and serving (`--url`) benchmarks, for people and CI."""

import sys
from pathlib import Path
from typing import List, Optional, Tuple

import typer

from omlx_cli.context import globals_of, note

FORMATS = ("table", "json", "csv", "md")


def _check_usage(url, compare, baseline, against, fail_below, fmt, batch, profile, sets) -> None:
    from omlx_core.errors import InputError

    if fmt not in FORMATS:
        raise InputError(f"--format: {fmt!r}; use one of {', '.join(FORMATS)}")
    chosen = [name for name, value in (("--compare", compare), ("--baseline", baseline),
                                       ("--against", against)) if value]
    if len(chosen) > 1:
        raise InputError(f"{' and '.join(chosen)} cannot be combined; pick one reference")
    if baseline and baseline != "mlx-lm":
        raise InputError(f"--baseline: {baseline!r}; the one baseline is mlx-lm")
    if fail_below is not None and not chosen:
        raise InputError("--fail-below needs something to compare: --compare A B, "
                         "--baseline mlx-lm or --against FILE")
    if fail_below is not None and fail_below <= 0:
        raise InputError(f"--fail-below: {fail_below} must be a positive ratio such as 0.9")
    if url:
        offline_only = [name for name, value in (("--compare", compare), ("--baseline", baseline),
                        ("--against", against), ("--profile", profile), ("--set", sets),
                        ("--batch", batch != 1)) if value]
        if offline_only:
            raise InputError(f"{', '.join(offline_only)}: offline only; with --url the server's "
                             "own settings apply")


def _variants(home, model_key, profile, sets, compare, baseline):
    from omlx_core.bench.variants import MLX_LM, OMLX, Variant, VariantSpec, parse_set, \
        parse_variant, variant_settings

    base = VariantSpec(profile, dict(parse_set(item) for item in sets))
    base_settings = variant_settings(home, model_key, base)
    if compare:
        specs = [parse_variant(text, base) for text in compare]
        return [Variant(name, OMLX, spec.text, variant_settings(home, model_key, spec))
                for name, spec in zip(("A", "B"), specs)], base_settings
    ours = Variant(OMLX, OMLX, base.text, base_settings)
    if baseline:
        return [Variant(MLX_LM, MLX_LM, "stock stream_generate, default settings"), ours], base_settings
    return [ours], base_settings


class _Progress:
    """A rich progress bar on stderr (silent with --quiet); the core reports (done, total, what)."""

    def __init__(self, quiet: bool):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, \
            TimeElapsedColumn

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=Console(stderr=True),
                            transient=True, disable=quiet)
        self.task = None

    def __enter__(self):
        self.bar.start()
        return self

    def __exit__(self, *exc):
        self.bar.stop()

    def __call__(self, done: int, total: int, what: str) -> None:
        if self.task is None:
            self.task = self.bar.add_task(what or "bench", total=total)
        self.bar.update(self.task, completed=done, total=total, **({"description": what} if what else {}))


def _emit(document: dict, fmt: str, output: Optional[Path]) -> None:
    from omlx_core.bench import render, schema

    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        with open(output, "a", encoding="utf-8") as history:
            history.write(schema.dumps(document, line=True) + "\n")
    if fmt == "json":
        sys.stdout.write(schema.dumps(document) + "\n")
    elif fmt == "csv":
        sys.stdout.write(render.csv_text(document))
    elif fmt == "md":
        sys.stdout.write(render.markdown(document) + "\n")
    else:
        from rich.console import Console

        console = Console()
        for table in render.rich_tables(document):
            console.print(table)
        console.print(render.context_line(document), style="dim")
        line = render.gate_line(document)
        if line:
            console.print(line)


def bench(
    context: typer.Context,
    model: Optional[str] = typer.Option(
        None, "--model", "-m",
        help="Offline: a model path, name or `default` (setting models.default). "
             "With --url: the model name sent to the server (default: none, the server's own)."),
    ctx: str = typer.Option("512", "--ctx", help="Prompt lengths in tokens, comma-separated: 512, 4k,16k, 1m."),
    gen: str = typer.Option("128", "--gen", help="Tokens generated per sequence (exact offline: EOS is masked)."),
    batch: int = typer.Option(1, "--batch", help="Offline: sequences run together."),
    repeats: int = typer.Option(3, "--repeats", help="Offline: measured runs per length and variant."),
    warmup: int = typer.Option(1, "--warmup", help="Discarded runs first (serving: requests per level, sent at its concurrency)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the synthetic prompts."),
    profile: Optional[str] = typer.Option(None, "--profile", help="Offline: use this profile of --model."),
    sets: List[str] = typer.Option([], "--set", metavar="KEY=VALUE",
                                   help="Offline: a setting for this run (repeatable)."),
    compare: Optional[Tuple[str, str]] = typer.Option(
        None, "--compare", metavar="A B",
        help='Two variants, run interleaved: each a profile name and/or key=value items, '
             'e.g. --compare "prefill.chunk_size=512" "prefill.chunk_size=2048"; "" = as set.'),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="Also run stock mlx-lm: `mlx-lm`."),
    against: Optional[Path] = typer.Option(
        None, "--against", help="Compare with a stored run (a --format json file or --output history)."),
    fail_below: Optional[float] = typer.Option(
        None, "--fail-below", metavar="RATIO", help="Exit 1 if prefill tok/s B/A is below RATIO at any --ctx."),
    fmt: str = typer.Option("table", "--format", help="table, json, csv or md."),
    as_json: bool = typer.Option(False, "--json", help="Same as --format json."),
    output: Optional[Path] = typer.Option(None, "--output", help="Append the run as one JSON line to FILE."),
    url: Optional[str] = typer.Option(None, "--url", help="Benchmark an OpenAI-compatible server instead."),
    concurrency: str = typer.Option("1", "--concurrency", help="With --url: concurrent requests, e.g. 1,4,8."),
    requests: Optional[int] = typer.Option(None, "--requests", help="With --url: requests per level (default 2 x concurrency, at least 4)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="With --url: bearer key."),
    endpoint: str = typer.Option("completions", "--endpoint", help="With --url: completions or chat."),
    timeout: float = typer.Option(600.0, "--timeout", help="With --url: seconds per request."),
):
    """Measure prefill, TTFT, decode and memory; compare settings; gate CI on a ratio."""
    from omlx_core.units import parse_count, parse_counts

    fmt = "json" if as_json else fmt
    _check_usage(url, compare, baseline, against, fail_below, fmt, batch, profile, sets)
    settings_globals = globals_of(context)
    lengths = tuple(parse_counts(ctx, "--ctx"))
    generated = parse_count(gen, "--gen")
    if url:
        from omlx_core.bench.serving import Server, ServingWorkload, run_serving

        server = Server(url, model, api_key, endpoint, timeout)
        workload = ServingWorkload(lengths, generated, tuple(parse_counts(concurrency, "--concurrency")),
                                   requests, warmup, seed)
        with _Progress(settings_globals.quiet) as progress:
            document = run_serving(server, workload, progress)
        _emit(document, fmt, output)
        failed = [r for r in document["results"] if r["completed"] == 0]
        if failed:
            from omlx_core.errors import OmlxError

            r = failed[0]
            errors = ", ".join(f"{k}: {v}" for k, v in r["errors"].items())
            raise OmlxError(f"{url}: no request succeeded at concurrency {r['concurrency']}, "
                            f"ctx {r['ctx']} ({errors}); is the server up and the model right?")
        return

    from omlx_core.bench.offline import run_offline
    from omlx_core.bench.workload import Workload
    from omlx_core.errors import OmlxError
    from omlx_core.models.resolve import resolve
    from omlx_core.settings import load_settings

    home = settings_globals.home
    workload = Workload(lengths, generated, batch, repeats, warmup, seed)
    baseline_document = None
    if against is not None:
        from omlx_core.bench import schema

        baseline_document = schema.load(against)
    ref = resolve(model or load_settings(home)["models.default"], home)
    variants, base_settings = _variants(home, ref.key, profile, sets, compare, baseline)
    with _Progress(settings_globals.quiet) as progress:
        document = run_offline(ref, workload, variants, base_settings, progress)
    if baseline_document is not None:
        from omlx_core.bench.compare import compare_against

        document["comparisons"], warnings = compare_against(document, baseline_document, str(against))
        for warning in warnings:
            note(context, f"omlx: warning: {warning}")
    if fail_below is not None:
        from omlx_core.bench.compare import gate

        document["gate"] = gate(document["comparisons"], fail_below)
    _emit(document, fmt, output)
    if document["gate"] is not None and not document["gate"]["passed"]:
        g = document["gate"]
        found = "no ratio could be measured" if g["worst_ratio"] is None else \
            f"{g['worst_ratio']:.3f} at ctx {g['worst_ctx']}"
        raise OmlxError(f"bench gate failed: {g['metric']} B/A {found} is below "
                        f"--fail-below {g['fail_below']}")
