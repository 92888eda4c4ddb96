"""A whole server: settings → guard → registry → scheduler → engine → HTTP app, and its status.

`Server` is what the CLI runs and what the tests start on a loopback port. It owns the
objects, not the logic: each lives in its own module with a narrow interface.
"""

import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import psutil

from omlx_core import __version__
from omlx_core.errors import OmlxError
from omlx_core.memory.guard import MemoryGuard
from omlx_core.prefill.lanes import lane_statuses
from omlx_core.serve.engine import Engine
from omlx_core.serve.metrics import ServerMetrics
from omlx_core.serve.registry import ModelRegistry
from omlx_core.serve.scheduler import Scheduler
from omlx_core.settings import load_settings

@dataclass(frozen=True)
class ServerOptions:
    models: tuple[str, ...]  # loaded at start and pinned; the first is the default
    host: str
    port: int
    api_key: str | None
    max_concurrency: int
    max_queue: int


def server_options(home: Path, models: list[str], cli: dict) -> tuple[ServerOptions, object]:
    """Options from flags > OMLX_* > settings.json > defaults, and the effective settings."""
    settings = load_settings(home, cli=cli)
    pinned = [m for m in settings["models.pinned"] if m not in models]
    return ServerOptions(
        models=tuple(models or [settings["models.default"]]) + tuple(pinned),
        host=settings["server.host"], port=settings["server.port"],
        api_key=settings["server.api_key"] or None,
        max_concurrency=settings["server.max_concurrency"], max_queue=settings["server.max_queue"],
    ), settings


class Server:
    def __init__(self, home: Path, options: ServerOptions, settings, cli: dict | None = None,
                 guard: MemoryGuard | None = None):
        self.home = home
        self.options = options
        self.settings = settings
        self.api_key = options.api_key
        self.started_at = time.time()
        self.guard = guard or MemoryGuard(soft_watermark=settings["memory.soft_watermark"],
                                          hard_watermark=settings["memory.hard_watermark"])
        self.metrics = ServerMetrics()
        self.registry = ModelRegistry(home, list(options.models), self.guard, cli)
        self.scheduler = Scheduler(self.guard, options.max_concurrency, options.max_queue)
        self.engine = Engine(self.registry, self.scheduler, self.guard, self.metrics)
        self.registry.busy = self.engine.busy_models
        self.metrics.watch_prompt_caches(lambda: self.registry.loaded)
        self.uvicorn = None

    def app(self):
        from omlx_core.serve.app import create_app

        return create_app(self)

    def status(self) -> dict:
        memory = self.guard.snapshot()
        memory["process_rss_bytes"] = psutil.Process(os.getpid()).memory_info().rss
        memory["mlx_active_bytes"] = mx.get_active_memory()
        memory["mlx_peak_bytes"] = mx.get_peak_memory()
        queue = self.scheduler.counts()
        queue["memory_rejections"] = int(sum(
            sample.value for metric in self.metrics.memory_rejections.collect()
            for sample in metric.samples if sample.name.endswith("_total")))
        live = memory["kv"]["requests"]
        models = []
        for model in list(self.registry.loaded.values()):
            mine = [r for r in live.values() if r["model"] == model.id]
            models.append({
                "id": model.id, "path": str(model.ref.path), "fingerprint": model.fingerprint,
                "pinned": model.pinned, "context_length": model.context_length,
                "weights_bytes": model.weights_bytes,
                "kv_bytes": sum(r["live_bytes"] for r in mine),
                "kv_estimate_bytes": sum(r["reserved_bytes"] for r in mine),
                "kv_profile": model.kv.to_dict(),
                "running": self.engine.active_count(model.id),
                "prompt_cache": model.prompt_cache.stats(),
                "active_profile": model.settings.profile,
                "prefill": _prefill(model),
                "kernels": model.kernels.as_dict()["kernels"],
                "dense_copy": model.dense_copy.as_dict() if model.dense_copy else None,
            })
        return {
            "version": __version__, "uptime_s": round(time.time() - self.started_at, 3),
            "started_at": self.started_at,
            "state": "error" if self.engine.load_error else ("ready" if self.engine.ready.is_set() else "loading"),
            "memory": memory, "queue": queue, "models": models,
            "available_models": self.registry.available(),
        }

    def run(self, on_listening=None, on_ready=None) -> None:
        """Serve until stopped (Ctrl-C, `stop()`): bind, then load models while answering /health."""
        import uvicorn

        config = uvicorn.Config(self.app(), host=self.options.host, port=self.options.port,
                                log_level="warning", access_log=False, timeout_graceful_shutdown=5)
        self.uvicorn = uvicorn.Server(config)
        listener = _listen(self.options.host, self.options.port)
        if on_listening is not None:
            on_listening(self)
        self.engine.start()
        threading.Thread(target=self._watch_load, args=(on_ready,), daemon=True).start()
        try:
            self.uvicorn.run(sockets=[listener])
        finally:
            self.engine.stop()
            listener.close()

    def stop(self) -> None:
        if self.uvicorn is not None:
            self.uvicorn.should_exit = True

    def _watch_load(self, on_ready) -> None:
        """Stop serving if a startup model cannot load; report readiness otherwise."""
        self.engine.ready.wait()
        if self.engine.load_error is not None:
            self.stop()
        elif on_ready is not None:
            on_ready(self)


def _listen(host: str, port: int) -> socket.socket:
    """Bind before loading anything, so a taken port is a one-line error, not a late crash."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as error:
        listener.close()
        raise OmlxError(f"cannot listen on {host}:{port}: {error.strerror}; "
                        "pick another --port or stop what uses it") from error
    listener.listen(2048)
    return listener


def _prefill(model) -> dict:
    """The model's prefill setup: each lane's state (eligible from this machine) and the build."""
    eligible = {lane.name: lane.eligible for lane in lane_statuses(model.settings)}
    report = model.lanes.as_dict()
    for lane in report["lanes"]:
        lane["eligible"] = eligible[lane["name"]]
    return {"chunk_size": model.settings["prefill.chunk_size"], **report}
