"""Shared fixtures: a fresh $OMLX_HOME per test and a way to run the real `omlx` command."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


TINY = "tiny-llama"  # the model of `tiny_home`


@pytest.fixture
def home(tmp_path: Path) -> Path:
    path = tmp_path / "omlx-home"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def tiny_home(tmp_path_factory) -> Path:
    """An $OMLX_HOME, shared by a test module, with a tiny llama (built in-process) as `TINY`."""
    from omlx_core.models.testing import build_tiny_model

    path = tmp_path_factory.mktemp("tiny-home")
    build_tiny_model("llama", path / "models" / TINY)
    return path


def omlx_env(home: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMLX_")}
    env["OMLX_HOME"] = str(home)
    env.update(extra)
    return env


def run_omlx(home: Path, *args: str, env: dict | None = None, check: bool = False,
             timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `omlx ARGS` in a subprocess, as a user or a script would."""
    result = subprocess.run(
        [sys.executable, "-m", "omlx_cli", *args],
        capture_output=True, text=True, env=env or omlx_env(home), timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"omlx {' '.join(args)} exited {result.returncode}: {result.stderr}")
    return result


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RunningServer:
    """A real `omlx serve` subprocess on a free loopback port."""

    def __init__(self, home: Path, args: tuple[str, ...], env: dict | None, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w+")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "omlx_cli", "serve", "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env or omlx_env(home))

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-4000:]

    def wait_ready(self, timeout: float = 180) -> None:
        import time

        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"omlx serve exited {self.process.returncode}: {self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"omlx serve not ready after {timeout} s: {self.log()}")

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


@pytest.fixture(scope="module")
def start_server(tmp_path_factory):
    """start_server(home, *serve_args, env=None) -> a ready RunningServer, stopped after the module."""
    started = []

    def start(home: Path, *args: str, env: dict | None = None, ready: bool = True) -> RunningServer:
        log = tmp_path_factory.mktemp("serve-log") / "server.log"
        server = RunningServer(home, args, env, log)
        started.append(server)
        if ready:
            server.wait_ready()
        return server

    yield start
    for server in started:
        server.stop()
