"""`omlx clone-fp16`: an fp16 copy of a checkpoint for CPU sharing, verified before it lands."""

from pathlib import Path

import typer

from omlx_cli.context import globals_of, print_json

TERMINATED_EXIT = 128 + 15  # what a shell reports for SIGTERM


def _progress_bar(enabled: bool):
    """A rich bytes bar on stderr, as a (callback, stop) pair; a no-op when disabled."""
    if not enabled:
        return None, lambda: None
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                               TimeRemainingColumn, TransferSpeedColumn)

    bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                   TransferSpeedColumn(), TimeRemainingColumn(),
                   console=Console(stderr=True), transient=True)
    task = bar.add_task("converting", total=None)
    bar.start()

    def update(stage: str, done: int, total: int) -> None:
        if stage == "convert":
            bar.update(task, completed=done, total=total)
        elif done == 0:
            bar.update(task, description=f"verifying ({total} greedy tokens)")

    return update, bar.stop


def _summary(report) -> str:
    from omlx_core.units import format_bytes

    lines = [
        f"cloned {report.source} -> {report.destination} in {report.elapsed_s:.1f}s: "
        f"{report.tensors_converted} tensors converted to fp16, {report.tensors_copied} copied, "
        f"{report.files_copied} other files, {format_bytes(report.bytes_written)} in "
        f"{report.shards} shard(s)"
    ]
    if report.clamped:
        lines.append(f"clamped {report.clamped} values to ±65504 in "
                     f"{', '.join(report.out_of_range)}")
    underflowed = sum(report.underflowed.values())
    if underflowed:
        lines.append(f"{underflowed} tiny non-zero values became 0 in "
                     f"{len(report.underflowed)} tensors")
    check = report.verification
    if check is None:
        lines.append("verification skipped (--no-verify)")
    elif check["status"] == "unavailable":
        lines.append(f"warning: verification unavailable: {check['reason']}")
    else:
        lines.append(f"verification {check['status']}: greedy tokens match for "
                     f"{check['tokens_matched']}/{check['steps']} steps, max |logit diff| "
                     f"{check['max_abs_logit_diff']:.4g}")
    return "\n".join(lines)


def clone_fp16(
    ctx: typer.Context,
    src: str = typer.Argument(..., help="A checkpoint path, a name under $OMLX_HOME/models, or `default`."),
    dst: Path = typer.Argument(..., help="Directory to create for the clone."),
    force: bool = typer.Option(False, "--force", help="Replace DST, once the new clone fully succeeded."),
    clamp: bool = typer.Option(False, "--clamp", help="Saturate values beyond ±65504 instead of refusing."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Load the clone and compare greedy output with SRC."),
    verify_tokens: int = typer.Option(32, "--verify-tokens", metavar="N", help="Greedy steps to compare."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON report."),
):
    """Write an FP16 clone of SRC to DST: floats become fp16, packed weights stay as they are."""
    from omlx_core.models.clone_fp16 import Terminated, clone_fp16 as clone
    from omlx_core.models.resolve import resolve

    if verify_tokens < 1:
        raise typer.BadParameter(f"{verify_tokens}; give at least 1", param_hint="--verify-tokens")
    model = resolve(src, globals_of(ctx).home)
    update, stop = _progress_bar(not globals_of(ctx).quiet)
    try:
        report = clone(model, dst, force=force, clamp=clamp, verify=verify,
                       verify_tokens=verify_tokens, progress=update)
    except Terminated:
        stop()
        typer.echo(f"omlx: clone-fp16 terminated; {dst} was not written", err=True)
        raise typer.Exit(TERMINATED_EXIT)
    finally:
        stop()
    if as_json:
        print_json(report.to_dict())
    elif not globals_of(ctx).quiet:
        typer.echo(_summary(report))
