"""Verification before activation: SSH reachability, matching versions, a collective check.

Runs fresh every time, with each step bounded by `cluster.verify_timeout_s`; the result is
recorded in the inventory for `omlx cluster status` to show, but nothing ever activates on a
recorded result: `omlx serve --distributed` calls `verify` again first.
"""

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from omlx_core.cluster import inventory, launch, ssh
from omlx_core.cluster.keys import controller_pair
from omlx_core.cluster.probe import mismatches, probe
from omlx_core.cluster.paths import cluster_dir
from omlx_core.errors import OmlxError
from omlx_core.settings.store import write_text_atomic


@dataclass
class Step:
    name: str
    ok: bool
    detail: str
    seconds: float


@dataclass
class WorkerResult:
    name: str
    target: str
    steps: list[Step] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.steps) and all(step.ok for step in self.steps)


@dataclass
class Report:
    started_at: float
    timeout_s: float
    backend: str
    workers: list[WorkerResult]
    collective: Step | None = None

    @property
    def ok(self) -> bool:
        return bool(self.workers) and all(w.ok for w in self.workers) and bool(self.collective and self.collective.ok)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "started_at": self.started_at, "timeout_s": self.timeout_s, "backend": self.backend,
                "workers": [{"name": w.name, "target": w.target, "ok": w.ok, "info": w.info,
                             "steps": [asdict(s) for s in w.steps]} for w in self.workers],
                "collective": asdict(self.collective) if self.collective else None}

    def failure(self) -> str:
        """The first problem, as one line."""
        for worker in self.workers:
            for step in worker.steps:
                if not step.ok:
                    return f"{step.name}: {step.detail}"
        if not self.workers:
            return "no workers enrolled: run `omlx cluster invite` here and `omlx cluster join` on a worker"
        return f"collective: {self.collective.detail}" if self.collective else "collective check did not run"


def _check_worker(home: Path, worker: inventory.Worker, key, here: dict, timeout_s: float) -> WorkerResult:
    result = WorkerResult(worker.name, worker.target)
    start = time.monotonic()
    try:
        done = ssh.run(home, worker, key, ssh.remote_omlx(worker, "cluster", "probe", "--json"), timeout_s)
        result.info = json.loads(done.stdout)
        result.steps.append(Step("ssh", True, f"logged in as {worker.ssh_user} (BatchMode)", done.seconds))
    except (OmlxError, ValueError) as error:
        detail = str(error) if isinstance(error, OmlxError) else f"{worker.name}: omlx probe printed no JSON"
        result.steps.append(Step("ssh", False, detail, time.monotonic() - start))
        return result
    differ = mismatches(here, result.info)
    result.steps.append(Step("versions", not differ, "same omlx, MLX and mlx-lm as the controller" if not differ
                             else f"{worker.name} runs " + "; ".join(differ) + ": install the same versions", 0.0))
    if worker.backend == "nccl" and not result.info.get("cuda"):
        result.steps.append(Step("backend", False, f"{worker.name} enrolled for nccl but has no CUDA device", 0.0))
    return result


DIRECT = ("P2P", "NVLS", "CUMEM", "SHM", "NET/IB", "COLLNET")


def nccl_links(output: str) -> tuple[bool, set[str]]:
    """NCCL's `Channel … via TRANSPORT` lines: (every peer link is direct, the transports seen).
    A single rank has no peers, so nothing is reported and nothing can be indirect."""
    links = {line.split(" via ", 1)[1].split()[0] for line in output.splitlines() if " via " in line
             and "Channel" in line}
    return all(any(kind in link for kind in DIRECT) for link in links), links


def collective_check(home: Path, workers: list[inventory.Worker], key, backend: str, ring_port: int,
                     timeout_s: float, controller_ip: str) -> Step:
    group = launch.ranks(home, controller_ip, workers)
    start = time.monotonic()
    code, out, err = launch.run_bounded(home, group, workers, key, backend, ring_port,
                                        "omlx_core.cluster.collective",
                                        ["--backend", backend, "--timeout", str(timeout_s)], timeout_s + 5)
    seconds = time.monotonic() - start
    log = cluster_dir(home) / "collective.log"
    write_text_atomic(log, f"$ mlx.launch ({backend}, {len(group)} ranks)\n--- stdout\n{out}\n--- stderr\n{err}\n")
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    good = [line for line in lines if line.get("ok")]
    if code == 0 and len(good) == len(group):
        detail = f"{backend} all-sum across {len(group)} ranks: {good[0]['sum']:g}"
        if backend == "nccl":
            direct, links = nccl_links(out)
            detail += f"; transports: {', '.join(sorted(links)) or 'none reported'}"
            if not direct:
                return Step("collective", False, detail + ": NCCL found no direct link between the GPUs "
                            "(NVLink/PCIe P2P or InfiniBand); it would run over sockets", seconds)
        return Step("collective", True, detail, seconds)
    if code is None:
        detail = (f"{backend} all-sum across {len(group)} ranks did not finish within {timeout_s:g} s; "
                  f"the ranks' output is in {log}")
    else:
        problems = [f"rank {line.get('rank')}: {line.get('error')}" for line in lines if not line.get("ok")]
        detail = (f"{backend} all-sum failed ({len(good)}/{len(group)} ranks answered): "
                  + ("; ".join(problems) if problems else f"exit status {code}") + f"; the ranks' output is in {log}")
    return Step("collective", False, detail, seconds)


def verify(home: Path, settings, names: list[str] | None = None) -> Report:
    """Check the named workers (default: all) and the group they form with this controller."""
    timeout_s = float(settings["cluster.verify_timeout_s"])
    chosen = [inventory.get(home, name) for name in names] if names else inventory.workers(home)
    backends = {w.backend for w in chosen} or {"ring"}
    backend = "nccl" if "nccl" in backends else "ring"
    report = Report(time.time(), timeout_s, backend, [])
    if not chosen:
        return report
    key = controller_pair(home)
    here = probe()
    with ThreadPoolExecutor(max_workers=min(16, len(chosen))) as pool:
        report.workers = list(pool.map(lambda w: _check_worker(home, w, key, here, timeout_s), chosen))
    if all(result.ok for result in report.workers):
        report.collective = collective_check(home, chosen, key, backend, int(settings["cluster.ring_port"]),
                                             timeout_s, launch.controller_ip(settings, chosen))
    else:
        report.collective = Step("collective", False, "skipped: not every worker passed the checks above", 0.0)
    for result in report.workers:
        inventory.record_verify(home, result.name, {"at": report.started_at, "ok": result.ok and report.ok,
                                                    "detail": "ok" if result.ok and report.ok else report.failure()})
    return report
