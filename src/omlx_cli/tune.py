"""`omlx tune MODEL`: find the fastest prefill setup here (and whether a dense copy speeds up
batched decode), verify it, stage it (or --save it)."""

from pathlib import Path
from typing import Optional

import typer

from omlx_cli.context import globals_of, note, print_json


class _LiveTable:
    """A rich table of candidates on stderr, redrawn as each is measured (off with --quiet)."""

    def __init__(self, quiet: bool):
        from rich.console import Console
        from rich.live import Live

        self.quiet = quiet
        self.rows: list = []
        self.status = "starting"
        self.live = Live(self._table(), console=Console(stderr=True), refresh_per_second=4,
                         transient=False) if not quiet else None

    def _table(self):
        from rich.table import Table

        from omlx_core.units import format_bytes

        table = Table("candidate", "prefill tok/s", "per length", "peak memory", "note",
                      title=f"omlx tune · {self.status}", title_justify="left")
        best = max((r.prefill_tps for r in self.rows if r.rejected is None and r.prefill_tps), default=None)
        for r in self.rows:
            mark = "[bold green]" if r.prefill_tps == best and r.rejected is None else ""
            table.add_row(r.label, f"{mark}{r.prefill_tps:,.1f}" if r.prefill_tps else "-",
                          "  ".join(f"{ctx}: {tps:,.0f}" for ctx, tps in r.per_ctx.items()),
                          format_bytes(r.peak_bytes), r.rejected or "")
        return table

    def __enter__(self):
        if self.live:
            self.live.start()
        return self

    def __exit__(self, *exc):
        if self.live:
            self.live.stop()

    def __call__(self, what: str, result) -> None:
        self.status = what
        if result is not None:
            self.rows.append(result)
        if self.live:
            self.live.update(self._table())


def tune(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="A model path, a name under $OMLX_HOME/models, or `default`."),
    lengths: str = typer.Option("4k,16k", "--ctx", help="Calibration prompt lengths, comma-separated."),
    gen: str = typer.Option("8", "--gen", help="Tokens generated after each calibration prompt."),
    repeats: int = typer.Option(3, "--repeats", help="Measured runs per length and candidate (median)."),
    warmup: int = typer.Option(1, "--warmup", help="Discarded runs per length and candidate."),
    budget_s: float = typer.Option(1800.0, "--budget-s", help="Seconds the search may take (verification after)."),
    decode_batch: Optional[int] = typer.Option(
        None, "--decode-batch", help="Sequences decoded together when measuring the dense copy "
        "(compute.dense_copy, quantized models; default server.max_concurrency; 0 skips it)."),
    save: bool = typer.Option(False, "--save", help="Save the staged recommendation as the active profile."),
    profile: Optional[str] = typer.Option(None, "--profile", help="With --save: the profile's name."),
    export: Optional[Path] = typer.Option(None, "--export", help="Also write the report as TOML to FILE."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON document."),
):
    """Measure prefill setups (and a dense copy for batched decode) here, verify, stage the best."""
    from omlx_core.bench.workload import Workload
    from omlx_core.errors import InputError
    from omlx_core.models.resolve import resolve
    from omlx_core.tune.run import export_toml, run_tune, stage
    from omlx_core.units import parse_count, parse_counts

    if profile is not None and not save:
        raise InputError("--profile names the saved profile: use it with --save")
    if decode_batch is not None and decode_batch < 0:
        raise InputError(f"--decode-batch: {decode_batch} must be 0 (skip) or more")
    if budget_s <= 0:
        raise InputError(f"--budget-s: {budget_s:g} must be more than 0 seconds")
    home = globals_of(ctx).home
    workload = Workload(tuple(parse_counts(lengths, "--ctx")), parse_count(gen, "--gen"),
                        1, repeats, warmup)
    ref = resolve(model, home)
    with _LiveTable(globals_of(ctx).quiet) as table:
        document = run_tune(ref, home, workload, budget_s, table, decode_batch=decode_batch)
    document = stage(document, home, ref.key, save, profile)
    if export is not None:
        export_toml(document, export)
    if as_json:
        print_json(document)
        return
    rec = document["recommendation"]
    note(ctx, ("default kept: " if rec["is_default"] else "recommended: ") + rec["label"])
    note(ctx, rec["reason"])
    if rec["decode_reason"]:
        note(ctx, rec["decode_reason"])
    for line in document["notes"]:
        note(ctx, f"note: {line}")
    where = f"saved as profile {document['saved_profile']!r} (active)" if save else \
        f"staged in the working profile; apply it with `omlx settings save --model {model}`"
    note(ctx, where)
