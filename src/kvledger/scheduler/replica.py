"""One replica, assembled in one place: the ledger, the tiers below its pool, the scheduler and the driver.

The engine (torch executor, wall clock), the simulator and the fleet simulator's replicas (cost-model
executor, virtual clock) and the admission lab (constant executor) all serve requests through the same
four pieces wired the same way; :class:`Replica` is that wiring, tensor-free. What differs between them is
only what they hand it: the executor, the clock and the driver's hooks. ``Replica.drive`` attaches the
driver once the executor exists (the engine's executor reports failed transfers to the scheduler, so it
is built after the scheduler).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.groups import KVCacheGroup
from ..core.ledger import KVLedger
from ..core.observe import EventLog
from ..core.tiers import TierLedger
from .config import SchedulerConfig
from .driver import Driver
from .execution import Executor
from .recovery import RecoveryCosts
from .scheduler import Scheduler


def tier_ledger(host_blocks: int = 0, disk_blocks: int = 0) -> TierLedger | None:
    """The ledger of the tiers below a device pool (host memory, then disk), None without any."""
    specs = [(name, n) for name, n in (("host", host_blocks), ("disk", disk_blocks)) if n]
    return TierLedger(specs) if specs else None


@dataclass(slots=True)
class Replica:
    """A ledger of ``num_blocks`` blocks, its tiers and a scheduler over them; :meth:`drive` adds the driver."""

    ledger: KVLedger
    tiers: TierLedger | None
    scheduler: Scheduler
    driver: Driver | None = field(default=None)

    @classmethod
    def assemble(cls, num_blocks: int, block_size: int, config: SchedulerConfig | None = None, *,
                 eviction: str = "lru", prefix_caching: bool = True, host_blocks: int = 0, disk_blocks: int = 0,
                 costs: RecoveryCosts | None = None, events: EventLog | None = None,
                 tiers: TierLedger | None = None, kv_groups: Sequence[KVCacheGroup] | None = None) -> Replica:
        """``tiers``: a tier ledger already built (else one from ``host_blocks`` and ``disk_blocks``).
        ``kv_groups``: a hybrid model's KV cache groups (the ledger charges and tables by group, for works of
        the scheduler's largest chunk)."""
        if kv_groups is not None and len(kv_groups) > 1:
            cfg = config or SchedulerConfig()
            ledger = KVLedger(num_blocks, block_size, prefix_caching=prefix_caching, policy=eviction, events=events,
                              kv_groups=kv_groups, step_tokens=min(cfg.prefill_chunk, cfg.token_budget))
        else:
            ledger = KVLedger(num_blocks, block_size, prefix_caching=prefix_caching, policy=eviction, events=events)
        return cls.around(ledger, config, tiers=tiers if tiers is not None else tier_ledger(host_blocks, disk_blocks),
                          costs=costs)

    @classmethod
    def around(cls, ledger: KVLedger, config: SchedulerConfig | None = None, *, tiers: TierLedger | None = None,
               costs: RecoveryCosts | None = None) -> Replica:
        """A replica over a ledger the caller owns (and may share with other users of its pool)."""
        return cls(ledger, tiers, Scheduler(ledger, config, host=tiers, costs=costs))

    def drive(self, executor: Executor, **driver: Any) -> Driver:
        """The one step loop over this replica's scheduler with ``executor`` (``driver``: the
        :class:`Driver`'s keywords -- clock, hooks, feed window, checks)."""
        self.driver = Driver(self.scheduler, executor, **driver)
        return self.driver


__all__ = ["Replica", "tier_ledger"]
