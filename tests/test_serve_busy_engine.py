"""A request while the engine thread is busy: an in-process `Server` on loopback (real
uvicorn, real tiny model), its engine thread held by a call as a long step holds it."""

import threading
import time

import httpx
import pytest

from conftest import TINY, free_port
from omlx_core.serve.server import Server, server_options


@pytest.fixture
def server(tiny_home):
    cli = {"server.port": free_port(), "server.host": "127.0.0.1", "server.warmup": False}
    options, settings = server_options(tiny_home, [TINY], cli)
    server = Server(tiny_home, options, settings, cli)
    ready = threading.Event()
    thread = threading.Thread(target=server.run, kwargs={"on_ready": lambda _: ready.set()}, daemon=True)
    thread.start()
    assert ready.wait(120), "the server did not load its model"
    yield server
    server.stop()
    thread.join(30)


def hold_engine(server) -> threading.Event:
    """Occupy the engine thread until the returned event is set (as a long step would)."""
    held, release = threading.Event(), threading.Event()

    def hold():
        held.set()
        release.wait(60)

    server.engine.call(hold)
    assert held.wait(30)
    return release


def test_a_request_for_a_loaded_model_queues_while_the_engine_is_in_a_step(server):
    release = hold_engine(server)
    url = f"http://{server.options.host}:{server.options.port}/v1/completions"
    replies = []
    client = threading.Thread(target=lambda: replies.append(httpx.post(
        url, json={"model": TINY, "prompt": "hello", "max_tokens": 3, "ignore_eos": True}, timeout=60)))
    client.start()
    try:
        deadline = time.monotonic() + 20
        while server.scheduler.counts()["waiting"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        # Tokenized and queued during the step, so the engine admits it as soon as the step ends.
        assert server.scheduler.counts()["waiting"] == 1
    finally:
        release.set()
    client.join(60)
    assert replies and replies[0].status_code == 200, replies and replies[0].text
    assert replies[0].json()["usage"]["completion_tokens"] == 3
