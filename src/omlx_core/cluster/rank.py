"""One rank of `omlx serve --distributed`, run on every machine by `mlx.launch`.

Every rank loads the model sharded with mlx-lm (tensor parallel where the model has
`shard`, pipeline where it has `pipeline`) and runs the same generation in lockstep.
Rank 0 also serves the OpenAI API; it hands each request to the group with two
`mx.distributed.all_sum` broadcasts (a header, then the prompt), so every rank samples
the same token from the same logits with the same seed. Requests run one at a time:
this is the experimental path, the single-machine engine batches.
"""

import argparse
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import mlx.core as mx

DEFAULT_MAX_TOKENS = 256  # when a request names no limit


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    tokens: "queue.Queue[int | None]" = field(default_factory=queue.Queue)
    generated: int = 0


@dataclass
class ShardedModel:
    """What the request parsers (`serve.prompts`) read from a model."""

    id: str
    tokenizer: object
    settings: dict
    vocab_size: int


def broadcast(group, values: list[int], length: int) -> list[int]:
    """Rank 0's `values` on every rank (the others contribute zeros)."""
    data = values if group.rank() == 0 else [0] * length
    total = mx.distributed.all_sum(mx.array(data, dtype=mx.int32), group=group)
    return total.tolist()


def run_job(model, group, job: Job | None, eos: set[int]) -> None:
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    header = [len(job.prompt), job.max_tokens, round(job.temperature * 1e6), round(job.top_p * 1e6),
              job.seed] if job else []
    length, max_tokens, temperature, top_p, seed = broadcast(group, header, 5)
    prompt = broadcast(group, job.prompt if job else [], length)
    mx.random.seed(seed)
    sampler = make_sampler(temperature / 1e6, top_p / 1e6)
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=sampler):
        if job:
            job.tokens.put(int(token))
        if int(token) in eos:
            break
    if job:
        job.tokens.put(None)


def load(path: str):
    from mlx_lm.utils import sharded_load

    model, tokenizer, config = sharded_load(path, return_config=True)
    return model, tokenizer, config


def serve_http(jobs: "queue.Queue[Job]", model: ShardedModel, host: str, port: int, ready: threading.Event):
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from omlx_core.serve import sse
    from omlx_core.serve.errors import APIError
    from omlx_core.serve.protocol import ChatCompletionRequest, CompletionRequest
    from omlx_core.serve.prompts import chat_prompt, completion_prompt

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    lock = threading.Lock()  # one request at a time across the group

    @app.exception_handler(APIError)
    async def _api_error(_, error: APIError):
        return JSONResponse(error.body(), status_code=error.status)

    def generate(job: Job):
        """(text, finish reason or None) pieces as the group generates `job`'s tokens."""
        jobs.put(job)
        detokenizer = model.tokenizer.detokenizer
        detokenizer.reset()
        while (token := job.tokens.get()) is not None:
            job.generated += 1
            if token in model.tokenizer.eos_token_ids:
                yield "", "stop"
                return
            detokenizer.add_token(token)
            yield detokenizer.last_segment, None
        detokenizer.finalize()
        yield detokenizer.last_segment, "length"

    def respond(prompt, body, limit, kind):
        created, ident = int(time.time()), f"{kind}-{uuid.uuid4().hex[:12]}"
        job = Job(prompt, limit or DEFAULT_MAX_TOKENS, body.temperature, body.top_p,
                  body.seed if body.seed is not None else int(time.time_ns() % 2**31))

        def choice(text, finish):
            if kind == "chatcmpl":
                return {"index": 0, "delta" if body.stream else "message": {"role": "assistant", "content": text},
                        "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}
        obj = ("chat.completion" if kind == "chatcmpl" else "text_completion") + (".chunk" if body.stream and
                                                                                 kind == "chatcmpl" else "")
        if body.stream:
            def events():
                with lock:
                    for text, finish in generate(job):
                        yield json.dumps({"id": ident, "object": obj, "created": created, "model": model.id,
                                          "choices": [choice(text, finish)]})
            return sse.iterated(events())
        with lock:
            parts, finish = [], "length"
            for text, finish in generate(job):
                parts.append(text)
        count = job.generated
        text = "".join(parts)
        for stop in body.stop or []:
            if stop in text:
                text, finish = text[:text.index(stop)], "stop"
        return {"id": ident, "object": obj, "created": created, "model": model.id,
                "choices": [choice(text, finish)],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": count,
                          "total_tokens": len(prompt) + count}}

    @app.post("/v1/completions")
    def completions(body: CompletionRequest):
        return respond(completion_prompt(model, body), body, body.token_limit, "cmpl")

    @app.post("/v1/chat/completions")
    def chat(body: ChatCompletionRequest):
        prompt, _ = chat_prompt(model, body)
        return respond(prompt, body, body.token_limit, "chatcmpl")

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": model.id, "object": "model", "owned_by": "omlx"}]}

    @app.get("/health")
    def health():
        return {"status": "ok", "distributed": True}

    config = uvicorn.Config(app, host=host, port=port, log_level="warning")
    server = uvicorn.Server(config)
    ready.set()
    server.run()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--name", default=None)
    parser.add_argument("--backend", default="ring")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)

    group = mx.distributed.init(strict=True, backend=args.backend)
    model, tokenizer, config = load(args.model)
    eos = set(tokenizer.eos_token_ids)
    jobs: "queue.Queue[Job]" = queue.Queue()
    if group.rank() == 0:
        from omlx_core.settings.schema import defaults

        text = config.get("text_config", config)
        described = ShardedModel(args.name or args.model, tokenizer, defaults(), int(text["vocab_size"]))
        ready = threading.Event()
        threading.Thread(target=serve_http, args=(jobs, described, args.host, args.port, ready), daemon=True).start()
        ready.wait()
        print(f"omlx: rank 0 of {group.size()} serving {described.id} on http://{args.host}:{args.port}", flush=True)
    while True:
        run_job(model, group, jobs.get() if group.rank() == 0 else None, eos)


if __name__ == "__main__":
    raise SystemExit(main())
