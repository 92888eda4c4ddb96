"""The serving benchmark: concurrent streaming requests against an OpenAI-compatible server.

Works with any server that streams `/v1/completions` or `/v1/chat/completions` as SSE
(ours, mlx_lm.server, vLLM, llama.cpp …). Each request asks for `max_tokens` = gen with
`ignore_eos` (honoured where the server supports it; the count is whatever came back
otherwise) and `stream_options.include_usage`, so token counts come from the server's own
usage report when it sends one and from the streamed chunks when it does not.

For every (concurrency, ctx): `concurrency` workers send `requests` requests between them
and each record gives TTFT (send to first content chunk), TPOT ((last - first) /
(tokens - 1)) and ITL (the gaps between content chunks: per token when the server sends
one token per chunk, as most do). Throughput is over the wall time of the whole level.
Errors are counted by HTTP status, or by exception name when no response came back.
"""

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from omlx_core.bench.report import finite, header
from omlx_core.bench.sse import sse_events
from omlx_core.bench.stats import percentiles
from omlx_core.bench.text_prompts import text_prompt, words_for
from omlx_core.errors import InputError

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class ServingWorkload:
    ctx: tuple[int, ...]
    gen: int = 128
    concurrency: tuple[int, ...] = (1,)
    requests: int | None = None  # per level; None: 2 x concurrency, at least 4
    warmup: int = 1
    seed: int = 0

    def __post_init__(self):
        if not self.ctx or min(self.ctx) < 1:
            raise InputError("--ctx: give one or more context lengths of at least 1 token")
        if not self.concurrency or min(self.concurrency) < 1:
            raise InputError("--concurrency: give one or more levels of at least 1, e.g. 1,4,8")
        if self.gen < 1:
            raise InputError(f"--gen: {self.gen} is too small; use 1 or more")
        if self.requests is not None and self.requests < 1:
            raise InputError(f"--requests: {self.requests} is too small; use 1 or more")
        if self.warmup < 0:
            raise InputError(f"--warmup: {self.warmup} is too small; use 0 or more")

    def requests_at(self, concurrency: int) -> int:
        return self.requests if self.requests is not None else max(4, 2 * concurrency)

    def as_dict(self) -> dict:
        return {"ctx": list(self.ctx), "gen": self.gen, "concurrency": list(self.concurrency),
                "requests": self.requests, "warmup": self.warmup, "seed": self.seed}


@dataclass(frozen=True)
class Server:
    url: str
    model: str | None = None  # sent as "model"; None leaves it out (the server's default)
    api_key: str | None = None
    endpoint: str = "completions"
    timeout_s: float = 600.0

    def __post_init__(self):
        if not self.url.startswith(("http://", "https://")):
            raise InputError(f"--url: {self.url!r} is not an http(s) URL (e.g. http://127.0.0.1:8000)")
        if self.endpoint not in ENDPOINTS:
            raise InputError(f"--endpoint: {self.endpoint!r}; use completions or chat")

    @property
    def base(self) -> str:
        base = self.url.rstrip("/")
        return base[:-3] if base.endswith("/v1") else base

    def describe(self) -> dict:
        return {"url": self.url, "model": self.model, "endpoint": self.endpoint}


@dataclass
class RequestRecord:
    start: float
    status: str = "ok"  # "ok", an HTTP status code, or an exception's name
    first: float | None = None
    arrivals: list[float] = field(default_factory=list)
    end: float | None = None
    chunks: int = 0
    usage: dict | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def completion_tokens(self) -> int:
        reported = (self.usage or {}).get("completion_tokens")
        return int(reported) if isinstance(reported, int) else self.chunks

    @property
    def prompt_tokens(self) -> int | None:
        reported = (self.usage or {}).get("prompt_tokens")
        return int(reported) if isinstance(reported, int) else None


def _body(server: Server, text: str, max_tokens: int) -> dict:
    body = {"max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0.0, "ignore_eos": True}
    if server.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if server.model:
        body["model"] = server.model
    return body


def _content(event: dict, endpoint: str) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning") or "")
    return choice.get("text") or ""


async def _send(client, server: Server, text: str, max_tokens: int) -> RequestRecord:
    import httpx

    record = RequestRecord(start=time.perf_counter())
    try:
        async with client.stream("POST", server.base + ENDPOINTS[server.endpoint],
                                 json=_body(server, text, max_tokens)) as response:
            if response.status_code != 200:
                await response.aread()
                record.status = str(response.status_code)
                return record
            async for event in sse_events(response.aiter_lines()):
                if "error" in event:
                    record.status = "stream_error"
                    continue
                if event.get("usage"):
                    record.usage = event["usage"]
                if _content(event, server.endpoint):
                    now = time.perf_counter()
                    record.first = record.first or now
                    record.arrivals.append(now)
                    record.chunks += 1
    except httpx.HTTPError as error:
        record.status = type(error).__name__
    finally:
        record.end = time.perf_counter()
    if record.ok and record.first is None:
        record.status = "no_tokens"
    return record


def _level_result(concurrency: int, ctx: int, gen: int, records: list[RequestRecord],
                  wall_s: float, started: float) -> dict:
    done = [r for r in records if r.ok]
    errors = Counter(r.status for r in records if not r.ok)
    tokens = sum(r.completion_tokens for r in done)
    ttft = [r.first - r.start for r in done]
    tpot = [(r.arrivals[-1] - r.first) / (r.completion_tokens - 1)
            for r in done if r.completion_tokens > 1]
    itl = [later - earlier for r in done for earlier, later in zip(r.arrivals, r.arrivals[1:])]
    prompts = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    return {
        "concurrency": concurrency, "ctx": ctx, "gen": gen, "requests": len(records),
        "completed": len(done), "errors": dict(sorted(errors.items())), "wall_s": wall_s,
        # on this machine's monotonic clock (a local server's logs can be lined up with it)
        "window_s": [started, started + wall_s],
        "request_throughput_rps": len(done) / wall_s if wall_s > 0 else None,
        "generation_tps": tokens / wall_s if wall_s > 0 else None,
        "prompt_tokens_mean": sum(prompts) / len(prompts) if prompts else None,
        "completion_tokens_mean": tokens / len(done) if done else None,
        "ttft_s": percentiles(ttft), "tpot_s": percentiles(tpot), "itl_s": percentiles(itl),
    }


async def _level(client, server: Server, texts: list[str], concurrency: int, gen: int,
                 tick: Callable[[], None]) -> tuple[list[RequestRecord], float, float]:
    """The level's records, its wall seconds and its start on the monotonic clock."""
    queue = list(enumerate(texts))
    records: list[RequestRecord | None] = [None] * len(texts)

    async def worker():
        while queue:
            index, text = queue.pop(0)
            records[index] = await _send(client, server, text, gen)
            tick()

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(texts)))))
    return records, time.monotonic() - started, started


async def _calibrate(client, server: Server, ctx: int, seed: int) -> float:
    """Tokens per word on this server, from one short request's usage (1.0 if it reports none)."""
    record = await _send(client, server, text_prompt(ctx, seed, 0), 1)
    if record.prompt_tokens:
        return record.prompt_tokens / ctx
    return 1.0


async def _run(server: Server, workload: ServingWorkload, on_progress: Progress) -> list[dict]:
    import httpx

    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    limit = max(workload.concurrency) + 2
    timeout = httpx.Timeout(server.timeout_s, connect=10.0)
    total = sum(len(workload.ctx) * (workload.warmup + workload.requests_at(c))
                for c in workload.concurrency)
    done = 0

    def tick():
        nonlocal done
        done += 1
        on_progress(done, total, "")

    results = []
    async with httpx.AsyncClient(headers=headers, timeout=timeout,
                                 limits=httpx.Limits(max_connections=limit)) as client:
        for ctx in workload.ctx:
            rate = await _calibrate(client, server, ctx, workload.seed) if workload.warmup else 1.0
            words = words_for(ctx, rate)
            for concurrency in workload.concurrency:
                on_progress(done, total, f"ctx {ctx} x{concurrency} warm-up")
                # at the level's concurrency: --warmup N >= it runs every batch size once first
                warm = [text_prompt(words, workload.seed, 1, concurrency, i) for i in range(workload.warmup)]
                await _level(client, server, warm, concurrency, workload.gen, tick)
                count = workload.requests_at(concurrency)
                texts = [text_prompt(words, workload.seed, 2, concurrency, i)
                         for i in range(count)]
                on_progress(done, total, f"ctx {ctx} x{concurrency}")
                records, wall, started = await _level(client, server, texts, concurrency, workload.gen, tick)
                results.append(_level_result(concurrency, ctx, workload.gen, records, wall, started))
    return results


def run_serving(server: Server, workload: ServingWorkload,
                on_progress: Progress | None = None) -> dict:
    """Drive `server` with `workload`; returns an `omlx.bench/1` serving document."""
    document = header("serving")
    results = asyncio.run(_run(server, workload, on_progress or (lambda done, total, what: None)))
    document.update({"server": server.describe(), "workload": workload.as_dict(),
                     "results": results})
    return finite(document)
