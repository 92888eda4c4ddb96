"""One JSON settings file on disk that never loses an update and is never seen torn.

Writers hold a `filelock` across read-modify-write, write a per-process temp file in
the same directory, flush + fsync it, `os.replace` it over the old file and fsync the
directory. Readers take no lock: `os.replace` is atomic, so they see the old file or
the new one. A file that fails to parse or validate is moved aside to
`<name>.corrupt-<UTC timestamp>` (never deleted) and the caller gets an empty document.
"""

import json
import logging
import os
import secrets
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from filelock import FileLock

from omlx_core.processes import pid_alive

log = logging.getLogger("omlx.settings")

Validator = Callable[[dict], None]  # raises ValueError (or InputError) when a document is invalid
LOCK_TIMEOUT_S = 30.0


class JsonStore:
    """Atomic, lock-protected access to one JSON object file (mode 0600)."""

    def __init__(self, path: Path, validate: Validator | None = None):
        self.path = Path(path)
        self.validate = validate or (lambda document: None)
        self.lock = FileLock(str(self.path) + ".lock", timeout=LOCK_TIMEOUT_S)

    def read(self) -> dict:
        """The current document; {} when the file is missing or had to be quarantined."""
        raw = self._read_bytes()
        if raw is None:
            return {}
        document, problem = self._parse(raw)
        if problem is None:
            return document
        with self.lock:
            return self._quarantine_if_unchanged(raw, problem)

    def update(self, mutate: Callable[[dict], Any]) -> dict:
        """Apply `mutate` to the document in place under the lock and write it atomically."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with self.lock:
            raw = self._read_bytes()
            document = {}
            if raw is not None:
                document, problem = self._parse(raw)
                if problem is not None:
                    document = self._quarantine_if_unchanged(raw, problem)
            mutate(document)
            self.validate(document)
            self._remove_stale_temp_files()
            self._write_atomic(json.dumps(document, indent=2, sort_keys=True) + "\n")
            return document

    def _read_bytes(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return None

    def _parse(self, raw: bytes) -> tuple[dict, str | None]:
        try:
            document = json.loads(raw)
            if not isinstance(document, dict):
                return {}, "top level is not a JSON object"
            self.validate(document)
            return document, None
        except Exception as error:  # noqa: BLE001 - bad JSON or any validation failure
            return {}, (str(error).splitlines() or [type(error).__name__])[0]

    def _quarantine_if_unchanged(self, raw: bytes, problem: str) -> dict:
        """Move the bad file aside, unless another process already replaced it."""
        current = self._read_bytes()
        if current is None:
            return {}
        if current != raw:
            document, again = self._parse(current)
            if again is None:
                return document
            raw, problem = current, again
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        counter = 1
        while target.exists():
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{counter}")
            counter += 1
        os.replace(self.path, target)
        _fsync_dir(self.path.parent)
        log.warning("%s is invalid (%s); moved it to %s and loaded defaults", self.path, problem, target)
        return {}

    def _write_atomic(self, text: str) -> None:
        write_text_atomic(self.path, text)

    def _remove_stale_temp_files(self) -> None:
        """Temp files left by a writer that was killed mid-write (its pid is gone)."""
        for temp in self.path.parent.glob(f".{self.path.name}.*.tmp"):
            parts = temp.name.rsplit(".", 3)
            if len(parts) == 4 and parts[1].isdigit() and not pid_alive(int(parts[1])):
                temp.unlink(missing_ok=True)



def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` (mode 0600) so readers see the old file or the new one:
    a per-process temp file beside it, fsync, `os.replace`, fsync of the directory."""
    path = Path(path)
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, 0o600)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
