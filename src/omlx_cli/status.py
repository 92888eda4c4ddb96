"""`omlx status`: what omlx sees on this machine."""

import typer

from omlx_cli.context import globals_of, print_json


def status(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
):
    """Versions, device, memory, settings files, models and prefill lanes."""
    from omlx_core.status import offline_status

    report = offline_status(globals_of(ctx).home)
    if as_json:
        print_json(report)
        return
    _render(report)


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
