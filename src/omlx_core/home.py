"""Where omlx keeps its state: `--home` > `$OMLX_HOME` > `~/.omlx`."""

import os
from pathlib import Path


def resolve_home(explicit: str | os.PathLike | None = None) -> Path:
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get("OMLX_HOME"):
        return Path(os.environ["OMLX_HOME"]).expanduser()
    return Path.home() / ".omlx"


def settings_path(home: Path) -> Path:
    return home / "settings.json"


def model_settings_dir(home: Path) -> Path:
    return home / "model-settings"


def models_dir(home: Path) -> Path:
    return home / "models"
