"""omlx core library: everything the `omlx` command does, usable from Python."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("omlx")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+unknown"

# Just before mlx.core is first imported: MLX's Linux CPU matmul then runs on an optimized BLAS.
from omlx_core.blas import load_before_mlx  # noqa: E402

load_before_mlx()
