"""scripts/bench/sse.py: real uvicorn servers in child processes, real HTTP clients."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "sse.py"
SRC = Path(__file__).resolve().parents[1] / "src"


def test_every_installed_stack_streams_every_event_and_reports_the_loops_cpu():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(SCRIPT), "--streams", "3", "--tokens", "20", "--rounds", "1",
                           "--step-ms", "1", "--json"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    stacks = {(row["http"], row["loop"]) for row in report["rows"]}
    assert stacks == {("h11", "asyncio"), ("httptools", "uvloop")}  # both installed with omlx
    for row in report["rows"]:
        assert row["events_per_round"] == 3 * 21  # every token's event and [DONE], on every stream
        assert row["loop_cpu_us_per_event"] >= 0 and len(row["rounds_us"]) == 1
    assert {row["response"] for row in report["rows"]} >= {"omlx"}
