"""Admission policies: how many output tokens each policy reserves at admission.

* full        -- the whole declared allowance; growth can never fail.
* incremental -- one token (the next step's slot); growth beyond it draws on unpromised capacity.
* predicted   -- a quantile of the output lengths observed so far (the whole allowance until enough
                 requests have finished to trust the estimate); growth beyond it as incremental.

Each policy is an :class:`AdmissionPolicy` in :data:`ADMISSION_POLICIES`; ``SchedulerConfig.policy``
names one.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.registry import Registry

if TYPE_CHECKING:
    from .config import SchedulerConfig


class OutputLengthTracker:
    """Sorted record of finished output lengths; quantiles in O(log n) insert, O(1) read."""

    def __init__(self) -> None:
        self._sorted: list[int] = []

    def observe(self, length: int) -> None:
        bisect.insort(self._sorted, length)

    def __len__(self) -> int:
        return len(self._sorted)

    def quantile(self, q: float) -> int:
        if not self._sorted:
            raise ValueError("no output lengths observed yet")
        idx = min(len(self._sorted) - 1, max(0, math.ceil(q * len(self._sorted)) - 1))
        return self._sorted[idx]


# (config, observed lengths, max_new_tokens, tokens still to generate) -> output tokens to reserve
Reserve = Callable[["SchedulerConfig", OutputLengthTracker, int, int], int]


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """``reserve`` says what admission promises; ``exact`` policies reserve the whole allowance, so growth
    can never fail and no watermark is kept free (a preemption under them is a bug)."""

    reserve: Reserve
    exact: bool = False


def _full(config: SchedulerConfig, lengths: OutputLengthTracker, max_new: int, remaining: int) -> int:
    return remaining


def _incremental(config: SchedulerConfig, lengths: OutputLengthTracker, max_new: int, remaining: int) -> int:
    return min(1, remaining)


def _predicted(config: SchedulerConfig, lengths: OutputLengthTracker, max_new: int, remaining: int) -> int:
    if len(lengths) < config.predicted_min_samples:
        return remaining
    predicted = lengths.quantile(config.predicted_quantile)
    already = max_new - remaining
    return max(min(remaining, predicted - already), min(1, remaining))


ADMISSION_POLICIES: Registry[AdmissionPolicy] = Registry("admission policy")
ADMISSION_POLICIES.register("full", AdmissionPolicy(_full, exact=True),
                            "reserve the whole output allowance: growth never fails, nothing is preempted")
ADMISSION_POLICIES.register("incremental", AdmissionPolicy(_incremental),
                            "reserve the next token only; growth draws on unpromised capacity")
ADMISSION_POLICIES.register("predicted", AdmissionPolicy(_predicted),
                            "reserve a quantile of observed output lengths (the whole allowance until enough "
                            "requests have finished)")


def reserve_tokens(config: SchedulerConfig, lengths: OutputLengthTracker, max_new: int, remaining: int) -> int:
    """Output tokens to reserve for a request with ``remaining`` of its ``max_new`` tokens left."""
    return ADMISSION_POLICIES[config.policy].reserve(config, lengths, max_new, remaining)
