"""Asking a running server for its status, with the standard library only (status stays snappy)."""

import json
import urllib.error
import urllib.request

from omlx_core.errors import OmlxError


class NoServer(OmlxError):
    """Nothing answers at the URL (refused, unreachable, timed out)."""


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
        raise NoServer(f"{url}: no omlx server answers ({reason}); start one with `omlx serve`") from error
    except json.JSONDecodeError as error:
        raise OmlxError(f"{endpoint}: the answer is not JSON; is this an omlx server?") from error


def default_url(settings) -> str:
    """Where `omlx serve` listens by these settings (a wildcard host is asked on loopback)."""
    host = settings["server.host"]
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://{f'[{host}]' if ':' in host else host}:{settings['server.port']}"


def probe_server(settings, timeout: float = 0.5) -> dict:
    """Whether a server answers at the settings' address, and its status if it does."""
    url = default_url(settings)
    try:
        return {"url": url, "running": True, "error": None,
                "status": fetch_status(url, settings["server.api_key"], timeout)}
    except NoServer:
        return {"url": url, "running": False, "error": None, "status": None}
    except OmlxError as error:  # something answers, but not as an omlx server would
        return {"url": url, "running": False, "error": str(error), "status": None}
