"""One-time join codes: high-entropy, stored only as a salted scrypt hash, expiring, single use.

`create` prints a code once and keeps its hash in `$OMLX_HOME/cluster/invites.json`.
`claim` checks a code and marks it used in one locked read-modify-write, so two claims of
one code (a replay, or a race) cannot both succeed. A claim hands back a short-lived
registration token that the worker spends, once, after its slow provisioning.
"""

import hashlib
import hmac
import secrets
import time
from pathlib import Path

from omlx_core.cluster.paths import invites_path
from omlx_core.errors import OmlxError
from omlx_core.settings.store import JsonStore

SCRYPT = {"n": 2**14, "r": 8, "p": 1, "dklen": 32}
REGISTRATION_TTL_S = 600.0
KEEP_EXPIRED_S = 86400.0


class CodeRefused(OmlxError):
    """The code is unknown, expired or already used."""


def _hash(secret: str, salt: bytes) -> str:
    return hashlib.scrypt(secret.encode(), salt=salt, **SCRYPT).hex()


def _store(home: Path) -> JsonStore:
    return JsonStore(invites_path(home))


def create(home: Path, ttl_s: float) -> tuple[str, dict]:
    """A new code (shown once) and its public record."""
    code = "omlx-" + secrets.token_urlsafe(24)  # 192 bits
    salt = secrets.token_bytes(16)
    now = time.time()
    record = {"id": secrets.token_hex(4), "salt": salt.hex(), "hash": _hash(code, salt),
              "created_at": now, "expires_at": now + ttl_s, "used_at": None, "claimed_by": None}

    def mutate(document):
        kept = [i for i in document.get("invites", []) if i["expires_at"] > now - KEEP_EXPIRED_S]
        document["invites"] = kept + [record]
    _store(home).update(mutate)
    return code, {key: record[key] for key in ("id", "created_at", "expires_at")}


def _matches(invite: dict, code: str) -> bool:
    return hmac.compare_digest(_hash(code, bytes.fromhex(invite["salt"])), invite["hash"])


def claim(home: Path, code: str, name: str) -> str:
    """Spend `code` for worker `name`; returns the registration token."""
    token = secrets.token_urlsafe(32)
    now = time.time()

    def mutate(document):
        for invite in document.get("invites", []):
            if not _matches(invite, code):
                continue
            if invite["used_at"] is not None:
                raise CodeRefused(f"join code already used (by {invite['claimed_by']!r}): codes are single use; "
                                  "run `omlx cluster invite` on the controller for a new one")
            if invite["expires_at"] <= now:
                raise CodeRefused("join code expired: run `omlx cluster invite` on the controller for a new one")
            invite.update(used_at=now, claimed_by=name,
                          registration=hashlib.sha256(token.encode()).hexdigest(),
                          registration_expires_at=now + REGISTRATION_TTL_S)
            return
        raise CodeRefused("join code not recognised by this controller: check it, or run "
                          "`omlx cluster invite` on the controller for a new one")
    _store(home).update(mutate)
    return token


def redeem(home: Path, token: str) -> str:
    """Spend a registration token (once); returns the worker name the code was claimed for."""
    digest = hashlib.sha256(token.encode()).hexdigest()
    now = time.time()
    found = {}

    def mutate(document):
        for invite in document.get("invites", []):
            if invite.get("registration") and hmac.compare_digest(invite["registration"], digest):
                if invite["registration_expires_at"] <= now:
                    raise CodeRefused("registration token expired: join again with a new code")
                invite["registration"] = None
                found["name"] = invite["claimed_by"]
                return
        raise CodeRefused("registration token not recognised or already used: join again with a new code")
    _store(home).update(mutate)
    return found["name"]


def pending(home: Path) -> list[dict]:
    """Invites that can still be claimed (for `omlx cluster status`)."""
    now = time.time()
    return [{key: i[key] for key in ("id", "created_at", "expires_at")}
            for i in _store(home).read().get("invites", []) if i["used_at"] is None and i["expires_at"] > now]
