"""`omlx status`: what omlx sees on this machine."""

from typing import Optional

import typer

from omlx_cli.context import globals_of, print_json


def status(
    ctx: typer.Context,
    url: Optional[str] = typer.Option(
        None, "--url", help="Ask only the omlx server at URL (default: server.host/port, when one answers)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="With --url: bearer key (default: server.api_key)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
):
    """This machine (versions, device, memory, settings, models, lanes), or a running server."""
    if url is not None:
        from omlx_core.serve.remote import fetch_status
        from omlx_core.settings import load_settings

        key = api_key or load_settings(globals_of(ctx).home)["server.api_key"]
        report = fetch_status(url, key)
        if as_json:
            print_json(report)
        else:
            _render_server(url, report)
        return
    from omlx_core.status import offline_status

    report = offline_status(globals_of(ctx).home)
    if as_json:
        print_json(report)
        return
    _render(report)
    server = report["server"]
    if server["running"]:
        _render_server(server["url"], server["status"])
    else:
        print(f"server    none at {server['url']}" + (f" ({server['error']})" if server["error"] else ""))


def _render_server(url: str, report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from omlx_core.units import format_bytes

    console = Console()
    memory, queue = report["memory"], report["queue"]
    console.print(f"[bold]omlx serve[/] {report['version']} at {url}  ·  {report['state']}  ·  "
                  f"up {report['uptime_s']:.0f} s")
    console.print(f"memory    {format_bytes(memory['committed_bytes'])} committed of "
                  f"{format_bytes(memory['total_bytes'])} (soft {format_bytes(memory['soft_watermark_bytes'])}, "
                  f"hard {format_bytes(memory['hard_watermark_bytes'])}); weights "
                  f"{format_bytes(memory['weights_bytes'])}, KV {format_bytes(memory['kv']['charged_bytes'])}, "
                  f"extras {format_bytes(memory['extras_bytes'])}")
    console.print(f"queue     {queue['running']}/{queue['max_running']} running, "
                  f"{queue['waiting']}/{queue['max_waiting']} waiting; refused: "
                  f"{queue['queue_rejections']} queue full, {queue['memory_rejections']} memory")
    table = Table("model", "weights", "KV live / reserved", "running", "prompt cache", "profile",
                  "lanes", title="loaded models", title_justify="left")
    for model in report["models"]:
        lanes = ", ".join(f"{lane['name']}{'' if lane['configured'] else ' (off)'}"
                          for lane in model["prefill"]["lanes"])
        table.add_row(model["id"], format_bytes(model["weights_bytes"]),
                      f"{format_bytes(model['kv_bytes'])} / {format_bytes(model['kv_estimate_bytes'])}",
                      str(model["running"]), _prompt_cache(model["prompt_cache"]),
                      model["active_profile"] or "-", lanes)
    console.print(table)
    from rich.markup import escape

    for model in report["models"]:  # a lane that built less than asked says which layer, and why
        for lane in model["prefill"]["lanes"]:
            for warning in lane.get("warnings", []):
                console.print(f"[yellow]warning[/]   {model['id']}: {escape(warning)}")


def _prompt_cache(cache: dict) -> str:
    """One cell: hit rates and bytes per tier, or why the cache is off."""
    from omlx_core.units import format_bytes

    if not cache["enabled"]:
        return f"off ({cache['unsupported']})"
    rate = cache["hit_rate"]
    text = f"hits {rate['memory']:.0%} mem / {rate['disk']:.0%} ssd · {format_bytes(cache['memory']['bytes'])} mem"
    if cache["disk"]:
        text += f" / {format_bytes(cache['disk']['bytes'])} ssd"
    writer = cache["writer"]
    if writer and (writer["pending_entries"] or writer["dropped"]):
        text += f" · writing {writer['pending_entries']}, dropped {writer['dropped']}"
    return text


def _render(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from omlx_core.units import format_bytes

    console = Console()
    gpu = f" ({report['gpu']})" if report["gpu"] else ""
    console.print(f"[bold]omlx[/] {report['omlx_version']}  ·  MLX {report['mlx_version']}"
                  f"  ·  mlx-lm {report['mlx_lm_version']}")
    console.print(f"backend   {report['backend']}{gpu}  device {report['device']}")
    hardware = report["hardware"]
    console.print(f"machine   {hardware['os']} {hardware['machine']}, {hardware['cpu']}, "
                  f"{hardware['cpu_count']} CPUs  [dim]{report['hardware_fingerprint']}[/]")
    memory = report["memory"]
    console.print(f"memory    {format_bytes(memory['available_bytes'])} available of "
                  f"{format_bytes(memory['total_bytes'])}")
    blas = report["blas"]
    if blas["loaded"] or "not needed" in blas["reason"]:
        console.print(f"blas      {blas['reason']}")
    else:
        console.print(f"blas      [yellow]{blas['reason']}[/]")
    console.print(f"home      {report['home']}")
    for file in report["settings_files"]:
        state = ("[green]valid[/]" if file["valid"] else f"[red]invalid[/]: {file['problem']}") \
            if file["exists"] else "[dim]not created (defaults)[/]"
        console.print(f"settings  {file['path']}: {state}")
    default = report["default_model"]
    console.print(f"models    {', '.join(report['models']) or 'none'}  [dim](default: {default['name']}, "
                  f"{'imported' if default['imported'] else 'imported on first use'})[/]")
    table = Table("lane", "eligible", "enabled", "reason", title="prefill lanes", title_justify="left")
    for lane in report["lanes"]:
        table.add_row(lane["name"], "yes" if lane["eligible"] else "[yellow]ineligible[/]",
                      "on" if lane["enabled"] else "off", lane["reason"])
    console.print(table)
    from rich.markup import escape

    kernels = Table("kernel", "replaces", "here", "reason", title="kernels", title_justify="left")
    for kernel in report["kernels"]:
        kernels.add_row(kernel["name"], escape(kernel["replaces"]),
                        "[green]active[/]" if kernel["active"] else "off", escape(kernel["reason"]))
    if report["kernels"]:
        console.print(kernels)
    cluster = report["cluster"]
    console.print(f"cluster: {'on' if cluster['enabled'] else 'off'} ({cluster['reason']}); "
                  f"workers: {', '.join(cluster['workers']) or 'none'}")
    fast = report["fast_paths"]
    console.print("fast paths  " + ", ".join(
        f"{name.replace('_', '-')} {'on' if path['enabled'] else 'off'} "
        + (f"(<= {path['max_scores']} scores)" if "max_scores" in path else f"(>= {path['min_tokens']} tokens)")
        for name, path in fast.items()))
