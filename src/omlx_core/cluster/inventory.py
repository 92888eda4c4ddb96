"""The controller's inventory of workers: `$OMLX_HOME/cluster/inventory.json` (0600, atomic).

A worker is keyed by name; its managed public key is its identity, so re-enrolling the
same worker updates its record, while a second name for a host already enrolled (a
`.local` name, an FQDN or an IP of the same machine) is refused.
"""

import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import tomli_w

from omlx_core.cluster.hosts import same_host
from omlx_core.cluster.paths import inventory_path
from omlx_core.errors import InputError, OmlxError
from omlx_core.settings.store import JsonStore


@dataclass
class Worker:
    name: str
    ssh_host: str
    ssh_port: int
    ssh_user: str
    backend: str  # ring | nccl
    python: str  # the worker's interpreter that has omlx
    home: str  # the worker's OMLX_HOME
    omlx_version: str
    mlx_version: str
    worker_key: str  # the worker's managed public key: its identity
    host_keys: list[str] = field(default_factory=list)  # sshd host keys pinned at join
    enrolled_at: float = 0.0
    last_verify: dict | None = None  # shown by status; never trusted for activation

    @classmethod
    def from_dict(cls, data: dict) -> "Worker":
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        return cls(**known)

    @property
    def target(self) -> str:
        return f"{self.ssh_user}@{self.ssh_host}:{self.ssh_port}"


def _store(home: Path) -> JsonStore:
    return JsonStore(inventory_path(home))


def controller_id(home: Path) -> str:
    """This controller's stable id (it tags its lines in workers' authorized_keys)."""
    document = _store(home).read()
    if "controller_id" in document:
        return document["controller_id"]
    return _store(home).update(lambda d: d.setdefault("controller_id", secrets.token_hex(8)))["controller_id"]


def workers(home: Path) -> list[Worker]:
    return [Worker.from_dict(item) for item in _store(home).read().get("workers", [])]


def get(home: Path, name: str) -> Worker:
    for worker in workers(home):
        if worker.name == name:
            return worker
    names = ", ".join(w.name for w in workers(home)) or "none enrolled"
    raise InputError(f"no worker named {name!r} in {inventory_path(home)} ({names})")


def enroll(home: Path, worker: Worker) -> Worker:
    """Add or update `worker`; refuses a name or host that belongs to another worker."""
    def mutate(document):
        document.setdefault("controller_id", secrets.token_hex(8))
        items = [Worker.from_dict(item) for item in document.get("workers", [])]
        for other in items:
            if other.worker_key == worker.worker_key:
                continue
            if other.name == worker.name:
                raise OmlxError(f"worker name {worker.name!r} is taken by another machine ({other.target}); "
                                f"join with --name NEW, or run `omlx cluster remove {other.name}` first")
            if same_host(other.ssh_host, worker.ssh_host) and other.ssh_port == worker.ssh_port:
                raise OmlxError(f"{worker.ssh_host} is the machine already enrolled as {other.name!r} "
                                f"({other.target}); run `omlx cluster remove {other.name}` to re-enroll it")
        worker.enrolled_at = time.time()
        kept = [item for item in items if item.worker_key != worker.worker_key]
        document["workers"] = [asdict(item) for item in kept + [worker]]
    _store(home).update(mutate)
    return worker


def remove(home: Path, name: str) -> Worker:
    worker = get(home, name)
    _store(home).update(lambda d: d.update(workers=[w for w in d.get("workers", []) if w["name"] != name]))
    return worker


def record_verify(home: Path, name: str, result: dict) -> None:
    def mutate(document):
        for item in document.get("workers", []):
            if item["name"] == name:
                item["last_verify"] = result
    _store(home).update(mutate)


def export_toml(home: Path) -> str:
    """The inventory as TOML, for people to read and diff (`omlx cluster export`)."""
    document = _store(home).read()
    out = {"controller_id": document.get("controller_id", ""), "workers": []}
    for item in document.get("workers", []):
        out["workers"].append({key: value for key, value in item.items() if value is not None})
    return tomli_w.dumps(out)
