"""`omlx serve` end to end: a real server process, the official openai client, real models.

One server holds the embedded SmolLM2 (text must make sense) and a tiny llama (fast,
exact token counts with ignore_eos). Every test leaves it serving for the next.
"""

import json
import time

import httpx
import openai
import pytest

from omlx_core.models.embedded import EMBEDDED_NAME
from omlx_core.models.testing import build_tiny_model
from conftest import free_port, omlx_env, run_omlx

TINY = "tiny-llama"
BLOCK = 16  # prompt-cache block, small so short prompts are cached


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory):
    home = tmp_path_factory.mktemp("serve-home")
    build_tiny_model("llama", home / "models" / TINY)
    return start_server(home, "--model", "default", "--model", TINY,
                        env=omlx_env(home, OMLX_PROMPT_CACHE_BLOCK_TOKENS=str(BLOCK)))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def post(server, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=120,
                      headers={"Content-Type": "application/json"}, **kwargs)


def test_chat_answers_the_paris_question(client):
    reply = client.chat.completions.create(
        model=EMBEDDED_NAME, temperature=0, max_tokens=24,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.prompt_tokens > 5 and 0 < usage.completion_tokens <= 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_streams_the_same_text_with_usage_last(client):
    messages = [{"role": "user", "content": "Name the capital of France in one word."}]
    whole = client.chat.completions.create(model=EMBEDDED_NAME, temperature=0, max_tokens=12,
                                           messages=messages)
    chunks = list(client.chat.completions.create(
        model=EMBEDDED_NAME, temperature=0, max_tokens=12, messages=messages, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_give_exactly_max_tokens_with_ignore_eos(client):
    kwargs = dict(model=TINY, prompt="hello world", max_tokens=7, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    assert whole.usage.completion_tokens == 7 and whole.choices[0].finish_reason == "length"
    streamed = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text
    by_ids = client.completions.create(**{**kwargs, "prompt": [5, 6, 7, 8]})
    assert by_ids.usage.prompt_tokens == 4 and by_ids.usage.completion_tokens == 7


def test_stop_strings_cut_the_text(client):
    reply = client.completions.create(model=EMBEDDED_NAME, prompt="The capital of France is",
                                      max_tokens=24, temperature=0, stop=["."])
    assert "." not in reply.choices[0].text and reply.choices[0].finish_reason == "stop"
    assert "Paris" in reply.choices[0].text


def test_a_seed_makes_sampling_repeatable(client):
    kwargs = dict(model=TINY, prompt="once upon", max_tokens=12, temperature=1.0, seed=7,
                  extra_body={"ignore_eos": True})
    first, second = (client.completions.create(**kwargs).choices[0].text for _ in range(2))
    assert first == second
    others = {client.completions.create(**{**kwargs, "seed": s}).choices[0].text for s in (1, 2, 3)}
    assert len(others | {first}) > 1  # different seeds do sample differently


def test_models_lists_what_can_be_served(client):
    ids = [m.id for m in client.models.list().data]
    assert ids[:2] == [EMBEDDED_NAME, TINY]


def test_a_repeated_conversation_reuses_its_prefix(server):
    body = {"model": TINY, "messages": [{"role": "user", "content": "a fairly long question " * 8}],
            "max_tokens": 4, "temperature": 0}
    first = post(server, "/v1/chat/completions", body).json()
    second = post(server, "/v1/chat/completions", body).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // BLOCK * BLOCK > 0
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


BAD_REQUESTS = [
    ("malformed JSON", "/v1/chat/completions", '{"messages": [', 400, None),
    ("messages not a list", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("wrong role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role"),
    ("temperature a word", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("negative max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("n of 2", "/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("token outside the vocabulary", "/v1/completions", {"model": TINY, "prompt": [10 ** 7]}, 400, "prompt"),
    ("prompt over context", "/v1/completions", {"model": TINY, "prompt": "word " * 5000}, 400, "messages"),
    ("max_tokens over context", "/v1/completions", {"model": TINY, "prompt": "x", "max_tokens": 10 ** 6},
     400, "messages"),
    ("unknown model", "/v1/chat/completions",
     {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("unknown path", "/v1/nothing-here", {}, 404, None),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server, name, path, body, status, param):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert set(error) >= {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    ok = post(server, "/v1/completions", {"model": TINY, "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200 and server.alive()


def test_context_overflow_says_so(server):
    response = post(server, "/v1/completions", {"model": TINY, "prompt": "word " * 5000})
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert "4096" in response.json()["error"]["message"]


def test_a_client_that_disconnects_frees_its_slot(server):
    body = {"model": TINY, "prompt": "go on", "max_tokens": 3000, "stream": True,
            "extra": None, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
        assert got
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        queue = httpx.get(server.url + "/api/status").json()["queue"]
        if queue["running"] == 0:
            break
        time.sleep(0.1)
    assert queue["running"] == 0 and queue["waiting"] == 0


def test_health_status_and_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    status = httpx.get(server.url + "/api/status").json()
    assert status["state"] == "ready" and status["version"]
    memory = status["memory"]
    assert 0 < memory["soft_watermark_bytes"] <= memory["hard_watermark_bytes"] <= memory["total_bytes"]
    models = {m["id"]: m for m in status["models"]}
    assert set(models) == {EMBEDDED_NAME, TINY}
    tiny = models[TINY]
    assert tiny["weights_bytes"] == memory["weights"][TINY] > 0
    assert tiny["fingerprint"].startswith("mf-")
    lanes = {lane["name"]: lane for lane in tiny["prefill"]["lanes"]}
    assert set(lanes) == {"gpu", "cpu", "ane"}
    assert all(set(lane["procedures"]) == {"mlp", "gdn", "dual", "resident"} for lane in lanes.values())
    assert all(lane["reason"] for lane in lanes.values())
    metrics = httpx.get(server.url + "/metrics").text
    for name in ("omlx_requests_running", "omlx_requests_waiting", "omlx_prompt_tokens_total",
                 "omlx_generation_tokens_total", "omlx_time_to_first_token_seconds_bucket",
                 "omlx_time_per_output_token_seconds_bucket", "omlx_kv_cache_bytes",
                 "omlx_memory_guard_rejections_total", "omlx_queue_rejections_total"):
        assert name in metrics, name
    def value(series: str) -> float:
        lines = [line for line in metrics.splitlines() if line.startswith(series + " ")]
        assert lines, series
        return float(lines[0].split()[-1])

    assert value(f'omlx_generation_tokens_total{{model="{TINY}"}}') > 0
    for phase in ("prefill", "decode"):  # the engine's steps, timed by phase
        steps = value(f'omlx_engine_step_seconds_count{{model="{TINY}",phase="{phase}"}}')
        seconds = value(f'omlx_engine_step_seconds_sum{{model="{TINY}",phase="{phase}"}}')
        assert steps >= 1 and seconds > 0, phase


def test_bad_requests_do_not_disturb_a_running_stream(server):
    body = {"model": TINY, "prompt": "keep going", "max_tokens": 120, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
        events = []
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            events.append(line[5:].strip())
            if len(events) == 3:  # mid-stream: a burst of bad requests
                for _, path, bad, status, _ in BAD_REQUESTS:
                    assert post(server, path, bad).status_code == status
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 120


def test_health_says_loading_until_the_model_is_ready(start_server, tmp_path_factory):
    home = tmp_path_factory.mktemp("fresh-home")  # the embedded model is imported at start
    server = start_server(home, ready=False)
    deadline = time.monotonic() + 60
    seen = []
    while time.monotonic() < deadline:
        try:
            response = httpx.get(server.url + "/health", timeout=2)
        except httpx.HTTPError:
            time.sleep(0.05)
            continue
        seen.append((response.status_code, response.json()))
        if response.status_code == 200:
            break
        time.sleep(0.05)
    assert seen[0] == (503, {"status": "loading"}) and seen[-1] == (200, {"status": "ok"})


def test_status_finds_the_server_at_the_settings_address(server, tmp_path):
    env = omlx_env(tmp_path, OMLX_SERVER_PORT=str(server.port))
    report = json.loads(run_omlx(tmp_path, "status", "--json", env=env, check=True).stdout)
    assert report["server"]["running"] and report["server"]["url"] == server.url
    assert {m["id"] for m in report["server"]["status"]["models"]} >= {TINY}
    text = run_omlx(tmp_path, "status", env={**env, "COLUMNS": "250"}, check=True).stdout
    assert "loaded models" in text and TINY in text

    nobody = omlx_env(tmp_path, OMLX_SERVER_PORT=str(free_port()))
    report = json.loads(run_omlx(tmp_path, "status", "--json", env=nobody, check=True).stdout)
    assert report["server"] == {"url": report["server"]["url"], "running": False, "error": None,
                                "status": None}
