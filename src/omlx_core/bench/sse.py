"""Server-sent events as OpenAI-compatible servers stream them: `data: {json}` lines.

Each event is the `data:` lines up to a blank line, joined by newlines. Comment lines
(`: keepalive`, which mlx_lm.server sends during long prefills) and other fields are
skipped. The stream ends at `data: [DONE]` or when the connection closes.
"""

import json
from collections.abc import AsyncIterator

DONE = "[DONE]"


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[dict]:
    """The JSON payload of every event; a payload that is not JSON is given as {"raw": text}."""
    data: list[str] = []
    async for line in lines:
        line = line.rstrip("\r")
        if line == "":
            if data:
                payload = "\n".join(data)
                data = []
                if payload.strip() == DONE:
                    return
                yield _decode(payload)
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        payload = "\n".join(data)
        if payload.strip() != DONE:
            yield _decode(payload)


def _decode(payload: str) -> dict:
    try:
        event = json.loads(payload)
    except json.JSONDecodeError:
        return {"raw": payload}
    return event if isinstance(event, dict) else {"raw": payload}
