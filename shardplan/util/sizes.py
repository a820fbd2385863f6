"""Parsing of human byte sizes ("60GiB", "1.5e9", 80 * 2**30)."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
# A sign, nan and inf are matched too, so that "-4GiB", "nan" and "inf" get a message saying what is wrong.
_PATTERN = re.compile(r"^\s*([+-]?(?:[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?|nan|inf(?:inity)?))\s*([a-zA-Z]*)\s*$",
                      re.IGNORECASE)
_HINT = "give a positive size such as 60e9 or '60GiB'"


def parse_bytes(value: int | float | str, *, what: str = "memory_budget") -> int:
    """Return ``value`` in bytes: a positive, finite number or a string such as ``"60GiB"``.

    ``what`` names the value in the ValueError a bad one raises (``memory_budget=nan is not a number
    of bytes; ...``); ``what=""`` leaves the name out, for a caller that names it itself (the CLI's
    ``argument --memory-budget: ...``).

    >>> parse_bytes("60GiB")
    64424509440
    >>> parse_bytes(1024)
    1024
    """
    shown = f"{what}={value!r}" if what else repr(value)
    if isinstance(value, bool):
        raise ValueError(f"{shown} is not a number of bytes; {_HINT}")
    if isinstance(value, int):
        number: float | int = value
    elif isinstance(value, float):
        number = value
    else:
        match = _PATTERN.match(str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{shown} is not a byte size; {_HINT} (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
        number = float(match.group(1)) * _UNITS[unit]
    if math.isnan(number):
        raise ValueError(f"{shown} is not a number of bytes; {_HINT}")
    if math.isinf(number):
        raise ValueError(f"{shown} is not a finite number of bytes; {_HINT}")
    if number <= 0:
        raise ValueError(f"{shown} is not a positive number of bytes; {_HINT}")
    if number < 1:
        raise ValueError(f"{shown} is less than one byte; {_HINT}")
    return int(number)


def parse_count(text: str) -> float:
    """``300e9``, ``300B``, ``1.5T``, ``20k``: a positive count (of tokens); ValueError otherwise."""
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(text[-1:].lower(), 1)
    try:
        value = float(text[:-1] if scale != 1 else text) * scale
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{text!r} is not a positive count; give e.g. 300e9 or 300B")
    return value


def format_bytes(n: float) -> str:
    """``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
