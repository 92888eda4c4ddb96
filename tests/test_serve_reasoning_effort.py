"""reasoning_effort reaches chat templates that read it, under the model's settings.

A tiny model whose template writes the effort into the prompt, so the prompt's token
count shows what the template received.
"""

import json

import httpx
import pytest

from conftest import run_omlx
from omlx_core.models.testing import CHAT_TEMPLATE, build_tiny_model
from omlx_core.serve.prompts import reasoning_effort

MODEL = "tiny-effort"
EFFORT_TEMPLATE = (
    "{%- if reasoning_effort is defined and reasoning_effort %}"
    "{{- '<|im_start|>system\\neffort ' + (reasoning_effort + ' ') * 20 + '<|im_end|>\\n' }}"
    "{%- endif %}" + CHAT_TEMPLATE
)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    home = tmp_path_factory.mktemp("effort-home")
    path = build_tiny_model("llama", home / "models" / MODEL)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = EFFORT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return home


def chat(url: str, effort: str | None = None) -> dict:
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    if effort is not None:
        body["reasoning_effort"] = effort
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def prompt_tokens(url: str, effort: str | None = None) -> int:
    return chat(url, effort)["usage"]["prompt_tokens"]


def test_request_effort_default_custom_and_force(start_server, home):
    server = start_server(home, "--model", MODEL)
    plain = prompt_tokens(server.url)
    high = chat(server.url, "high")
    assert high["reasoning_effort"] == "high" and high["usage"]["prompt_tokens"] > plain + 15
    server.stop()

    run_omlx(home, "settings", "set", "chat.reasoning_effort", "low", "--model", MODEL, check=True)
    server = start_server(home, "--model", MODEL)
    assert chat(server.url)["reasoning_effort"] == "low"  # the model's default
    assert chat(server.url, "high")["reasoning_effort"] == "high"  # the request wins
    server.stop()

    run_omlx(home, "settings", "set", "chat.reasoning_effort_force", "true", "--model", MODEL, check=True)
    server = start_server(home, "--model", MODEL)
    assert chat(server.url, "high")["reasoning_effort"] == "low"  # forced
    server.stop()

    for key, value in (("chat.reasoning_effort", "custom"), ("chat.reasoning_effort_custom", "xhigh")):
        run_omlx(home, "settings", "set", key, value, "--model", MODEL, check=True)
    server = start_server(home, "--model", MODEL)
    assert chat(server.url, "medium")["reasoning_effort"] == "xhigh"


def test_custom_without_a_value_is_a_400():
    settings = {"chat.reasoning_effort": None, "chat.reasoning_effort_custom": None,
                "chat.reasoning_effort_force": False}
    assert reasoning_effort("high", settings) == "high"
    assert reasoning_effort(None, settings) is None
    with pytest.raises(Exception) as refused:
        reasoning_effort("custom", settings)
    assert refused.value.status == 400 and "chat.reasoning_effort_custom" in refused.value.message
