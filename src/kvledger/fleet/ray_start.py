"""Starting a local Ray on a busy machine, Ray-free: a start that timed out is tried once more, and one that
still fails -- or fails for another reason -- is one :class:`~kvledger.errors.ConfigError` line, never a
traceback.

Ray raises a plain ``Exception`` when its node does not come up in time ("The current node timed out during
startup ... or the GCS has become overloaded"): on a machine whose cores are all busy, its fixed 30 s wait
for the raylet runs out. That is load, not a fault, so it is worth one more try; anything else (a Ray that
listens beyond loopback, a bad option) is a fault and is not retried. The fleet's tests read the same
markers (tests/fleet/conftest.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

from ..errors import ConfigError

T = TypeVar("T")

# What Ray says when a node did not come up in time (as opposed to a real fault, which is not retried).
RAY_START_TIMEOUTS = ("timed out during startup", "GCS has become overloaded", "Failed to connect to GCS",
                      "failed to register", "Timed out while waiting for", "DEADLINE_EXCEEDED")


def is_ray_start_timeout(text: str) -> bool:
    """Whether ``text`` (an exception, a subprocess's stderr) is Ray not coming up in time."""
    return any(marker.lower() in text.lower() for marker in RAY_START_TIMEOUTS)


def load_average() -> str:
    """The machine's load, as the failure line names it."""
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "unknown"
    return f"{one:.1f} (5 min {five:.1f}) on {os.cpu_count()} cores"


def _last_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return " ".join(text.splitlines()[-1].split())[:300].rstrip(".") if text else type(exc).__name__


def start_ray(init: Callable[[], T], stop: Callable[[], object], attempts: int = 2) -> T:
    """``init()`` (``ray.init``), tried up to ``attempts`` times while it times out, ``stop()`` (``ray.shutdown``)
    after each failed try so that a half-started node does not linger. A :class:`ConfigError` from ``init``
    (a real fault found by our own checks) passes through; any other failure becomes one ConfigError line
    naming Ray's own last line (and, for time-outs, the load and the tries)."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    started, load = time.monotonic(), load_average()
    for attempt in range(1, attempts + 1):
        try:
            return init()
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 -- Ray raises plain Exceptions; the user gets one line
            stop()
            if not is_ray_start_timeout(f"{type(exc).__name__}: {exc}"):
                raise ConfigError(f"Ray did not start: {_last_line(exc)}") from None
            if attempt == attempts:
                tries = "tried once" if attempts == 1 else f"tried {attempts} times"
                raise ConfigError(
                    f"Ray did not start within {time.monotonic() - started:.0f} s ({tries}; load {load} at the "
                    f"start): {_last_line(exc)}; a busy machine slows Ray's start-up: try again when it is "
                    "quieter") from None
    raise AssertionError("unreachable")  # pragma: no cover


__all__ = ["RAY_START_TIMEOUTS", "is_ray_start_timeout", "load_average", "start_ray"]
