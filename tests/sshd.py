"""A real OpenSSH server on a free loopback port, for the cluster tests.

It has its own host key, logs in only the current user with public keys, and reads
authorized_keys from a throwaway home (`.ssh` under the test's directory), so a test
never touches the real `~/.ssh`. Debian's openssh-server provides /usr/sbin/sshd.
"""

import getpass
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from conftest import free_port

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


class Sshd:
    def __init__(self, root: Path):
        self.root = root
        self.home = root / "home"
        self.ssh_dir = self.home / ".ssh"
        self.ssh_dir.mkdir(parents=True, mode=0o700)
        self.host_key = root / "host_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.host_key)], check=True)
        self.port = free_port()
        self.user = getpass.getuser()
        self.config = root / "sshd_config"
        self.config.write_text("\n".join([
            f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {self.host_key}",
            f"PidFile {root / 'sshd.pid'}", f"AuthorizedKeysFile {self.ssh_dir / 'authorized_keys'}",
            "StrictModes no", "PubkeyAuthentication yes", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password", "UsePAM no",
            f"AllowUsers {self.user}", "LogLevel VERBOSE", "MaxStartups 50", ""]))
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        self.log = root / "sshd.log"
        self.process = None
        self.start()

    @property
    def host_public_key(self) -> Path:
        return self.host_key.with_name(self.host_key.name + ".pub")

    def start(self) -> None:
        self.process = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.config)],
                                        stdout=open(self.log, "a"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"sshd exited {self.process.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"sshd not listening on {self.port}: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)

    def worker_env(self) -> dict:
        """Settings (as environment) for a worker whose sshd this is."""
        return {"OMLX_CLUSTER_SSH_DIR": str(self.ssh_dir), "OMLX_CLUSTER_SSH_PORT": str(self.port),
                "OMLX_CLUSTER_HOST_KEY_FILES": str(self.host_public_key), "OMLX_CLUSTER_SSH_HOST": "127.0.0.1"}

    def login(self, private_key: Path, timeout: float = 10) -> subprocess.CompletedProcess:
        """A plain `ssh … true` with one key, as any client would try it."""
        return subprocess.run(["ssh", "-i", str(private_key), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
                               "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                               "-o", "LogLevel=ERROR", "-p", str(self.port), f"{self.user}@127.0.0.1", "true"],
                              capture_output=True, text=True, timeout=timeout)


def available() -> bool:
    return os.path.exists(SSHD) and shutil.which("ssh") is not None and shutil.which("ssh-keygen") is not None
