"""Admission policies: how many output tokens each policy reserves at admission.

* full        -- the whole declared allowance; growth can never fail.
* incremental -- one token (the next step's slot); growth beyond it draws on unpromised capacity.
* predicted   -- a quantile of the output lengths observed so far (the whole allowance until enough
                 requests have finished to trust the estimate); growth beyond it as incremental.
"""

from __future__ import annotations

import bisect
import math

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


def reserve_tokens(config: SchedulerConfig, lengths: OutputLengthTracker, max_new: int, remaining: int) -> int:
    """Output tokens to reserve for a request with ``remaining`` of its ``max_new`` tokens left."""
    if config.policy == "full":
        return remaining
    if config.policy == "incremental":
        return min(1, remaining)
    if len(lengths) < config.predicted_min_samples:
        return remaining
    predicted = lengths.quantile(config.predicted_quantile)
    already = max_new - remaining
    return max(min(remaining, predicted - already), min(1, remaining))
