"""Changing settings: set, unset, reset, and staging a model's working profile.

`set`/`unset` with a model write its active profile (or `profile=`) directly: an explicit
change. `stage=True` writes the working profile instead, which starts as a copy of the
active one and is never used until `save_working` makes it a named profile and active.
"""

import copy
from pathlib import Path
from typing import Any

from omlx_core.errors import InputError
from omlx_core.settings.files import DEFAULT_PROFILE, global_store, model_store, put, remove
from omlx_core.settings.schema import lookup


def _profile_sections(document: dict, profile: str | None, stage: bool) -> dict:
    """The sections dict that a change should go into (created if needed)."""
    active = document.setdefault("active", DEFAULT_PROFILE)
    profiles = document.setdefault("profiles", {})
    if stage:
        if "working" not in document:
            document["working"] = copy.deepcopy(profiles.get(active, {}))
        return document["working"]
    return profiles.setdefault(profile or active, {})


def _change(home: Path, key: str, value: Any, model_key: str | None, profile: str | None,
            stage: bool, delete: bool) -> None:
    if (profile or stage) and model_key is None:
        raise InputError("--profile and --stage need --model: profiles belong to a model")

    def apply(sections: dict) -> None:
        remove(sections, key) if delete else put(sections, key, value)

    if model_key is None:
        global_store(home).update(apply)
    else:
        model_store(home, model_key).update(
            lambda document: apply(_profile_sections(document, profile, stage))
        )


def set_setting(home: Path, key: str, text: str, *, model_key: str | None = None,
                profile: str | None = None, stage: bool = False) -> Any:
    """Parse and store one value typed by a person; returns the typed value."""
    setting = lookup(key)
    value = setting.parse(text)
    _change(home, setting.key, value, model_key, profile, stage, delete=False)
    return value


def unset_setting(home: Path, key: str, *, model_key: str | None = None,
                  profile: str | None = None, stage: bool = False) -> None:
    setting = lookup(key)
    _change(home, setting.key, None, model_key, profile, stage, delete=True)


def reset_settings(home: Path, *, model_key: str | None = None) -> None:
    """Back to defaults: empties the global file, or every profile of one model."""
    store = global_store(home) if model_key is None else model_store(home, model_key)
    store.update(lambda document: document.clear())


def save_working(home: Path, model_key: str, profile: str | None = None) -> str:
    """Make the staged working profile a named profile and activate it; returns its name."""
    saved = {}

    def promote(document: dict) -> None:
        if "working" not in document:
            raise InputError(f"model {model_key!r} has no staged working profile to save")
        name = profile or document.get("active", DEFAULT_PROFILE)
        document.setdefault("profiles", {})[name] = document.pop("working")
        document["active"] = name
        saved["name"] = name

    model_store(home, model_key).update(promote)
    return saved["name"]


def discard_working(home: Path, model_key: str) -> None:
    model_store(home, model_key).update(lambda document: document.pop("working", None))


def activate_profile(home: Path, model_key: str, profile: str) -> None:
    def switch(document: dict) -> None:
        if profile not in document.get("profiles", {}) and profile != DEFAULT_PROFILE:
            known = ", ".join(sorted(document.get("profiles", {}))) or "none"
            raise InputError(f"model {model_key!r} has no profile {profile!r} (profiles: {known})")
        document["active"] = profile

    model_store(home, model_key).update(switch)
