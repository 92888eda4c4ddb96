"""The HTTP app: OpenAI-compatible endpoints over the engine, plus health, status, metrics.

Handlers validate, tokenize and wait; the engine thread does every MLX call. Every error
leaves in OpenAI's shape. A request is admitted (or refused with 503/507) before its
response starts, so a streaming client still gets a real status code; once streaming,
a client that goes away cancels its request, which frees its slot on the next step.
"""

import asyncio
import hmac
import json
import time
import uuid

from fastapi import Depends, FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from omlx_core.memory.guard import MemoryRefused
from omlx_core.serve import sse
from omlx_core.serve.errors import APIError, bad_request, memory_refused, server_error, unauthorized, \
    unknown_model
from omlx_core.serve.protocol import ChatCompletionRequest, CompletionRequest
from omlx_core.serve.prompts import chat_prompt, completion_prompt
from omlx_core.serve.request import Delta, Finished, Request

DEFAULT_MAX_TOKENS = 4096  # when a request names none: the context's remainder, at most this
DISCONNECT_POLL_S = 0.5


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    first = error.errors()[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('msg')}", None
    return (f"{param}: {first.get('msg')}" if param else str(first.get("msg"))), param


def create_app(server) -> FastAPI:
    """`server` is a `serve.server.Server`: engine, registry, guard, metrics, api key."""
    app = FastAPI(title="omlx", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_BodyIsJSON)

    @app.exception_handler(APIError)
    async def _api_error(_, error: APIError):
        return _error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, error: RequestValidationError):
        message, param = _validation_message(error)
        return _error_response(bad_request(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, error: StarletteHTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(error.status_code, str(error.detail), kind))

    @app.exception_handler(Exception)
    async def _unexpected(_, error: Exception):
        return _error_response(server_error(f"internal error: {type(error).__name__}: {error}"))

    def authorize(http: HTTPRequest) -> None:
        if server.api_key is None:
            return
        header = http.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 server.api_key.encode()):
            raise unauthorized()

    async def loaded_model(requested: str | None):
        model_id = server.registry.canonical(requested)
        if model_id is None:
            raise unknown_model(requested, server.registry.available())
        if (model := server.registry.loaded_now(model_id)) is not None:
            # Not through the engine thread, which takes calls between steps: a request that
            # came during a step would be admitted a step later (a prefill step: 0.1-0.5 s).
            return model
        future = server.engine.call(lambda: server.registry.get(model_id))
        try:
            return await asyncio.wrap_future(future)
        except MemoryRefused as refusal:  # no room for its weights, even after unloading others
            raise memory_refused(refusal) from refusal
        except Exception as error:  # noqa: BLE001 - a model that cannot load is the server's fault
            raise server_error(f"model {model_id!r} could not be loaded: {error}") from error

    def token_budget(model, prompt: list[int], requested: int | None) -> int:
        room = model.context_length - len(prompt)
        if room < 1 or (requested is not None and requested > room):
            asked = f" + max_tokens {requested}" if requested is not None else ""
            raise bad_request(f"the prompt has {len(prompt)} tokens{asked}, more than model "
                              f"{model.id!r} can hold ({model.context_length} tokens); shorten it",
                              "messages", "context_length_exceeded")
        return requested if requested is not None else min(room, DEFAULT_MAX_TOKENS)

    def check_ever_fits(model, request: Request) -> None:
        """Refuse at once what could not fit even on an idle server (507, with numbers)."""
        needed = server.engine.worst_case_bytes(model, len(request.prompt), request.max_tokens)
        ceiling = server.guard.hard_bytes - model.weights_bytes
        if needed > ceiling:
            server.metrics.memory_rejections.labels(model.id).inc()
            raise memory_refused(MemoryRefused(request.id, needed, max(0, ceiling), server.guard.hard_bytes))

    async def next_event(http: HTTPRequest, request: Request):
        """The request's next event; cancels it if the client disconnects meanwhile."""
        while True:
            try:
                return await asyncio.wait_for(request.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    request.cancel()
                    server.engine.wake()
                    raise asyncio.CancelledError from None

    async def start(http: HTTPRequest, model, body, prompt: list[int]) -> Request:
        request = Request(model_id=model.id, prompt=prompt,
                          max_tokens=token_budget(model, prompt, body.token_limit),
                          temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                          stop=body.stop, ignore_eos=body.ignore_eos,
                          loop=asyncio.get_running_loop())
        check_ever_fits(model, request)
        server.engine.submit(request)
        first = await next_event(http, request)
        if isinstance(first, Finished):  # refused at admission
            raise _finished_error(first)
        return request

    async def collect(http: HTTPRequest, request: Request) -> tuple[str, Finished]:
        parts = []
        while True:
            event = await next_event(http, request)
            if isinstance(event, Delta):
                parts.append(event.text)
            elif isinstance(event, Finished):
                if event.error is not None:
                    raise _finished_error(event)
                return "".join(parts), event

    def stream(request: Request, chunk, include_usage: bool):
        def render(event) -> tuple[bytes, bool]:
            if isinstance(event, Delta):
                return sse.frame(chunk(event.text, None)), False
            if not isinstance(event, Finished):
                return b"", False
            if event.error is not None:
                return sse.frame(_json(_finished_error(event).body())) + sse.DONE, True
            usage = sse.frame(chunk(None, None, usage=_usage(event))) if include_usage else b""
            return sse.frame(chunk(None, _finish_reason(event))) + usage + sse.DONE, True

        def closed() -> None:
            if request.finished_at is None:  # the client went away: free its slot on the next step
                request.cancel()
                server.engine.wake()

        opening = chunk(None, None, first=True)
        return sse.response(request.events, render, first=b"" if opening is None else sse.frame(opening),
                            on_close=closed)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
        model = await loaded_model(body.model)
        prompt, effort = await asyncio.to_thread(chat_prompt, model, body)
        request = await start(http, model, body, prompt)
        created, rid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex[:24]}"
        if body.stream:
            def chunk(text, finish, first=False, usage=None):
                document = {"id": rid, "object": "chat.completion.chunk", "created": created,
                            "model": model.id, "choices": []}
                if usage is not None:
                    document["usage"] = usage
                else:
                    delta = {"role": "assistant", "content": ""} if first else \
                        ({"content": text} if text is not None else {})
                    document["choices"] = [{"index": 0, "delta": delta, "logprobs": None,
                                            "finish_reason": finish}]
                return _json(document)
            return stream(request, chunk, body.include_usage)
        text, finished = await collect(http, request)
        return {"id": rid, "object": "chat.completion", "created": created, "model": model.id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": _finish_reason(finished)}],
                "usage": _usage(finished),
                **({"reasoning_effort": effort} if effort is not None else {})}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, http: HTTPRequest):
        model = await loaded_model(body.model)
        prompt = await asyncio.to_thread(completion_prompt, model, body)
        request = await start(http, model, body, prompt)
        created, rid = int(time.time()), f"cmpl-{uuid.uuid4().hex[:24]}"
        if body.stream:
            def chunk(text, finish, first=False, usage=None):
                if first:
                    return None  # text completions have no role chunk
                document = {"id": rid, "object": "text_completion", "created": created,
                            "model": model.id, "choices": []}
                if usage is not None:
                    document["usage"] = usage
                else:
                    document["choices"] = [{"index": 0, "text": text or "", "logprobs": None,
                                            "finish_reason": finish}]
                return _json(document)
            return stream(request, chunk, body.include_usage)
        text, finished = await collect(http, request)
        return {"id": rid, "object": "text_completion", "created": created, "model": model.id,
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": _finish_reason(finished)}],
                "usage": _usage(finished)}

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        created = int(server.started_at)
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "omlx"}
            for name in server.registry.available()]}

    from omlx_core.cluster.api import cluster_routes

    app.include_router(cluster_routes(server, authorize))

    @app.get("/health")
    async def health():
        if server.engine.load_error is not None:
            return JSONResponse({"status": "error", "message": str(server.engine.load_error)}, 503)
        if not server.engine.ready.is_set():
            return JSONResponse({"status": "loading"}, 503)
        return {"status": "ok"}

    @app.get("/api/status", dependencies=[Depends(authorize)])
    async def status():
        return server.status()

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=server.metrics.content_type)

    return app


class _BodyIsJSON:
    """Read every POST body as JSON, whatever Content-Type it claims (curl -d sends a form type)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = dict(scope, headers=headers + [(b"content-type", b"application/json")])
        await self.app(scope, receive, send)


def _finished_error(event: Finished) -> APIError:
    if isinstance(event.error, MemoryRefused):
        return memory_refused(event.error)
    if isinstance(event.error, APIError):
        return event.error
    return server_error(f"generation failed: {event.error}")


def _finish_reason(event: Finished) -> str:
    return "length" if event.reason == "length" else "stop"


def _usage(event: Finished) -> dict:
    return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
            "total_tokens": event.prompt_tokens + event.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": event.cached_tokens}}


def _json(document) -> str:
    return json.dumps(document, separators=(",", ":"))
