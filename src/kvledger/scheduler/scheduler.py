"""The step scheduler: which requests advance, which are admitted, and which memory actions come first.

It plans one engine step at a time on top of the ledger and knows nothing of tensors, so the simulator
and the real runtime drive this very code. A step is ``plan = schedule()``, the executor carries out
``plan`` (copies, swaps, then the forward pass) and then calls ``confirm(plan, sampled)``. Every block
the plan touches is leased until ``confirm``, so nothing it names is released early.

Order inside ``schedule``: (1) hand tokens sampled last step to the ledger -- this is where running
requests grow, and where growth failures are handled by the policy; (2) restore swapped requests;
(3) decode and prefill chunks for running requests under the token budget; (4) admit waiting requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from ..core.ledger import KVLedger
from ..core.types import Outcome, Request
from ..errors import InvariantError, LedgerError, OutOfBlocksError
from .config import SchedulerConfig
from .host import HostPool
from .plan import Branch, GenRequest, Preemption, Status, StepPlan, Work
from .policies import OutputLengthTracker, reserve_tokens
from .recovery import RecoveryCosts


class Scheduler:
    def __init__(self, ledger: KVLedger, config: SchedulerConfig | None = None, *,
                 host: HostPool | None = None, costs: RecoveryCosts | None = None) -> None:
        self.ledger = ledger
        self.config = config or SchedulerConfig()
        self.host = host
        self.costs = costs or RecoveryCosts()
        self.lengths = OutputLengthTracker()
        self.waiting: deque[list[Branch]] = deque()  # admission units: a fresh request or a preempted family
        self.swapped: deque[list[Branch]] = deque()
        self.running: dict[str, list[Branch]] = {}  # request id -> live branches, in admission order
        self.finished: dict[str, list[Branch]] = {}
        self._all: dict[str, list[Branch]] = {}
        self._step = 0
        self._order = 0
        self.preemptions = 0
        self._restored: list[Branch] = []  # swapped-in branches whose transfer completes this step
        self._swap_leases: list[int] = []  # device blocks being copied out this step
        self._swapped_now: set[str] = set()  # requests swapped out by the plan being built
        self._by_seq: dict[str, Branch] = {}
        wm = self.config.watermark if self.config.policy != "full" else 0.0
        self._keep_free = int(wm * ledger.num_blocks) + (
            self.config.headroom_blocks if self.config.on_growth_failure == "headroom" else 0)

    # ---- requests -------------------------------------------------------------------------------
    def add(self, request: GenRequest) -> None:
        rid = request.request_id
        if rid in self._all:
            raise LedgerError(f"request id {rid!r} already submitted")
        if request.n < 1 or request.max_new_tokens < 1 or not request.prompt:
            raise LedgerError(f"request {rid!r} needs a prompt, max_new_tokens >= 1 and n >= 1")
        branches = [Branch(rid if i == 0 else f"{rid}/{i}", request, list(request.prompt)) for i in range(request.n)]
        self._all[rid] = branches
        for br in branches:
            self._by_seq[br.seq_id] = br
        self.waiting.append(list(branches))  # queues hold their own lists; _all keeps every branch

    def cancel(self, request_id: str) -> bool:
        """Cancel at any point; blocks an in-flight step still uses are released when its lease ends."""
        branches = self._all.get(request_id)
        if branches is None or request_id in self.finished:
            return False
        for unit_queue in (self.waiting, self.swapped):
            for unit in list(unit_queue):
                if unit and unit[0].request.request_id == request_id:
                    unit_queue.remove(unit)
                    for br in unit:
                        if br.host_blocks and self.host is not None:
                            self.host.free(br.host_blocks)
                            br.host_blocks = []
        self.ledger.cancel(request_id)
        self.running.pop(request_id, None)
        self._finish_request(request_id, "cancelled")
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.swapped or self.running)

    def branches(self, request_id: str) -> list[Branch]:
        return self._all[request_id]

    def adopt_branch(self, br: Branch) -> None:
        """Register a branch created outside ``add`` (a beam fork) as running."""
        rid = br.request.request_id
        self._all.setdefault(rid, []).append(br)
        self.running.setdefault(rid, []).append(br)
        self._by_seq[br.seq_id] = br

    def forget(self, request_id: str) -> list[Branch]:
        """Drop a finished request's state (its token lists) and return its branches: long runs (the
        simulator) keep memory bounded by forgetting what they have already recorded."""
        if request_id not in self.finished:
            raise LedgerError(f"request {request_id!r} is not finished")
        branches = self.finished.pop(request_id)
        self._all.pop(request_id, None)
        for br in branches:
            self._by_seq.pop(br.seq_id, None)
        return branches

    # ---- planning -------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan(self._step)
        self._step += 1
        self._swapped_now.clear()
        self._grow(plan)
        self._swap_in(plan)
        budget = self.config.token_budget
        budget = self._schedule_running(plan, budget)
        self._admit(plan, budget)
        plan.copies.extend(self.ledger.take_copies())
        # Lease everything the plan names until confirm: the sequences that compute or are restored,
        # and both ends of every copy (the source may belong to a sibling that is not scheduled).
        seqs = {w.seq_id for w in plan.prefills}
        seqs.update(w.seq_id for w in plan.decodes)
        seqs.update(br.seq_id for br in self._restored if br.status is Status.RUNNING)
        blocks = [b for op in plan.copies for b in (op.src, op.dst)]
        if seqs or blocks:
            plan.lease = self.ledger.lease(request_ids=seqs, blocks=blocks)
        return plan

    def _branch(self, seq_id: str) -> Branch:
        try:
            return self._by_seq[seq_id]
        except KeyError:
            raise LedgerError(f"unknown sequence {seq_id!r}") from None

    def _grow(self, plan: StepPlan) -> None:
        """Give the ledger the tokens sampled last step; handle growth failures by policy."""
        self._grow_once(plan)
        live = self._live()
        if live and all(br.deferred for br in live) and not plan.swap_out:
            # Deferring only helps while someone else can finish and free memory; when every running
            # request is stuck, waiting would be a deadlock, so one victim is recomputed instead.
            victim = self._pick_victim(exclude=set())
            if victim is not None and len(self.running) > 1:
                self._preempt(victim, plan, "every running request was deferred", force="recompute")
                self._grow_once(plan)

    def _grow_once(self, plan: StepPlan) -> None:
        ledger = self.ledger
        live = self._live()
        for br in live:
            br.deferred = False
            if br.request.lookahead:
                ledger.trim_lookahead(br.seq_id)
        # The common case -- one new token per running branch -- goes to the ledger in one call.
        single = [br for br in live if len(br.tokens) - br.in_ledger == 1]
        if single:
            try:
                ledger.decode_step([(br.seq_id, br.tokens[br.in_ledger]) for br in single])
                for br in single:
                    br.in_ledger += 1
            except OutOfBlocksError:
                for br in single:  # decode_step applies in order up to the one that failed
                    if ledger.sequence(br.seq_id).num_tokens > br.in_ledger:
                        br.in_ledger += 1
        for rid in list(self.running):
            for br in list(self.running.get(rid, ())):
                if br.status is not Status.RUNNING:
                    continue
                while br.in_ledger < len(br.tokens) and br.status is Status.RUNNING:
                    try:
                        ledger.append_token(br.seq_id, br.tokens[br.in_ledger])
                        br.in_ledger += 1
                    except OutOfBlocksError as exc:
                        if not self._growth_failed(br, plan, str(exc)):
                            break

    def _growth_failed(self, br: Branch, plan: StepPlan, why: str) -> bool:
        """Returns True when the append should be retried now."""
        cfg = self.config
        if cfg.policy == "full":
            raise InvariantError(f"growth failed under full reservation: {why}")
        action = cfg.on_growth_failure
        if action == "defer":
            br.deferred = True
            return False
        if action == "reject":
            self.end_branch(br, "rejected: no memory to grow", plan)
            return False
        # preempt (headroom falls back to preemption once the reserve is gone)
        rid = br.request.request_id
        victim = self._pick_victim(exclude=set())
        if victim is None or (victim == rid and len(self.running) == 1):
            if self._swap_leases:
                br.deferred = True  # blocks being swapped out this step come free at confirm
                return False
            self.end_branch(br, "rejected: the request outgrew the whole pool", plan)
            return False
        mode = self._preempt(victim, plan, f"{rid} needed a block")
        if victim == rid:
            return False
        if mode == "swap":
            br.deferred = True  # the swapped blocks are reusable only once the transfer completes
            return False
        return True

    # ---- preemption -----------------------------------------------------------------------------
    def _pick_victim(self, exclude: set[str]) -> str | None:
        candidates = [rid for rid in self.running if rid not in exclude]
        if not candidates:
            return None
        v = self.config.victim
        order = {rid: self.running[rid][0].admitted_order for rid in candidates}
        if v == "latest":
            return max(candidates, key=lambda r: order[r])
        if v == "priority":
            return min(candidates, key=lambda r: (self.running[r][0].request.priority, -order[r]))
        if v == "least_computed":
            return min(candidates, key=lambda r: (sum(b.computed for b in self.running[r]), -order[r]))
        # min_waste: memory held x time lost recovering it (InferCept's waste), time ~ tokens to replay
        return min(candidates, key=lambda r: (self._held_blocks(self.running[r])
                                              * self._replay_tokens(self.running[r]), -order[r]))

    def _held_blocks(self, branches: list[Branch]) -> int:
        return len({b for br in branches for b in self.ledger.sequence(br.seq_id).table.blocks})

    def _replay_tokens(self, branches: list[Branch]) -> int:
        """Tokens a recompute must run again: all of them, minus full blocks other requests still hold
        (they stay in the prefix index whatever happens to this request)."""
        ledger = self.ledger
        mine = len(branches)  # references this family itself holds on a shared block
        total = 0
        for br in branches:
            seq = ledger.sequence(br.seq_id)
            kept = 0
            for b in seq.table.blocks[: seq.written_blocks]:
                if ledger.pool.ref[b] <= mine:
                    break
                kept += 1
            total += len(br.tokens) - kept * ledger.block_size
        return total

    def _preempt(self, rid: str, plan: StepPlan, why: str, force: str | None = None) -> str:
        """Preempt every branch of ``rid`` together (gang semantics); returns the recovery mode."""
        branches = self.running.pop(rid)
        mode = force or self.config.recovery
        reason = why
        # Distinct blocks of the family in table order (head first), so that ending the swap lease
        # releases them tail first, as any release does.
        blocks = list(dict.fromkeys(b for br in branches for b in self.ledger.sequence(br.seq_id).table.blocks))
        if mode == "auto":
            mode, r_s, s_s = self.costs.choose(self._replay_tokens(branches), len(blocks))
            reason += f"; auto chose {mode} (recompute {r_s * 1e3:.3f} ms vs swap {s_s * 1e3:.3f} ms)"
        if mode == "swap" and (self.host is None or self.host.num_free < len(blocks)):
            mode = "recompute"
            reason += "; host pool cannot hold the blocks, recomputing instead"
        if mode == "swap":
            assert self.host is not None
            host_of = dict(zip(blocks, self.host.allocate(len(blocks)), strict=True))
            plan.swap_out.extend(host_of.items())
            lease = self.ledger.lease(blocks=blocks)  # device blocks stay until the copy is done
            plan.transfer_wait_s += self.costs.transfer.blocking_time_s(len(blocks), self.costs.block_bytes)
            self._swap_leases.append(lease)
            for br in branches:
                br.host_blocks = [host_of[b] for b in self.ledger.sequence(br.seq_id).table.blocks]
                self.ledger.preempt(br.seq_id)
                br.status = Status.SWAPPED
                br.deferred = False
                br.preemptions += 1
            self.swapped.append(branches)
            self._swapped_now.add(rid)
        else:
            for br in branches:
                self.ledger.preempt(br.seq_id)
                br.status = Status.WAITING
                br.computed = 0
                br.in_ledger = 0
                br.deferred = False
                br.preemptions += 1
            self.waiting.appendleft(branches)  # recovered first, before new arrivals
        self.preemptions += 1
        plan.preempted.append(Preemption(rid, mode, reason))
        return mode

    # ---- restoring and admitting ----------------------------------------------------------------
    def _ledger_request(self, br: Branch, fresh: bool) -> Request:
        req = br.request
        remaining = req.max_new_tokens - br.num_generated
        reserve = reserve_tokens(self.config, self.lengths, req.max_new_tokens, remaining)
        prompt = br.tokens[: br.in_ledger] if br.status is Status.SWAPPED else br.tokens
        return Request(br.seq_id, prompt, remaining + (len(br.tokens) - len(prompt)), req.context,
                       reserve_new_tokens=min(reserve, remaining), branches=req.n if fresh else 1,
                       lookahead=req.lookahead, family=req.request_id)

    def _admit_unit(self, unit: list[Branch], plan: StepPlan) -> Outcome:
        fresh = unit[0].status is Status.WAITING and unit[0].admitted_order < 0 and len(unit) == unit[0].request.n \
            and all(br.num_generated == 0 for br in unit)
        ledger = self.ledger
        # The watermark protects running requests' growth; with nothing running it would only stop a
        # request that fits the pool from ever starting.
        keep_free = self._keep_free if self.running else 0
        if fresh:
            decision = ledger.admit(self._ledger_request(unit[0], True), keep_free)
            if not decision.admitted:
                return decision.outcome
            hit_ready = ledger.ready_tokens(unit[0].seq_id)
        else:
            # A preempted family comes back whole or not at all (gang semantics).
            admitted: list[str] = []
            for br in unit:
                decision = ledger.admit(self._ledger_request(br, False), keep_free)
                if not decision.admitted:
                    for seq_id in admitted:
                        ledger.retract(seq_id)
                    return decision.outcome
                admitted.append(br.seq_id)
            hit_ready = None
        rid = unit[0].request.request_id
        for br in unit:
            br.admitted_order = self._order
            if br.status is Status.SWAPPED:
                seq = ledger.sequence(br.seq_id)
                blocks, written = seq.table.blocks, ledger.pool.written
                for i in range(seq.hit_blocks, len(blocks)):
                    plan.swap_in.append((br.host_blocks[i], blocks[i]))
                # Prefix hits need no transfer, but one that another request is still filling cannot
                # be read yet: recompute from there. A prefill cut short by the swap resumes where it was.
                ready = next((i for i in range(seq.hit_blocks) if not written[blocks[i]]), seq.hit_blocks)
                br.computed = min(br.computed, br.in_ledger - 1, ready * ledger.block_size
                                  if ready < seq.hit_blocks else br.in_ledger - 1)
                plan.transfer_wait_s += self.costs.transfer.blocking_time_s(
                    len(seq.table.blocks) - seq.hit_blocks, self.costs.block_bytes)
                self._restored.append(br)
            else:
                br.in_ledger = len(br.tokens)
                br.computed = hit_ready if hit_ready is not None else ledger.ready_tokens(br.seq_id)
                br.computed = min(br.computed, len(br.tokens) - 1)
            br.status = Status.RUNNING
        self._order += 1
        self.running[rid] = list(unit)
        plan.admitted.append(rid)
        return Outcome.ADMITTED

    def _swap_in(self, plan: StepPlan) -> None:
        while self.swapped and len(self._live()) + len(self.swapped[0]) <= self.config.max_running:
            if self.swapped[0][0].request.request_id in self._swapped_now:
                break  # its blocks come free only when this step's transfer is done
            if self._admit_unit(self.swapped[0], plan) is not Outcome.ADMITTED:
                break
            self.swapped.popleft()

    def _admit(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and budget > 0:
            unit = self.waiting[0]
            if len(unit) > self.config.max_running:
                outcome = Outcome.NEVER  # more branches than may ever run at once
            elif len(self._live()) + len(unit) > self.config.max_running:
                break
            else:
                outcome = self._admit_unit(unit, plan)
            if outcome is Outcome.NEVER:
                self.waiting.popleft()
                rid = unit[0].request.request_id
                why = ("never: more branches than max_running" if len(unit) > self.config.max_running
                       else "never: larger than the whole pool")
                for br in unit:
                    br.status = Status.FINISHED
                    br.finish_reason = why
                    plan.ended.append((br.seq_id, why))
                self.finished[rid] = self._all[rid]
                continue
            if outcome is not Outcome.ADMITTED:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            for br in unit:
                budget = self._schedule_branch(br, plan, budget)

    def _live(self) -> list[Branch]:
        return [br for branches in self.running.values() for br in branches]

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        """Decodes first (one token each: they keep latency low), then prefill chunks in the budget
        that is left. Requests admitted in this plan are scheduled by ``_admit``."""
        admitted = set(plan.admitted)
        restored = {br.seq_id for br in self._restored}
        running = Status.RUNNING
        later: list[Branch] = []
        decodes = plan.decodes
        for branches in self.running.values():
            for br in branches:
                if br.deferred or br.status is not running or br.in_ledger < len(br.tokens):
                    continue
                if br.request.request_id in admitted and br.seq_id not in restored:
                    continue
                todo = len(br.tokens) - br.computed
                if todo == 1 and not br.request.lookahead:
                    if budget <= 0:
                        return budget
                    decodes.append(Work(br.seq_id, br.computed, br.computed + 1, True, 0))
                    budget -= 1
                else:
                    later.append(br)
        later.sort(key=lambda b: len(b.tokens) - b.computed > 1)  # lookahead decodes before prefills
        for br in later:
            budget = self._schedule_branch(br, plan, budget)
        return budget

    def _schedule_branch(self, br: Branch, plan: StepPlan, budget: int) -> int:
        if br.deferred or br.status is not Status.RUNNING or budget <= 0 or br.in_ledger < len(br.tokens):
            return budget
        todo = len(br.tokens) - br.computed
        if todo == 1:
            k = br.request.lookahead
            if k:
                try:
                    self.ledger.reserve_lookahead(br.seq_id, k)
                except OutOfBlocksError:
                    k = 0
            plan.decodes.append(Work(br.seq_id, br.computed, br.computed + 1, True, k))
            return budget - 1 - k
        chunk = min(todo, self.config.prefill_chunk, budget)
        end = br.computed + chunk
        plan.prefills.append(Work(br.seq_id, br.computed, end, end == len(br.tokens)))
        return budget - chunk

    # ---- confirmation ---------------------------------------------------------------------------
    def confirm(self, plan: StepPlan, sampled: Mapping[str, Sequence[int]]) -> list[Branch]:
        """The executor ran ``plan``; ``sampled`` maps each sequence that sampled to its new tokens
        (one, or the accepted draft tokens plus one). Returns the branches that finished this step."""
        ledger = self.ledger
        done: list[Branch] = []
        for w in plan.prefills:
            br = self._branch(w.seq_id)
            if br.status is not Status.RUNNING:
                continue
            br.computed = w.end
            ledger.mark_computed(br.seq_id, w.end)
            if w.sample:
                self.accept(br, sampled.get(w.seq_id, ()), done)
        by_seq, running, accept = self._by_seq, Status.RUNNING, self.accept
        for w in plan.decodes:
            br = by_seq[w.seq_id]
            if br.status is not running:
                continue
            br.computed = w.end
            accept(br, sampled.get(w.seq_id, ()), done)
        for br in self._restored:
            if br.status is Status.RUNNING:
                ledger.mark_computed(br.seq_id, min(br.computed, br.in_ledger))
        freed: set[int] = set()
        for br in self._restored:
            freed.update(br.host_blocks)
            br.host_blocks = []
        if freed and self.host is not None:
            self.host.free(sorted(freed))
        self._restored.clear()
        for lease in self._swap_leases:
            ledger.end_lease(lease)
        self._swap_leases.clear()
        if plan.lease is not None:
            ledger.end_lease(plan.lease)
        return done

    def accept(self, br: Branch, tokens: Sequence[int], done: list[Branch]) -> None:
        """Append sampled tokens to a branch and end it at a stop token or its length limit."""
        if not tokens:
            raise LedgerError(f"{br.seq_id!r} was scheduled to sample but no token came back")
        stop = br.request.stop_token_ids
        out = br.tokens
        for token in tokens:
            out.append(int(token))
            if stop and token in stop:
                self.end_branch(br, "stop")
                done.append(br)
                return
            if len(out) >= br.limit:
                self.end_branch(br, "length")
                done.append(br)
                return

    def end_branch(self, br: Branch, reason: str, plan: StepPlan | None = None) -> None:
        """End one branch now (released in the ledger; its request ends with its last branch)."""
        rid = br.request.request_id
        br.status = Status.FINISHED
        br.finish_reason = reason
        if br.seq_id in self.ledger:
            self.ledger.release(br.seq_id)
        live = self.running.get(rid)
        if live is not None:
            live.remove(br)
            if not live:
                del self.running[rid]
                self._finish_request(rid, None)
        if plan is not None:
            plan.ended.append((br.seq_id, reason))
        if reason in ("stop", "length"):
            self.lengths.observe(br.num_generated)

    def _finish_request(self, rid: str, reason: str | None) -> None:
        for br in self._all[rid]:
            if br.status is not Status.FINISHED:
                br.status = Status.FINISHED
                br.finish_reason = reason or br.finish_reason
        self.finished[rid] = self._all[rid]

    # ---- audit ----------------------------------------------------------------------------------
    def check(self) -> None:
        self.ledger.check()
        if self.host is not None:
            self.host.check()
        for branches in self.running.values():
            for br in branches:
                if br.status is not Status.RUNNING or br.seq_id not in self.ledger:
                    raise InvariantError(f"running branch {br.seq_id!r} is not running in the ledger")
        if self.config.policy == "full" and self.preemptions:
            raise InvariantError("a request was preempted under full reservation")
