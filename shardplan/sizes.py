"""Parsing of human byte sizes ("60GiB", "1.5e9", 80 * 2**30)."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, *, what: str = "memory_budget") -> int:
    """Return ``value`` in bytes.

    >>> parse_bytes("60GiB")
    64424509440
    >>> parse_bytes(1024)
    1024
    """
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a byte count such as 80e9 or '60GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"{what} must be positive, got {value!r}")
        return int(value)
    match = _PATTERN.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{what}={value!r} is not a byte size; write e.g. '60GiB', '80GB' or 8e10")
    number = float(match.group(1)) * _UNITS[unit]
    if number <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return int(number)


def format_bytes(n: float) -> str:
    """``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
