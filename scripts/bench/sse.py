#!/usr/bin/env python
"""The event loop's CPU per streamed token: omlx's server-sent events against sse-starlette's.

Why: at 32 streams `omlx serve` writes thousands of events a second from its event loop,
whose Python shares the GIL with the engine thread that builds each decode step, so what
an event costs the loop can hold back the next step. This serves the streaming endpoint's
events from a real uvicorn server in a child process, delivered as the engine delivers
them (a thread hands the loop one event per stream per step, in one call), to `--streams`
real HTTP clients, and reads the CPU time of the server's event loop thread alone (the
delivering thread left out) per event, for each response and each of uvicorn's HTTP
parsers and event loops installed here:

  omlx          omlx_core.serve.sse.response: byte frames, the queued events in one send
  sse-starlette EventSourceResponse of an async generator (omlx serve's before), when installed

    python scripts/bench/sse.py [--streams 32] [--tokens 256] [--rounds 3] [--step-ms 2] [--json]
"""

import argparse
import asyncio
import importlib.util
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from serve import Subprocess, free_port  # a sibling bench script: a server process and its /health wait

DOCUMENT = {"id": "cmpl-0123456789abcdef01234567", "object": "text_completion", "created": 1765000000,
            "model": "dense-4bit", "choices": [{"index": 0, "text": " word", "logprobs": None,
                                                "finish_reason": None}]}


def child_server(port: int, kind: str, http: str, loop: str, streams: int, tokens: int, step_s: float) -> None:
    """The child: an app whose POST /stream gets `tokens` events, each one token's JSON chunk,
    from a delivering thread that hands each step's events to the loop in one call, as the
    engine's Outbox does, once all `streams` requests of a round have arrived."""
    import uvicorn
    from fastapi import FastAPI

    from omlx_core.serve import sse

    app, waiting, lock = FastAPI(), [], threading.Lock()
    started = threading.Event()
    END = object()

    def deliver() -> None:
        while True:
            started.wait()
            with lock:
                round_, waiting[:] = list(waiting), []
                started.clear()
            for step in range(tokens + 1):
                time.sleep(step_s)
                items = [(queue, END if step == tokens else step) for queue, _ in round_]
                round_[0][1].call_soon_threadsafe(lambda items=items: [q.put_nowait(e) for q, e in items])

    threading.Thread(target=deliver, daemon=True).start()
    app.get("/health")(lambda: {"status": "ok"})

    def chunk(step) -> str:
        return json.dumps(DOCUMENT, separators=(",", ":"))

    @app.post("/stream")
    async def stream():
        queue: asyncio.Queue = asyncio.Queue()
        with lock:
            waiting.append((queue, asyncio.get_running_loop()))
            if len(waiting) == streams:
                started.set()
        if kind == "omlx":
            return sse.response(queue, lambda e: (sse.DONE, True) if e is END else (sse.frame(chunk(e)), False))
        from sse_starlette.sse import EventSourceResponse

        async def events():
            while (event := await queue.get()) is not END:
                yield {"data": chunk(event)}
            yield {"data": "[DONE]"}
        return EventSourceResponse(events(), ping=15)

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", http=http, loop=loop)


def thread_cpu_s(pid: int) -> float:
    """CPU seconds of the process's main thread (its event loop), from /proc."""
    fields = open(f"/proc/{pid}/task/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def clients(port: int, streams: int) -> int:
    import httpx

    async def one(client) -> int:
        count = 0
        async with client.stream("POST", "/stream") as response:
            async for line in response.aiter_lines():
                count += line.startswith("data:")
        return count

    limits = httpx.Limits(max_connections=streams + 8)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120, limits=limits) as client:
        return sum(await asyncio.gather(*[one(client) for _ in range(streams)]))


def measure(kind: str, http: str, loop: str, args) -> dict:
    port = free_port()
    command = [sys.executable, __file__, "--child", kind, http, loop, str(port), "--streams", str(args.streams),
               "--tokens", str(args.tokens), "--step-ms", str(args.step_ms)]
    with tempfile.TemporaryDirectory() as logs:
        child = Subprocess(f"{kind} on {http}/{loop}", command, port, Path(logs) / "server.log")
        child.start(timeout_s=60)
        try:
            asyncio.run(clients(port, args.streams))  # warm-up round
            per_event = []
            for _ in range(args.rounds):
                before = thread_cpu_s(child.proc.pid)
                events = asyncio.run(clients(port, args.streams))
                per_event.append((thread_cpu_s(child.proc.pid) - before) / events * 1e6)
        finally:
            child.stop(10)
    per_event.sort()
    return {"response": kind, "http": http, "loop": loop, "events_per_round": events,
            "loop_cpu_us_per_event": round(per_event[len(per_event) // 2], 1),
            "rounds_us": [round(v, 1) for v in per_event]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=2.0, help="time between delivered steps")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs=4, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, http, loop, port = args.child
        return child_server(int(port), kind, http, loop, args.streams, args.tokens, args.step_ms / 1e3)
    installed = lambda name: importlib.util.find_spec(name) is not None  # noqa: E731
    kinds = ["omlx"] + (["sse-starlette"] if installed("sse_starlette") else [])
    stacks = [("h11", "asyncio")] + ([("httptools", "uvloop")] if installed("httptools") and installed("uvloop")
                                     else [])
    rows = [measure(kind, http, loop, args) for http, loop in stacks for kind in kinds]
    result = {"command": " ".join(sys.argv), "streams": args.streams, "tokens": args.tokens, "rows": rows,
              "skipped": [] if installed("sse_starlette") else ["sse-starlette: not installed"]}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for row in rows:
        print(f"{row['response']:>13} on {row['http']}/{row['loop']}: {row['loop_cpu_us_per_event']} us of the "
              f"event loop's CPU an event ({row['events_per_round']} events a round)")


if __name__ == "__main__":
    main()
