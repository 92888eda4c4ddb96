"""scripts/bench/admission.py on the tiny model: a forward per batch, the steps of an admission."""

import json
import subprocess
import sys
from pathlib import Path

from conftest import TINY, omlx_env

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "admission.py"


def admission(home, *args: str) -> dict:
    """The script's --json report on the tiny model with `args`; it must exit 0."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--home", str(home), "--model", TINY, *args, "--json"],
                          capture_output=True, text=True, timeout=600, env=omlx_env(home))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_admission_times_forwards_and_the_steps_that_admit_prompts(tiny_home):
    report = admission(tiny_home, "--batches", "1,3", "--tokens", "16,9", "--repeats", "2", "--running", "2",
                       "--new", "3,1", "--trials", "2", "--spread", "0", "--no-clear-cache")
    assert [(r["batch"], r["tokens"], len(r["ms"])) for r in report["forward"]] == [
        (1, 16, 2), (3, 16, 2), (1, 9, 2), (3, 9, 2)]
    assert all(ms > 0 for r in report["forward"] for ms in r["ms"])
    assert report["clear_cache"] is False and [t["new"] for t in report["admission"]] == [3, 3, 1, 1]
    for trial in report["admission"]:
        steps, new = trial["steps"], trial["new"]
        assert steps[0][1] == new  # the new prompts prefill together
        assert steps[-1][2] == 2 + new  # the last step generates for the running and the admitted


def test_phases_split_an_admission_step_into_each_generators_parts(tiny_home):
    trials = admission(tiny_home, "--batches", "1", "--tokens", "12", "--repeats", "1", "--running", "2",
                       "--new", "2", "--trials", "1", "--spread", "0", "--phases",
                       "--generators", "omlx,mlx-lm")["admission"]
    assert [t["generator"] for t in trials] == ["omlx", "mlx-lm"]
    moves = {"omlx": {"join"}, "mlx-lm": {"split", "merge"}}  # how finished prompts move to generation
    for trial in trials:
        steps = trial["steps"]
        assert set(steps[0][3]) == {"decode", "prefill"}  # the running batch decodes, the new prompts prefill
        assert any(moves[trial["generator"]] <= set(parts) for *_, parts in steps[1:])
        assert steps[-1][2] == 4  # both generators end with the running and the admitted generating
        for ms, _, _, parts in steps:
            assert all(v >= 0 for v in parts.values()) and sum(parts.values()) <= ms + 0.5


def test_an_unknown_generator_is_a_one_line_error(tiny_home):
    done = subprocess.run([sys.executable, str(SCRIPT), "--home", str(tiny_home), "--model", TINY,
                           "--generators", "vllm"], capture_output=True, text=True, timeout=120, env=omlx_env(tiny_home))
    assert done.returncode != 0 and "--generators 'vllm'" in done.stderr


def test_finish_trials_time_a_window_where_sequences_finish_against_the_one_before(tiny_home):
    rows = admission(tiny_home, "--batches", "1", "--tokens", "8", "--repeats", "1", "--running", "1", "--new", "1",
                     "--trials", "1", "--finish", "1,3", "--finish-running", "3", "--window", "4",
                     "--generators", "omlx,mlx-lm")["finish"]
    assert [(r["generator"], r["finishing"]) for r in rows] == [("omlx", 1), ("omlx", 3), ("mlx-lm", 1), ("mlx-lm", 3)]
    for row in rows:
        assert row["running"] == 3 and row["finished"] == row["finishing"]  # they finished inside the timed window
        assert row["steady_ms"] > 0 and row["finish_ms"] > 0
        assert abs(row["excess_ms"] - (row["finish_ms"] - row["steady_ms"])) <= 0.11  # each rounded to 0.1


def test_more_sequences_finishing_than_running_is_a_one_line_error(tiny_home):
    done = subprocess.run([sys.executable, str(SCRIPT), "--home", str(tiny_home), "--model", TINY, "--finish", "5",
                           "--finish-running", "4"], capture_output=True, text=True, timeout=120, env=omlx_env(tiny_home))
    assert done.returncode != 0 and "--finish 5: between 1 and --finish-running (4)" in done.stderr
