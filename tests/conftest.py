"""Shared fixtures: a fresh $OMLX_HOME per test and a way to run the real `omlx` command."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture
def home(tmp_path: Path) -> Path:
    path = tmp_path / "omlx-home"
    path.mkdir()
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
