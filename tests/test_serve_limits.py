"""`omlx serve` refusing what it cannot do: API keys, memory guard (507), full queue (503).

Each case runs its own real server with the limit under test; after every refusal the
server must still answer a normal request.
"""

import concurrent.futures
import json

import httpx

from conftest import TINY, omlx_env, run_omlx
from omlx_core.memory.kv import kv_profile, worst_case_kv_bytes
from omlx_core.memory.weights import weights_bytes
from omlx_core.models.testing import build_tiny_model


def complete(url: str, max_tokens: int = 2, key: str | None = None, **extra) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/completions", headers=headers, timeout=120,
                      json={"model": TINY, "prompt": "hello", "max_tokens": max_tokens, **extra})


def test_api_key_is_required_when_set(start_server, tiny_home):
    server = start_server(tiny_home, "--model", TINY, "--api-key", "s3cret")
    assert complete(server.url).status_code == 401
    wrong = complete(server.url, key="s3cret-not")
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert complete(server.url, key="s3cret").status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200  # health stays open for probes
    status = run_omlx(tiny_home, "status", "--url", server.url, "--json")
    assert status.returncode == 1 and "API key" in status.stderr
    shown = run_omlx(tiny_home, "status", "--url", server.url, "--api-key", "s3cret", "--json", check=True)
    assert json.loads(shown.stdout)["models"][0]["id"] == TINY


def test_api_key_from_the_environment(start_server, tiny_home):
    env = omlx_env(tiny_home, OMLX_SERVER_API_KEY="from-env")
    server = start_server(tiny_home, "--model", TINY, env=env)
    assert complete(server.url).status_code == 401
    assert complete(server.url, key="from-env").status_code == 200


def test_memory_guard_refuses_with_507_and_numbers(start_server, tiny_home):
    from mlx_lm.utils import load

    model, tokenizer = load(str(tiny_home / "models" / TINY))
    prompt_tokens = len(tokenizer.encode("hello"))
    fits = worst_case_kv_bytes(kv_profile(model), prompt_tokens, 8, prefill_chunk=2048)
    hard = weights_bytes(model) + 2 * fits
    env = omlx_env(tiny_home, OMLX_MEMORY_HARD_WATERMARK=str(hard), OMLX_MEMORY_SOFT_WATERMARK=str(hard))
    server = start_server(tiny_home, "--model", TINY, env=env)
    assert complete(server.url, max_tokens=8).status_code == 200
    refused = complete(server.url, max_tokens=3000)
    assert refused.status_code == 507, refused.text
    error = refused.json()["error"]
    assert error["code"] == "memory_guard" and error["watermark_bytes"] == hard
    assert error["needed_bytes"] > error["available_bytes"]
    assert "memory.hard_watermark" in error["message"]
    streamed = complete(server.url, max_tokens=3000, stream=True)
    assert streamed.status_code == 507  # refused before the stream starts
    assert complete(server.url, max_tokens=8).status_code == 200 and server.alive()
    metrics = httpx.get(server.url + "/metrics").text
    assert f'omlx_memory_guard_rejections_total{{model="{TINY}"}} 2.0' in metrics


def test_a_full_queue_answers_503_with_retry_after(start_server, tiny_home):
    server = start_server(tiny_home, "--model", TINY, "--max-concurrency", "1", "--max-queue", "1")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda _: complete(server.url, max_tokens=400, ignore_eos=True), range(8)))
    codes = sorted(r.status_code for r in replies)
    assert codes.count(200) >= 2 and codes.count(503) >= 1, codes
    busy = next(r for r in replies if r.status_code == 503)
    assert busy.headers["Retry-After"].isdigit() and busy.json()["error"]["code"] == "queue_full"
    assert complete(server.url).status_code == 200 and server.alive()
    status = json.loads(run_omlx(tiny_home, "status", "--url", server.url, "--json", check=True).stdout)
    assert status["queue"]["queue_rejections"] == codes.count(503)
    table = run_omlx(tiny_home, "status", "--url", server.url, check=True,
                     env=omlx_env(tiny_home, COLUMNS="200")).stdout
    assert TINY in table and "queue full" in table


def test_status_url_without_a_server_is_a_clear_error(tiny_home):
    from conftest import free_port

    result = run_omlx(tiny_home, "status", "--url", f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 1 and "no omlx server answers" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_taken_port_is_a_one_line_error(start_server, tiny_home):
    server = start_server(tiny_home, "--model", TINY)
    result = run_omlx(tiny_home, "serve", "--model", TINY, "--port", str(server.port))
    assert result.returncode == 1 and f"cannot listen on 127.0.0.1:{server.port}" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_models_load_on_first_use_and_the_least_recent_unpinned_is_unloaded(start_server, tmp_path_factory):
    from mlx_lm.utils import load

    home = tmp_path_factory.mktemp("lru-home")
    for seed, name in enumerate(("pinned", "second", "third")):
        build_tiny_model("llama", home / "models" / name, seed=seed)
    loaded = weights_bytes(load(str(home / "models" / "pinned"))[0])
    on_disk = sum(f.stat().st_size for f in (home / "models" / "pinned").glob("*.safetensors"))
    hard = 2 * loaded + max(loaded, on_disk) // 2  # room for two models, never three
    env = omlx_env(home, OMLX_MEMORY_HARD_WATERMARK=str(hard), OMLX_MEMORY_SOFT_WATERMARK=str(hard))
    server = start_server(home, "--model", "pinned", env=env)

    def ask(model: str) -> list[str]:
        reply = httpx.post(server.url + "/v1/completions", timeout=120,
                           json={"model": model, "prompt": "hi", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        return sorted(m["id"] for m in httpx.get(server.url + "/api/status").json()["models"])

    assert ask("second") == ["pinned", "second"]
    assert ask("third") == ["pinned", "third"]  # second was idle and least recently used
    assert ask("pinned") == ["pinned", "third"]
    assert ask("second") == ["pinned", "second"]


def test_above_the_soft_watermark_the_prefill_chunk_shrinks(start_server, tiny_home):
    env = omlx_env(tiny_home, OMLX_MEMORY_SOFT_WATERMARK="1KiB")  # always above it
    server = start_server(tiny_home, "--model", TINY, env=env)
    assert complete(server.url, max_tokens=8).status_code == 200
    memory = httpx.get(server.url + "/api/status").json()["memory"]
    assert memory["over_soft"] and memory["prefill_chunk"] == 256  # halved step by step to the floor
