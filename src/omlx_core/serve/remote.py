"""Asking a running server for its status, with the standard library only (status stays snappy)."""

import json
import urllib.error
import urllib.request

from omlx_core.errors import OmlxError


def fetch_status(url: str, api_key: str | None = None, timeout: float = 5.0) -> dict:
    """The server's /api/status document; OmlxError naming the URL and the fix otherwise."""
    endpoint = url.rstrip("/") + "/api/status"
    request = urllib.request.Request(endpoint, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        if error.code == 401:
            raise OmlxError(f"{endpoint}: the server wants an API key; pass --api-key or set "
                            "server.api_key") from error
        raise OmlxError(f"{endpoint}: HTTP {error.code}; is this an omlx server?") from error
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise OmlxError(f"{url}: no omlx server answers ({reason}); start one with `omlx serve`") from error
    except json.JSONDecodeError as error:
        raise OmlxError(f"{endpoint}: the answer is not JSON; is this an omlx server?") from error
