"""Restoring swapped requests, admitting waiting ones, and the liveness rule for queued requests.

:class:`Admitter` is the scheduler's collaborator for it: it reads and changes the scheduler's queues and
running set (``Scheduler.admitter``; the scheduler composes it rather than inheriting it). A fresh request is
one ledger admission with ``branches=n``; a preempted family -- recomputed or swapped -- comes back in one
``KVLedger.admit_family`` decision, all-or-nothing, changing nothing when refused.

Units are admitted in priority order, first come first served, and nobody overtakes a unit the pool
cannot take now. A unit refused by its trust group's quota (``Decision.over_quota``) is different: the
group waits for its own requests to finish, so the units behind it of other groups go ahead, while the
group's later units keep waiting behind it (first come first served within the group). One tenant at its
cap never holds up another.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..core.types import Outcome, Request
from .growth import NEVER_BEAMS, NEVER_BRANCHES, NEVER_POOL, NEVER_QUOTA, REJECTED_NO_ROOM, REJECTED_OUTGREW
from .plan import Admission, Branch, Status, StepPlan
from .policies import reserve_tokens
from .queue import WaitingQueue

if TYPE_CHECKING:
    from .scheduler import Scheduler


class Admitter:
    """Restores swapped units and admits waiting ones for its scheduler ``s`` (see the module docstring)."""

    __slots__ = ("s",)

    def __init__(self, scheduler: Scheduler) -> None:
        # A weak proxy: the scheduler holds its admitter, and a strong reference back would make every
        # scheduler (with its ledger and requests) a cycle only the cyclic garbage collector frees, whose
        # full passes then slow every later step of the process.
        self.s = weakref.proxy(scheduler)

    # ---- restoring and admitting ----------------------------------------------------------------
    def ledger_request(self, br: Branch, fresh: bool, readmission: bool) -> Request:
        s = self.s
        req = br.request
        remaining = req.max_new_tokens - br.num_generated
        reserve = reserve_tokens(s.config, s.lengths, req.max_new_tokens, remaining)
        n = br.in_ledger if br.status is Status.SWAPPED else len(br.tokens)
        # The same prompt object on every attempt while the unit waits: the ledger then remembers its
        # digests instead of hashing the prompt again each step.
        prompt = br.ledger_prompt
        if prompt is None or len(prompt) != n:
            prompt = br.ledger_prompt = tuple(br.tokens[:n])
        return Request(br.seq_id, prompt, remaining + (len(br.tokens) - n), req.context,
                       reserve_new_tokens=min(reserve, remaining), branches=req.n if fresh else 1,
                       lookahead=req.lookahead, family=req.request_id, read_prefix_cache=req.read_prefix_cache,
                       readmission=readmission, drop_last_hit_block=req.drop_last_hit_block, mm_items=req.mm_items)

    def admit_unit(self, unit: list[Branch], plan: StepPlan) -> tuple[Outcome, bool]:
        """Admit one unit. Returns the outcome and whether a refusal came from its group's quota."""
        s = self.s
        first = unit[0]
        readmission = first.admitted_order >= 0
        fresh = not readmission and len(unit) == first.request.n and all(br.num_generated == 0 for br in unit)
        ledger = s.ledger
        # The watermark protects running requests' growth; with nothing running it would only stop a
        # request that fits the pool from ever starting.
        keep_free = s._keep_free if s.running else 0
        if fresh:
            request = self.ledger_request(first, True, False)
            s.tier_planner.promote(unit, plan, request, keep_free)
            decision = ledger.admit(request, keep_free)
        else:
            # A preempted family comes back whole or not at all (gang semantics), in one ledger decision
            # that changes nothing when it refuses; its branches share their common full blocks as they
            # did before (with or without prefix caching), so a family that fitted fits again.
            requests = [self.ledger_request(br, False, readmission) for br in unit]
            if first.status is not Status.SWAPPED:  # a recomputed family may find its prefix below the device
                s.tier_planner.promote(unit, plan, requests[0], keep_free)
            decision = ledger.admit_family(requests, keep_free)
        if not decision.admitted:
            return decision.outcome, decision.over_quota
        rid = first.request.request_id
        bs = ledger.block_size
        cached = 0
        restoring = first.status is Status.SWAPPED
        restored_blocks: set[int] = set()
        hit_ready = ledger.ready_tokens(first.seq_id) if fresh else None
        for i, br in enumerate(unit):
            br.admitted_order = s._order
            seq = ledger.sequence(br.seq_id)
            br.blocks = blocks = seq.table.blocks
            br.ledger_prompt = None
            br.hit_end = seq.hit_blocks * bs  # pending hits among them: see Scheduler._shared_start
            if restoring:
                written = ledger.pool.written
                for j in range(seq.hit_blocks, len(blocks)):
                    if blocks[j] not in restored_blocks:  # a block the family shares comes back once
                        restored_blocks.add(blocks[j])
                        plan.swap_in.append((br.host_blocks[j], blocks[j]))
                # Prefix hits need no transfer, but one that another request is still filling cannot
                # be read yet: recompute from there. A prefill cut short by the swap resumes where it was.
                ready = next((j for j in range(seq.hit_blocks) if not written[blocks[j]]), seq.hit_blocks)
                # Every token the ledger knows is restored; the last is recomputed (its logits) unless the token
                # it sampled waits to enter the ledger and a state group's state already took it in (a state
                # cannot go back a token: resuming one early would recompute the whole request).
                top = br.in_ledger - 1
                if len(br.tokens) > br.in_ledger and s._kv_state:
                    top = br.in_ledger
                br.refill_resume = min(br.computed, top)
                br.computed = min(br.computed, top, ready * bs if ready < seq.hit_blocks else top)
                if i == 0:
                    cached = min(ready * bs, br.in_ledger - 1)
                if br.group_host or s._kv_groups:  # a hybrid pool: the other groups' window comes back too
                    copies = ledger.restore_group_tables(br.seq_id, br.computed,
                                                         {(g, j): h for g, j, h in br.group_host})
                    if copies is None:  # the host copy lacks an entry the window or a state needs: recompute it all
                        br.computed = br.refill_resume = 0
                        if i == 0:
                            cached = 0
                    else:
                        restored_blocks.update(b for _h, b in copies)
                        plan.swap_in.extend(copies)
                if len(br.tokens) > br.in_ledger and (ready < seq.hit_blocks or br.computed < br.in_ledger - 1):
                    br.refill_end = br.in_ledger
                br.hits_counted = max(br.computed, cached)
                s._restored.append(br)
            else:
                br.in_ledger = len(br.tokens)
                br.computed = hit_ready if hit_ready is not None else ledger.ready_tokens(br.seq_id)
                br.computed = min(br.computed, len(br.tokens) - 1)
                if i == 0:
                    cached = br.computed  # written hits; pending ones are counted when skipped (shared_hits)
                br.hits_counted = br.computed
            br.status = Status.RUNNING
        if restored_blocks:
            plan.transfer_wait_s += s.costs.transfer.time_s(len(restored_blocks), s.costs.block_bytes, "in")
            if s.config.restore_ahead:
                s.tier_planner.arriving.add(rid)
        s._order += 1
        s.running[rid] = list(unit)
        plan.admitted.append(rid)
        plan.admissions.append(Admission(rid, cached, readmission))
        return Outcome.ADMITTED, False

    def swap_in(self, plan: StepPlan) -> None:
        s = self.s
        if not s.swapped:
            return
        live = s.num_live()
        held: set[str] = set()  # trust groups at their quota this step
        rest: Iterator[list[Branch]] | None = None  # past a unit its quota holds: the units behind it
        while s.swapped:
            if rest is None:
                unit = s.swapped[0]
            else:
                unit = next(rest, None)
                if unit is None:
                    break
                if unit[0].request.context.trust_group in held:
                    continue
            if live + len(unit) > s.config.max_running:
                break
            if unit[0].request.request_id in s._swapped_now:
                break  # its blocks come free only when this step's transfer is done
            outcome, over_quota = self.admit_unit(unit, plan)
            if outcome is Outcome.NEVER:
                self.end_unit(s.swapped, unit, NEVER_QUOTA if over_quota else REJECTED_OUTGREW, plan)
                continue
            if outcome is not Outcome.ADMITTED:
                if not over_quota:
                    break
                held.add(unit[0].request.context.trust_group)
                if rest is None:
                    rest = iter(list(s.swapped)[1:])
                continue
            s.swapped.remove(unit)
            live += len(unit)

    def end_unit(self, queue: WaitingQueue | deque[list[Branch]], unit: list[Branch], why: str,
                  plan: StepPlan) -> None:
        """End a queued unit (waiting or swapped) that will never run, freeing its host copies."""
        s = self.s
        queue.remove(unit)
        s._free_host_blocks(unit)
        for br in unit:
            br.status = Status.FINISHED
            br.finish_reason = why
            br.ledger_prompt = None
            plan.ended.append((br.seq_id, why))
        s._finish_request(unit[0].request.request_id, why)

    def admit(self, plan: StepPlan, budget: int) -> None:
        s = self.s
        waiting = s.waiting
        max_running = s.config.max_running
        live = s.num_live() if waiting else 0
        held: set[str] = set()  # trust groups at their quota this step
        rest: Iterator[list[Branch]] | None = None  # past a unit its quota holds: the units behind it
        while budget > 0:
            if rest is None:
                if not waiting:
                    break
                unit = waiting.head()
            else:
                unit = next(rest, None)
                if unit is None:
                    break
                if unit[0].request.context.trust_group in held:
                    continue  # first come first served within the group
            over_quota = False
            if len(unit) > max_running:
                outcome = Outcome.NEVER  # more branches than may ever run at once
            elif len(unit) > s.config.token_budget and unit[0].request.beam:
                outcome = Outcome.NEVER  # a beam step decodes every beam at once: it could never run
            elif live + len(unit) > max_running:
                break
            else:
                outcome, over_quota = self.admit_unit(unit, plan)
            if outcome is Outcome.NEVER:
                if len(unit) > max_running:
                    why = NEVER_BRANCHES
                elif unit[0].request.beam and len(unit) > s.config.token_budget:
                    why = NEVER_BEAMS
                elif over_quota:
                    why = NEVER_QUOTA
                else:  # a preempted family that no longer fits even the empty pool outgrew it
                    why = REJECTED_OUTGREW if unit[0].admitted_order >= 0 else NEVER_POOL
                self.end_unit(waiting, unit, why, plan)
                continue
            if outcome is not Outcome.ADMITTED:
                if not over_quota:
                    break  # priority order, first come first served: nobody overtakes what the pool refuses
                held.add(unit[0].request.context.trust_group)
                if rest is None:
                    rest = iter(list(waiting)[1:])  # the units behind the head, in admission order
                continue
            if rest is None:
                waiting.popleft()
            else:
                waiting.remove(unit)
            live += len(unit)
            if unit[0].request.request_id in s.tier_planner.arriving:
                continue  # its promoted blocks arrive this step: it computes from the next one
            for br in unit:
                budget = s._schedule_branch(br, plan, budget)

    def liveness(self, plan: StepPlan) -> None:
        """The liveness rule for queued requests. When a step does nothing at all while nothing runs and
        no memory is in transit, the pool is as empty as this scheduler can make it: a swapped or
        waiting unit at the head of its queue that still does not fit never will. It ends with
        ``REJECTED_NO_ROOM`` instead of blocking every later request. (Running requests that cannot
        grow are handled in ``_grow``; a request that can never fit even an empty pool ends ``never``.)"""
        s = self.s
        if s.running or plan.progressed or s.ledger.pool.deferred:
            return
        queue: WaitingQueue | deque[list[Branch]] = s.swapped if s.swapped else s.waiting
        if queue:
            self.end_unit(queue, queue[0], REJECTED_NO_ROOM, plan)
