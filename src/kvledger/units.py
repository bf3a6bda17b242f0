"""Byte sizes: parse `512MiB`, `2GiB`, `80GB`, `4096`; format for people."""

from __future__ import annotations

import re

from .errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """Parse a byte size. Decimal units (GB) are powers of 10, binary units (GiB) powers of 2.

    Bare single-letter suffixes (K, M, G, T) mean binary units, as in most CLIs.
    """
    if isinstance(text, bool):
        raise ConfigError(f"not a byte size: {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(str(text))
        if not match or match.group(2).lower() not in _UNITS:
            raise ConfigError(f"not a byte size: {text!r} (use e.g. 512MiB, 2GiB, 80GB or a plain integer)")
        number, unit = match.groups()
        value_f = float(number) * _UNITS[unit.lower()]
        value = int(value_f)
        if value != value_f:
            raise ConfigError(f"byte size {text!r} is not a whole number of bytes")
    if value <= 0:
        raise ConfigError(f"byte size must be positive, got {text!r}")
    return value


def format_bytes(n: int | float) -> str:
    """Format with binary units: 131072 -> '128 KiB', 536870912 -> '512 MiB'."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            if unit == "B" or float(n).is_integer():
                return f"{sign}{int(n)} {unit}"
            return f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
