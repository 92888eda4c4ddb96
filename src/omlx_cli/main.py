"""The `omlx` command: global options, subcommand registry and the error contract.

Exit codes: 0 ok; 1 the work failed; 2 bad usage or bad input. Errors are one line on
stderr; a traceback only with `--debug`. Heavy imports live inside the commands.
"""

import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from omlx_cli import bench, cache, clone, cluster, models, serve, settings, status, tune
from omlx_cli.context import Globals

app = typer.Typer(
    name="omlx",
    help="Run large language models with MLX, fast and safely, on the machine you have.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("serve")(serve.serve)
app.command("status")(status.status)
app.command("clone-fp16")(clone.clone_fp16)
app.command("bench")(bench.bench)
app.command("tune")(tune.tune)
app.add_typer(settings.app, name="settings")
app.add_typer(models.app, name="models")
app.add_typer(cache.app, name="cache")
app.add_typer(cluster.app, name="cluster")

_debug = False


@app.callback()
def main(
    ctx: typer.Context,
    home: Optional[Path] = typer.Option(None, "--home", help="State directory (env OMLX_HOME; default ~/.omlx)."),
    log_level: Optional[str] = typer.Option(None, "--log-level", help="debug, info, warning or error."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Only errors on stderr."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
):
    global _debug
    _debug = debug
    from omlx_core.home import resolve_home

    if log_level is not None and log_level.lower() not in ("debug", "info", "warning", "error"):
        raise typer.BadParameter(f"{log_level!r}; use debug, info, warning or error", param_hint="--log-level")
    level = "error" if quiet else (log_level or ("debug" if debug else "warning"))
    logging.basicConfig(level=level.upper(), format="omlx: %(levelname)s: %(message)s", stream=sys.stderr)
    ctx.obj = Globals(home=resolve_home(home), quiet=quiet)


def run() -> None:
    """Console entry point: typer reports usage errors (exit 2); we report the rest."""
    from omlx_core.errors import OmlxError

    try:
        app(prog_name="omlx")
    except OmlxError as error:
        if _debug:
            raise
        print(f"omlx: error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    except KeyboardInterrupt:
        print("omlx: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as error:  # noqa: BLE001 - the last line of defence keeps the contract
        if _debug:
            raise
        print(f"omlx: error: {type(error).__name__}: {error} (run with --debug for the traceback)",
              file=sys.stderr)
        sys.exit(1)
