"""Seeded distributions of lengths, counts and priorities, and arrival processes (Poisson, gamma renewal).

Each aspect of a workload draws from its own named random stream (`_rng`), so changing one leaves the
others unchanged."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..errors import ConfigError
from .requests import _check_int, _is_int

# ---- distributions ---------------------------------------------------------------------------


class IntDist(Protocol):
    """A distribution of integers: token lengths, n, priorities."""

    def sample(self, rng: random.Random) -> int: ...


@dataclass(frozen=True, slots=True)
class Fixed:
    value: int

    def __post_init__(self) -> None:
        _check_int(self.value, "Fixed value", 0)

    def sample(self, rng: random.Random) -> int:
        return self.value


@dataclass(frozen=True, slots=True)
class Uniform:
    """Integers uniform on [low, high], both included."""

    low: int
    high: int

    def __post_init__(self) -> None:
        _check_int(self.low, "Uniform low", 0)
        _check_int(self.high, "Uniform high", self.low)

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclass(frozen=True, slots=True)
class LogNormal:
    """Log-normal with the given mean and coefficient of variation (std / mean), rounded to an
    integer and clipped to [low, high] (clipping moves the mean a little for heavy tails)."""

    mean: float
    cv: float
    low: int = 1
    high: int | None = None

    def __post_init__(self) -> None:
        if not self.mean > 0 or not self.cv > 0:
            raise ConfigError(f"LogNormal needs mean > 0 and cv > 0, got mean={self.mean!r} cv={self.cv!r}")
        _check_int(self.low, "LogNormal low", 0)
        if self.high is not None:
            _check_int(self.high, "LogNormal high", max(self.low, 1))

    def sample(self, rng: random.Random) -> int:
        sigma2 = math.log1p(self.cv * self.cv)
        value = round(rng.lognormvariate(math.log(self.mean) - sigma2 / 2, math.sqrt(sigma2)))
        value = max(self.low, value)
        return value if self.high is None else min(self.high, value)


@dataclass(frozen=True, slots=True)
class Choice:
    """One of `values`, with optional relative `weights`."""

    values: tuple[int, ...]
    weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(self.values))
        if not self.values or not all(_is_int(v) for v in self.values):
            raise ConfigError(f"Choice needs at least one integer value, got {self.values!r}")
        if self.weights is not None:
            object.__setattr__(self, "weights", tuple(self.weights))
            if len(self.weights) != len(self.values) or any(not w >= 0 for w in self.weights) \
                    or not sum(self.weights) > 0:
                raise ConfigError("Choice weights must be one non-negative number per value, not all zero")

    def sample(self, rng: random.Random) -> int:
        if self.weights is None:
            return rng.choice(self.values)
        return rng.choices(self.values, weights=self.weights)[0]


def _as_dist(value: IntDist | int, what: str) -> IntDist:
    if _is_int(value):
        return Fixed(value)
    if not hasattr(value, "sample"):
        raise ConfigError(f"{what} must be an integer or a distribution (Fixed, Uniform, LogNormal, Choice)")
    return value


# ---- arrival processes -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Poisson:
    """Poisson arrivals: exponential gaps with mean 1 / rate_per_s."""

    rate_per_s: float

    def __post_init__(self) -> None:
        rate = self.rate_per_s
        if isinstance(rate, bool) or not (isinstance(rate, int | float) and rate > 0 and math.isfinite(rate)):
            raise ConfigError(f"rate_per_s must be a positive number, got {self.rate_per_s!r}")

    def arrival_times(self, count: int, rng: random.Random) -> list[float]:
        """`count` arrival times; the first request arrives at 0."""
        return _cumulative(rng.expovariate(self.rate_per_s) for _ in range(count - 1))


@dataclass(frozen=True, slots=True)
class Gamma:
    """Renewal arrivals with gamma-distributed gaps: mean 1 / rate_per_s, coefficient of variation
    `cv` (cv = 1 is Poisson; cv > 1 burstier; cv < 1 more regular)."""

    rate_per_s: float
    cv: float

    def __post_init__(self) -> None:
        Poisson(self.rate_per_s)  # same check
        if not (isinstance(self.cv, int | float) and self.cv > 0 and math.isfinite(self.cv)):
            raise ConfigError(f"cv must be a positive number, got {self.cv!r}")

    def arrival_times(self, count: int, rng: random.Random) -> list[float]:
        shape = 1.0 / (self.cv * self.cv)
        scale = 1.0 / (self.rate_per_s * shape)
        return _cumulative(rng.gammavariate(shape, scale) for _ in range(count - 1))


ArrivalProcess = Poisson | Gamma


def _cumulative(gaps: Iterable[float]) -> list[float]:
    out, now = [0.0], 0.0
    for gap in gaps:
        now += gap
        out.append(now)
    return out


def _arrivals(arrivals: ArrivalProcess | Sequence[float], count: int, rng: random.Random) -> list[float]:
    if count == 0:
        return []
    if isinstance(arrivals, Poisson | Gamma):
        return arrivals.arrival_times(count, rng)
    if isinstance(arrivals, Sequence) and not isinstance(arrivals, str | bytes):
        if len(arrivals) < count:
            raise ConfigError(f"{len(arrivals)} arrival times given for {count} requests")
        return [float(t) for t in arrivals[:count]]
    raise ConfigError(f"arrivals must be Poisson(...), Gamma(...) or a list of times, got {arrivals!r}")


def _rng(seed: int, stream: str) -> random.Random:
    # One independent stream per aspect, so changing e.g. the n distribution leaves prompts alone.
    return random.Random(f"kvledger.sim/{seed}/{stream}")


__all__ = ["ArrivalProcess", "Choice", "Fixed", "Gamma", "IntDist", "LogNormal", "Poisson", "Uniform"]
