"""The settings a benchmark run uses, and the variants `--compare` sets against each other.

A variant is written the way people type it on the command line: whitespace-separated
items, each either `key=value` (a setting, parsed by the settings schema) or one bare
word, the name of a profile of the model. An empty spec is the effective settings as they
stand. Examples:

    ""                                          the effective settings, unchanged
    "prefill.chunk_size=512"                    one setting changed
    "prefill.chunk_size=512 prefill.lanes=gpu,cpu"
    "long-prompts"                              the model's profile named long-prompts
    "long-prompts prefill.chunk_size=8k"        that profile, one key changed

Precedence is the usual one, with the named profile standing in for the active one:
`key=value` > `OMLX_*` environment > the profile > global `settings.json` > defaults.
`--set` items apply to every variant; a variant's own items win over them.
"""

from dataclasses import dataclass, field
from pathlib import Path

from omlx_core.errors import InputError
from omlx_core.settings import EffectiveSettings, Resolved, load_settings, lookup
from omlx_core.settings.files import DEFAULT_PROFILE, flatten, model_store

OMLX = "omlx"
MLX_LM = "mlx-lm"


@dataclass(frozen=True)
class VariantSpec:
    profile: str | None = None
    sets: dict[str, str] = field(default_factory=dict)  # key -> text as typed

    @property
    def text(self) -> str:
        items = ([self.profile] if self.profile else []) + [f"{k}={v}" for k, v in self.sets.items()]
        return " ".join(items)


def parse_set(item: str) -> tuple[str, str]:
    """`prefill.chunk_size=512` -> ("prefill.chunk_size", "512"), the key checked."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise InputError(f"--set: {item!r} is not key=value (e.g. prefill.chunk_size=512)")
    setting = lookup(key.strip())
    setting.parse(value)  # fail now, with the key's own message, not mid-benchmark
    return setting.key, value.strip()


def parse_variant(text: str, base: VariantSpec | None = None) -> VariantSpec:
    """One `--compare` side; `base` (from --profile / --set) fills what it leaves out."""
    base = base or VariantSpec()
    profile, sets = base.profile, dict(base.sets)
    bare = []
    for item in text.split():
        if "=" in item:
            key, value = parse_set(item)
            sets[key] = value
        else:
            bare.append(item)
    if len(bare) > 1:
        raise InputError(f"--compare: {text!r} names {len(bare)} profiles ({', '.join(bare)}); "
                         "a variant is at most one profile plus key=value items")
    return VariantSpec(bare[0] if bare else profile, sets)


def variant_settings(home: Path, model_key: str | None, spec: VariantSpec,
                     environ=None) -> EffectiveSettings:
    """Every setting's value and source for this variant."""
    cli = {key: lookup(key).parse(text) for key, text in spec.sets.items()}
    if spec.profile is None:
        return load_settings(home, model_key, cli=cli, environ=environ)
    if model_key is None:
        raise InputError(f"profile {spec.profile!r}: profiles belong to a model; pass --model")
    store = model_store(home, model_key)
    profiles = store.read().get("profiles", {})
    if spec.profile not in profiles and spec.profile != DEFAULT_PROFILE:
        known = ", ".join(sorted(profiles)) or "none"
        raise InputError(f"model {model_key!r} has no profile {spec.profile!r} (profiles: {known}); "
                         "see `omlx settings show --model …`")
    resolved = dict(load_settings(home, None, cli=cli, environ=environ).resolved)
    where = f"{store.path} [{spec.profile}]"
    for key, value in flatten(profiles.get(spec.profile, {}), where).items():
        if resolved[key].source in ("default", "file"):
            resolved[key] = Resolved(value, "model", where)
    return EffectiveSettings(resolved)


def prefill_settings(settings: EffectiveSettings) -> dict:
    """The keys that decide how a model computes (`prefill.*`, `compute.*`), with value and
    source, as a report carries them."""
    return {key: {"value": r.value, "source": r.source, "where": r.where}
            for key, r in settings.resolved.items() if key.startswith(("prefill.", "compute."))}


@dataclass(frozen=True)
class Variant:
    """One thing being measured: omlx under some settings, or stock mlx-lm."""

    name: str
    runner: str  # OMLX | MLX_LM
    spec: str
    settings: EffectiveSettings | None = None  # None for stock mlx-lm

    @property
    def chunk_size(self) -> int:
        return int(self.settings["prefill.chunk_size"]) if self.settings is not None else 2048

    def describe(self) -> dict:
        prefill = (prefill_settings(self.settings) if self.settings is not None else
                   {"prefill.chunk_size": {"value": 2048, "source": "mlx-lm default", "where": ""}})
        return {"name": self.name, "runner": self.runner, "spec": self.spec, "settings": prefill}
