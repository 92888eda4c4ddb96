"""What the global options decide, handed to every subcommand through typer's context."""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import typer


@dataclass(frozen=True)
class Globals:
    home: Path
    quiet: bool = False


def globals_of(ctx: typer.Context) -> Globals:
    return ctx.find_root().obj


def print_json(document) -> None:
    """One JSON document on stdout, nothing else."""
    sys.stdout.write(json.dumps(document, indent=2, default=str) + "\n")


def note(ctx: typer.Context, message: str) -> None:
    """A human message on stderr, unless --quiet."""
    if not globals_of(ctx).quiet:
        typer.echo(message, err=True)
