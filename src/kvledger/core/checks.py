"""The one set of input validators: counts, numbers, fractions, byte sizes and flags.

Every layer checks its arguments with these, so a rule ("a count is an integer, never a bool or a float";
"a number is finite") is decided in one place and every refusal reads the same: a
:class:`~kvledger.errors.ConfigError` saying ``"{what} must be ..., got {show(value)}"``. Counts accept
integer-likes such as numpy integers and return a plain ``int``; numbers accept ``int`` and ``float`` (never
``bool``) and return a ``float``. Standard library only, shared by both halves of the core.
"""

from __future__ import annotations

import math
import operator

from ..errors import ConfigError


def show(value: object) -> str:
    """A short description of a bad value for an error message (never a 4,000-digit repr)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value) if isinstance(value, (str, bytes, int, float, type(None))) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def count(value: object, what: str, minimum: int | None = 0, maximum: int | None = None) -> int:
    """``value`` as a plain ``int`` in ``[minimum, maximum]`` (None: unbounded on that side); a bool,
    float, str or None is refused (``True`` is not one token, ``2.0`` is not two branches)."""
    if maximum is not None:  # a bounded count: one message names the whole range
        rule = f"an integer in [{'...' if minimum is None else f'{minimum:,}'}, {maximum:,}]"
        if isinstance(value, bool) or not hasattr(type(value), "__index__"):
            raise ConfigError(f"{what} must be {rule}, got {show(value)}")
        number = operator.index(value)
        if number > maximum or (minimum is not None and number < minimum):
            raise ConfigError(f"{what} must be {rule}, got {show(number)}")
        return number
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise ConfigError(f"{what} must be an integer, got {show(value)}")
    number = operator.index(value)
    if minimum is not None and number < minimum:
        raise ConfigError(f"{what} must be >= {minimum}, got {show(number)}")
    return number


def positive(value: object, what: str) -> int:
    """``value`` as a plain ``int`` >= 1: a count of things there must be some of (blocks, tokens, replicas).
    One message for a wrong type and a wrong sign: ``"{what} must be a positive integer, got ..."``."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__") or operator.index(value) < 1:
        raise ConfigError(f"{what} must be a positive integer, got {show(value)}")
    return operator.index(value)


def non_negative(value: object, what: str) -> int:
    """``value`` as a plain ``int`` >= 0, with one message for a wrong type and a wrong sign:
    ``"{what} must be a non-negative integer, got ..."`` (as :func:`positive` says "a positive integer")."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__") or operator.index(value) < 0:
        raise ConfigError(f"{what} must be a non-negative integer, got {show(value)}")
    return operator.index(value)


def size(value: object, what: str, minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` as a byte count: a plain ``int`` in ``[minimum, maximum]``. (Text with units, such as
    ``"16GiB"``, is parsed by :func:`kvledger.units.parse_bytes` before it gets here.)"""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise ConfigError(f"{what} must be a byte count (an integer), got {show(value)}")
    return count(value, what, minimum, maximum)


def _number(bound: float) -> str:
    """A bound as people write it: ``1,000,000`` for ``1e6``, ``0.5`` for ``0.5``."""
    return f"{int(bound):,}" if float(bound).is_integer() else repr(bound)


def _bound(minimum: float | None, maximum: float | None, open_min: bool, open_max: bool) -> str:
    if minimum is not None and maximum is not None:
        return f"in {'(' if open_min else '['}{_number(minimum)}, {_number(maximum)}{')' if open_max else ']'}"
    if minimum is not None:
        return f"{'>' if open_min else '>='} {_number(minimum)}"
    return f"{'<' if open_max else '<='} {_number(maximum)}"


def finite(value: object, what: str, minimum: float | None = None, maximum: float | None = None, *,
           open_min: bool = False, open_max: bool = False) -> float:
    """``value`` as a ``float``: an ``int`` or ``float`` (never a bool), finite, and within the bounds
    (``open_min``/``open_max`` exclude the bound itself: ``finite(x, "rate", 0, open_min=True)`` is x > 0).
    One message for every refusal: ``"{what} must be a finite number >= 0, got ..."``."""
    number = math.nan
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        number = float(value) if not isinstance(value, int) or value.bit_length() <= 1023 else math.inf
    if (not math.isfinite(number)
            or (minimum is not None and (number <= minimum if open_min else number < minimum))
            or (maximum is not None and (number >= maximum if open_max else number > maximum))):
        rule = "" if minimum is None and maximum is None else " " + _bound(minimum, maximum, open_min, open_max)
        raise ConfigError(f"{what} must be a finite number{rule}, got {show(value)}")
    return number


def fraction(value: object, what: str) -> float:
    """``value`` as a ``float`` in [0, 1]; one message for every refusal: ``"{what} must be in [0, 1], ..."``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(f"{what} must be in [0, 1], got {show(value)}")
    return float(value)


def flag(value: object, what: str) -> bool:
    """``value`` if it is ``True`` or ``False``; 0, 1, "yes" and None are refused."""
    if type(value) is not bool:
        raise ConfigError(f"{what} must be True or False, got {show(value)}")
    return value
