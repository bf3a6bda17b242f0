"""Tier planning: the scheduler's side of demotion, promotion and swapping to the tiers below the pool.

Composed into :class:`~kvledger.scheduler.scheduler.Scheduler` as its ``tier_planner``. The scheduler's ``host`` is a
:class:`~kvledger.core.tiers.TierLedger` (a :class:`~kvledger.scheduler.host.HostPool` is one with a
single ``host`` tier). Swapped requests take *held* slots of it (:meth:`Scheduler.preempt`). With
``SchedulerConfig.offload_prefixes`` the ledger is attached to it, so that:

* the retained prefix blocks next in line for eviction are **written back** (``plan.writeback``, with
  the ``plan.tier_moves`` that make room below): copied down while they stay on the device, beside the
  step's compute, so that evicting them later copies nothing; and each tier but the last keeps
  ``writeback_blocks`` slots free by **spilling** its coldest entries one tier down (``plan.tier_moves``);
* a retained block the device pool evicts before any write-back reached it is **demoted** urgently
  (``plan.demote``): its bytes are read out before anything in the step writes the block;
* a request about to be admitted gets the prompt blocks the tiers hold for its trust group **promoted**
  (``plan.promote``): device blocks indexed and leased until ``confirm``, then shared by its admission
  as ordinary prefix hits. Promotion is attempted only when the admission would succeed anyway, so a
  request that must wait never drags its prefix up just to have it evicted again.

Every transfer of a step completes within that step; ``confirm`` makes the written slots readable and
frees the drained ones (:meth:`TierLedger.complete`). ``restore_ahead`` keeps a request whose blocks arrive
this step from computing until the next one (see :mod:`kvledger.scheduler.transfers` for why that lets
the transfer hide). A failed transfer (:meth:`TierPlanner.transfers_failed`) drops the tier entries it was
writing and takes the identity of the device blocks it was filling, so no tenant is ever served bytes that
did not arrive. It fails no request: a lost demotion only loses a cache entry, and a request holding a
promoted block that did not arrive goes back to the waiting queue and recomputes those tokens
(:meth:`Scheduler.requeue`), as a prefix miss would have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..core.ledger import KVLedger
from ..core.registry import Registry
from ..core.tiers import TierLedger
from ..errors import ConfigError
from .config import SchedulerConfig
from .plan import Branch, StepPlan

# How evicted prefix blocks go to the tiers below the pool (issue 38): the one list the simulator's
# ``demotion`` setting (and its sweeps) reads.
DEMOTION_RULES: Registry[str] = Registry("demotion rule")
DEMOTION_RULES.register("always", "every evicted prefix block goes to the fastest tier with room")
DEMOTION_RULES.register("cost", "a block goes to a tier only when the time a later hit saves (recompute less "
                                "load, times the chance of that hit) beats the copy's cost to the step")


def cost_aware_rule(recompute_s: Callable[[int], float], load_s: Sequence[float], write_s: Sequence[float],
                    reuse: Callable[[], float] | None = None) -> Callable[[int, int | None, bool], bool]:
    """The ``cost`` demotion rule as a :attr:`TierLedger.worth`. Tier ``t`` is worth a block at ``depth``
    when a later hit would save time -- ``recompute_s(depth) > load_s[t]`` -- and, for an urgent copy
    (the step waits for its ``write_s[t]``), when the saving expected from it pays for the write:
    ``reuse() * (recompute_s(depth) - load_s[t]) > write_s[t]``, with ``reuse()`` the chance that a demoted
    entry is promoted again (the tiers' own record, measured as the run goes; 1 when not given). An unknown
    depth (no tree policy) is taken as the first block's, the cheapest to recompute."""
    if len(load_s) != len(write_s):
        raise ConfigError("load_s and write_s need one figure per tier")
    memo: dict[int, float] = {}

    def worth(tier: int, depth: int | None, urgent: bool) -> bool:
        d = depth or 0
        cost = memo.get(d)
        if cost is None:
            cost = memo[d] = recompute_s(d)
        gain = cost - load_s[tier]
        if gain <= 0:
            return False
        return not urgent or (1.0 if reuse is None else reuse()) * gain > write_s[tier]

    return worth


class TierPlanner:
    """The scheduler's tier planning. It owns the promotion and failure figures and the requests whose
    blocks arrive this step; it shares the scheduler's ledger, tiers (``host``), configuration, its
    list of swap leases (ended at ``confirm``) and running table, and sends a request back to the
    waiting queue through the ``requeue`` its caller hands in when a promoted block it holds did not arrive."""

    def __init__(self, ledger: KVLedger, host: TierLedger | None, config: SchedulerConfig, *, lease_owner: str,
                 swap_leases: list[int], running: dict[str, list[Branch]]) -> None:
        if host is not None and not isinstance(host, TierLedger):
            raise ConfigError(f"the scheduler's host tier must be a TierLedger or HostPool, got {type(host).__name__}")
        self.ledger = ledger
        self.host = host
        self.config = config
        self.lease_owner = lease_owner
        self._swap_leases = swap_leases
        self._running = running
        self.arriving: set[str] = set()  # requests whose blocks arrive from a tier this step
        self.promoted_tokens = 0
        # Tier entries dropped because the transfer writing them failed (or could not be trusted: its step
        # failed), and promoted blocks that did not arrive (their requests recomputed them).
        self.demotion_failures = 0
        self.promotion_failures = 0
        # Promoted blocks of the step in flight already known lost: the driver's rerun of a failed step
        # runs its transfers again and may report the same loss twice.
        self._lost_promotions: set[int] = set()
        if self.config.offload_prefixes:
            if host is None or host.num_blocks == 0:
                raise ConfigError("offload_prefixes needs tiers below the device pool (a host or disk tier)")
            self.ledger.attach_tiers(host)  # ConfigError without prefix caching

    @property
    def offloading(self) -> bool:
        return self.host is not None and self.ledger.tiers is self.host

    def promote(self, unit: list[Branch], plan: StepPlan, request: Any, keep_free: int) -> None:
        """Before ``unit``'s admission: promote the prompt blocks the tiers hold for it, if it fits now."""
        if not self.offloading or not self.host.index:
            return
        ledger = self.ledger
        if not ledger.can_admit(request, keep_free).admitted:
            return
        pairs, lease = ledger.promote_from_tiers(request, f"{self.lease_owner} promote step {plan.step}", keep_free)
        if lease is None:
            return
        self._swap_leases.append(lease)  # ended at confirm, when the transfer is done
        plan.promote.extend(pairs)
        self.promoted_tokens += len(pairs) * ledger.block_size
        if self.config.restore_ahead:
            self.arriving.add(unit[0].request.request_id)

    def _plan_writeback(self) -> None:
        """Copy down, ahead of their eviction, the retained blocks the next ``writeback_blocks`` allocations
        beyond the free list would evict (only those not below already). Planned after everything else
        of the step: these blocks are nobody's in this plan, so nothing writes them while they are read."""
        budget = self.config.writeback_blocks
        pool = self.ledger.pool
        tiers = self.host
        # Each tier but the last keeps ``budget`` slots free by spilling its coldest entries one tier down,
        # so that urgent demotions find a free fast slot instead of dropping a cached entry.
        for i in range(len(tiers.names) - 1):
            short = budget - tiers.free_in(i)
            if short > 0:
                tiers.spill(i, short)
        need = budget - pool.num_free
        if need <= 0 or not pool.num_retained:
            return
        peek = getattr(pool.retained, "peek", None)
        candidates = peek(budget) if peek is not None else pool.retained.blocks()[:budget]
        digest, group = pool.digest, pool.group
        depth_of = getattr(pool.retained, "depth", None)  # a tree policy knows each block's depth
        for block in candidates:
            d = digest[block]
            if d is None or d in tiers.index:
                continue
            tiers.demote(block, d, group[block], urgent=False, depth=None if depth_of is None else depth_of(block))
            need -= 1
            if need <= 0:
                return

    def take_ops(self, plan: StepPlan) -> None:
        """Demotions, write-backs and moves the ledger decided since the last step go into this plan."""
        if not self.offloading:
            return
        if self.config.writeback_blocks:
            self._plan_writeback()
        lists = {"demote": plan.demote, "move": plan.tier_moves, "writeback": plan.writeback}
        for op in self.host.take_ops():
            lists[op.kind].append((op.src, op.dst))

    def complete(self) -> None:
        """Every transfer of the step is done: written slots readable, drained ones free."""
        if self.host is not None:
            self.host.complete()
        self.arriving.clear()
        self._lost_promotions.clear()

    def transfers_failed(self, plan: StepPlan, requeue: Callable[[str], Any]) -> list[str]:
        """The executor could not complete these tier transfers of the step in flight (``plan`` names
        them: the whole step's, or only the ones that failed). The tier entries they were writing are
        dropped -- only those cache entries are lost. The promoted device blocks lose their identity, and
        every running request holding one goes back to the front of the waiting queue to recompute it
        (``requeue``, :meth:`Scheduler.requeue`: its work in the step in flight is ignored; handed in per
        call, since a planner holding its scheduler's method would make the two a reference cycle). No
        request fails. Returns the requests sent back, in admission order."""
        if self.host is not None:
            written = [s for _, s in (*plan.demote, *plan.tier_moves, *plan.writeback)]
            if written:
                self.demotion_failures += self.host.discard(written)
        if not plan.promote:
            return []
        missing = [d for _, d in plan.promote if d not in self._lost_promotions]
        if not missing:
            return []
        self._lost_promotions.update(missing)
        self.ledger.invalidate(missing)
        self.promotion_failures += len(missing)
        self.promoted_tokens -= len(missing) * self.ledger.block_size  # they were not served from a tier
        lost = set(missing)
        readers = [rid for rid, branches in self._running.items()
                   if any(not lost.isdisjoint(br.blocks) for br in branches)]
        for rid in reversed(readers):  # each goes to the front: the last first keeps their order
            requeue(rid)
        return readers

    def tier_stats(self) -> dict[str, Any]:
        """Slots by tier and state, the flow of cached entries, promoted prefix tokens, and the tier
        entries and promoted blocks lost to failed transfers."""
        if self.host is None:
            return {}
        return {**self.host.stats(), "promoted_tokens": self.promoted_tokens, "offload_prefixes": self.offloading,
                "demotion_failures": self.demotion_failures, "promotion_failures": self.promotion_failures}


__all__ = ["TierPlanner"]
