"""`omlx bench --url` against a real mlx_lm.server on a free local port."""

import subprocess
import sys
import time

import httpx
import pytest

from conftest import free_port, run_omlx
from omlx_core.bench import schema
from omlx_core.models.testing import build_tiny_model

READY_TIMEOUT_S = 90


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    model = build_tiny_model("llama", tmp_path_factory.mktemp("serve") / "llama")
    port = free_port()
    log = open(tmp_path_factory.mktemp("serve-log") / "server.log", "w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "WARNING"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if process.poll() is not None:
                log.seek(0)
                pytest.fail(f"mlx_lm.server exited {process.returncode}: {log.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"mlx_lm.server not ready on {url} after {READY_TIMEOUT_S} s")
            time.sleep(0.25)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def test_serving_bench_against_mlx_lm_server(home, server_url, tmp_path):
    history = tmp_path / "serving.jsonl"
    result = run_omlx(home, "bench", "--url", server_url, "--concurrency", "1,3", "--requests", "4",
                      "--ctx", "48", "--gen", "8", "--json", "--output", str(history), check=True)
    document = schema.loads(result.stdout)
    assert document["mode"] == "serving" and document["server"]["url"] == server_url
    assert [(r["concurrency"], r["ctx"]) for r in document["results"]] == [(1, 48), (3, 48)]
    for level in document["results"]:
        assert level["requests"] == 4 and level["completed"] == 4 and level["errors"] == {}
        # mlx_lm.server ignores ignore_eos, so a random model may stop early: count what came
        assert 1 <= level["completion_tokens_mean"] <= 8
        assert level["prompt_tokens_mean"] > 0  # from the server's usage report
        assert level["generation_tps"] > 0 and level["request_throughput_rps"] > 0
        ttft = level["ttft_s"]
        assert 0 < ttft["p50"] <= ttft["p90"] <= ttft["p99"]
    assert len(history.read_text().splitlines()) == 1

    table = run_omlx(home, "bench", "--url", server_url, "--requests", "2", "--ctx", "16",
                     "--gen", "4", "--endpoint", "chat", "--format", "md", check=True)
    assert "TTFT ms p50/90/99" in table.stdout and "| 2/2 |" in table.stdout


def test_serving_bench_counts_errors_and_fails_when_nothing_succeeds(home):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = run_omlx(home, "bench", "--url", url, "--requests", "2", "--ctx", "8", "--gen", "2",
                      "--warmup", "0", "--json")
    assert result.returncode == 1
    assert "no request succeeded" in result.stderr
    (level,) = schema.loads(result.stdout)["results"]
    assert level["completed"] == 0 and level["errors"] == {"ConnectError": 2}


def test_serving_bench_against_omlx_serve_counts_exact_tokens(home, start_server, tmp_path):
    build_tiny_model("llama", home / "models" / "tiny")
    server = start_server(home, "--model", "tiny")
    result = run_omlx(home, "bench", "--url", server.url, "--concurrency", "1,4", "--requests", "4",
                      "--ctx", "32", "--gen", "6", "--json", check=True)
    for level in schema.loads(result.stdout)["results"]:
        assert level["completed"] == 4 and level["errors"] == {}
        assert level["completion_tokens_mean"] == 6  # omlx honours ignore_eos: exactly --gen
        assert level["generation_tps"] > 0
