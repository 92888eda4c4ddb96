"""serve/sse.py: server-sent events as byte frames, through a real uvicorn server on loopback."""

import asyncio
import threading
import time

import httpx
import pytest
import uvicorn
from conftest import free_port
from fastapi import FastAPI

from omlx_core.serve import sse

END = object()


@pytest.fixture
def app_server():
    """A FastAPI app served by uvicorn in a thread; yields (app, base url, closed streams)."""
    app, closed = FastAPI(), []
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield app, f"http://127.0.0.1:{port}", closed
    server.should_exit = True
    thread.join(10)


def render(event):
    return (sse.DONE, True) if event is END else (sse.frame(event), False)


def lines(url: str, path: str) -> list[str]:
    with httpx.stream("POST", url + path, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return [line for line in response.iter_lines() if line]


def test_a_blocking_iterator_streams_in_order_then_done(app_server):
    app, url, _ = app_server

    def words():
        for word in ("one", "two\nlines", "three"):
            time.sleep(0.01)  # blocks: runs in a worker thread, not on the loop
            yield word

    app.post("/words")(lambda: sse.iterated(words()))
    assert lines(url, "/words") == ["data: one", "data: two", "data: lines", "data: three", "data: [DONE]"]


def test_a_waiting_stream_pings_then_sends_what_is_queued(app_server):
    app, url, _ = app_server

    @app.post("/late")
    async def late():
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        loop.call_later(0.5, lambda: [queue.put_nowait(e) for e in ("a", "b", END)])
        return sse.response(queue, render, first=sse.frame("opening"), ping_s=0.1)

    got = lines(url, "/late")
    assert got[0] == "data: opening" and got[-3:] == ["data: a", "data: b", "data: [DONE]"]
    assert set(got[1:-3]) == {": ping"} and len(got[1:-3]) >= 2  # the wait was kept alive


def test_a_client_that_goes_away_closes_its_stream(app_server):
    app, url, closed = app_server

    @app.post("/endless")
    async def endless():
        queue: asyncio.Queue = asyncio.Queue()

        async def feed():
            for step in range(100000):
                queue.put_nowait(str(step))
                await asyncio.sleep(0.005)
        task = asyncio.ensure_future(feed())
        return sse.response(queue, render, on_close=lambda: closed.append(task.cancel()))

    with httpx.stream("POST", url + "/endless", timeout=30) as response:
        got = [line for line, _ in zip(response.iter_lines(), range(10)) if line.startswith("data:")]
    assert got[:2] == ["data: 0", "data: 1"]
    deadline = time.monotonic() + 10
    while not closed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert closed == [True]  # on_close ran, while the feed was still going
