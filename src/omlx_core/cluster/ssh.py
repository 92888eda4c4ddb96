"""SSH from the controller to its workers: bounded, non-interactive, with pinned host keys.

Every login uses the controller's managed key only (`IdentitiesOnly`), `BatchMode` (never a
prompt), a connect timeout and an outer wall-clock bound. Host keys the worker sent at join
are pinned in omlx's own known_hosts; a failure comes back as one line of pairing guidance
(which key, which host, what to run) instead of ssh's output. `mlx.launch` calls plain
`ssh HOST`, so `launch_environment` puts a wrapper first on PATH that adds omlx's config.
"""

import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from omlx_core.cluster.inventory import Worker
from omlx_core.cluster.keys import KeyPair
from omlx_core.cluster.paths import cluster_dir, known_hosts_path
from omlx_core.errors import OmlxError
from omlx_core.settings.store import write_text_atomic


class SSHFailure(OmlxError):
    """An SSH login or remote command failed; the message says what to do."""


@dataclass(frozen=True)
class Completed:
    stdout: str
    stderr: str
    seconds: float


def alias(worker: Worker) -> str:
    return f"omlx-{worker.name}"


def _known_host_name(worker: Worker) -> str:
    return worker.ssh_host if worker.ssh_port == 22 else f"[{worker.ssh_host}]:{worker.ssh_port}"


def pin_host_keys(home: Path, worker: Worker) -> None:
    """Replace `worker`'s lines in omlx's known_hosts with the host keys it sent at join."""
    path = known_hosts_path(home)
    name = _known_host_name(worker)
    lines = path.read_text().splitlines() if path.exists() else []
    kept = [line for line in lines if line.split(" ", 1)[0] != name]
    write_text_atomic(path, "".join(f"{line}\n" for line in kept + [f"{name} {key}" for key in worker.host_keys]))


def _ssh_options(home: Path, worker: Worker, timeout_s: float) -> dict[str, str]:
    """The ssh options every omlx login uses (as `ssh -o` flags and as ssh_config lines)."""
    return {"IdentitiesOnly": "yes", "BatchMode": "yes", "ConnectTimeout": str(max(1, int(timeout_s))),
            "StrictHostKeyChecking": "yes" if worker.host_keys else "accept-new",
            "UserKnownHostsFile": str(known_hosts_path(home)), "GlobalKnownHostsFile": "/dev/null",
            "LogLevel": "ERROR", "ServerAliveInterval": "5", "ServerAliveCountMax": "2"}


def options(home: Path, worker: Worker, key: KeyPair, timeout_s: float) -> list[str]:
    flags = [f for name, value in _ssh_options(home, worker, timeout_s).items() for f in ("-o", f"{name}={value}")]
    return ["-i", str(key.private), *flags, "-p", str(worker.ssh_port), "-l", worker.ssh_user]


def remote_omlx(worker: Worker, *args: str) -> str:
    """The command line that runs `omlx ARGS` on the worker, as it was installed there."""
    return shlex.join(["env", f"OMLX_HOME={worker.home}", worker.python, "-m", "omlx_cli", *args])


def run(home: Path, worker: Worker, key: KeyPair, command: str, timeout_s: float,
        stdin: str | None = None) -> Completed:
    """Run `command` on `worker`; raises SSHFailure with guidance, within `timeout_s`."""
    argv = ["ssh", *options(home, worker, key, timeout_s), worker.ssh_host, command]
    start = time.monotonic()
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(stdin, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise SSHFailure(f"{worker.name} ({worker.target}) did not answer within {timeout_s:g} s: check the "
                         f"machine is up and sshd is reachable, then run `omlx cluster verify {worker.name}`")
    if process.returncode != 0:
        raise SSHFailure(guidance(worker, key, stderr, process.returncode))
    return Completed(stdout, stderr, time.monotonic() - start)


def guidance(worker: Worker, key: KeyPair, stderr: str, code: int) -> str:
    """One line that says what went wrong and how to repair the pairing."""
    text = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit status {code}"
    lowered = stderr.lower()
    where = f"{worker.name} ({worker.target})"
    if "permission denied" in lowered:
        return (f"{where} refused the controller key {key.public} ({key.fingerprint()}): the worker's "
                f"authorized_keys lacks it or it was rotated. Re-pair: run `omlx cluster invite` here, then "
                f"`omlx cluster join <controller URL> --code <code>` on {worker.ssh_host}")
    if "host key verification failed" in lowered or "remote host identification has changed" in lowered:
        return (f"{where} presented a host key that differs from the one pinned at join in "
                f"{worker.ssh_host}'s entry of the cluster known_hosts: if the worker was reinstalled, run "
                f"`omlx cluster remove {worker.name}` and join it again; otherwise do not trust it")
    if "connection refused" in lowered:
        return f"{where}: connection refused, no sshd listening on port {worker.ssh_port}: start sshd on the worker"
    if "could not resolve" in lowered or "no route" in lowered or "timed out" in lowered:
        return f"{where} is unreachable ({text}): check the address and the network, then verify again"
    return f"{where}: remote command failed: {text}"


def launch_environment(home: Path, workers: list[Worker], key: KeyPair, timeout_s: float) -> dict:
    """Environment for `mlx.launch`: a PATH whose `ssh` logs into each `omlx-NAME` alias with
    omlx's key, known_hosts and timeouts."""
    directory = cluster_dir(home)
    blocks = []
    for worker in workers:
        blocks.append("\n".join([f"Host {alias(worker)}", f"  HostName {worker.ssh_host}",
                                 f"  Port {worker.ssh_port}", f"  User {worker.ssh_user}",
                                 f"  IdentityFile {key.private}",
                                 *(f"  {name} {value}" for name, value in _ssh_options(home, worker, timeout_s).items())]))
    config = directory / "ssh_config"
    write_text_atomic(config, "\n\n".join(blocks) + "\n")
    bin_dir = directory / "bin"
    bin_dir.mkdir(exist_ok=True, mode=0o700)
    wrapper = bin_dir / "ssh"
    real = _real_ssh(bin_dir)
    write_text_atomic(wrapper, f"#!/bin/sh\nexec {shlex.quote(real)} -F {shlex.quote(str(config))} \"$@\"\n")
    os.chmod(wrapper, 0o700)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


def _real_ssh(wrapper_dir: Path) -> str:
    import shutil

    search = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != str(wrapper_dir))
    found = shutil.which("ssh", path=search)
    if not found:
        raise OmlxError("ssh not found: install OpenSSH's client (Debian: apt install openssh-client)")
    return found
