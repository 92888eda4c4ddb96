"""omlx_core loads an optimized BLAS under MLX's CPU matmul (real subprocesses, real libraries)."""

import json
import os
import subprocess
import sys

import pytest

from omlx_core.blas import candidates

PROBE = """
import json, sys
{before}
import omlx_core
import mlx.core as mx
import numpy as np
from omlx_core.blas import blas_state
a, b = mx.random.normal((300, 200)), mx.random.normal((200, 100))
mapped = [line.split()[-1] for line in open("/proc/self/maps") if "libopenblas" in line]
print(json.dumps({**blas_state().as_dict(), "mapped": sorted(set(mapped)),
                  "error": float(np.abs(np.array(a @ b) - np.array(a) @ np.array(b)).max())}))
"""

OPENBLAS = [path for path in candidates() if os.path.exists(path)]


def probe(before: str = "", **env) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE.replace("{before}", before)], capture_output=True, text=True,
                          env={**os.environ, **env}, check=True, timeout=120)
    return json.loads(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MLX links the system BLAS elsewhere")
@pytest.mark.skipif(not OPENBLAS, reason="no OpenBLAS installed (apt install libopenblas0-pthread)")
def test_mlx_matmul_runs_on_openblas_and_gives_numpys_product():
    state = probe(OMLX_BLAS="auto")
    assert state["loaded"] and state["library"] == OPENBLAS[0]
    assert state["library"] in state["mapped"] or any("libopenblas" in m for m in state["mapped"])
    assert state["error"] < 1e-3


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MLX links the system BLAS elsewhere")
def test_off_and_late_imports_keep_the_reference_blas_and_say_so():
    off = probe(OMLX_BLAS="off")
    assert not off["loaded"] and "OMLX_BLAS=off" in off["reason"] and not off["mapped"]
    late = probe(before="import mlx.core", OMLX_BLAS="auto")
    assert not late["loaded"] and "imported before omlx_core" in late["reason"]
    bad = probe(OMLX_BLAS="/nonexistent/libblas.so")
    assert not bad["loaded"] and "/nonexistent/libblas.so" in bad["reason"]
    for state in (off, late, bad):
        assert state["error"] < 1e-3  # MLX's own BLAS still computes the same product


def test_status_reports_the_blas(home):
    from conftest import run_omlx

    report = json.loads(run_omlx(home, "status", "--json", check=True).stdout)
    assert set(report["blas"]) == {"loaded", "library", "reason"} and report["blas"]["reason"]


@pytest.mark.skipif(not OPENBLAS, reason="no OpenBLAS installed (apt install libopenblas0-pthread)")
def test_the_blas_loads_only_when_mlx_is_imported():
    code = ("import omlx_core, omlx_core.settings\n"
            "maps = lambda: any('libopenblas' in line for line in open('/proc/self/maps'))\n"
            "before = maps()\nimport mlx.core\nprint(before, maps())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                          env={**os.environ, "OMLX_BLAS": "auto"})
    assert done.stdout.split() == ["False", "True"]  # commands without MLX skip OpenBLAS's start-up
