"""Peak memory of one run: MLX's own allocator peak, and the process's resident peak.

MLX's peak (`mx.get_peak_memory`) can be reset before each run. The process peak RSS
can be reset only on Linux (writing 5 to /proc/self/clear_refs resets VmHWM); elsewhere
it is the peak since the process started, and `rss_scope` says so.
"""

import resource
import sys
from pathlib import Path

import mlx.core as mx

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def _reset_rss_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def _rss_peak_bytes() -> int:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class PeakMemory:
    """Reset both peaks on `start()`; read them after the run with `mlx_bytes()`/`rss_bytes()`."""

    def __init__(self):
        self.rss_scope = "process"

    def start(self) -> None:
        mx.reset_peak_memory()
        self.rss_scope = "run" if _reset_rss_peak() else "process"

    def mlx_bytes(self) -> int:
        return int(mx.get_peak_memory())

    def rss_bytes(self) -> int:
        return _rss_peak_bytes()
