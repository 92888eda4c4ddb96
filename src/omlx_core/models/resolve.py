"""Name a model: a checkpoint path, a name under `$OMLX_HOME/models`, or `default`."""

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from omlx_core.errors import InputError
from omlx_core.home import models_dir
from omlx_core.models.checkpoint import check_checkpoint
from omlx_core.models.embedded import EMBEDDED_NAME, embedded_checkpoint, ensure_embedded

DEFAULT = "default"


@dataclass(frozen=True)
class ModelRef:
    name: str  # what people call it
    key: str  # file-safe id for its per-model settings
    path: Path  # checkpoint directory (for `default`, possibly not imported yet)
    embedded: bool = False


def _looks_like_path(ref: str) -> bool:
    return os.sep in ref or ref.startswith(".") or ref.startswith("~")


def locate(ref: str, home: Path) -> ModelRef:
    """Find a model without importing or loading anything; InputError if there is none."""
    if ref == DEFAULT or ref == EMBEDDED_NAME:
        return ModelRef(EMBEDDED_NAME, EMBEDDED_NAME, embedded_checkpoint(home), embedded=True)
    named = models_dir(home) / ref
    if not _looks_like_path(ref) and named.is_dir():
        return ModelRef(ref, ref, named)
    path = Path(ref).expanduser()
    if path.exists():
        path = path.resolve()
        if path.parent == models_dir(home).resolve():
            return ModelRef(path.name, path.name, path)
        digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", path.name) or "model"
        return ModelRef(path.name, f"{safe}-{digest}", path)
    known = list_model_names(home)
    hint = f" (known: {', '.join(known)})" if known else ""
    raise InputError(f"model {ref!r} not found: not a path, `default`, or a name under "
                     f"{models_dir(home)}{hint}")


def resolve(ref: str, home: Path) -> ModelRef:
    """Locate a model and make sure mlx-lm can load it (imports `default` on first use)."""
    model = locate(ref, home)
    if model.embedded:
        ensure_embedded(home)
    check_checkpoint(model.path)
    return model


def list_model_names(home: Path) -> list[str]:
    root = models_dir(home)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "config.json").is_file())
