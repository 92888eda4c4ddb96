"""examples/bench-ci.sh as a CI job runs it: record a baseline, pass, then fail a gate."""

import subprocess
import sys
from pathlib import Path

from conftest import omlx_env
from omlx_core.models.testing import build_tiny_model

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "bench-ci.sh"


def _ci(home: Path, workdir: Path, model: Path, fail_below: str) -> subprocess.CompletedProcess:
    env = omlx_env(home, OMLX=str(Path(sys.executable).with_name("omlx")), MODEL=str(model),
                   CTX="32", GEN="4", REPEATS="2", FAIL_BELOW=fail_below)
    return subprocess.run(["bash", str(SCRIPT), "baseline.json"], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300)


def test_bench_ci_records_then_gates(home, tmp_path):
    model = build_tiny_model("llama", tmp_path / "llama")
    recorded = _ci(home, tmp_path, model, "0.9")
    assert recorded.returncode == 0, recorded.stderr
    assert (tmp_path / "baseline.json").is_file() and "recorded baseline" in recorded.stderr

    passed = _ci(home, tmp_path, model, "0.01")
    assert passed.returncode == 0, passed.stderr
    assert "gate passed" in (tmp_path / "bench-report.md").read_text()

    failed = _ci(home, tmp_path, model, "100")  # no branch is 100x faster than itself
    assert failed.returncode == 1, failed.stderr
    assert "gate failed" in failed.stderr and "gate FAILED" in failed.stdout
    assert len((tmp_path / "bench-history.jsonl").read_text().splitlines()) == 3
