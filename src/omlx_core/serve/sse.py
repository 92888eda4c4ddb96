"""Server-sent events written as bytes: the streaming endpoints of `omlx serve` and a cluster rank.

Why: at 32 streams `omlx serve` writes a few thousand events a second from its event loop,
whose Python shares the GIL with the engine thread that builds every decode step: what the
loop spends on an event can hold back the next step's build. With sse-starlette's EventSourceResponse
(an object per event, encoded, then a send each) on h11 and asyncio, the loop spent 70-88 us
of CPU an event on the 2-core development machine; with these byte frames on httptools and
uvloop, 41-58 (docs/benchmarks/serve-cpu-tiny-llama-sse.json).

- `response(queue, render)`: a text/event-stream response of what `render` makes of each
  event of an asyncio queue, the events already queued written in one send, and a ping
  comment every PING_S seconds (a stream waiting in the queue or a long prefill sends
  nothing else, and proxies close silent connections).
- `iterated(items)`: the same for an iterator of data strings (a cluster rank's tokens),
  iterated in a worker thread.
- `frame(data)`: one `data:` event.
"""

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable

from starlette.concurrency import iterate_in_threadpool
from starlette.responses import StreamingResponse

PING_S = 15.0
PING = b": ping\r\n\r\n"
DONE = b"data: [DONE]\r\n\r\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of the stream
_PING, _END = object(), object()  # put in the queue by the ping timer, and after a `source`


def frame(data: str) -> bytes:
    """`data` as one event (a line of its own per line of data)."""
    if "\n" in data or "\r" in data:
        return "".join(f"data: {line}\r\n" for line in data.splitlines()).encode() + b"\r\n"
    return b"data: " + data.encode() + b"\r\n\r\n"


def response(queue: asyncio.Queue, render: Callable[[object], tuple[bytes, bool]], first: bytes = b"",
             on_close: Callable[[], None] | None = None, ping_s: float = PING_S,
             source: AsyncIterator | None = None) -> StreamingResponse:
    """The stream of `queue`'s events: `first`, then for each event `render(event)` -> (bytes,
    whether the stream ends with it). `source`: what to put in the queue meanwhile, then
    _END. `on_close` runs when the stream ends or the client goes away (Starlette cancels
    the stream then)."""
    return StreamingResponse(_frames(queue, render, first, on_close, ping_s, source),
                             media_type="text/event-stream", headers=HEADERS)


def iterated(items: Iterable[str], ping_s: float = PING_S) -> StreamingResponse:
    """`response` over `items`' data strings, then [DONE]; `items` is iterated in a worker thread
    (it may block)."""
    return response(asyncio.Queue(), lambda item: (DONE, True) if item is _END else (frame(item), False),
                    ping_s=ping_s, source=iterate_in_threadpool(iter(items)))


async def _fill(queue: asyncio.Queue, source: AsyncIterator) -> None:
    try:
        async for item in source:
            queue.put_nowait(item)
    finally:
        queue.put_nowait(_END)


async def _frames(queue: asyncio.Queue, render, first: bytes, on_close, ping_s: float, source):
    loop = asyncio.get_running_loop()
    pump = None if source is None else asyncio.ensure_future(_fill(queue, source))

    def ping() -> None:
        nonlocal timer
        queue.put_nowait(_PING)
        timer = loop.call_later(ping_s, ping)

    timer = loop.call_later(ping_s, ping)
    try:
        if first:
            yield first
        while True:
            event, frames, done = await queue.get(), [], False
            while True:
                if event is _PING:
                    frames.append(PING)
                else:
                    data, done = render(event)
                    frames.append(data)
                    if done:
                        break
                if queue.empty():
                    break
                event = queue.get_nowait()
            yield b"".join(frames)
            if done:
                return
    finally:
        timer.cancel()
        if pump is not None:
            pump.cancel()
        if on_close is not None:
            on_close()
