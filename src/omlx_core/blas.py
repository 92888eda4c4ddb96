"""An optimized BLAS under MLX's CPU matmul on Linux.

Why: MLX's Linux wheels link the reference BLAS (netlib `libblas.so.3`, bundled in
`mlx_cpu.libs`), so every dense matmul MLX runs on the CPU, attention's included, is
unblocked scalar code: on the 2-core dev machine a 512x576 @ 576x1536 float32 product
takes 467 ms there and 10 ms in OpenBLAS, and a causal attention of 512 tokens 299 ms
against 53 ms. `libmlx.so` calls `cblas_sgemm` and friends through the dynamic linker, and
the linker searches the process's global scope before a library's own dependencies, so
loading an optimized BLAS with RTLD_GLOBAL before `mlx.core` is first imported makes MLX
call it. Nothing of MLX is patched; the same symbols come from a faster library.

`omlx_core/__init__` calls `load_before_mlx()`: the library is loaded just before the
process first imports `mlx.core` (an import hook that removes itself), so commands that
never touch MLX (`omlx --help`, `omlx settings`) do not pay OpenBLAS's start-up (about
0.5 s). Where no optimized BLAS is installed, or MLX was imported first, or
`OMLX_BLAS=off`, MLX keeps its reference BLAS and `omlx status` says so with the fix.
`OMLX_BLAS=/path/lib.so` picks one.
"""

import ctypes
import ctypes.util
import os
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

FIX = "apt install libopenblas0-pthread (or set OMLX_BLAS to a CBLAS library)"
# Debian/Ubuntu's OpenBLAS (the pthread build first: it uses every core), then the linker's.
_DEBIAN = ("/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0",
           "/usr/lib/{arch}-linux-gnu/openblas-openmp/libopenblas.so.0",
           "/usr/lib/{arch}-linux-gnu/libopenblas.so.0")


@dataclass(frozen=True)
class BlasState:
    loaded: bool
    library: str | None
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


_state: BlasState | None = None


def candidates() -> list[str]:
    arch = platform.machine()
    found = [path.format(arch=arch) for path in _DEBIAN]
    name = ctypes.util.find_library("openblas")
    if name:
        found.append(name)
    return found


def _load(path: str) -> str | None:
    """Load `path` into the global scope; None when it has no CBLAS sgemm (or fails)."""
    try:
        library = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    return path if hasattr(library, "cblas_sgemm") else None


def load_optimized_blas() -> BlasState:
    """Load an optimized CBLAS for MLX once per process (see the module docstring)."""
    global _state
    if _state is not None:
        return _state
    choice = os.environ.get("OMLX_BLAS", "auto")
    if platform.system() != "Linux":
        _state = BlasState(False, None, "not needed: MLX links the system's BLAS on this OS")
    elif choice == "off":
        _state = BlasState(False, None, "off by OMLX_BLAS=off: MLX's CPU matmul uses its reference BLAS")
    elif "mlx.core" in sys.modules:
        _state = BlasState(False, None, "mlx was imported before omlx_core: MLX's CPU matmul uses its "
                                        "reference BLAS (import omlx_core first)")
    else:
        paths = [choice] if choice != "auto" else [p for p in candidates() if p == Path(p).name or Path(p).exists()]
        loaded = next((path for path in paths if _load(path)), None)
        if loaded:
            _state = BlasState(True, loaded, f"MLX's CPU matmul runs on {Path(loaded).name}")
        elif choice != "auto":
            _state = BlasState(False, None, f"OMLX_BLAS={choice}: not a loadable CBLAS library; "
                                            "MLX's CPU matmul uses its reference BLAS")
        else:
            _state = BlasState(False, None, f"no optimized BLAS found: MLX's CPU matmul uses its reference "
                                            f"BLAS (10-50x slower); {FIX}")
    return _state


def blas_state() -> BlasState:
    return load_optimized_blas()


class _BeforeMlx:
    """A meta-path finder that loads the BLAS when `mlx.core` is first imported, then leaves."""

    def find_spec(self, name, path=None, target=None):
        if name == "mlx.core":
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            load_optimized_blas()
        return None  # the normal finders import the module


def load_before_mlx() -> None:
    if "mlx.core" in sys.modules:
        load_optimized_blas()  # too late: records why
    elif not any(isinstance(finder, _BeforeMlx) for finder in sys.meta_path):
        sys.meta_path.insert(0, _BeforeMlx())
