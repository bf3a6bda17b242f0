"""Byte sizes: parse `512MiB`, `2GiB`, `79.18GiB`, `80GB`, `4096B`; format for people.

On the command line a size needs its unit (`unit_required`): `--device-memory 80` is refused, naming
`80GiB`, `80GB` and `80B`, rather than read as 80 bytes.

Every size is bounded (`MAX_BYTES`, 1 EiB) and so is the text it is written in (`MAX_SIZE_CHARS`), so a
size with hundreds of digits is one clear `ConfigError`, never a slow parse or an overflow.
"""

from __future__ import annotations

import re
from decimal import ROUND_FLOOR, Decimal, InvalidOperation

from .errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
MAX_BYTES = 2**60  # 1 EiB: far beyond any device or host tier, small enough to keep arithmetic exact
MAX_SIZE_CHARS = 40  # "1152921504606846976" is 19 digits; 40 leaves room for decimals and a unit


def parse_bytes(text: str | int, *, allow_zero: bool = False, unit_required: bool = False) -> int:
    """Parse a byte size. Decimal units (GB) are powers of 10, binary units (GiB) powers of 2.

    Bare single-letter suffixes (K, M, G, T) mean binary units, as in most CLIs. A fractional size
    (`79.18GiB`, the figure `nvidia-smi` and vLLM print) is rounded down to whole bytes. Sizes must be
    positive (or zero with `allow_zero`) and at most `MAX_BYTES`. With `unit_required` a written size
    other than zero must name its unit (`B` for bytes): what the command line asks, where a bare `80` meant
    for GiB would otherwise plan 80 bytes.
    """
    if isinstance(text, bool):
        raise ConfigError(f"not a byte size: {text!r}")
    if isinstance(text, int):
        value = text
    else:
        raw = str(text)
        if len(raw) > MAX_SIZE_CHARS:
            raise ConfigError(f"byte size {raw[:20]}... is too long ({len(raw)} characters; "
                              f"the largest size is {format_bytes(MAX_BYTES)})")
        match = _SIZE.match(raw)
        if not match or match.group(2).lower() not in _UNITS:
            raise ConfigError(f"not a byte size: {raw!r} (use e.g. 512MiB, 2GiB, 79.18GiB, 80GB or a plain "
                              "integer)")
        number, unit = match.groups()
        if unit_required and not unit and Decimal(number) != 0:
            raise ConfigError(f"size {raw.strip()!r} has no unit: write {number}GiB (binary), {number}GB (decimal) "
                              f"or {number}B (bytes)")
        try:
            exact = Decimal(number) * _UNITS[unit.lower()]
        except InvalidOperation:  # pragma: no cover - the regex admits only plain decimals
            raise ConfigError(f"not a byte size: {raw!r}") from None
        if exact > MAX_BYTES:
            raise ConfigError(f"byte size {raw!r} is larger than {format_bytes(MAX_BYTES)}")
        value = int(exact.to_integral_value(rounding=ROUND_FLOOR))
        if value == 0 and exact > 0:
            raise ConfigError(f"byte size {raw!r} is less than one byte")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"byte size must be positive, got {text!r}")
    if value > MAX_BYTES:
        raise ConfigError(f"byte size {value} is larger than {format_bytes(MAX_BYTES)}")
    return value


def format_bytes(n: int | float) -> str:
    """Format with binary units: 131072 -> '128 KiB', 536870912 -> '512 MiB'."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if n < 1024 or unit == "EiB":
            if unit == "B" or float(n).is_integer():
                return f"{sign}{int(n)} {unit}"
            return f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_gib(n: int | float) -> str:
    """Bytes as GiB with two decimals, the way vLLM logs memory: 55168925696 -> '51.38 GiB'."""
    return f"{n / 2**30:,.2f} GiB"


__all__ = ["MAX_BYTES", "MAX_SIZE_CHARS", "format_bytes", "format_gib", "parse_bytes"]
