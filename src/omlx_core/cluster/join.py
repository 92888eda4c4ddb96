"""The worker's side of `omlx cluster join`: claim first, then provision, then register.

Claiming first means a replayed or expired code is refused before anything on this
machine changes. Provisioning makes (or reuses) this worker's key pair and installs the
controller's key in `authorized_keys` (`from=<controller>,restrict`, in place).
"""

import getpass
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

from omlx_core.cluster import authorized_keys
from omlx_core.cluster.hosts import resolve
from omlx_core.cluster.keys import check_public_key, worker_pair
from omlx_core.cluster.paths import cluster_dir
from omlx_core.cluster.probe import probe, resolve_backend
from omlx_core.errors import InputError, OmlxError
from omlx_core.home import resolve_home
from omlx_core.settings.store import JsonStore


def _post(url: str, path: str, body: dict, timeout_s: float) -> dict:
    try:
        response = httpx.post(url.rstrip("/") + path, json=body, timeout=timeout_s)
    except httpx.HTTPError as error:
        raise OmlxError(f"cannot reach the controller at {url}: {error}; is `omlx serve` running there?") from error
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text.strip()[:200]
        raise OmlxError(f"controller {url} refused {path}: {message}")
    return response.json()


def controller_address(url: str, given: str | None) -> str:
    """Where the controller's SSH logins come from: its own setting, else the URL's host as an IP."""
    if given:
        return given
    host = urlparse(url).hostname or ""
    addresses = sorted(a for a in resolve(host) if ":" not in a) or sorted(resolve(host))
    if not addresses:
        raise InputError(f"controller host {host!r} does not resolve")
    return addresses[0]


def _joined(home: Path) -> JsonStore:
    return JsonStore(cluster_dir(home) / "worker.json")


def remember(home: Path, controller_id: str, url: str, ssh_dir: Path) -> None:
    """Record which SSH directory this join edited: the controller's later remote commands
    (rotation, revocation) must edit the same one, whatever their login's environment says."""
    entry = {"url": url, "ssh_dir": str(ssh_dir.resolve()), "joined_at": time.time()}
    _joined(home).update(lambda d: d.setdefault("controllers", {}).__setitem__(controller_id, entry))


def joined_ssh_dir(home: Path, controller_id: str) -> Path:
    entry = _joined(home).read().get("controllers", {}).get(controller_id)
    if entry is None:
        raise InputError(f"this worker ({cluster_dir(home)}) has not joined controller {controller_id}: join it first")
    return Path(entry["ssh_dir"])


def join(home: Path, settings, url: str, code: str, name: str | None, backend: str,
         timeout_s: float = 60.0) -> dict:
    if not urlparse(url).scheme:
        url = "http://" + url
    info = probe()
    backend = resolve_backend(backend, info)
    name = name or socket.gethostname().split(".", 1)[0]
    claimed = _post(url, "/api/cluster/claim", {"code": code, "name": name}, timeout_s)

    pair = worker_pair(home)
    address = controller_address(url, claimed.get("controller_address"))
    path = authorized_keys.authorize(settings["cluster.ssh_dir"], claimed["controller_key"], address,
                                     claimed["controller_id"])
    remember(home, claimed["controller_id"], url, path.parent)
    host_keys = []
    for file in settings["cluster.host_key_files"]:
        try:
            host_keys.append(check_public_key(Path(file).read_text(), f"host key {file}"))
        except OSError:
            continue
    registered = _post(url, "/api/cluster/register", {
        "registration_token": claimed["registration_token"],
        "worker": {"ssh_host": settings["cluster.ssh_host"], "ssh_port": settings["cluster.ssh_port"],
                   "ssh_user": settings["cluster.ssh_user"] or getpass.getuser(), "backend": backend,
                   "python": sys.executable, "home": str(resolve_home(home)),
                   "omlx_version": info["omlx_version"], "mlx_version": info["mlx_version"],
                   "worker_key": pair.public_key(), "host_keys": host_keys}}, timeout_s)
    return {"name": registered["name"], "controller": url, "controller_address": address,
            "authorized_keys": str(path), "worker_key": pair.fingerprint(), "backend": backend,
            "host_keys_pinned": len(host_keys), "login": registered["login"], "target": registered["target"]}
