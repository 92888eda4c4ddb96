"""Parse the sizes people type: `16k` tokens, `8GB` / `512MiB` of memory, `0.9` of RAM."""

import re

from omlx_core.errors import InputError

_COUNT_SUFFIX = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
_BYTE_SUFFIX = {
    "": 1,
    "b": 1,
    "k": 1024, "kb": 1000, "kib": 1024,
    "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
}
_NUMBER = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_count(text: str | int, what: str = "value") -> int:
    """A token count or length: `4096`, `16k` (= 16384), `1m`."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = _NUMBER.match(str(text))
    suffix = match.group(2).lower() if match else None
    if not match or suffix not in _COUNT_SUFFIX:
        raise InputError(f"{what}: {text!r} is not a length (use e.g. 4096, 16k, 1m)")
    value = float(match.group(1)) * _COUNT_SUFFIX[suffix]
    if value != int(value):
        raise InputError(f"{what}: {text!r} is not a whole number of tokens")
    return int(value)


def parse_counts(text: str, what: str = "value") -> list[int]:
    """A comma-separated list of lengths: `4k,16k`."""
    return [parse_count(part, what) for part in str(text).split(",") if part.strip()]


def parse_memory(text: str | int | float, what: str = "value") -> int | float:
    """Memory as bytes (`8GB`, `512MiB`, `1073741824`) or a fraction of RAM (`0.9`).

    A number with a decimal point and no unit is a fraction and must lie in (0, 1].
    Returns an int of bytes, or a float fraction.
    """
    bad = InputError(f"{what}: {text!r} is not a memory size (use e.g. 8GB, 512MiB, or 0.9 of RAM)")
    if isinstance(text, bool):
        raise bad
    if isinstance(text, int):
        return text
    match = _NUMBER.match(str(text))
    if not match or match.group(2).lower() not in _BYTE_SUFFIX:
        raise bad
    number, suffix = match.group(1), match.group(2).lower()
    if isinstance(text, float) or ("." in number and not suffix):
        fraction = float(number)
        if not 0 < fraction <= 1:
            raise InputError(f"{what}: fraction {text!r} must be in (0, 1]; for bytes add a unit (8GB)")
        return fraction
    return int(float(number) * _BYTE_SUFFIX[suffix])


def format_bytes(n: int | float | None) -> str:
    """Binary units, the way memory is reported by the OS."""
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
