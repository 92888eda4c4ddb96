"""`omlx models`: list, inspect and import models."""

from pathlib import Path
from typing import Optional

import typer

from omlx_cli.context import globals_of, note, print_json

app = typer.Typer(help="List, inspect and import models.", no_args_is_help=True)
JSON = typer.Option(False, "--json", help="Print one JSON document.")


def _describe(ref) -> dict:
    from omlx_core.models.fingerprint import model_summary

    entry = {"name": ref.name, "path": str(ref.path), "settings_key": ref.key, "embedded": ref.embedded}
    if (ref.path / "config.json").is_file():
        entry.update(model_summary(ref.path))
    return entry


@app.command("list")
def list_(ctx: typer.Context, as_json: bool = JSON):
    """Models under $OMLX_HOME/models, and the embedded default."""
    from omlx_core.models.resolve import list_model_names, locate

    home = globals_of(ctx).home
    names = list_model_names(home)
    refs = [locate(name, home) for name in names]
    if not any(ref.embedded for ref in refs):
        refs.insert(0, locate("default", home))
    entries = [_describe(ref) for ref in refs]
    if as_json:
        print_json({"models": entries})
        return
    from rich.console import Console
    from rich.table import Table

    from omlx_core.units import format_bytes

    table = Table("name", "type", "quantization", "size", "path")
    for e in entries:
        quant = e.get("quantization")
        quant_text = f"{quant.get('bits')}-bit g{quant.get('group_size')}" if quant else "none"
        if "model_type" not in e:
            table.add_row(e["name"] + " (default)", "-", "-", "-", "imported on first use")
            continue
        table.add_row(e["name"] + (" (default)" if e["embedded"] else ""), e["model_type"],
                      quant_text, format_bytes(e["size_bytes"]), e["path"])
    Console().print(table)


@app.command()
def info(ctx: typer.Context, model: str, as_json: bool = JSON):
    """Architecture, size, quantization and fingerprint of one model."""
    from omlx_core.models.resolve import resolve

    entry = _describe(resolve(model, globals_of(ctx).home))
    if as_json:
        print_json(entry)
        return
    for key, value in entry.items():
        typer.echo(f"{key:16} {value}")


@app.command("import-gguf")
def import_gguf(
    ctx: typer.Context,
    file: Path = typer.Argument(..., help="A GGUF file (llama, qwen2, qwen3)."),
    name: Optional[str] = typer.Option(None, "--name", help="Name under $OMLX_HOME/models (default: file stem)."),
    as_json: bool = JSON,
):
    """Convert a GGUF file into an MLX checkpoint under $OMLX_HOME/models."""
    from omlx_core.errors import InputError
    from omlx_core.home import models_dir
    from omlx_core.models.gguf import import_gguf as convert

    home = globals_of(ctx).home
    name = name or file.name.removesuffix(".gguf")
    dest = models_dir(home) / name
    if dest.exists():
        raise InputError(f"{dest} already exists; choose another --name or remove it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    convert(file, dest)
    if as_json:
        print_json({"name": name, "path": str(dest)})
    else:
        note(ctx, f"imported {file} as {name!r} ({dest})")
