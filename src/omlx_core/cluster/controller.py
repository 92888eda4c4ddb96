"""The controller's side of enrollment: invite, claim, register (the HTTP API calls these).

Order matters and is enforced here: a worker first claims its code (atomic, single use),
then provisions itself, then registers with the token the claim gave it. Registration
pins the worker's host keys and ends with a real SSH login, so `join` reports a working
pairing, or exactly why not.
"""

import time
from pathlib import Path

from omlx_core.cluster import inventory, invites, ssh
from omlx_core.cluster.hosts import is_loopback, primary_address
from omlx_core.cluster.keys import check_public_key, controller_pair
from omlx_core.cluster.probe import probe
from omlx_core.errors import InputError, OmlxError


def invite(home: Path, settings, ttl_s: float) -> dict:
    key = controller_pair(home)
    code, record = invites.create(home, ttl_s)
    host = settings["server.host"]
    wildcard = host in ("0.0.0.0", "::", "")
    url = f"http://{primary_address() if wildcard else host}:{settings['server.port']}"
    loopback = not wildcard and is_loopback(host)
    return {"code": code, **record, "controller_url": url, "controller_id": inventory.controller_id(home),
            "controller_key": key.fingerprint(),
            "note": ("omlx serve listens on loopback only (server.host): only this machine can join; "
                     "serve with --host 0.0.0.0 for other machines") if loopback else None}


def claim(home: Path, settings, code: str, name: str) -> dict:
    """Spend the code; hand the worker what it needs to authorize this controller."""
    check_name(name)
    token = invites.claim(home, code, name)
    key = controller_pair(home)
    return {"registration_token": token, "controller_id": inventory.controller_id(home),
            "controller_key": key.public_key(), "controller_address": settings["cluster.address"],
            "versions": probe()}


def check_name(name: str) -> str:
    if not name or len(name) > 63 or not all(c.isalnum() or c in "-_" for c in name):
        raise InputError(f"worker name {name!r}: use 1-63 letters, digits, '-' or '_'")
    return name


def register(home: Path, settings, token: str, payload: dict, peer: str) -> dict:
    """Enroll the worker that spent `token`, then log into it once over SSH."""
    name = invites.redeem(home, token)
    try:
        worker = inventory.Worker(
            name=name, ssh_host=str(payload.get("ssh_host") or peer), ssh_port=int(payload["ssh_port"]),
            ssh_user=str(payload["ssh_user"]), backend=str(payload["backend"]), python=str(payload["python"]),
            home=str(payload["home"]), omlx_version=str(payload["omlx_version"]),
            mlx_version=str(payload["mlx_version"]),
            worker_key=check_public_key(payload["worker_key"], "the worker's public key"),
            host_keys=[check_public_key(k, "a worker host key") for k in payload.get("host_keys", [])])
    except (KeyError, TypeError, ValueError) as error:
        raise InputError(f"registration is missing or has a bad field: {error}") from error
    if worker.backend not in ("ring", "nccl"):
        raise InputError(f"backend {worker.backend!r}: use ring or nccl")
    inventory.enroll(home, worker)
    ssh.pin_host_keys(home, worker)
    start = time.monotonic()
    try:
        ssh.run(home, worker, controller_pair(home), ssh.remote_omlx(worker, "cluster", "probe", "--json"),
                float(settings["cluster.verify_timeout_s"]))
        login = {"ok": True, "detail": f"controller logged into {worker.target} over SSH"}
    except OmlxError as error:
        login = {"ok": False, "detail": str(error)}
    login["seconds"] = round(time.monotonic() - start, 3)
    inventory.record_verify(home, name, {"at": time.time(), "ok": login["ok"], "detail": login["detail"]})
    return {"name": name, "target": worker.target, "login": login}
