"""The settings store with real files and real processes: no lost update, no torn file."""

import json
import multiprocessing
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omlx_core.settings.store import JsonStore

from conftest import omlx_env, run_omlx


def _bump_many(path: str, key: str, times: int) -> None:
    store = JsonStore(Path(path))
    for _ in range(times):
        store.update(lambda document: document.__setitem__(key, document.get(key, 0) + 1))


def test_parallel_writers_lose_no_update(tmp_path):
    path = tmp_path / "state.json"
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_bump_many, args=(str(path), f"k{i}", 40)) for i in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
        assert worker.exitcode == 0
    document = json.loads(path.read_text())
    assert document == {f"k{i}": 40 for i in range(8)}


def test_cli_set_from_eight_processes_on_different_keys(home):
    values = {
        "server.port": "8123", "server.host": "0.0.0.0", "server.max_concurrency": "3",
        "server.max_queue": "17", "memory.soft_watermark": "0.5", "prefill.chunk_size": "1k",
        "cluster.enabled": "true", "logging.level": "debug", "prefill.lanes": "gpu,cpu",
    }
    processes = [
        subprocess.Popen([sys.executable, "-m", "omlx_cli", "settings", "set", key, value],
                         env=omlx_env(home), stderr=subprocess.PIPE, text=True)
        for key, value in values.items()
    ]
    for process in processes:
        assert process.wait(120) == 0, process.stderr.read()
    shown = json.loads(run_omlx(home, "settings", "show", "--effective", "--json", check=True).stdout)
    expected = {"server.port": 8123, "server.host": "0.0.0.0", "server.max_concurrency": 3,
                "server.max_queue": 17, "memory.soft_watermark": 0.5, "prefill.chunk_size": 1024,
                "cluster.enabled": True, "logging.level": "debug", "prefill.lanes": ["gpu", "cpu"]}
    for key, value in expected.items():
        assert shown[key]["value"] == value, key
        assert shown[key]["source"] == "file"


def test_file_mode_is_0600_and_no_temp_files_remain(home):
    run_omlx(home, "settings", "set", "server.port", "8001", check=True)
    path = home / "settings.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in home.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("content", [b"{not json\x00\xff", b'{"server": {"port": "eighty"}}', b"[1, 2]"])
def test_malformed_file_is_preserved_byte_for_byte_and_defaults_load(home, content):
    path = home / "settings.json"
    path.write_bytes(content)
    result = run_omlx(home, "settings", "get", "server.port", check=True)
    assert result.stdout.strip() == "8000"
    moved = list(home.glob("settings.json.corrupt-*"))
    assert len(moved) == 1
    assert moved[0].read_bytes() == content
    assert str(path) in result.stderr and str(moved[0]) in result.stderr
    # The next write starts from defaults and leaves the quarantined copy alone.
    run_omlx(home, "settings", "set", "server.port", "8002", check=True)
    assert json.loads(path.read_text()) == {"server": {"port": 8002}}
    assert moved[0].read_bytes() == content


def test_status_and_validate_report_a_corrupt_file_without_moving_it(home):
    path = home / "settings.json"
    path.write_text('{"server": {"prot": 1}}')
    result = run_omlx(home, "settings", "validate")
    assert result.returncode == 2
    assert "INVALID" in result.stdout and "server.prot" in result.stdout
    report = json.loads(run_omlx(home, "status", "--json", check=True).stdout)
    assert report["settings_files"][0]["valid"] is False
    assert path.exists() and not list(home.glob("settings.json.corrupt-*"))


_WRITER = """
import sys
from pathlib import Path
from omlx_core.settings.store import JsonStore
store = JsonStore(Path(sys.argv[1]))
round = 0
while True:
    round += 1
    store.update(lambda d: d.update(big=str(round) * 400_000, round=round))
    if round == 1:  # the first update swept older temp files; from here on, count ours
        print("writing", flush=True)
"""


def test_killed_writer_leaves_a_whole_file(tmp_path):
    path = tmp_path / "settings.json"
    JsonStore(path).update(lambda d: d.update(keep="me", round=0, big=""))
    killed_mid_write = attempt = 0
    while killed_mid_write < 3 and attempt < 150:  # until kills provably hit mid-write
        attempt += 1
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE)
        assert writer.stdout.readline() == b"writing\n"
        time.sleep(0.005 * (attempt % 10))
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
        killed_mid_write += any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
        document = json.loads(path.read_text())  # parses: never torn
        assert document["keep"] == "me"
        assert document["big"] == (str(document["round"]) * 400_000 if document["round"] else "")
    assert killed_mid_write == 3, f"only {killed_mid_write} of {attempt} kills landed mid-write"
    # The next write sweeps the temp files a killed writer left.
    JsonStore(path).update(lambda d: d.update(after="crash"))
    assert [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    assert json.loads(path.read_text())["after"] == "crash"
