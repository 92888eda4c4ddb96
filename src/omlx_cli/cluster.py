"""`omlx cluster`: enroll workers over SSH, verify them, rotate the controller key.

Distributed inference is experimental and off by default (`cluster.enabled`); enrolling
and verifying work regardless, so a cluster can be prepared and checked before use.
"""

import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from omlx_cli.context import globals_of, note, print_json

app = typer.Typer(help="Enroll, verify and manage distributed workers (experimental).", no_args_is_help=True)
JSON = typer.Option(False, "--json", help="Print one JSON document.")


def _settings(ctx: typer.Context, cli: dict | None = None):
    from omlx_core.settings import load_settings

    return load_settings(globals_of(ctx).home, cli=cli)


def _duration(text: str) -> float:
    from omlx_core.errors import InputError

    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    raw = text.strip().lower()
    try:
        return float(raw[:-1]) * units[raw[-1]] if raw and raw[-1] in units else float(raw)
    except (ValueError, KeyError):
        raise InputError(f"--ttl {text!r}: use a duration such as 90s, 10m or 1h") from None


def _age(at: float | None) -> str:
    if not at:
        return "never"
    seconds = max(0, time.time() - at)
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago" if seconds < 7200 \
        else f"{seconds / 3600:.0f}h ago"


@app.command()
def invite(ctx: typer.Context, ttl: str = typer.Option("10m", "--ttl", help="How long the code stays valid."),
           as_json: bool = JSON):
    """Print a one-time join code for a worker (shown once; stored only as a salted hash)."""
    from omlx_core.cluster.controller import invite as make_invite

    result = make_invite(globals_of(ctx).home, _settings(ctx), _duration(ttl))
    if as_json:
        print_json(result)
        return
    expires = time.strftime("%H:%M:%S", time.localtime(result["expires_at"]))
    print(result["code"])
    note(ctx, f"omlx: single-use join code, valid until {expires}. On the worker run:\n"
              f"  omlx cluster join {result['controller_url']} --code {result['code']}\n"
              f"(`omlx serve` must be running here to answer it; controller key {result['controller_key']})"
              + (f"\nomlx: note: {result['note']}" if result["note"] else ""))


@app.command()
def join(ctx: typer.Context, controller: str = typer.Argument(..., help="The controller's URL (http://host:port)."),
         code: str = typer.Option(..., "--code", help="The code `omlx cluster invite` printed."),
         name: Optional[str] = typer.Option(None, "--name", help="This worker's name (default: hostname)."),
         backend: str = typer.Option("auto", "--backend", help="auto, ring or nccl."),
         as_json: bool = JSON):
    """Enroll this machine as a worker: claim the code, install the controller's key, register."""
    from omlx_core.cluster.join import join as do_join
    from omlx_core.errors import InputError, OmlxError

    if backend not in ("auto", "ring", "nccl"):
        raise InputError(f"--backend {backend!r}: use auto, ring or nccl")
    result = do_join(globals_of(ctx).home, _settings(ctx), controller, code, name, backend)
    if as_json:
        print_json(result)
    else:
        note(ctx, f"omlx: joined {result['controller']} as {result['name']!r} ({result['target']}, {result['backend']}); "
                  f"controller key installed in {result['authorized_keys']} for logins from "
                  f"{result['controller_address']}")
    if not result["login"]["ok"]:
        raise OmlxError(f"enrolled, but the controller could not log in: {result['login']['detail']}")
    if not as_json:
        note(ctx, f"omlx: {result['login']['detail']}")


@app.command("list")
def list_workers(ctx: typer.Context, as_json: bool = JSON):
    """Enrolled workers and their last verification (shown, never trusted for activation)."""
    from dataclasses import asdict

    from omlx_core.cluster import inventory

    workers = inventory.workers(globals_of(ctx).home)
    if as_json:
        print_json({"workers": [asdict(w) for w in workers]})
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "ssh", "backend", "omlx / MLX", "last verify")
    for w in workers:
        last = w.last_verify or {}
        verdict = ("ok" if last.get("ok") else f"failed: {last.get('detail', '')}") if last else "-"
        table.add_row(w.name, w.target, w.backend, f"{w.omlx_version} / {w.mlx_version}",
                      f"{verdict} ({_age(last.get('at'))})")
    Console().print(table)


@app.command()
def status(ctx: typer.Context, as_json: bool = JSON):
    """The controller: whether distributed serving is on, its key, open invites, workers."""
    from dataclasses import asdict

    from omlx_core.cluster import inventory, invites
    from omlx_core.cluster.keys import controller_pair

    home = globals_of(ctx).home
    settings = _settings(ctx)
    key = controller_pair(home, create=False)
    document = {"enabled": settings["cluster.enabled"], "controller_id": inventory.controller_id(home),
                "controller_key": key.fingerprint() if key else None, "open_invites": invites.pending(home),
                "workers": [asdict(w) for w in inventory.workers(home)]}
    if as_json:
        print_json(document)
        return
    state = "on" if document["enabled"] else "off (set cluster.enabled = true to serve --distributed)"
    print(f"distributed serving: {state}")
    print(f"controller key:      {document['controller_key'] or 'none yet (made by the first invite)'}")
    print(f"open invites:        {len(document['open_invites'])}")
    print(f"workers:             {len(document['workers'])}"
          + (" (last verify is informational; serve --distributed verifies again)" if document["workers"] else ""))
    for w in document["workers"]:
        last = w["last_verify"] or {}
        print(f"  {w['name']:<16} {w['ssh_user']}@{w['ssh_host']}:{w['ssh_port']}  "
              f"{'ok' if last.get('ok') else 'not ok' if last else 'unverified'} ({_age(last.get('at'))})")


@app.command()
def remove(ctx: typer.Context, name: str = typer.Argument(...), as_json: bool = JSON):
    """Forget a worker, and remove the controller's key from it when it can still be reached."""
    from omlx_core.cluster import inventory, ssh
    from omlx_core.cluster.keys import controller_pair
    from omlx_core.errors import OmlxError

    home = globals_of(ctx).home
    worker = inventory.get(home, name)
    revoked, why = False, ""
    key = controller_pair(home, create=False)
    if key is not None:
        try:
            ssh.run(home, worker, key, ssh.remote_omlx(worker, "cluster", "authorize", "--revoke", "--controller-id",
                                                       inventory.controller_id(home)),
                    float(_settings(ctx)["cluster.verify_timeout_s"]))
            revoked = True
        except OmlxError as error:
            why = str(error)
    inventory.remove(home, name)
    if as_json:
        print_json({"removed": name, "key_revoked": revoked, "detail": why})
    else:
        note(ctx, f"omlx: removed {name}" + ("; its authorized_keys no longer trusts this controller" if revoked
                                            else f"; could not revoke the key on it ({why}): remove the "
                                                 "omlx-controller line from its authorized_keys by hand"))


@app.command()
def verify(ctx: typer.Context, names: List[str] = typer.Argument(None, help="Workers to check (default: all)."),
           as_json: bool = JSON):
    """Check SSH reachability, versions and a collective all-sum, each within cluster.verify_timeout_s."""
    from omlx_core.cluster.verify import verify as run_verify
    from omlx_core.errors import OmlxError

    report = run_verify(globals_of(ctx).home, _settings(ctx), names or None)
    if as_json:
        print_json(report.as_dict())
    else:
        for worker in report.workers:
            for step in worker.steps:
                print(f"{worker.name:<16} {step.name:<10} {'ok ' if step.ok else 'FAIL'} {step.detail} "
                      f"({step.seconds:.1f}s)")
        if report.collective:
            step = report.collective
            print(f"{'group':<16} {step.name:<10} {'ok ' if step.ok else 'FAIL'} {step.detail} ({step.seconds:.1f}s)")
    if not report.ok:
        raise OmlxError(f"cluster verification failed: {report.failure()}")


@app.command("rotate-key")
def rotate_key(ctx: typer.Context, confirm: bool = typer.Option(False, "--confirm", help="Really rotate."),
               as_json: bool = JSON):
    """Replace the controller's SSH key on every worker; a failure leaves the current key working."""
    from omlx_core.cluster.rotate import rotate

    result = rotate(globals_of(ctx).home, _settings(ctx), confirm)
    if as_json:
        print_json(result)
    else:
        note(ctx, f"omlx: controller key rotated to {result['new_key']} on {len(result['workers'])} worker(s)"
                  + ("; not promoted on: " + "; ".join(result["unpromoted"]) if result["unpromoted"] else ""))


@app.command()
def export(ctx: typer.Context, file: Optional[Path] = typer.Argument(None, help="TOML file (default: stdout).")):
    """The inventory as TOML."""
    from omlx_core.cluster.inventory import export_toml
    from omlx_core.settings.store import write_text_atomic

    text = export_toml(globals_of(ctx).home)
    if file is None:
        sys.stdout.write(text)
    else:
        write_text_atomic(file, text)
        note(ctx, f"omlx: wrote {file}")


@app.command(hidden=True)
def probe(as_json: bool = JSON):
    """(Run by the controller over SSH.) This machine's versions and backends."""
    from omlx_core.cluster.probe import probe as read

    print_json(read())


@app.command(hidden=True)
def authorize(ctx: typer.Context, controller_id: str = typer.Option(..., "--controller-id"),
              pending: bool = typer.Option(False, "--pending"), promote: bool = typer.Option(False, "--promote"),
              revoke: bool = typer.Option(False, "--revoke")):
    """(Run by the controller over SSH.) Stage, promote or revoke its key in this worker's authorized_keys."""
    from omlx_core.cluster import authorized_keys
    from omlx_core.cluster.join import joined_ssh_dir
    from omlx_core.errors import InputError

    ssh_dir = joined_ssh_dir(globals_of(ctx).home, controller_id)
    if revoke:
        authorized_keys.revoke(ssh_dir, controller_id, pending)
    elif promote:
        authorized_keys.promote(ssh_dir, controller_id)
    elif pending:
        current = authorized_keys.current_line(ssh_dir, controller_id)
        if current is None:
            raise InputError(f"this worker does not trust controller {controller_id}: join it first")
        authorized_keys.authorize(ssh_dir, sys.stdin.readline(), current["from"], controller_id, pending=True)
    else:
        raise InputError("say --pending (key on stdin), --promote or --revoke")
