"""How much MLX memory a piece of work takes above what was already allocated."""

from collections.abc import Callable

import mlx.core as mx


def peak_extra_bytes(work: Callable[[], object]) -> int:
    """Run `work()` (evaluating what it returns) and return MLX's peak active memory
    during it above the active memory before it; 0 if it never rose."""
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    result = work()
    if result is not None:
        mx.eval(result)
    mx.synchronize()
    return max(0, mx.get_peak_memory() - base)


def host_peak_extra_bytes(work: Callable[[], object]) -> tuple[object, int]:
    """Run `work()` under tracemalloc and return (its result, the peak of Python-heap memory,
    numpy buffers included, above what was traced when it started). Slower while it runs:
    for builds measured once, not for hot paths."""
    import tracemalloc

    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        result = work()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        if started:
            tracemalloc.stop()
    return result, max(0, peak - base)
