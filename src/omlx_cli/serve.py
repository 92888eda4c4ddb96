"""`omlx serve`: the OpenAI-compatible server with continuous batching."""

import sys
from typing import List, Optional

import typer

from omlx_cli.context import globals_of


def serve(
    ctx: typer.Context,
    model: List[str] = typer.Option(
        [], "--model", "-m",
        help="A model to load at start and keep loaded (repeatable; first = default). "
             "Default: setting models.default. Others load on first request."),
    host: Optional[str] = typer.Option(None, "--host", help="Listen address (setting server.host)."),
    port: Optional[int] = typer.Option(None, "--port", help="TCP port (setting server.port)."),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", help="Bearer key clients must send (env OMLX_SERVER_API_KEY, setting server.api_key)."),
    max_concurrency: Optional[int] = typer.Option(
        None, "--max-concurrency", help="Requests generated together (setting server.max_concurrency)."),
    max_queue: Optional[int] = typer.Option(
        None, "--max-queue", help="Requests waiting beyond those before 503 (setting server.max_queue)."),
    distributed: bool = typer.Option(
        False, "--distributed", help="Experimental: shard the model over the enrolled workers "
                                     "(needs cluster.enabled; verifies them first)."),
):
    """Serve models over an OpenAI-compatible HTTP API (chat, completions, models)."""
    from omlx_core.serve.server import Server, server_options

    flags = {"server.host": host, "server.port": port, "server.api_key": api_key,
             "server.max_concurrency": max_concurrency, "server.max_queue": max_queue}
    cli = {key: value for key, value in flags.items() if value is not None}
    home = globals_of(ctx).home
    options, settings = server_options(home, model, cli)
    if distributed:
        from omlx_core.cluster.distributed import serve_distributed
        from omlx_core.models.resolve import resolve

        ref = resolve(options.models[0], home)
        raise typer.Exit(serve_distributed(home, settings, ref.path, options.host, options.port, ref.name))
    server = Server(home, options, settings, cli)
    quiet = globals_of(ctx).quiet
    where = f"http://{options.host}:{options.port}"

    def announce(running: Server) -> None:
        if not quiet:
            names = ", ".join(ref.name for ref in running.registry.startup)
            print(f"omlx: serving {names} on {where}/v1 (health {where}/health)", file=sys.stderr)

    def listening(_: Server) -> None:
        if not quiet:
            auth = "key required" if options.api_key else "no key"
            warming = " and warming up its decode batches" if settings["server.warmup"] else ""
            print(f"omlx: listening on {where} ({auth}); loading {', '.join(options.models)}{warming}",
                  file=sys.stderr)

    server.run(on_listening=listening, on_ready=announce)
    if server.engine.load_error is not None:
        from omlx_core.errors import OmlxError

        raise OmlxError(f"could not load {options.models[0]}: {server.engine.load_error}")
