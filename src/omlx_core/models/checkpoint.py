"""Read an MLX checkpoint directory without loading it: config, tensor headers, support."""

import importlib.util
import json
import struct
from pathlib import Path

from omlx_core.errors import InputError


def read_config(path: Path) -> dict:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise InputError(f"{path}: no config.json; is this an MLX checkpoint directory?")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise InputError(f"{config_path}: not valid JSON ({error})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise InputError(f"{config_path}: missing 'model_type'")
    return config


def read_text_config(path: Path) -> dict:
    """The language model's config: `text_config` where a checkpoint nests it (qwen3_5)."""
    config = read_config(path)
    return config.get("text_config", config)


def weight_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def read_safetensors_header(file: Path) -> dict:
    """Tensor name -> {"dtype", "shape", "data_offsets"}; reads only the JSON header."""
    with open(file, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise InputError(f"{file}: truncated safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        try:
            header = json.loads(handle.read(length))
        except ValueError:
            raise InputError(f"{file}: corrupt safetensors header") from None
    header.pop("__metadata__", None)
    return header


def tensor_index(path: Path) -> dict[str, dict]:
    """All tensors of a checkpoint, across shards, from headers only."""
    tensors = {}
    for file in weight_files(path):
        for name, info in read_safetensors_header(file).items():
            tensors[name] = {"dtype": info["dtype"], "shape": info["shape"], "file": file.name}
    return tensors


def _mlx_lm_models_dir() -> Path:
    spec = importlib.util.find_spec("mlx_lm")  # locates the package without importing it
    return Path(spec.submodule_search_locations[0]) / "models"


def supported_model_type(model_type: str) -> str | None:
    """mlx-lm's module name for `model_type`, or None when mlx-lm cannot run it."""
    if (_mlx_lm_models_dir() / f"{model_type}.py").is_file():
        return model_type
    from mlx_lm.utils import MODEL_REMAPPING  # slow import; only for aliased types

    remapped = MODEL_REMAPPING.get(model_type)
    return remapped if remapped and (_mlx_lm_models_dir() / f"{remapped}.py").is_file() else None


def check_checkpoint(path: Path) -> dict:
    """Raise a clear InputError unless `path` is a checkpoint mlx-lm can load; returns config."""
    if not path.exists():
        raise InputError(f"{path}: no such model directory")
    if path.is_file():
        hint = " (import it first: omlx models import-gguf FILE)" if path.suffix == ".gguf" else ""
        raise InputError(f"{path}: a model is a checkpoint directory, not a file{hint}")
    config = read_config(path)
    if supported_model_type(config["model_type"]) is None:
        raise InputError(
            f"{path}: model_type {config['model_type']!r} is not supported by the installed mlx-lm"
        )
    if not weight_files(path):
        raise InputError(f"{path}: no *.safetensors weight files")
    return config
