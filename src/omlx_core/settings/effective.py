"""Precedence: CLI flag > `OMLX_<SECTION>_<KEY>` env > model profile > global file > defaults."""

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omlx_core.errors import InputError
from omlx_core.settings.files import active_profile, flatten, global_store, model_store
from omlx_core.settings.schema import BY_KEY, SETTINGS


@dataclass(frozen=True)
class Resolved:
    value: Any
    source: str  # default | file | model | env | cli
    where: str = ""  # the file, profile or variable the value came from


class EffectiveSettings(Mapping):
    """Every setting's value and where it came from; read like a dict of values."""

    def __init__(self, resolved: dict[str, Resolved], profile: str | None = None):
        self.resolved = resolved
        self.profile = profile  # the model profile read, if a model was named

    def __getitem__(self, key: str) -> Any:
        return self.resolved[key].value

    def __iter__(self):
        return iter(self.resolved)

    def __len__(self) -> int:
        return len(self.resolved)


def load_settings(
    home: Path,
    model_key: str | None = None,
    cli: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    use_working: bool = False,
) -> EffectiveSettings:
    """Resolve every key. `use_working` reads the staged profile instead of the active one."""
    environ = os.environ if environ is None else environ
    resolved = {setting.key: Resolved(setting.default, "default") for setting in SETTINGS}

    profile = None
    store = global_store(home)
    for key, value in flatten(store.read(), str(store.path)).items():
        resolved[key] = Resolved(value, "file", str(store.path))

    if model_key is not None:
        store = model_store(home, model_key)
        document = store.read()
        name, sections = active_profile(document)
        if use_working and "working" in document:
            name, sections = "working", document["working"]
        profile = name
        for key, value in flatten(sections, str(store.path)).items():
            resolved[key] = Resolved(value, "model", f"{store.path} [{name}]")

    for setting in SETTINGS:
        if setting.env_name in environ:
            try:
                value = setting.parse(environ[setting.env_name])
            except InputError as error:
                raise InputError(f"{setting.env_name}: {error}") from None
            resolved[setting.key] = Resolved(value, "env", setting.env_name)

    for key, value in (cli or {}).items():
        if value is not None:
            resolved[key] = Resolved(BY_KEY[key].validate(value), "cli", "command line")
    return EffectiveSettings(resolved, profile)
