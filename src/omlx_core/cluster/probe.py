"""What a machine runs, as verification compares it: omlx, MLX and mlx-lm versions, backend."""

import importlib.metadata
import socket
import sys


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def probe() -> dict:
    import mlx.core as mx

    from omlx_core import __version__

    cuda = bool(hasattr(mx, "cuda") and mx.cuda.is_available())
    return {"omlx_version": __version__, "mlx_version": mx.__version__, "mlx_lm_version": _version("mlx-lm"),
            "backends": ["ring"] + (["nccl"] if cuda else []), "cuda": cuda,
            "hostname": socket.gethostname(), "python": sys.executable}


def mismatches(controller: dict, worker: dict) -> list[str]:
    """The versions that differ (a sharded model needs the same code on every rank)."""
    return [f"{key} {worker.get(key)} (controller {controller.get(key)})"
            for key in ("omlx_version", "mlx_version", "mlx_lm_version") if worker.get(key) != controller.get(key)]


def resolve_backend(choice: str, info: dict) -> str:
    if choice == "auto":
        return "nccl" if info["cuda"] else "ring"
    if choice not in info["backends"]:
        from omlx_core.errors import InputError

        raise InputError(f"--backend {choice}: not available on this machine (it has {', '.join(info['backends'])})")
    return choice
