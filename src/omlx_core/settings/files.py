"""The settings files: the global `settings.json` and one file per model with profiles.

Global file:   {"server": {"port": 8001}, "prefill": {...}}
Model file:    {"active": "default",
                "profiles": {"default": {"prefill": {"chunk_size": 1024}}, "fast": {...}},
                "working": {...}}        # staged by the tuner; never read until saved

Every change goes through `JsonStore.update`, so it is atomic and loses no update.
"""

from pathlib import Path
from typing import Any

from omlx_core.errors import InputError
from omlx_core.home import model_settings_dir, settings_path
from omlx_core.settings.schema import lookup
from omlx_core.settings.store import JsonStore

DEFAULT_PROFILE = "default"


def flatten(sections: Any, where: str) -> dict[str, Any]:
    """`{"server": {"port": 1}}` -> `{"server.port": 1}`, validating every key and value."""
    if not isinstance(sections, dict):
        raise InputError(f"{where}: expected a JSON object of sections")
    flat = {}
    for section, values in sections.items():
        if not isinstance(values, dict):
            raise InputError(f"{where}: section {section!r} must be a JSON object")
        for name, value in values.items():
            setting = lookup(f"{section}.{name}")
            flat[setting.key] = setting.validate(value)
    return flat


def put(sections: dict, key: str, value: Any) -> None:
    section, name = key.split(".", 1)
    sections.setdefault(section, {})[name] = value


def remove(sections: dict, key: str) -> None:
    section, name = key.split(".", 1)
    sections.get(section, {}).pop(name, None)
    if section in sections and not sections[section]:
        del sections[section]


def global_store(home: Path) -> JsonStore:
    path = settings_path(home)
    return JsonStore(path, lambda document: flatten(document, str(path)))


def model_store(home: Path, model_key: str) -> JsonStore:
    path = model_settings_dir(home) / f"{model_key}.json"
    return JsonStore(path, lambda document: validate_model_document(document, str(path)))


def validate_model_document(document: dict, where: str) -> None:
    active = document.get("active", DEFAULT_PROFILE)
    profiles = document.get("profiles", {})
    if not isinstance(active, str) or not isinstance(profiles, dict):
        raise InputError(f"{where}: 'active' must be a profile name and 'profiles' an object")
    for name, sections in profiles.items():
        flatten(sections, f"{where} profile {name!r}")
    if "working" in document:
        flatten(document["working"], f"{where} working profile")
    unknown = set(document) - {"active", "profiles", "working", "model"}
    if unknown:
        raise InputError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")


def active_profile(document: dict) -> tuple[str, dict]:
    """The active profile's name and its sections."""
    name = document.get("active", DEFAULT_PROFILE)
    return name, document.get("profiles", {}).get(name, {})
