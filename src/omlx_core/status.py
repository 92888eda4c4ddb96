"""The offline status report: versions, device, memory, home, settings files, models, lanes."""

import importlib.metadata
import json
from pathlib import Path

import psutil

from omlx_core import __version__
from omlx_core.hardware import hardware_fingerprint, hardware_info
from omlx_core.kernels.registry import machine_view
from omlx_core.home import model_settings_dir, models_dir, settings_path
from omlx_core.models.resolve import list_model_names
from omlx_core.models.embedded import EMBEDDED_NAME, embedded_checkpoint
from omlx_core.blas import blas_state
from omlx_core.prefill.fast_paths import dense_enabled, upcast_enabled
from omlx_core.prefill.lanes import lane_statuses
from omlx_core.settings import load_settings
from omlx_core.settings.files import global_store, model_store
from omlx_core.settings.schema import defaults


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _file_state(path: Path, validate) -> dict:
    """Whether a settings file exists and is valid, without quarantining it (status only looks)."""
    if not path.exists():
        return {"path": str(path), "exists": False, "valid": True, "problem": None}
    try:
        validate(json.loads(path.read_bytes()))
        return {"path": str(path), "exists": True, "valid": True, "problem": None}
    except Exception as error:  # noqa: BLE001 - any parse or validation failure is reported
        return {"path": str(path), "exists": True, "valid": False,
                "problem": (str(error).splitlines() or [type(error).__name__])[0]}


def settings_files(home: Path) -> list[dict]:
    files = [_file_state(settings_path(home), global_store(home).validate)]
    directory = model_settings_dir(home)
    if directory.is_dir():
        for path in sorted(directory.glob("*.json")):
            files.append(_file_state(path, model_store(home, path.stem).validate))
    return files


def cluster_summary(home: Path, settings) -> dict:
    """Whether distributed serving is on and who is enrolled (only looks; creates nothing)."""
    import json

    inventory = home / "cluster" / "inventory.json"
    try:
        workers = json.loads(inventory.read_text()).get("workers", []) if inventory.is_file() else []
    except (OSError, ValueError):
        workers = []
    return {"enabled": settings["cluster.enabled"], "workers": [w.get("name") for w in workers],
            "reason": "experimental; on with cluster.enabled" if not settings["cluster.enabled"]
            else f"serve --distributed verifies {len(workers)} worker(s) before it starts"}


def _dense_copy(settings, backend: str) -> dict:
    from omlx_core.decode.dense_copy import plan_for

    plan, reason = plan_for(settings, backend)
    if plan is not None:
        sizes = "every input" if backend == "cpu" else f"1..{plan.max_tokens} tokens"
        reason = f"dense copies of quantized weights compute {sizes}"
    return {"enabled": plan is not None, "setting": settings["compute.dense_copy"], "min_tokens": 1,
            "reason": reason}


def offline_status(home: Path) -> dict:
    from omlx_core.serve.remote import probe_server

    info = hardware_info()
    memory = psutil.virtual_memory()
    files = settings_files(home)
    # An invalid file is reported, not quarantined: status only looks.
    settings = load_settings(home) if files[0]["valid"] else defaults()
    lanes = lane_statuses(settings)
    models = list_model_names(home)
    return {
        "omlx_version": __version__,
        "mlx_version": info["mlx_version"],
        "mlx_lm_version": _version("mlx-lm"),
        "backend": info["backend"],
        "device": info["device"],
        "gpu": info["gpu"],
        "hardware": info,
        "hardware_fingerprint": hardware_fingerprint(info),
        "memory": {"total_bytes": memory.total, "available_bytes": memory.available},
        "blas": blas_state().as_dict(),
        "home": str(home),
        "settings_files": files,
        "models": models,
        "default_model": {
            "name": EMBEDDED_NAME,
            "imported": (embedded_checkpoint(home) / "config.json").is_file(),
            "path": str(embedded_checkpoint(home)),
        },
        "models_dir": str(models_dir(home)),
        "lanes": [lane.as_dict() for lane in lanes],
        "fast_paths": {
            "dequantize_to_dense": {"enabled": dense_enabled(settings), "setting": settings["prefill.dense"],
                                    "min_tokens": settings["prefill.dense_min_tokens"]},
            "small_attention": {"enabled": settings["prefill.small_attention_scores"] > 0 and info["backend"] == "cuda",
                                "max_scores": settings["prefill.small_attention_scores"]},
            "chunked_gdn": {"enabled": settings["prefill.chunked_gdn"],
                            "min_tokens": settings["prefill.chunked_gdn_min_tokens"]},
            "float32_quantized": {"enabled": upcast_enabled(settings),
                                  "setting": settings["compute.upcast_quantized"], "min_tokens": 1},
            "dense_copy": _dense_copy(settings, info["backend"]),
        },
        "kernels": machine_view(settings),
        "cluster": cluster_summary(home, settings),
        "server": probe_server(settings),
    }
