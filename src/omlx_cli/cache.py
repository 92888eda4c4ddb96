"""`omlx cache`: see and clear the prompt cache's SSD tier under $OMLX_HOME/cache."""

from typing import Optional

import typer

from omlx_cli.context import globals_of, note, print_json

app = typer.Typer(help="See and clear the prompt cache kept on SSD.", no_args_is_help=True)
JSON = typer.Option(False, "--json", help="Print one JSON document.")
MODEL = typer.Option(None, "--model", "-m", help="Only this model's cache (a name, path or `default`).")


def _identity(ctx: typer.Context, model: str | None) -> str | None:
    if model is None:
        return None
    from omlx_core.models.resolve import resolve
    from omlx_core.prompt_cache.identity import model_cache_identity

    return model_cache_identity(resolve(model, globals_of(ctx).home))


@app.command()
def show(ctx: typer.Context, model: Optional[str] = MODEL, as_json: bool = JSON):
    """Each model's cache on SSD: files and bytes."""
    from omlx_core.prompt_cache.identity import list_caches

    identity = _identity(ctx, model)
    caches = [c for c in list_caches(globals_of(ctx).home) if identity in (None, c["identity"])]
    if as_json:
        print_json({"caches": caches})
        return
    from rich.console import Console
    from rich.table import Table

    from omlx_core.units import format_bytes

    table = Table("cache identity", "files", "size", "directory")
    for cache in caches:
        table.add_row(cache["identity"], str(cache["files"]), format_bytes(cache["bytes"]),
                      cache["directory"])
    Console().print(table if caches else "no prompt cache on disk")


@app.command()
def clear(ctx: typer.Context, model: Optional[str] = MODEL, as_json: bool = JSON):
    """Delete cached blocks on SSD, for one model or all; a running server recomputes them."""
    from omlx_core.prompt_cache.identity import clear_caches
    from omlx_core.units import format_bytes

    removed = clear_caches(globals_of(ctx).home, _identity(ctx, model))
    if as_json:
        print_json({"removed": removed, "bytes": sum(c["bytes"] for c in removed)})
        return
    note(ctx, f"removed {len(removed)} cache(s), {sum(c['files'] for c in removed)} files, "
              f"{format_bytes(sum(c['bytes'] for c in removed))}")
