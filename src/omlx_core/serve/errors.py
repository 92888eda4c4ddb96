"""API errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from dataclasses import dataclass, field


@dataclass
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # more fields for the error object

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code, **self.extra}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unknown_model(model: str, known: list[str]) -> APIError:
    return APIError(404, f"model {model!r} not found; available: {', '.join(known) or 'none'}",
                    "invalid_request_error", "model", "model_not_found")


def unauthorized() -> APIError:
    return APIError(401, "missing or invalid API key; send 'Authorization: Bearer <key>'",
                    "authentication_error", None, "invalid_api_key",
                    {"WWW-Authenticate": "Bearer"})


def queue_full(waiting: int, limit: int, retry_after_s: int) -> APIError:
    return APIError(503, f"server busy: {waiting} requests waiting (server.max_queue = {limit}); "
                    f"retry after {retry_after_s} s", "server_busy", None, "queue_full",
                    {"Retry-After": str(retry_after_s)})


def memory_refused(refusal) -> APIError:
    """507 with the guard's numbers, so a client can tell how far off it was."""
    error = APIError(507, str(refusal), "insufficient_memory", None, "memory_guard")
    error.extra = {"needed_bytes": refusal.needed, "available_bytes": refusal.available,
                   "watermark_bytes": refusal.watermark}
    return error


def server_error(message: str) -> APIError:
    return APIError(500, message, "server_error", None, None)
