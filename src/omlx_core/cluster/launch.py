"""Start a program on every rank with `mlx.launch`: the controller is rank 0, workers follow.

We write the hostfile `mlx.launch` reads (each host's SSH name and IP), and a rank
dispatcher: `mlx.launch` runs one command line everywhere, but each machine has its own
Python and OMLX_HOME, so the command is a tiny `sh` case on `MLX_RANK`. The launcher runs
in its own process group under a wall-clock bound; on timeout it is interrupted (which
makes `mlx.launch` stop its remote ranks) and then killed.
"""

import json
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from omlx_core.cluster.hosts import is_loopback, primary_address, resolve
from omlx_core.cluster.inventory import Worker
from omlx_core.cluster.keys import KeyPair
from omlx_core.cluster.paths import cluster_dir
from omlx_core.cluster.ssh import alias, launch_environment
from omlx_core.home import resolve_home
from omlx_core.settings.store import write_text_atomic


# The `mlx.launch` console script, run with this interpreter (its module has no __main__).
MLX_LAUNCH = "import sys; from mlx._distributed_utils.launch import main; sys.argv[0] = 'mlx.launch'; sys.exit(main())"


@dataclass(frozen=True)
class Rank:
    ssh: str  # what mlx.launch ssh-es to; 127.0.0.1 means "run here"
    ip: str  # where the ring backend connects
    python: str
    home: str


def ip_of(host: str) -> str:
    addresses = sorted(a for a in resolve(host) if ":" not in a)
    return addresses[0] if addresses else host


def controller_ip(settings, workers: list[Worker]) -> str:
    """Where the workers' ranks reach rank 0: the setting, loopback for an all-local group,
    else this machine's outgoing address."""
    if settings["cluster.address"]:
        return settings["cluster.address"]
    if all(is_loopback(ip_of(w.ssh_host)) for w in workers):
        return "127.0.0.1"
    return primary_address()


def ranks(home: Path, controller_ip: str, workers: list[Worker]) -> list[Rank]:
    here = Rank("127.0.0.1", controller_ip, sys.executable, str(resolve_home(home)))
    return [here] + [Rank(alias(w), ip_of(w.ssh_host), w.python, w.home) for w in workers]


def write_hostfile(home: Path, group: list[Rank], backend: str) -> Path:
    path = cluster_dir(home) / "hostfile.json"
    document = {"backend": backend, "envs": [],
                "hosts": [{"ssh": rank.ssh, "ips": [rank.ip]} for rank in group]}
    write_text_atomic(path, json.dumps(document, indent=2) + "\n")
    return path


def dispatcher(group: list[Rank], module: str, args: list[str]) -> list[str]:
    """`sh -c 'case $MLX_RANK in …'`: each rank execs its own Python with its own OMLX_HOME."""
    cases = " ".join(f"{index}) export OMLX_HOME={shlex.quote(rank.home)}; exec {shlex.quote(rank.python)} "
                     f"-m {module} \"$@\";;" for index, rank in enumerate(group))
    script = f'case "$MLX_RANK" in {cases} *) echo "omlx: no rank $MLX_RANK" >&2; exit 64;; esac'
    return ["sh", "-c", script, "omlx-rank", *args]


def command(hostfile: Path, backend: str, ring_port: int, rank_command: list[str]) -> list[str]:
    return [sys.executable, "-c", MLX_LAUNCH, "--hostfile", str(hostfile),
            "--backend", backend, "--starting-port", str(ring_port), "--", *rank_command]


def start(home: Path, group: list[Rank], workers: list[Worker], key: KeyPair, backend: str, ring_port: int,
          module: str, args: list[str], timeout_s: float, **popen) -> subprocess.Popen:
    hostfile = write_hostfile(home, group, backend)
    env = launch_environment(home, workers, key, timeout_s)
    return subprocess.Popen(command(hostfile, backend, ring_port, dispatcher(group, module, args)),
                            env=env, start_new_session=True, **popen)


def stop(process: subprocess.Popen, grace_s: float = 3.0) -> None:
    """Interrupt the launcher (it stops its remote ranks), then kill what is left."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGINT)
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def run_bounded(home: Path, group: list[Rank], workers: list[Worker], key: KeyPair, backend: str,
                ring_port: int, module: str, args: list[str], timeout_s: float) -> tuple[int | None, str, str]:
    """Run to completion within `timeout_s`; returns (exit code or None on timeout, stdout, stderr)."""
    process = start(home, group, workers, key, backend, ring_port, module, args, timeout_s,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        out, err = process.communicate(timeout=timeout_s)
        return process.returncode, out, err
    except subprocess.TimeoutExpired:
        stop(process)
        out, err = process.communicate()
        return None, out or "", err or ""
