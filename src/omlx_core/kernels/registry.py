"""The kernel registry: a custom kernel runs only where it was validated.

A `KernelSpec` names the op it replaces, its source under the repo's `kernels/` directory
(`.cu` for `mx.fast.cuda_kernel`, `.metal` for `mx.fast.metal_kernel`), and the
`Validation` records it was checked on, each pairing a model match with a hardware match.
At load, `install_kernels` decides per kernel (`decide`) and installs the active ones by
module replacement (`prefill.split.replace_module`, the one way omlx changes a model);
anything else keeps mlx-lm's ops path. The setting `kernels.<name>` = auto|on|off
(auto: validated pairs only) can force a kernel off, or on for experiments, with a warning.

Model matches come in two granularities, on purpose:
- `ModelMatch(fingerprint="mf-…")`: exactly the checkpoint layout that was validated
  (models.fingerprint: every tensor's name, shape, dtype and the quantization). Right for
  a kernel whose result depends on the weights' layout (a quantized matmul for one format).
- `ModelMatch(model_type=…, config={…})`: an architecture-level match, every model of that
  `model_type` whose config has the listed values. Right for a kernel that replaces an
  activation-only op (scores from q and k): its result depends on the op's shapes (head
  count, head size) and the activation dtype, not on the weights, so requiring one exact
  checkpoint would keep a kernel validated on the real shapes off for every copy,
  quantization or fine-tune of the model. The listed config values are the shapes the
  validation covered; a model with other values stays on the ops path.
- `ModelMatch.every_model()`: for a kernel whose output is bit-identical to the op it
  replaces for every format it accepts (checked over all of them on the hardware): its
  result cannot depend on the model, only the hardware needs a record.

Hardware matches name the backend and, optionally, the GPU architecture (`sm_90`, or an
Apple GPU family) and the exact GPU name (`NVIDIA H200`, `Apple M3 Max`);
`hardware.kernel_hardware()` gives the current machine's.
"""

import hashlib
import logging
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from omlx_core.errors import OmlxError

log = logging.getLogger("omlx.kernels")

CHOICES = ("auto", "on", "off")
EVERY_MODEL = "*"  # ModelMatch.every_model()
BACKEND_OF_SOURCE = {".cu": "cuda", ".metal": "metal"}


@dataclass(frozen=True)
class ModelMatch:
    """An exact checkpoint (`fingerprint`) or an architecture with config values."""

    fingerprint: str | None = None
    model_type: str | None = None
    config: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def architecture(cls, model_type: str, **config) -> "ModelMatch":
        return cls(model_type=model_type, config=tuple(sorted(config.items())))

    @classmethod
    def every_model(cls) -> "ModelMatch":
        return cls(model_type=EVERY_MODEL)

    def __post_init__(self):
        if (self.fingerprint is None) == (self.model_type is None):
            raise ValueError("a ModelMatch names either a fingerprint or a model_type")

    def matches(self, facts: "ModelFacts") -> bool:
        if self.fingerprint is not None:
            return facts.fingerprint == self.fingerprint
        if self.model_type == EVERY_MODEL:
            return True
        return facts.model_type == self.model_type and all(
            facts.config.get(key) == value for key, value in self.config)

    def describe(self) -> str:
        if self.fingerprint is not None:
            return self.fingerprint
        if self.model_type == EVERY_MODEL:
            return "every model"
        values = ", ".join(f"{key}={value}" for key, value in self.config)
        return f"{self.model_type}" + (f" ({values})" if values else "")


@dataclass(frozen=True)
class HardwareMatch:
    """A backend, optionally narrowed to a GPU architecture and an exact GPU name."""

    backend: str
    arch: str | None = None  # "sm_90"; on Metal the GPU family from mx.device_info()
    gpu: str | None = None  # "NVIDIA H200", "Apple M3 Max"

    def matches(self, hardware: Mapping) -> bool:
        return (hardware.get("backend") == self.backend
                and self.arch in (None, hardware.get("arch"))
                and self.gpu in (None, hardware.get("gpu")))

    def describe(self) -> str:
        return " ".join(part for part in (self.backend, self.arch, self.gpu) if part)


@dataclass(frozen=True)
class Validation:
    model: ModelMatch
    hardware: HardwareMatch
    evidence: str = ""  # where the check is recorded, e.g. a docs/benchmarks file

    def describe(self) -> str:
        return f"{self.model.describe()} on {self.hardware.describe()}"


@dataclass(frozen=True)
class KernelSpec:
    name: str  # also the settings key kernels.<name>
    replaces: str  # the op, in words
    source: str  # file name under kernels/
    validated: tuple[Validation, ...]
    applies: Callable[[Any], bool]  # does this model have the op at all?
    absent: str  # what a model without the op lacks, for "model has no …"
    # Replace the modules; returns their paths. None: the kernel replaces no module of its
    # own, a path that omlx installs calls it when the report names it active.
    install: Callable[[Any], list[str]] | None

    @property
    def backend(self) -> str:
        return BACKEND_OF_SOURCE[Path(self.source).suffix]

    @property
    def setting_key(self) -> str:
        return f"kernels.{self.name}"


@dataclass(frozen=True)
class ModelFacts:
    """What model matches look at: the fingerprint, the architecture and its config."""

    fingerprint: str | None
    model_type: str | None
    config: Mapping[str, Any]


def model_facts(model, fingerprint: str | None) -> ModelFacts:
    args = getattr(model, "args", None)
    config = dict(vars(args)) if args is not None and hasattr(args, "__dict__") else {}
    model_type = getattr(model, "model_type", None) or config.get("model_type")
    return ModelFacts(fingerprint, model_type, config)


@dataclass(frozen=True)
class Decision:
    kernel: str
    active: bool
    reason: str
    setting: str
    validated: bool  # a validation record covers this pair (or, with no model, this hardware)

    def as_dict(self) -> dict:
        return {"name": self.kernel, "active": self.active, "reason": self.reason,
                "setting": self.setting, "validated": self.validated}


def decide(spec: KernelSpec, setting: str, hardware: Mapping, facts: ModelFacts | None = None,
           model=None) -> Decision:
    """Whether `spec` runs here, and why. Without a model (`facts` None) it answers whether
    it would activate on this hardware for the models it was validated on."""
    def decision(active: bool, reason: str, validated: bool = False) -> Decision:
        return Decision(spec.name, active, reason, setting, validated)

    if setting not in CHOICES:
        raise OmlxError(f"{spec.setting_key}: invalid value {setting!r}; expected one of {', '.join(CHOICES)}")
    if setting == "off":
        return decision(False, f"off by {spec.setting_key} = off")
    if model is not None and not spec.applies(model):
        return decision(False, f"model has no {spec.absent}")
    if hardware.get("backend") != spec.backend:
        return decision(False, f"needs the {spec.backend} backend; this machine computes on "
                               f"{hardware.get('backend')}")
    on_hardware = [v for v in spec.validated if v.hardware.matches(hardware)]
    if facts is None:
        if on_hardware:
            return decision(True, "validated on this hardware for "
                            + "; ".join(v.model.describe() for v in on_hardware), True)
        if setting == "on":
            return decision(True, forced_reason(spec))
        return decision(False, f"not validated on this hardware ({describe_hardware(hardware)})")
    matched = next((v for v in on_hardware if v.model.matches(facts)), None)
    if matched is not None:
        return decision(True, f"validated on {matched.describe()}", True)
    if setting == "on":
        return decision(True, forced_reason(spec))
    if not on_hardware:
        return decision(False, f"not validated on this hardware ({describe_hardware(hardware)})")
    return decision(False, f"not validated for this model ({describe_model(facts)}); validated for "
                    + "; ".join(v.model.describe() for v in on_hardware))


def forced_reason(spec: KernelSpec) -> str:
    return f"forced on by {spec.setting_key} = on — unvalidated, results may differ"


def describe_hardware(hardware: Mapping) -> str:
    return " ".join(str(hardware[key]) for key in ("backend", "arch", "gpu") if hardware.get(key))


def describe_model(facts: ModelFacts) -> str:
    return ", ".join(part for part in (facts.model_type, facts.fingerprint) if part) or "unknown model"


@dataclass
class KernelReport:
    """What `install_kernels` did: one decision per registered kernel, and the modules
    each active kernel replaced (for /api/status, `omlx bench` JSON and the logs)."""

    decisions: list[Decision] = field(default_factory=list)
    replaced: dict[str, list[str]] = field(default_factory=dict)

    @property
    def active(self) -> list[str]:
        return [d.kernel for d in self.decisions if d.active]

    def as_dict(self) -> dict:
        return {"kernels": [{**d.as_dict(), "modules": len(self.replaced.get(d.kernel, [])),
                             "paths": self.replaced.get(d.kernel, [])} for d in self.decisions]}


def setting_of(spec: KernelSpec, settings: Mapping) -> str:
    return settings.get(spec.setting_key, "auto")


def install_kernels(model, model_fingerprint: str | None, settings: Mapping, *,
                    kernels: tuple[KernelSpec, ...] | None = None,
                    hardware: Mapping | None = None) -> KernelReport:
    """Install every registered kernel that `decide` activates for this model here.

    `kernels` and `hardware` default to the catalog and this machine (tests pass others).
    A kernel whose installation fails is reported inactive with the error, and the ops
    path runs (its `install` builds every replacement before it replaces any module).
    """
    from omlx_core.hardware import kernel_hardware
    from omlx_core.kernels.catalog import registered

    kernels = registered() if kernels is None else kernels
    hardware = kernel_hardware() if hardware is None else hardware
    facts = model_facts(model, model_fingerprint)
    report = KernelReport()
    for spec in kernels:
        decision = decide(spec, setting_of(spec, settings), hardware, facts, model)
        if decision.active and not decision.validated:
            log.warning("kernel %s: %s", spec.name, decision.reason)
        if decision.active and spec.install is not None:
            try:
                report.replaced[spec.name] = spec.install(model)
            except Exception as error:  # noqa: BLE001 - any failure keeps the ops path
                reason = f"install failed ({type(error).__name__}: {error}); the ops path runs"
                log.warning("kernel %s: %s", spec.name, reason)
                decision = Decision(spec.name, False, reason, decision.setting, decision.validated)
        report.decisions.append(decision)
    return report


def replace_modules(model, source: str, paths: list[str], make: Callable) -> list[str]:
    """Replace the modules at `paths` by `make(module)`, every replacement built before any
    is set (and the kernel's `source` found first), so a failed install changes nothing;
    returns the paths. The install of a kernel that replaces whole modules."""
    from omlx_core.prefill.split import replace_module

    kernel_source(source)
    modules = dict(model.named_modules())
    replacements = {path: make(modules[path]) for path in paths}
    for path, module in replacements.items():
        replace_module(model, path, module)
    return list(replacements)


def machine_view(settings: Mapping, *, kernels: tuple[KernelSpec, ...] | None = None,
                 hardware: Mapping | None = None) -> list[dict]:
    """For `omlx status` without a model: every registered kernel, whether it would
    activate on this hardware and why."""
    from omlx_core.hardware import kernel_hardware
    from omlx_core.kernels.catalog import registered

    kernels = registered() if kernels is None else kernels
    hardware = kernel_hardware() if hardware is None else hardware
    return [{**decide(spec, setting_of(spec, settings), hardware).as_dict(),
             "replaces": spec.replaces, "source": spec.source,
             "validated_on": [v.describe() for v in spec.validated]} for spec in kernels]


def kernels_dirs() -> list[Path]:
    """Where kernel sources are looked for: the repo's `kernels/` (a source checkout or an
    editable install), then `<prefix>/share/omlx/kernels` (where a wheel puts them, see
    pyproject's data-files)."""
    repo = Path(__file__).resolve().parents[3] / "kernels"
    return [repo, Path(sys.prefix) / "share" / "omlx" / "kernels"]


def kernel_source(name: str) -> str:
    """The text of kernel source `name` (a file name under kernels/)."""
    return kernel_path(name).read_text(encoding="utf-8")


@lru_cache(maxsize=None)
def included_source(name: str) -> str:
    """Kernel source `name` as an mx.fast.cuda_kernel `header` carries it: an #include of
    the file by absolute path, with a digest of its content. MLX builds, copies and hashes
    a custom kernel's whole source on every call (microseconds on each of a decode step's
    few hundred calls for a 10 KB kernel), while NVRTC reads an included file only when it
    compiles; the digest changes the source, so the module MLX caches, whenever the file
    does. A path an #include cannot spell gets the file's text, comments stripped."""
    path = kernel_path(name)
    text = path.read_text(encoding="utf-8")
    if any(char in str(path) for char in '"\\\n'):
        lines = (re.sub(r"\s+//.*$|^\s*//.*$", "", line).strip() for line in text.splitlines())
        return "\n".join(line for line in lines if line) + "\n"
    return f'#include "{path}"  // sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}\n'


def kernel_path(name: str) -> Path:
    """Where kernel source `name` (a file name under kernels/) is."""
    for directory in kernels_dirs():
        path = directory / name
        if path.is_file():
            return path.resolve()
    raise OmlxError(f"kernel source {name} not found in {' or '.join(map(str, kernels_dirs()))}; "
                    "reinstall omlx or run it from its source checkout")
