"""Managed SSH key pairs: the controller's (it logs into workers) and each worker's (its identity).

Keys are ed25519 pairs made by `ssh-keygen`, kept under `$OMLX_HOME/cluster/keys/`. The
controller's pair lives in a generation directory named by `controller/current`, so a
rotation can build and verify a new generation off-path and switch to it with one atomic
write of that pointer; the old generation stays intact until the switch.
"""

import os
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from omlx_core.cluster.paths import keys_dir
from omlx_core.errors import OmlxError
from omlx_core.settings.store import write_text_atomic

PUBLIC_KEY = re.compile(r"^(ssh-ed25519|ecdsa-sha2-nistp(256|384|521)|ssh-rsa) [A-Za-z0-9+/]+={0,3}$")


@dataclass(frozen=True)
class KeyPair:
    private: Path

    @property
    def public(self) -> Path:
        return self.private.with_name(self.private.name + ".pub")

    def public_key(self) -> str:
        """`type base64`, without the comment (omlx puts its own marker there)."""
        return " ".join(self.public.read_text().split()[:2])

    def fingerprint(self) -> str:
        out = subprocess.run(["ssh-keygen", "-lf", str(self.public)], capture_output=True, text=True)
        return out.stdout.split()[1] if out.returncode == 0 else "unknown"


def check_public_key(text: str, what: str) -> str:
    """A single-line OpenSSH public key `type base64`: nothing that could smuggle options or lines."""
    key = " ".join(str(text).split()[:2])
    if not PUBLIC_KEY.match(key) or "\n" in str(text).strip():
        raise OmlxError(f"{what} is not an OpenSSH public key (expected 'ssh-ed25519 AAAA…')")
    return key


def generate(directory: Path, comment: str) -> KeyPair:
    if not shutil.which("ssh-keygen"):
        raise OmlxError("ssh-keygen not found: install OpenSSH's client (Debian: apt install openssh-client)")
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    pair = KeyPair(directory / "id_ed25519")
    result = subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(pair.private)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise OmlxError(f"ssh-keygen failed in {directory}: {result.stderr.strip()}")
    os.chmod(pair.private, 0o600)
    return pair


def worker_pair(home: Path) -> KeyPair:
    """This worker's pair, made on first join and reused after (its identity on re-enrollment)."""
    pair = KeyPair(keys_dir(home) / "worker" / "id_ed25519")
    if pair.private.exists() and pair.public.exists():
        return pair
    return generate(pair.private.parent, "omlx-worker")


def _controller_root(home: Path) -> Path:
    root = keys_dir(home) / "controller"
    root.mkdir(exist_ok=True, mode=0o700)
    return root


def controller_pair(home: Path, create: bool = True) -> KeyPair | None:
    """The controller's current pair (made on first use when `create`)."""
    root = _controller_root(home)
    pointer = root / "current"
    if pointer.exists():
        pair = KeyPair(root / pointer.read_text().strip() / "id_ed25519")
        if pair.private.exists():
            return pair
        raise OmlxError(f"{pointer} names a missing key pair ({pair.private}): restore it or remove "
                        f"{pointer} and re-pair every worker")
    if not create:
        return None
    pair = new_controller_generation(home)
    switch_controller_pair(home, pair)
    return pair


def new_controller_generation(home: Path) -> KeyPair:
    """A fresh pair beside the current one, not yet in use."""
    return generate(_controller_root(home) / f"gen-{secrets.token_hex(6)}", "omlx-controller")


def switch_controller_pair(home: Path, pair: KeyPair) -> None:
    """Make `pair` the current one in one atomic write."""
    write_text_atomic(_controller_root(home) / "current", pair.private.parent.name + "\n")


def discard(pair: KeyPair) -> None:
    shutil.rmtree(pair.private.parent, ignore_errors=True)
