"""Where cluster state lives: `$OMLX_HOME/cluster/`, a 0700 directory of 0600 files."""

import os
from pathlib import Path


def cluster_dir(home: Path) -> Path:
    path = Path(home) / "cluster"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def inventory_path(home: Path) -> Path:
    return cluster_dir(home) / "inventory.json"


def invites_path(home: Path) -> Path:
    return cluster_dir(home) / "invites.json"


def keys_dir(home: Path) -> Path:
    path = cluster_dir(home) / "keys"
    path.mkdir(exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def known_hosts_path(home: Path) -> Path:
    return cluster_dir(home) / "known_hosts"
