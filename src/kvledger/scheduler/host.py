"""The tiers below the device pool as the scheduler sees them: slot ledgers and the link model.

:class:`HostPool` is a :class:`~kvledger.core.tiers.TierLedger` with one tier named ``host`` (the swap
space of earlier versions); build a ``TierLedger([("host", H), ("disk", D)])`` for more tiers. Its slots
hold swapped requests' blocks and, when the scheduler offloads prefixes, demoted prefix blocks.

:class:`TransferModel` is one link between the device and a tier (or between tiers), per direction::

    time_s(blocks) = rounds x overhead_s + blocks x block_bytes / bandwidth      rounds = ceil(blocks / staging)

Blocks move through a bounded staging buffer of ``staging_blocks``: a batch larger than the buffer takes
several rounds, each paying the fixed overhead. ``out`` is device -> tier (``link_Bps``, ``overhead_s``),
``in`` is tier -> device (``in_link_Bps``, ``in_overhead_s``; the same as ``out`` unless given).

Overlap is never a guarantee. :meth:`TransferModel.blocking_time_s` is what a step waits for: the whole
transfer when the step needs its data (a restored or promoted block the step reads, a device block the step
overwrites) or when the executor does not overlap copies with compute; otherwise only what is left once the
step's concurrent compute is over, ``max(0, time - concurrent_s)``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from ..core import checks
from ..core.tiers import TierLedger
from ..errors import ConfigError

DIRECTIONS = ("out", "in")


def _rate(value: object, what: str, positive: bool) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))
    if not ok or (float(value) <= 0 if positive else float(value) < 0):
        raise ConfigError(f"transfer model: {what} must be a {'positive' if positive else 'non-negative'} "
                          f"number, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class TransferModel:
    link_Bps: float = 25e9  # noqa: N815 -- device -> tier bandwidth, bytes/s
    overhead_s: float = 20e-6  # fixed cost per transfer round (launch, sync, DMA setup, a file call)
    staging_blocks: int = 64  # bounded staging buffer, in blocks
    overlap: bool = False  # True only if the executor really overlaps copies with compute
    in_link_Bps: float | None = None  # noqa: N815 -- tier -> device; None: as link_Bps
    in_overhead_s: float | None = None

    def __post_init__(self) -> None:
        _rate(self.link_Bps, "link_Bps", True)
        _rate(self.overhead_s, "overhead_s", False)
        if self.in_link_Bps is not None:
            _rate(self.in_link_Bps, "in_link_Bps", True)
        if self.in_overhead_s is not None:
            _rate(self.in_overhead_s, "in_overhead_s", False)
        if isinstance(self.staging_blocks, bool) or not isinstance(self.staging_blocks, int) or self.staging_blocks < 1:
            raise ConfigError(f"transfer model: staging_blocks must be an integer >= 1, got {self.staging_blocks!r}")
        checks.flag(self.overlap, "transfer model: overlap")

    def bandwidth(self, direction: str = "out") -> float:
        if direction not in DIRECTIONS:
            raise ConfigError(f"a transfer direction is 'out' or 'in', got {direction!r}")
        return self.link_Bps if direction == "out" or self.in_link_Bps is None else self.in_link_Bps

    def fixed_s(self, direction: str = "out") -> float:
        if direction not in DIRECTIONS:
            raise ConfigError(f"a transfer direction is 'out' or 'in', got {direction!r}")
        return self.overhead_s if direction == "out" or self.in_overhead_s is None else self.in_overhead_s

    def rounds(self, blocks: int) -> int:
        return math.ceil(blocks / self.staging_blocks) if blocks > 0 else 0

    def time_s(self, blocks: int, block_bytes: int, direction: str = "out") -> float:
        """Seconds to move ``blocks`` one way: bytes / bandwidth + one fixed overhead per staging round."""
        if blocks <= 0:
            return 0.0
        return blocks * block_bytes / self.bandwidth(direction) + self.rounds(blocks) * self.fixed_s(direction)

    def blocking_time_s(self, blocks: int, block_bytes: int, *, needed: bool = True, concurrent_s: float = 0.0,
                        direction: str = "out") -> float:
        """What a step waits for: all of it when the step needs the data (``needed``) or nothing overlaps
        (``overlap`` False); otherwise what outlasts the step's concurrent compute."""
        t = self.time_s(blocks, block_bytes, direction)
        if needed or not self.overlap:
            return t
        return max(0.0, t - max(0.0, float(concurrent_s)))


class HostPool(TierLedger):
    """One host tier of ``num_blocks`` slots (the swap space): ``free + held + cached + draining == total``."""

    def __init__(self, num_blocks: int, block_bytes: int = 0) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ConfigError("host pool size must be >= 0")
        super().__init__([("host", num_blocks)])
        self.block_bytes = block_bytes


__all__ = ["DIRECTIONS", "HostPool", "TierLedger", "TransferModel"]
