"""Edit a worker's `authorized_keys` safely: one omlx line per controller, updated in place.

The controller's key goes in as `from="<controller address>",restrict,pty <key> omlx-controller:<id>`:
logins only from the controller, no forwarding, agent, X11 or user rc. `pty` is re-allowed
because `mlx.launch` runs each rank under `ssh -tt` (the terminal's hangup is how a remote
rank dies with its launcher) and fails outright without one.
Re-enrollment replaces that line where it stands; other lines are kept byte for byte. The
file is written with a temp file and an atomic replace (0600) in a 0700 directory. A
symlinked `~/.ssh` or `authorized_keys` is refused: the write could land anywhere.
"""

import os
import re
from pathlib import Path

from omlx_core.cluster.keys import check_public_key
from omlx_core.errors import OmlxError
from omlx_core.settings.store import write_text_atomic

OPTIONS = "restrict,pty"
ADDRESS = re.compile(r"^[A-Za-z0-9.:*?!/-]+$")


def marker(controller_id: str, pending: bool = False) -> str:
    return f"omlx-controller:{controller_id}" + (":next" if pending else "")


def ssh_directory(ssh_dir: str | Path) -> Path:
    """The SSH directory, created 0700 if missing; refused if it is a symlink."""
    path = Path(os.path.expanduser(str(ssh_dir)))
    if path.is_symlink():
        raise OmlxError(f"{path} is a symlink (to {os.readlink(path)}); omlx edits authorized_keys only in a "
                        "real directory, since a link could send the write elsewhere: replace it with a directory")
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not path.is_dir():
        raise OmlxError(f"{path} is not a directory")
    os.chmod(path, 0o700)
    return path


def _file(ssh_dir: str | Path) -> Path:
    path = ssh_directory(ssh_dir) / "authorized_keys"
    if path.is_symlink():
        raise OmlxError(f"{path} is a symlink (to {os.readlink(path)}); omlx will not write through it: "
                        "replace it with a regular file (cp --remove-destination \"$(readlink -f F)\" F)")
    if path.exists() and not path.is_file():
        raise OmlxError(f"{path} is not a regular file")
    return path


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines(keepends=True) if path.exists() else []


def _owner(line: str) -> str | None:
    words = line.split()
    return words[-1] if words and words[-1].startswith("omlx-controller:") else None


def _write(path: Path, lines: list[str]) -> None:
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    write_text_atomic(path, "".join(lines))


def authorize(ssh_dir: str | Path, public_key: str, from_address: str, controller_id: str,
              pending: bool = False) -> Path:
    """Install (or update in place) the controller's line; returns the file's path."""
    key = check_public_key(public_key, "the controller's public key")
    if not ADDRESS.match(from_address):
        raise OmlxError(f"controller address {from_address!r} is not a host or IP pattern")
    if not re.fullmatch(r"[0-9a-f]{8,64}", controller_id):
        raise OmlxError(f"controller id {controller_id!r} is not an omlx controller id")
    path = _file(ssh_dir)
    line = f'from="{from_address}",{OPTIONS} {key} {marker(controller_id, pending)}\n'
    lines = _lines(path)
    tag = marker(controller_id, pending)
    for index, existing in enumerate(lines):
        if _owner(existing) == tag:
            lines[index] = line
            break
    else:
        lines.append(line)
    _write(path, lines)
    return path


def current_line(ssh_dir: str | Path, controller_id: str) -> dict | None:
    """The controller's current line as {"from", "key"}, or None."""
    for line in _lines(_file(ssh_dir)):
        if _owner(line) == marker(controller_id):
            found = re.match(r'^from="([^"]*)",\S+ (\S+ \S+) ', line)
            if found:
                return {"from": found.group(1), "key": found.group(2)}
    return None


def revoke(ssh_dir: str | Path, controller_id: str, pending: bool = False) -> bool:
    """Remove the controller's line (or its pending rotation line); True if one was there."""
    path = _file(ssh_dir)
    lines = _lines(path)
    kept = [line for line in lines if _owner(line) != marker(controller_id, pending)]
    if len(kept) == len(lines):
        return False
    _write(path, kept)
    return True


def promote(ssh_dir: str | Path, controller_id: str) -> None:
    """Finish a rotation: the pending line takes the current line's place."""
    path = _file(ssh_dir)
    lines = _lines(path)
    pending = [line for line in lines if _owner(line) == marker(controller_id, True)]
    if not pending:
        raise OmlxError(f"{path} has no pending omlx key for controller {controller_id}")
    promoted = pending[0].replace(marker(controller_id, True), marker(controller_id))
    out, placed = [], False
    for line in lines:
        owner = _owner(line)
        if owner == marker(controller_id):
            out.append(promoted)
            placed = True
        elif owner != marker(controller_id, True):
            out.append(line)
    if not placed:
        out.append(promoted)
    _write(path, out)
