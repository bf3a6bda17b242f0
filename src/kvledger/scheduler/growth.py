"""What happens when a running request cannot grow: the growth actions, and the finish reasons of
requests that can no longer make progress (the scheduler's liveness rule).

Growth fails when a branch's next token starts a block it has no promise for and
``free + evictable - promised`` is 0 (or a copy-on-write copy of a shared tail has no block). Each
action is a :class:`GrowthAction` in :data:`GROWTH_ACTIONS`; its handler returns True when the append
should be retried at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.registry import Registry
from .plan import Branch, StepPlan

if TYPE_CHECKING:
    from .scheduler import Scheduler

# Finish reasons of the liveness rule and of the growth actions (they are part of the API: match on them).
REJECTED_NO_MEMORY = "rejected: no memory to grow"
REJECTED_OUTGREW = "rejected: the request outgrew the whole pool"
REJECTED_NO_ROOM = "rejected: does not fit even with nothing else running"
NEVER_POOL = "never: larger than the whole pool"
NEVER_BRANCHES = "never: more branches than max_running"
NEVER_BEAMS = "never: more beams than token_budget (beams decode in one step)"
NEVER_QUOTA = "never: larger than its trust group's quota"

# (scheduler, the branch that cannot grow, the plan being built, why) -> retry the append now?
Handler = Callable[["Scheduler", Branch, StepPlan, str], bool]


@dataclass(frozen=True, slots=True)
class GrowthAction:
    handle: Handler
    keeps_headroom: bool = False  # admission keeps SchedulerConfig.headroom_blocks free for growth


def _defer(sched: Scheduler, br: Branch, plan: StepPlan, why: str) -> bool:
    sched.defer(br)  # retried next step; Scheduler._grow breaks the all-deferred deadlock
    return False


def _reject(sched: Scheduler, br: Branch, plan: StepPlan, why: str) -> bool:
    sched.end_branch(br, REJECTED_NO_MEMORY, plan)
    return False


def _preempt(sched: Scheduler, br: Branch, plan: StepPlan, why: str) -> bool:
    rid = br.request.request_id
    victim = sched.pick_victim()
    if victim is None or (victim == rid and len(sched.running) == 1):
        if sched.swap_in_flight:
            sched.defer(br)  # blocks being swapped out this step come free at confirm
            return False
        sched.end_branch(br, REJECTED_OUTGREW, plan)
        return False
    mode = sched.preempt(victim, plan, f"{rid} needed a block")
    if victim == rid:
        return False
    if mode == "swap":
        # The victim's blocks are reusable only once the transfer completes: the grower waits one step
        # (retrying now would pick a second victim for memory that is already on its way).
        sched.defer(br)
        return False
    return True


GROWTH_ACTIONS: Registry[GrowthAction] = Registry("growth action")
GROWTH_ACTIONS.register("defer", GrowthAction(_defer),
                        "skip the branch this step and retry; if every running request is deferred, "
                        "recompute one victim")
GROWTH_ACTIONS.register("preempt", GrowthAction(_preempt),
                        "preempt a victim (victim policy) by the recovery mode and retry")
GROWTH_ACTIONS.register("reject", GrowthAction(_reject), "end the branch with a clear reason")
GROWTH_ACTIONS.register("headroom", GrowthAction(_preempt, keeps_headroom=True),
                        "admission keeps headroom_blocks free for growth; past that, as preempt")

__all__ = ["GROWTH_ACTIONS", "NEVER_BEAMS", "NEVER_BRANCHES", "NEVER_POOL", "NEVER_QUOTA", "REJECTED_NO_MEMORY",
           "REJECTED_NO_ROOM", "REJECTED_OUTGREW", "GrowthAction", "Handler"]
