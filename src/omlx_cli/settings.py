"""`omlx settings`: read and change settings, globally or for one model's profiles."""

import json
import shutil
from datetime import datetime, timezone
from typing import Optional

import typer

from omlx_cli.context import globals_of, note, print_json

app = typer.Typer(help="Show and change settings (global, or per model with --model).",
                  no_args_is_help=True)

MODEL = typer.Option(None, "--model", "-m", help="A model: path, name, or `default`.")
PROFILE = typer.Option(None, "--profile", help="A named profile of --model (default: the active one).")
STAGE = typer.Option(False, "--stage", help="Change --model's working profile; `settings save` activates it.")
JSON = typer.Option(False, "--json", help="Print one JSON document.")


def _model_key(ctx: typer.Context, model: Optional[str]) -> Optional[str]:
    if model is None:
        return None
    from omlx_core.models.resolve import locate

    return locate(model, globals_of(ctx).home).key


def _store(ctx: typer.Context, model: Optional[str]):
    from omlx_core.settings.files import global_store, model_store

    home = globals_of(ctx).home
    key = _model_key(ctx, model)
    return global_store(home) if key is None else model_store(home, key)


@app.command()
def show(
    ctx: typer.Context,
    model: Optional[str] = MODEL,
    effective: bool = typer.Option(False, "--effective", help="Every key with its value and source."),
    as_json: bool = JSON,
):
    """What the settings file holds, or with --effective every value and where it came from."""
    from omlx_core.settings import BY_KEY, load_settings

    home = globals_of(ctx).home
    if effective:
        resolved = load_settings(home, _model_key(ctx, model)).resolved
        if as_json:
            print_json({key: {"value": "****" if BY_KEY[key].secret and r.value else r.value,
                              "source": r.source, "where": r.where} for key, r in resolved.items()})
            return
        from rich.console import Console
        from rich.table import Table

        table = Table("key", "value", "source")
        for key, r in resolved.items():
            source = r.source if r.source == "default" else f"{r.source}: {r.where}"
            table.add_row(key, BY_KEY[key].show(r.value), source)
        Console().print(table)
        return
    store = _store(ctx, model)
    document = store.read()
    if as_json:
        print_json({"path": str(store.path), "settings": _masked(document)})
    else:
        typer.echo(f"# {store.path}" + ("" if store.path.exists() else " (not created: all defaults)"))
        typer.echo(json.dumps(_masked(document), indent=2, sort_keys=True))


def _masked(node):
    """A copy with secret values replaced, wherever a section sits (top level or a profile)."""
    from omlx_core.settings import BY_KEY
    from omlx_core.settings.schema import SECTIONS

    if not isinstance(node, dict):
        return node
    out = {}
    for name, value in node.items():
        if name in SECTIONS and isinstance(value, dict):
            out[name] = {k: "****" if v and getattr(BY_KEY.get(f"{name}.{k}"), "secret", False) else v
                         for k, v in value.items()}
        else:
            out[name] = _masked(value)
    return out


@app.command()
def get(ctx: typer.Context, key: str, model: Optional[str] = MODEL, as_json: bool = JSON):
    """The effective value of one key (CLI > env > file > default)."""
    from omlx_core.settings import load_settings, lookup

    setting = lookup(key)
    resolved = load_settings(globals_of(ctx).home, _model_key(ctx, model)).resolved[setting.key]
    if as_json:
        print_json({"key": setting.key, "value": resolved.value, "source": resolved.source,
                    "where": resolved.where})
    else:
        value = resolved.value
        typer.echo("" if value is None else str(value) if setting.secret else setting.show(value))


@app.command("set")
def set_(ctx: typer.Context, key: str, value: str, model: Optional[str] = MODEL,
         profile: Optional[str] = PROFILE, stage: bool = STAGE):
    """Store one value, parsed and validated by its type."""
    from omlx_core.settings import lookup, set_setting

    typed = set_setting(globals_of(ctx).home, key, value, model_key=_model_key(ctx, model),
                        profile=profile, stage=stage)
    note(ctx, f"{lookup(key).key} = {lookup(key).show(typed)}  ({_store(ctx, model).path})")


@app.command()
def unset(ctx: typer.Context, key: str, model: Optional[str] = MODEL,
          profile: Optional[str] = PROFILE, stage: bool = STAGE):
    """Remove one key from the file, so the next layer (default) applies."""
    from omlx_core.settings import unset_setting

    unset_setting(globals_of(ctx).home, key, model_key=_model_key(ctx, model),
                  profile=profile, stage=stage)
    note(ctx, f"unset {key}  ({_store(ctx, model).path})")


@app.command()
def reset(ctx: typer.Context, model: Optional[str] = MODEL):
    """Back to defaults; the previous file is kept beside it as `.reset-<timestamp>`."""
    from omlx_core.settings import reset_settings

    store = _store(ctx, model)
    backup = None
    if store.path.exists():
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        backup = store.path.with_name(f"{store.path.name}.reset-{stamp}")
        shutil.copy2(store.path, backup)
    reset_settings(globals_of(ctx).home, model_key=_model_key(ctx, model))
    note(ctx, f"reset {store.path}" + (f" (previous copy: {backup})" if backup else ""))


@app.command()
def path(ctx: typer.Context, model: Optional[str] = MODEL, as_json: bool = JSON):
    """Where the settings file lives."""
    store = _store(ctx, model)
    if as_json:
        print_json({"path": str(store.path), "exists": store.path.exists()})
    else:
        typer.echo(str(store.path))


@app.command()
def validate(ctx: typer.Context, model: Optional[str] = MODEL, as_json: bool = JSON):
    """Check settings files and OMLX_* variables without changing anything; exit 2 if invalid."""
    import os

    from omlx_core.errors import InputError
    from omlx_core.settings import SETTINGS
    from omlx_core.status import settings_files

    home = globals_of(ctx).home
    files = settings_files(home)
    if model is not None:
        wanted = str(_store(ctx, model).path)
        files = [f for f in files if f["path"] == wanted] or [{"path": wanted, "exists": False,
                                                              "valid": True, "problem": None}]
    problems = [f"{f['path']}: {f['problem']}" for f in files if not f["valid"]]
    for setting in SETTINGS:
        if setting.env_name in os.environ:
            try:
                setting.parse(os.environ[setting.env_name])
            except InputError as error:
                problems.append(f"{setting.env_name}: {error}")
    if as_json:
        print_json({"valid": not problems, "files": files, "problems": problems})
    else:
        for f in files:
            typer.echo(f"{f['path']}: " + ("valid" if f["valid"] else f"INVALID: {f['problem']}")
                       + ("" if f["exists"] else " (not created)"))
        for problem in problems:
            if problem.startswith("OMLX_"):
                typer.echo(problem)
    if problems:
        raise typer.Exit(2)


@app.command()
def save(ctx: typer.Context, model: str = typer.Option(..., "--model", "-m", help="The model."),
         profile: Optional[str] = typer.Option(None, "--profile", help="Save under this name.")):
    """Make --model's staged working profile a saved profile and activate it."""
    from omlx_core.settings import save_working

    name = save_working(globals_of(ctx).home, _model_key(ctx, model), profile)
    note(ctx, f"saved the working profile as {name!r} and made it active")


@app.command()
def discard(ctx: typer.Context, model: str = typer.Option(..., "--model", "-m", help="The model.")):
    """Drop --model's staged working profile; the active profile is untouched."""
    from omlx_core.settings import discard_working

    discard_working(globals_of(ctx).home, _model_key(ctx, model))
    note(ctx, "discarded the working profile")


@app.command()
def use(ctx: typer.Context, profile: str,
        model: str = typer.Option(..., "--model", "-m", help="The model.")):
    """Activate one of --model's saved profiles."""
    from omlx_core.settings import activate_profile

    activate_profile(globals_of(ctx).home, _model_key(ctx, model), profile)
    note(ctx, f"profile {profile!r} is now active")
