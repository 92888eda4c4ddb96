"""scripts/bench/serve.py as an A/B of one omlx setting: two real omlx servers on a tiny model."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import TINY, omlx_env

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "serve.py"


def serve_bench(home, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--home", str(home), "--model", TINY, *args],
                          capture_output=True, text=True, timeout=600, env=omlx_env(home))


def test_omlx_against_omlx_with_other_settings(tiny_home):
    done = serve_bench(tiny_home, "--concurrency", "2", "--requests", "3", "--ctx", "16", "--gen", "4",
                       "--against", "omlx", "--set", "server.prefill_batch=1",
                       "--against-set", "server.prefill_batch=2", "--prime", "--step-log", "--quiet", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["baseline"] == "omlx-baseline" and report["ratio_generation_tps"] > 0
    assert report["primed"]["server"] == "omlx-baseline" and report["primed"]["generation_tps"] > 0
    assert report["order"] == ["omlx-baseline", "omlx"]  # the primed run is not a round
    assert report["settings"] == {"omlx": {"OMLX_SERVER_PREFILL_BATCH": "1"},
                                  "omlx-baseline": {"OMLX_SERVER_PREFILL_BATCH": "2"}}
    ours = report["rounds"]["omlx"][0]
    # One prompt a prefill step, for the calibration request, the warm-up's (as many as
    # --concurrency by default) and the three measured ones; the split that starts a prompt's
    # generation takes a step of its own unless the next prompt prefills in it, and the last
    # of each level's cannot.
    assert report["workload"]["warmup"] == 2
    assert (1 + 2 + 3) + 3 <= ours["engine_steps"]["prefill"]["steps"] <= 2 * (1 + 2 + 3)
    assert ours["engine_steps"]["decode"]["steps"] >= 1
    assert 0 <= ours["engine_steps"]["decode"]["slow"] < ours["engine_steps"]["decode"]["steps"]  # a tiny step is fast
    assert report["summary"]["omlx"]["completed"] == report["summary"]["omlx-baseline"]["completed"] == 3
    # --step-log: the measured level's steps (the metrics count the warm-up's too), each in
    # its phase, within the level's wall time
    logged, wall_ms = ours["step_log"], ours["result"]["wall_s"] * 1000
    prefills, decodes = logged["prefill_steps"], logged["decode_steps"]
    assert 3 <= len(prefills) < ours["engine_steps"]["prefill"]["steps"]
    assert 3 <= decodes["count"] < ours["engine_steps"]["decode"]["steps"]
    prompts = 3 * ours["result"]["prompt_tokens_mean"]
    assert sum(tokens for _, _, _, tokens in prefills) == round(prompts) - 3  # each prompt but its last token
    assert all(0 <= at <= wall_ms / 1000 and ms > 0 for at, ms, _, _ in prefills)
    assert 0 < logged["outside_steps_ms"] < wall_ms


def test_a_bad_setting_is_refused_before_any_server_starts(tiny_home):
    done = serve_bench(tiny_home, "--against", "omlx", "--set", "server.prefil_batch=2")
    assert done.returncode != 0
    assert "--set server.prefil_batch=2: unknown setting 'server.prefil_batch'" in done.stderr
    assert "server.prefill_batch" in done.stderr  # the close match it suggests
    bad_value = serve_bench(tiny_home, "--against", "omlx", "--against-set", "server.prefill_batch=0")
    assert bad_value.returncode != 0 and "--against-set server.prefill_batch=0" in bad_value.stderr
    alone = serve_bench(tiny_home, "--against-set", "server.prefill_batch=2")
    assert alone.returncode != 0 and "add --against omlx" in alone.stderr


def test_the_baseline_runs_another_checkouts_code(tiny_home, tmp_path):
    """--against-src: the baseline server imports omlx from the other checkout (whose copy
    of omlx_core notes each import in a file), the omlx side from this one."""
    other = tmp_path / "other"
    shutil.copytree(SCRIPT.parents[2] / "src", other / "src", ignore=shutil.ignore_patterns("__pycache__"))
    marks = tmp_path / "imports.txt"
    init = other / "src" / "omlx_core" / "__init__.py"
    init.write_text(init.read_text() + f"\nopen({str(marks)!r}, 'a').write('imported\\n')\n")
    engine = other / "src" / "omlx_core" / "serve" / "engine.py"  # as a checkout before the step log
    engine.write_text(engine.read_text().replace("log.isEnabledFor(logging.DEBUG)", "False"))
    done = serve_bench(tiny_home, "--concurrency", "1", "--requests", "1", "--ctx", "8", "--gen", "2",
                       "--against", "omlx", "--against-src", str(other), "--step-log", "--quiet", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["settings"]["omlx-baseline"]["PYTHONPATH"].split(os.pathsep)[0] == str(other / "src")
    assert "PYTHONPATH" not in report["settings"]["omlx"]
    assert marks.is_file() and marks.read_text().count("imported") >= 1  # the baseline server's process
    assert report["summary"]["omlx"]["completed"] == report["summary"]["omlx-baseline"]["completed"] == 1
    # --step-log: the other checkout logs no steps, so it reports none (not an idle level)
    assert report["rounds"]["omlx-baseline"][0]["step_log"] is None
    assert report["rounds"]["omlx"][0]["step_log"]["decode_steps"]["count"] >= 1


def test_another_checkout_must_have_omlx_core(tiny_home, tmp_path):
    done = serve_bench(tiny_home, "--against", "omlx", "--against-src", str(tmp_path))
    assert done.returncode != 0 and f"--against-src {tmp_path}: no src/omlx_core there" in done.stderr
    alone = serve_bench(tiny_home, "--against-src", str(tmp_path))
    assert alone.returncode != 0 and "--against-src: the baseline is mlx_lm.server" in alone.stderr
