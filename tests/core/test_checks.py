"""The shared validators (``kvledger.core.checks``): what each accepts, what it refuses and how it says so; and
the rule that the core raises only kvledger's typed errors."""

from __future__ import annotations

import ast
import builtins
import math
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvledger.core import checks
from kvledger.errors import ConfigError

CORE = Path(__file__).resolve().parents[2] / "src" / "kvledger" / "core"


class IntLike:
    """An integer-like that is not an ``int`` (as numpy's integers are): counts accept it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __index__(self) -> int:
        return self.n


NOT_INTEGERS = [True, False, 1.0, 2.5, "3", None, [1], Fraction(1)]
NOT_NUMBERS = [True, False, "1", None, [1.0], Fraction(1, 2), float("nan"), math.inf, -math.inf, 10**400]


# ---- counts -------------------------------------------------------------------------------------------------

@given(st.integers(min_value=0, max_value=2**70))
def test_count_accepts_every_integer_at_or_above_the_minimum(n: int) -> None:
    assert checks.count(n, "n") == n and type(checks.count(n, "n")) is int


def test_count_converts_integer_likes_to_int() -> None:
    got = checks.count(IntLike(7), "n")
    assert got == 7 and type(got) is int


@pytest.mark.parametrize("value", NOT_INTEGERS)
def test_count_refuses_what_is_not_an_integer(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^n must be an integer, got "):
        checks.count(value, "n")


def test_count_bounds_and_their_messages() -> None:
    with pytest.raises(ConfigError, match=r"^n must be >= 0, got -1$"):
        checks.count(-1, "n")
    assert checks.count(-5, "n", minimum=None) == -5
    assert checks.count(3, "n", 1, 3) == 3
    with pytest.raises(ConfigError, match=r"^n must be an integer in \[1, 3\], got 4$"):
        checks.count(4, "n", 1, 3)
    with pytest.raises(ConfigError, match=r"^n must be an integer in \[1, 3\], got 0$"):
        checks.count(0, "n", 1, 3)
    with pytest.raises(ConfigError, match=r"^n must be an integer in \[1, 3\], got 2.0$"):
        checks.count(2.0, "n", 1, 3)
    with pytest.raises(ConfigError, match=r"^n must be an integer in \[\.\.\., 3\], got 4$"):
        checks.count(4, "n", None, 3)
    with pytest.raises(ConfigError, match=r"^n must be an integer in \[1, 16,777,216\], got 0$"):
        checks.count(0, "n", 1, 2**24)


def test_a_huge_value_is_shown_short() -> None:
    with pytest.raises(ConfigError, match=r"^n must be >= 0, got an integer of 3001 bits$"):
        checks.count(-(2**3000), "n")


@given(st.integers(min_value=-(2**70), max_value=2**70))
def test_positive_accepts_exactly_the_integers_above_zero(n: int) -> None:
    if n >= 1:
        assert checks.positive(n, "n") == n
    else:
        with pytest.raises(ConfigError, match=rf"^n must be a positive integer, got {checks.show(n)}$"):
            checks.positive(n, "n")


@pytest.mark.parametrize("value", NOT_INTEGERS)
def test_positive_refuses_what_is_not_an_integer(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^n must be a positive integer, got "):
        checks.positive(value, "n")


@given(st.integers(min_value=-(2**70), max_value=2**70))
def test_non_negative_accepts_exactly_the_integers_from_zero(n: int) -> None:
    if n >= 0:
        assert checks.non_negative(n, "n") == n
    else:
        with pytest.raises(ConfigError, match=rf"^n must be a non-negative integer, got {checks.show(n)}$"):
            checks.non_negative(n, "n")


@pytest.mark.parametrize("value", NOT_INTEGERS)
def test_non_negative_refuses_what_is_not_an_integer(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^n must be a non-negative integer, got "):
        checks.non_negative(value, "n")


def test_size_is_a_byte_count() -> None:
    assert checks.size(0, "bytes") == 0 and checks.size(2**40, "bytes", 1) == 2**40
    with pytest.raises(ConfigError, match=r"^bytes must be a byte count \(an integer\), got '1GiB'$"):
        checks.size("1GiB", "bytes")
    with pytest.raises(ConfigError, match=r"^bytes must be >= 1, got 0$"):
        checks.size(0, "bytes", 1)
    with pytest.raises(ConfigError, match=r"^bytes must be an integer in \[0, 8\], got 9$"):
        checks.size(9, "bytes", 0, 8)


# ---- numbers ------------------------------------------------------------------------------------------------

@given(st.one_of(st.integers(min_value=-(2**100), max_value=2**100), st.floats(allow_nan=False, allow_infinity=False)))
def test_finite_accepts_every_finite_int_and_float(x: float) -> None:
    got = checks.finite(x, "x")
    assert type(got) is float and got == float(x)


@pytest.mark.parametrize("value", NOT_NUMBERS)
def test_finite_refuses_bools_non_numbers_and_non_finite_values(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^x must be a finite number, got "):
        checks.finite(value, "x")


@pytest.mark.parametrize(("kwargs", "value", "message"), [
    ({"minimum": 0}, -0.5, "x must be a finite number >= 0, got -0.5"),
    ({"minimum": 0, "open_min": True}, 0, "x must be a finite number > 0, got 0"),
    ({"maximum": 1}, 1.5, "x must be a finite number <= 1, got 1.5"),
    ({"maximum": 1, "open_max": True}, 1, "x must be a finite number < 1, got 1"),
    ({"minimum": 0, "maximum": 1, "open_min": True}, 0.0, "x must be a finite number in (0, 1], got 0.0"),
    ({"minimum": 0, "maximum": 1, "open_max": True}, 1.0, "x must be a finite number in [0, 1), got 1.0"),
])
def test_finite_bounds_and_their_messages(kwargs: dict, value: float, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        checks.finite(value, "x", **kwargs)
    assert str(err.value) == message


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_fraction_accepts_exactly_the_closed_unit_interval(x: float) -> None:
    if 0 <= x <= 1:
        assert checks.fraction(x, "f") == x
    else:
        with pytest.raises(ConfigError, match=r"^f must be in \[0, 1\], got "):
            checks.fraction(x, "f")


def test_flag_accepts_only_the_two_bools() -> None:
    assert checks.flag(True, "on") is True and checks.flag(False, "on") is False
    for value in (0, 1, "yes", None, 1.0):
        with pytest.raises(ConfigError, match=r"^on must be True or False, got "):
            checks.flag(value, "on")


@pytest.mark.parametrize("value", NOT_NUMBERS)
def test_fraction_refuses_what_is_not_a_finite_number(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^f must be in \[0, 1\], got "):
        checks.fraction(value, "f")


def test_every_refusal_is_a_config_error_and_so_a_value_error() -> None:
    """Callers that catch the builtin ``ValueError`` still catch a validator's refusal."""
    with pytest.raises(ValueError):
        checks.count("x", "n")


# ---- the core raises only typed errors ----------------------------------------------------------------------

BUILTIN_EXCEPTIONS = {name for name, obj in vars(builtins).items()
                      if isinstance(obj, type) and issubclass(obj, BaseException)}
# Builtins the core may raise on purpose: an unimplemented protocol method says so the one way Python knows.
ALLOWED_BUILTINS = {"NotImplementedError"}


def untyped_raises(path: Path, root: Path = CORE) -> list[str]:
    """Where ``path`` raises a builtin exception class, or uses ``assert`` (which ``python -O`` strips)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in BUILTIN_EXCEPTIONS and exc.id not in ALLOWED_BUILTINS:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: raise {exc.id}")
        elif isinstance(node, ast.Assert):
            found.append(f"{path.relative_to(root.parent)}:{node.lineno}: assert")
    return found


def test_the_core_raises_only_typed_errors() -> None:
    """Every error the core raises on purpose is one of kvledger's typed errors (``kvledger.errors``): bad input
    is a ``ConfigError`` (a ``ValueError``), a broken ledger rule a ``LedgerError``, a broken conservation law an
    ``InvariantError`` (an ``AssertionError``). The rule, read from the source of every module under
    ``src/kvledger/core``: no ``raise`` names a builtin exception class (``NotImplementedError`` aside; a bare
    ``raise`` re-raising what was caught is fine), and there is no ``assert`` at all, not even for type
    narrowing: ``python -O`` strips asserts, so a check written as one would vanish (narrow with an ``if`` that
    raises ``InvariantError``, or with ``typing.cast``). Errors Python raises on its own (a ``TypeError`` from
    arithmetic on a corrupted field) are not raises of the core and are not counted."""
    found = [hit for path in sorted(CORE.rglob("*.py")) for hit in untyped_raises(path)]
    assert found == []


@pytest.mark.parametrize("source", [
    "def f():\n    raise ValueError('x')\n",
    "def f():\n    raise IndexError\n",
    "def f(x):\n    assert x is not None\n",
])
def test_the_rule_sees_an_untyped_raise(source: str, tmp_path: Path) -> None:
    """Each form the rule forbids is reported when planted in a module."""
    planted = tmp_path / "core" / "planted.py"
    planted.parent.mkdir()
    planted.write_text(source, encoding="utf-8")
    assert len(untyped_raises(planted, tmp_path / "core")) == 1


def test_the_rule_lets_typed_errors_and_re_raises_through(tmp_path: Path) -> None:
    planted = tmp_path / "core" / "planted.py"
    planted.parent.mkdir()
    planted.write_text("from kvledger.errors import LedgerError\n"
                       "def f():\n    try:\n        g()\n    except KeyError:\n        raise\n"
                       "    raise LedgerError('x')\n"
                       "def g():\n    raise NotImplementedError\n", encoding="utf-8")
    assert untyped_raises(planted, tmp_path / "core") == []
