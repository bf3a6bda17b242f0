"""The step scheduler: which requests advance, which are admitted, and which memory actions come first.

It plans one engine step at a time on top of the ledger and knows nothing of tensors, so the simulator
and the real runtime drive this very code -- through :class:`~kvledger.scheduler.driver.Driver`, the one
step loop (``plan = schedule()``, the executor carries out ``plan``, ``confirm(plan, sampled)``). Every
block the plan touches is leased until ``confirm``, so nothing it names is released early.

Order inside ``schedule``: (1) hand tokens sampled last step to the ledger -- this is where running
requests grow, and where growth failures are handled by the policy; (2) restore swapped requests;
(3) decode and prefill chunks for running requests under the token budget; (4) admit waiting requests
in priority order; (5) the liveness rule: a request that can no longer make progress ends with a reason.

The module is long (past 800 lines) because ``schedule`` and ``confirm`` must see one step's whole state.
Tier planning and admission are collaborators it composes (:class:`~kvledger.scheduler.tiers.TierPlanner`,
:class:`~kvledger.scheduler.admission.Admitter`), not mixins: the scheduler is one class in one file.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from ..core.ledger import KVLedger
from ..core.lifetimes import CacheReset
from ..errors import ConfigError, InvariantError, LedgerError, OutOfBlocksError
from .admission import Admitter
from .config import SchedulerConfig
from .growth import GROWTH_ACTIONS, REJECTED_OUTGREW
from .host import HostPool, TierLedger
from .plan import Branch, GenRequest, Preemption, SharedRead, Status, StepPlan, Work, validate_request
from .policies import OutputLengthTracker
from .queue import WaitingQueue
from .recovery import RECOVERY_MODES, RecoveryCosts
from .tiers import TierPlanner
from .victims import VictimQueue, pick_victim, replay_tokens


class Scheduler:
    """Plans engine steps on one ledger; see the module docstring and docs/scheduler.md."""

    def __init__(self, ledger: KVLedger, config: SchedulerConfig | None = None, *,
                 host: HostPool | TierLedger | None = None, costs: RecoveryCosts | None = None) -> None:
        self.ledger = ledger
        self.config = config or SchedulerConfig()
        self.host = host
        self.costs = costs or RecoveryCosts()
        self.lengths = OutputLengthTracker()
        self.waiting = WaitingQueue()  # admission units: a fresh request or a preempted family
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
        self._finished_now: list[str] = []  # finished since the last take_finished()
        self._in_flight: StepPlan | None = None  # scheduled, not confirmed yet
        self._deferred: list[Branch] = []  # branches deferred this step (their flags are reset next step)
        self._decoding: list[Branch] = []  # the branch of each of the in-flight plan's decodes, in order
        self._steady: tuple[list[Branch], list[Branch]] | None = None  # see _grow_once
        # Beam requests added and not finished: their beams sample in step (see _schedule_running), so
        # while one runs, steps take the general path; other workloads never pay for the check per branch.
        self._beam_ids: set[str] = set()
        self._growing = False  # a growth pass is under way: victims come from _victims
        self._victims: VictimQueue | None = None  # that pass's victims, from its first pick on
        # block -> (sequence, request) whose prefill in the plan being built completes it
        self._writes: dict[int, tuple[str, str]] = {}
        self._writes_seen = 0  # prefills of that plan indexed in _writes so far
        self._grow_action = GROWTH_ACTIONS[self.config.on_growth_failure].handle
        self._keep_free = self.config.keep_free(ledger.num_blocks)
        # Every lease this scheduler takes is named after it, so check() can tell a lease that outlived
        # its step from one somebody else holds.
        self.lease_owner = f"scheduler-{id(self):x}"
        self.admitter = Admitter(self)  # restores swapped units and admits waiting ones
        self.tier_planner = TierPlanner(ledger, host, self.config, lease_owner=self.lease_owner,
                                        swap_leases=self._swap_leases, running=self.running)
        # A hybrid pool (KV cache groups, `core.windows`): every work carries each group's table.
        self._kv_groups = ledger.groups is not None
        self._kv_state = self._kv_groups and any(g.kind == "state" for g in ledger.groups.groups)  # type: ignore[union-attr]
        if self._kv_groups:
            step = min(self.config.prefill_chunk, self.config.token_budget)
            if step > ledger.groups.step_tokens:  # type: ignore[union-attr]
                raise ConfigError(f"the hybrid pool bounds a sliding window's blocks for works of at most "
                                  f"{ledger.groups.step_tokens} tokens, the scheduler plans {step}")  # type: ignore

    # ---- tiers (planned by the tier planner) ------------------------------------------------------
    @property
    def offloading(self) -> bool:
        """Whether evicted prefix blocks go to the tiers below the pool (``offload_prefixes``)."""
        return self.tier_planner.offloading

    @property
    def promoted_tokens(self) -> int:
        return self.tier_planner.promoted_tokens

    def transfers_failed(self, plan: StepPlan) -> list[str]:
        """See :meth:`TierPlanner.transfers_failed`: the requests sent back to recompute."""
        return self.tier_planner.transfers_failed(plan, self.requeue)

    def tier_stats(self) -> dict:
        return self.tier_planner.tier_stats()

    # ---- requests -------------------------------------------------------------------------------
    def add(self, request: GenRequest) -> None:
        validate_request(request)
        rid = request.request_id
        if self._kv_groups and request.lookahead:
            raise ConfigError(f"request {rid!r}: a hybrid KV pool takes no speculative slots yet")
        if rid in self._all:
            raise LedgerError(f"request id {rid!r} already submitted")
        branches = [Branch(rid if i == 0 else f"{rid}/{i}", request, list(request.prompt), index=i)
                    for i in range(request.n)]
        self._all[rid] = branches
        for br in branches:
            self._by_seq[br.seq_id] = br
        if request.beam:
            self._beam_ids.add(rid)
        self.waiting.append(list(branches))  # queues hold their own lists; _all keeps every branch

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """End a request at any point with ``reason`` (``cancelled``, or ``error: ...`` for a request a
        step failed on). Blocks an in-flight step still uses are released when its lease ends. Returns
        False for an unknown or finished request."""
        branches = self._all.get(request_id)
        if branches is None or request_id in self.finished:
            return False
        for unit_queue in (self.waiting, self.swapped):
            for unit in list(unit_queue):
                if unit and unit[0].request.request_id == request_id:
                    unit_queue.remove(unit)
                    self._free_host_blocks(unit)
        self.ledger.cancel(request_id)
        self.running.pop(request_id, None)
        self._finish_request(request_id, reason)
        return True

    def _free_host_blocks(self, unit: Sequence[Branch]) -> None:
        """Free a family's host copies. Branches share the host copy of a block they shared on the
        device, so each host block is freed once, however many branches name it."""
        freed: set[int] = set()
        for br in unit:
            freed.update(br.host_blocks)
            br.host_blocks = []
            if br.group_host:
                freed.update(h for _g, _j, h in br.group_host)
                br.group_host = []
        if freed and self.host is not None:
            self.host.free(sorted(freed))

    def has_work(self) -> bool:
        return bool(self.waiting or self.swapped or self.running)

    def __contains__(self, request_id: object) -> bool:
        """The request was added and not forgotten."""
        return request_id in self._all

    def branches(self, request_id: str) -> list[Branch]:
        try:
            return self._all[request_id]
        except KeyError:
            raise LedgerError(f"unknown request {request_id!r}") from None

    def adopt_branch(self, br: Branch) -> None:
        """Register a branch created outside ``add`` (a beam fork) as running."""
        rid = br.request.request_id
        if br.seq_id in self._by_seq:
            raise LedgerError(f"branch {br.seq_id!r} already exists")
        br.blocks = self.ledger.sequence(br.seq_id).table.blocks
        self._all.setdefault(rid, []).append(br)
        self.running.setdefault(rid, []).append(br)
        self._by_seq[br.seq_id] = br

    def forget(self, request_id: str) -> list[Branch]:
        """Drop a finished request's state (its token lists) and return its branches: long runs keep
        memory bounded by forgetting what they have already recorded."""
        if request_id not in self.finished:
            raise LedgerError(f"request {request_id!r} is not finished")
        branches = self.finished.pop(request_id)
        self._all.pop(request_id, None)
        self._beam_ids.discard(request_id)
        for br in branches:
            self._by_seq.pop(br.seq_id, None)
        return branches

    @property
    def has_finished(self) -> bool:
        """Requests finished that take_finished() has not returned yet."""
        return bool(self._finished_now)

    def take_finished(self) -> list[str]:
        """Requests that finished since the last call (in the order they finished)."""
        done, self._finished_now = self._finished_now, []
        return done

    @property
    def swap_in_flight(self) -> bool:
        """A swap-out of this plan has not completed yet (its blocks come free at ``confirm``)."""
        return bool(self._swap_leases)

    @property
    def in_flight(self) -> StepPlan | None:
        """The plan scheduled and not confirmed yet."""
        return self._in_flight

    def transfer_owners(self, plan: StepPlan) -> tuple[list[str | None], list[str | None], list[str | None]]:
        """The request each of the in-flight plan's ``copies``, ``swap_out`` and ``swap_in`` belongs to
        (None if none does). For isolating a failing step; O(running blocks)."""
        dst_owner: dict[int, str] = {}
        for rid, branches in self.running.items():
            for br in branches:
                for b in br.blocks:
                    dst_owner[b] = rid
                if self._kv_groups:  # a copy of a shared group block (copy-on-write) lands in a group's table
                    dst_owner.update(dict.fromkeys(self.ledger.groups.live(br.seq_id), rid))  # type: ignore
        host_owner: dict[int, str] = {}
        swapped_now = self._swapped_now
        for unit in self.swapped:
            rid = unit[0].request.request_id
            if rid in swapped_now:
                for br in unit:
                    host_owner.update(dict.fromkeys(br.host_blocks, rid))
                    host_owner.update(dict.fromkeys((h for _g, _j, h in br.group_host), rid))
        restored_owner: dict[int, str] = {}
        for br in self._restored:
            restored_owner.update(dict.fromkeys(br.host_blocks, br.request.request_id))
            restored_owner.update(dict.fromkeys((h for _g, _j, h in br.group_host), br.request.request_id))
        # A copy into a block swapped out this step fills it for the host copy: it is the victim's.
        for d, h in plan.swap_out:
            dst_owner.setdefault(d, host_owner.get(h))  # type: ignore[arg-type]
        return ([dst_owner.get(op.dst) for op in plan.copies], [host_owner.get(h) for _, h in plan.swap_out],
                [restored_owner.get(h) for h, _ in plan.swap_in])

    # ---- planning -------------------------------------------------------------------------------
    @staticmethod
    def _copies_from_host(plan: StepPlan) -> None:
        """A copy-on-write whose source block this very plan swaps in would read it before it is filled
        (executors copy before they swap in): it becomes a second swap-in of the same host copy into
        the destination instead. A restored family whose branches still share a partial tail, one of
        which writes it in the step that brings it back, needs this."""
        if not plan.copies or not plan.swap_in:
            return
        arriving = {d: h for h, d in plan.swap_in}
        kept = []
        for op in plan.copies:
            host = arriving.get(op.src)
            if host is None:
                kept.append(op)
            else:
                plan.swap_in.append((host, op.dst))
        plan.copies[:] = kept

    def schedule(self) -> StepPlan:
        if self._in_flight is not None:
            raise LedgerError(f"step {self._in_flight.step} is still in flight: confirm it first")
        plan = StepPlan(self._step)
        self._step += 1
        self._decoding = []
        self._writes.clear()
        self._writes_seen = 0
        self._swapped_now.clear()
        self.tier_planner.arriving.clear()
        self._grow(plan)
        self.admitter.swap_in(plan)
        budget = self.config.token_budget
        budget = self._schedule_running(plan, budget)
        self.admitter.admit(plan, budget)
        self.admitter.liveness(plan)
        if self._kv_groups:  # (before the copies are taken: a work writing into a shared group block copies it)
            self._group_tables(plan)
        plan.copies.extend(self.ledger.take_copies())
        self._copies_from_host(plan)
        self.tier_planner.take_ops(plan)
        # Lease everything the plan names until confirm: the sequences that compute or are restored,
        # and both ends of every copy (the source may belong to a sibling that is not scheduled).
        # (A sequence has at most one work per plan; a restored one may also have none.)
        seqs = [br.seq_id for br in self._decoding]
        if len(seqs) != len(plan.decodes):
            seqs = [w.seq_id for w in plan.decodes]
        seqs += [w.seq_id for w in plan.prefills]
        if self._restored:
            seqs = list(dict.fromkeys(seqs + [br.seq_id for br in self._restored if br.status is Status.RUNNING]))
        blocks = [b for op in plan.copies for b in (op.src, op.dst)]
        if seqs or blocks:
            plan.lease = self.ledger.lease(request_ids=seqs, blocks=blocks,
                                           owner=f"{self.lease_owner} step {plan.step}")
        self._in_flight = plan
        return plan

    def _group_tables(self, plan: StepPlan) -> None:
        """A hybrid pool: give every work its KV cache groups' tables (a sliding group releases the blocks that
        left its window first). The step's lease of the work's sequence covers them: a sequence dropped while
        leased hands every group's blocks over to the lease."""
        group_tables = self.ledger.group_tables
        for works in (plan.prefills, plan.decodes):
            for i, w in enumerate(works):
                works[i] = w._replace(groups=group_tables(w.seq_id, w.start, w.end))

    def _branch(self, seq_id: str) -> Branch:
        try:
            return self._by_seq[seq_id]
        except KeyError:
            raise LedgerError(f"unknown sequence {seq_id!r}") from None

    def _grow(self, plan: StepPlan) -> None:
        """Give the ledger the tokens sampled last step; handle growth failures by policy."""
        self._growing, self._victims = True, None
        try:
            self._grow_pass(plan)
        finally:
            self._growing, self._victims = False, None

    def _grow_pass(self, plan: StepPlan) -> None:
        self._grow_once(plan)
        if not self._deferred or plan.swap_out:
            return
        live = self._live()
        if live and all(self._stuck(brs) for brs in self.running.values()):
            # Deferring only helps while someone else can finish and free memory; when every running
            # request is stuck, waiting would be a deadlock, so one victim is recomputed instead.
            if len(self.running) > 1:
                victim = self.pick_victim()
                assert victim is not None
                self.preempt(victim, plan, "every running request was deferred", force="recompute")
                self._grow_once(plan)
            elif not self.ledger.pool.deferred:
                # The liveness rule: alone, with no memory in transit, and it cannot grow -- it holds
                # everything it could ever get.
                for br in list(live):
                    self.end_branch(br, REJECTED_OUTGREW, plan)

    @staticmethod
    def _stuck(branches: list[Branch]) -> bool:
        """A running request cannot advance this step: every branch deferred -- or, for beam search, any
        one (its beams sample in step, so the driver holds back the others until the deferred one grows)."""
        if branches[0].request.beam:
            return any(br.deferred for br in branches)
        return all(br.deferred for br in branches)

    def defer(self, br: Branch) -> None:
        """Skip ``br`` this step (it could not grow); it retries next step."""
        br.deferred = True
        self._deferred.append(br)

    def _grow_once(self, plan: StepPlan) -> None:
        ledger = self.ledger
        deferred = self._deferred
        if deferred:
            for br in deferred:
                br.deferred = False
            deferred.clear()
        # The common case -- one new token per running branch -- goes to the ledger in one call, built
        # in one pass; anything else (several tokens, a failed append) takes the loop below.
        pairs: list[tuple[str, int]] = []
        single: list[Branch] = []
        others: list[Branch] = []
        rest = irregular = False
        self._steady = None
        for branches in self.running.values():
            for br in branches:
                tokens = br.tokens
                d = len(tokens) - br.in_ledger
                if br.request.lookahead:
                    ledger.trim_lookahead(br.seq_id)
                    irregular = True
                if br.refill_end:
                    others.append(br)  # its sampled tokens wait until it has computed refill_end again
                    continue
                if d == 1:
                    single.append(br)
                    pairs.append((br.seq_id, tokens[-1]))
                else:
                    others.append(br)
                    if d or len(tokens) - br.computed == 1:
                        rest |= d > 0
                        irregular = True
        if pairs:
            try:
                ledger.decode_step(pairs)
            except OutOfBlocksError:
                # decode_step applied the pairs in order up to the one that failed; the loop below
                # retries the rest one by one, through the growth action.
                for br in single:
                    br.in_ledger = ledger.sequence(br.seq_id).num_tokens
                rest = True
            else:
                for br in single:
                    br.in_ledger += 1
        if not rest:
            beam_ids = self._beam_ids
            if beam_ids and not irregular:
                running = self.running
                irregular = any(rid in running for rid in beam_ids)
            if not irregular:
                # The steady state: every branch either decodes one token or continues a prefill,
                # nothing was deferred, no lookahead. _schedule_running takes these lists as they are.
                self._steady = (single, others)
            return
        for rid in list(self.running):
            for br in list(self.running.get(rid, ())):
                if br.status is not Status.RUNNING:
                    continue
                while br.in_ledger < len(br.tokens) and br.status is Status.RUNNING and not br.refill_end:
                    try:
                        ledger.append_token(br.seq_id, br.tokens[br.in_ledger])
                        br.in_ledger += 1
                    except OutOfBlocksError as exc:
                        if not self._growth_failed(br, plan, str(exc)):
                            break

    def _growth_failed(self, br: Branch, plan: StepPlan, why: str) -> bool:
        """Returns True when the append should be retried now."""
        if self.config.exact:
            raise InvariantError(f"growth failed under full reservation: {why}")
        return self._grow_action(self, br, plan, why)

    # ---- preemption -----------------------------------------------------------------------------
    def pick_victim(self) -> str | None:
        """The running request the victim policy preempts next."""
        policy = self.config.victim
        if not self._growing or policy == "latest":
            return pick_victim(policy, self.ledger, self.running)
        if self._victims is None:
            self._victims = VictimQueue(policy, self.ledger, self.running)
        return self._victims.pick()

    def preempt(self, rid: str, plan: StepPlan, why: str, force: str | None = None) -> str:
        """Preempt every branch of ``rid`` together (gang semantics); returns the recovery mode."""
        branches = self.running.pop(rid)
        # Distinct blocks of the family in table order (head first), so that ending the swap lease
        # releases them tail first, as any release does.
        blocks = list(dict.fromkeys(b for br in branches for b in self.ledger.sequence(br.seq_id).table.blocks))
        # A hybrid pool: every branch's other KV cache groups' live blocks travel too (a block the branches share
        # once), each group's own pages.
        entries = [self.ledger.group_entries(br.seq_id) for br in branches] if self._kv_groups else []
        distinct = list(dict.fromkeys(b for es in entries for _g, _j, b in es))
        mode, note = RECOVERY_MODES[force or self.config.recovery](
            self.costs, replay_tokens(self.ledger, branches), len(blocks) + len(distinct))
        reason = why + note
        if mode == "swap" and (self.host is None or self.host.holdable < len(blocks) + len(distinct)):
            mode = "recompute"
            reason += "; host pool cannot hold the blocks, recomputing instead"
        if mode == "swap":
            assert self.host is not None
            host_of = dict(zip(blocks, self.host.allocate(len(blocks)), strict=True))
            plan.swap_out.extend(host_of.items())
            if distinct:
                group_host = dict(zip(distinct, self.host.allocate(len(distinct)), strict=True))
                plan.swap_out.extend(group_host.items())
                for br, es in zip(branches, entries, strict=True):
                    br.group_host = [(g, j, group_host[b]) for g, j, b in es]
                blocks = blocks + distinct
            # A copy-on-write copy recorded this step (a branch's first write into a shared tail) must
            # still run: the executor makes copies before swap-outs, so the host gets the filled block.
            # Taken now, because dropping the sequences below discards copies into their blocks.
            plan.copies.extend(self.ledger.take_copies())
            # The device blocks stay until the copy to the host is done.
            lease = self.ledger.lease(blocks=blocks, owner=f"{self.lease_owner} swap-out step {plan.step}")
            plan.transfer_wait_s += self.costs.transfer.time_s(len(blocks), self.costs.block_bytes)
            self._swap_leases.append(lease)
            for br in branches:
                br.host_blocks = [host_of[b] for b in br.blocks]
                self.ledger.preempt(br.seq_id)
                br.status = Status.SWAPPED
                br.deferred = False
                br.refill_end = 0  # set again when it is restored
                br.preemptions += 1
                br.blocks = []
            self.swapped.append(branches)
            self._swapped_now.add(rid)
        else:
            for br in branches:
                self.ledger.preempt(br.seq_id)
                br.status = Status.WAITING
                br.computed = 0
                br.in_ledger = 0
                br.refill_end = 0
                br.deferred = False
                br.preemptions += 1
                br.blocks = []
            self.waiting.appendleft(branches)  # recovered first among its priority
        self.preemptions += 1
        plan.preempted.append(Preemption(rid, mode, reason))
        return mode

    def _live(self) -> list[Branch]:
        return [br for branches in self.running.values() for br in branches]

    def num_live(self) -> int:
        """Running branches (what ``max_running`` counts)."""
        return sum(map(len, self.running.values()))

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        """Decodes first (one token each: they keep latency low), then prefill chunks in the budget
        that is left. Requests admitted in this plan are scheduled by ``_admit``.

        A beam request's beams sample in step (``BeamSearch.hold_back`` drops the sampling works of a
        request whose live beams would not all sample at one position), so budget is never spent on
        decodes that would be dropped: a beam request decodes only when every live beam is at its last
        token, undeferred, and the budget left covers all of them; otherwise its ready beams wait and
        only its lagging beams' prefills are scheduled (one that completes is trimmed by hold_back, and
        next step every beam decodes together). Spending the budget on held-back decodes instead
        starved a lagging beam's prefill forever under a small token budget."""
        running = Status.RUNNING
        later: list[Branch] = []
        decodes = plan.decodes
        decoding = self._decoding
        make = tuple.__new__  # Work(...) without the keyword machinery: hundreds per step
        steady = self._steady
        if steady is not None:
            # Set by _grow_once: the decoding branches (in running order), then the branches that
            # continue a prefill; only restored branches come after them.
            self._steady = None
            single, later = steady
            for br in single:
                tokens = br.tokens
                n = len(tokens)
                c = br.computed
                if n - c != 1:
                    later.append(br)
                    continue
                if budget <= 0:
                    return budget
                decodes.append(make(Work, (br.seq_id, c, n, True, 0, br.request, br.index, br.blocks, tokens, ())))
                decoding.append(br)
                budget -= 1
            walk = [self._restored] if self._restored else []
        else:
            walk = self.running.values()
        admitted = set(plan.admitted)
        restored = {br.seq_id for br in self._restored}
        beam_ready: dict[str, list[Branch]] = {}  # beam request -> its beams ready to decode, waiting
        for branches in walk:
            for br in branches:
                if br.deferred or br.status is not running:
                    continue
                tokens = br.tokens
                n = len(tokens)
                if br.in_ledger < n and not br.refill_end:
                    continue
                req = br.request
                if admitted and req.request_id in admitted and (br.seq_id not in restored
                                                                 or req.request_id in self.tier_planner.arriving):
                    continue  # admitted now (scheduled by _admit), or its blocks arrive this step
                c = br.computed
                if n - c == 1 and not req.lookahead:
                    if req.beam:
                        # Decided when the request's last ready beam is seen (a family's branches are
                        # walked together), so beam requests keep their place in the decode order.
                        rid = req.request_id
                        ready = beam_ready.setdefault(rid, [])
                        ready.append(br)
                        if len(ready) < len(self.running[rid]):
                            continue
                        del beam_ready[rid]
                        if budget <= 0:
                            return budget
                        if budget >= len(ready):
                            budget = self._decode_beams(ready, plan, budget)
                        continue
                    if budget <= 0:
                        return budget
                    decodes.append(make(Work, (br.seq_id, c, n, True, 0, req, br.index, br.blocks, tokens, ())))
                    decoding.append(br)
                    budget -= 1
                else:
                    later.append(br)
        later.sort(key=lambda b: len(b.tokens) - b.computed > 1)  # lookahead decodes before prefills
        first_late = len(decodes)
        for br in later:
            budget = self._schedule_branch(br, plan, budget)
        if beam_ready:
            budget = self._complete_beams(beam_ready, plan, first_late, budget)
        return budget

    def _decode_beams(self, ready: list[Branch], plan: StepPlan, budget: int) -> int:
        """Schedule the decodes of a beam request's ready beams, in family order."""
        decodes, decoding = plan.decodes, self._decoding
        for br in ready:
            tokens = br.tokens
            n = len(tokens)
            decodes.append(Work(br.seq_id, n - 1, n, True, 0, br.request, br.index, br.blocks, tokens))
            decoding.append(br)
        return budget - len(ready)

    def _complete_beams(self, beam_ready: dict[str, list[Branch]], plan: StepPlan, first_late: int,
                        budget: int) -> int:
        """A lagging beam whose prefix hits turned its prefill into a decode (``_shared_start``) samples
        at the same position as its waiting siblings: let those decode with it, or it is held back
        alone every step."""
        late: dict[str, int] = {}
        for w in plan.decodes[first_late:]:
            rid = w.request_id
            if rid in beam_ready and w.end == len(beam_ready[rid][0].tokens):
                late[rid] = late.get(rid, 0) + 1
        for rid, ready in beam_ready.items():
            if late.get(rid, 0) + len(ready) == len(self.running[rid]) and budget >= len(ready):
                budget = self._decode_beams(ready, plan, budget)
        return budget

    def _schedule_branch(self, br: Branch, plan: StepPlan, budget: int) -> int:
        refill = br.refill_end
        if br.deferred or br.status is not Status.RUNNING or budget <= 0 or (br.in_ledger < len(br.tokens)
                                                                                and not refill):
            return budget
        c = br.computed
        if c < br.hit_end:
            c = self._shared_start(br, plan, c)
            if c < 0:
                return budget  # an earlier request is about to write the prefix it needs next
        tokens = br.tokens
        req = br.request
        if refill:
            # Recompute up to what the ledger knows, without sampling: the token after it was sampled.
            # Past the prefix hits, the blocks came back from the host, valid up to refill_resume.
            if c >= br.hit_end:
                c = max(c, br.refill_resume)
            end = c + min(refill - c, self.config.prefill_chunk, budget)
            plan.prefills.append(Work(br.seq_id, c, end, False, 0, req, br.index, br.blocks, tokens))
            return budget - (end - c)
        todo = len(tokens) - c
        if todo == 1:
            k = req.lookahead
            if k:
                try:
                    self.ledger.reserve_lookahead(br.seq_id, k)
                except OutOfBlocksError:
                    k = 0
            plan.decodes.append(Work(br.seq_id, c, c + 1, True, k, req, br.index, br.blocks, tokens))
            self._decoding.append(br)
            return budget - 1 - k
        chunk = min(todo, self.config.prefill_chunk, budget)
        end = c + chunk
        plan.prefills.append(Work(br.seq_id, c, end, end == len(tokens), 0, req, br.index, br.blocks, tokens))
        return budget - chunk

    # ---- prefix blocks written in the same step ---------------------------------------------------
    def _shared_start(self, br: Branch, plan: StepPlan, c: int) -> int:
        """Where the next work of ``br`` starts, past the prefix hits it can read now; -1: it waits.

        ``br`` computed ``c`` tokens and was admitted with prefix hits covering ``hit_end`` tokens. A hit
        block is readable when it is written, or when a prefill already in this plan completes it: every
        work's K/V of a layer is written before any work reads that layer (the executor contract), so
        the reader skips those positions and the plan says so (:class:`SharedRead`).

        At the first hit block that is neither, if a running request admitted earlier still has to
        compute that block, the branch waits: no work this step. The earlier
        request gets the step's budget first and moves through the shared run one chunk per step, as
        the branch would by recomputing it, so waiting delays the branch by at most about one step and
        saves the whole run (vLLM recomputes here: it finds only blocks already scheduled). With nobody
        to wait for (the filler was preempted or cancelled) the branch computes the blocks itself."""
        bs = self.ledger.block_size
        written = self.ledger.pool.written
        blocks = br.blocks
        # The last token is always computed: its logits give the next one (refilling, the last token
        # the ledger knows: its KV is what the sampled token after it needs).
        last = (br.refill_end or len(br.tokens)) - 1
        hit_blocks = br.hit_end // bs
        j = c // bs
        reads: list[SharedRead] = []
        rid = br.request.request_id
        while j < hit_blocks and j * bs < last:
            b = blocks[j]
            if not written[b]:
                found = self._plan_writer(plan, b)
                # A sibling computing the family's pending blocks is not a writer to read from: the
                # branches' identical works are computed once (the executor deduplicates them).
                if found is None or found[1] == rid:
                    break
                writer = found[0]
                lo = max(c, j * bs)
                hi = min((j + 1) * bs, last)
                prev = reads[-1] if reads else None
                if prev is not None and prev.writer == writer and prev.end == lo:
                    reads[-1] = prev._replace(end=hi)
                elif hi > lo:
                    reads.append(SharedRead(br.seq_id, writer, lo, hi))
            j += 1
        start = max(c, min(j * bs, last))
        if j < hit_blocks and start < last and self._filler_ahead(br, j):
            return -1
        plan.shared_reads.extend(reads)
        if start > br.hits_counted:
            if br.index == 0:
                plan.shared_hits.append((rid, start - br.hits_counted))
            br.hits_counted = start
        return start

    def _plan_writer(self, plan: StepPlan, block: int) -> tuple[str, str] | None:
        """The sequence (and its request) whose prefill in ``plan`` completes ``block`` (indexed lazily:
        only steps with pending prefix hits pay for it). Beam requests never count: beam search may
        shorten their work after planning (``BeamSearch.hold_back``)."""
        writes = self._writes
        bs = self.ledger.block_size
        prefills = plan.prefills
        for w in prefills[self._writes_seen:]:
            req = w.request
            if req is not None and req.beam:
                continue
            blocks = w.blocks
            who = (w.seq_id, w.request_id)
            for j in range(w.start // bs, w.end // bs):
                writes.setdefault(blocks[j], who)
        self._writes_seen = len(prefills)
        return writes.get(block)

    def _filler_ahead(self, br: Branch, j: int) -> bool:
        """Whether a running request admitted before ``br`` holds ``br``'s block ``j`` and has yet to
        compute it."""
        block = br.blocks[j]
        end = (j + 1) * self.ledger.block_size
        order = br.admitted_order
        for branches in self.running.values():  # in admission order
            if branches[0].admitted_order >= order:
                return False
            for f in branches:
                held = f.blocks
                if len(held) > j and held[j] == block and f.computed < end:
                    return True
        return False

    # ---- confirmation ---------------------------------------------------------------------------
    def confirm(self, plan: StepPlan, sampled: Mapping[str, Sequence[int]]) -> list[Branch]:
        """The executor ran ``plan``; ``sampled`` maps each sequence that sampled to its new tokens
        (one, or the accepted draft tokens plus one). Returns the branches that finished this step."""
        if plan is not self._in_flight:
            raise LedgerError(f"step {plan.step} is not the step in flight")
        ledger = self.ledger
        done: list[Branch] = []
        for w in plan.prefills:
            br = self._by_seq.get(w.seq_id)
            if br is None or br.status is not Status.RUNNING:
                continue
            br.computed = w.end
            ledger.mark_computed(br.seq_id, w.end)
            if br.refill_end and w.end >= br.refill_end:
                br.refill_end = 0  # its sampled tokens go to the ledger next step
            if w.sample:
                self.accept(br, sampled.get(w.seq_id, ()), done)
        by_seq, running, accept = self._by_seq, Status.RUNNING, self.accept
        decodes = plan.decodes
        # The branch of each decode, as scheduled (beam search may have held some back: look them up).
        branches = self._decoding if len(self._decoding) == len(decodes) else [by_seq.get(w.seq_id) for w in decodes]
        for w, br in zip(decodes, branches, strict=True):
            if br is None or br.status is not running:
                continue
            br.computed = w.end
            got = sampled.get(w.seq_id)
            if got is not None and len(got) == 1 and not br.request.stop_token_ids:
                out = br.tokens  # accept() for its common case: one token, no stop tokens
                out.append(int(got[0]))
                if len(out) >= br.limit:
                    self.end_branch(br, "length")
                    done.append(br)
            else:
                accept(br, () if got is None else got, done)
        self._decoding = []
        for br in self._restored:
            if br.status is Status.RUNNING:
                ledger.mark_computed(br.seq_id, min(br.computed, br.in_ledger))
        self._free_host_blocks(self._restored)
        self._restored.clear()
        for lease in self._swap_leases:
            ledger.end_lease(lease)
        self._swap_leases.clear()
        self.tier_planner.complete()  # every transfer of the step is done: written slots readable, drained free
        if plan.lease is not None:
            ledger.end_lease(plan.lease)
        self._in_flight = None
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
        self._beam_ids.discard(rid)
        if rid not in self.finished:
            self.finished[rid] = self._all[rid]
            self._finished_now.append(rid)

    # ---- the prefix cache -----------------------------------------------------------------------
    def reset_prefix_cache(self, requeue_running: bool = False) -> CacheReset:
        """Forget the whole prefix cache (after a weight update, say), as vLLM's ``reset_prefix_cache``.

        The ledger can only forget blocks nobody holds. With ``requeue_running`` every running request
        first goes back to the front of the waiting queue (its memory dropped, to be recomputed from its
        tokens when it is re-admitted; not counted as a preemption); without it, running requests
        make the reset refuse. Refused -- while a step is in flight, or with pins, leases or running
        requests -- nothing changes and the result says why. Swapped requests keep their host copies."""
        ledger = self.ledger
        if self._in_flight is not None:
            return CacheReset(False, 0, f"step {self._in_flight.step} is in flight: reset between steps")
        if requeue_running:
            held = []
            if ledger.pins():
                held.append(f"{len(ledger.pins())} pins")
            if ledger.outstanding_leases():
                held.append(f"{ledger.outstanding_leases()} outstanding leases")
            if held:  # refuse before requeueing anything
                return CacheReset(False, 0, "blocks are still held: " + ", ".join(held))
            for rid in sorted(self.running, key=lambda r: -self.running[r][0].admitted_order):
                self._requeue(rid)
        # The ledger clears the tiers attached to it (the cache below the device goes too); swapped
        # requests keep their host slots.
        return ledger.reset_prefix_cache()

    def requeue(self, request_id: str) -> bool:
        """Send a running request back to the front of its priority in the waiting queue: its memory is
        dropped and it is computed again from its tokens when it is re-admitted (not an error, not
        counted as a preemption). Between ``schedule`` and ``confirm`` its work in the plan in flight is
        ignored, and the blocks that plan leases stay until ``confirm``. The driver does this to a
        request whose step read KV that a failed part of the same step was to write. Returns False if
        the request is not running."""
        if request_id not in self.running:
            return False
        self._requeue(request_id)
        return True

    def _requeue(self, rid: str) -> None:
        """Send a running request back to the front of its priority in the waiting queue."""
        branches = self.running.pop(rid)
        for br in branches:
            self.ledger.preempt(br.seq_id, counted=False)  # its written blocks become plain cache
            br.status = Status.WAITING
            br.computed = 0
            br.in_ledger = 0
            br.refill_end = 0
            br.deferred = False
            br.blocks = []
        self.waiting.appendleft(branches)

    # ---- audit ----------------------------------------------------------------------------------
    def check(self) -> None:
        """Every conservation law of the ledger and the host pool, plus the scheduler's own: running
        branches are running in the ledger under their own block tables, nothing was preempted under
        an exact policy, and no lease outlives what took it -- every outstanding lease has an owner,
        and this scheduler's leases belong to the step in flight."""
        ledger = self.ledger
        ledger.check()
        if self.host is not None:
            self.host.check()
        order = -1
        for branches in self.running.values():
            if not branches or branches[0].admitted_order <= order:
                raise InvariantError("running requests are not in admission order (the victim policies rely on it)")
            order = branches[0].admitted_order
            for br in branches:
                if br.status is not Status.RUNNING or br.seq_id not in ledger:
                    raise InvariantError(f"running branch {br.seq_id!r} is not running in the ledger")
                if br.blocks is not ledger.sequence(br.seq_id).table.blocks:
                    raise InvariantError(f"running branch {br.seq_id!r} does not name its ledger block table")
        if self.config.exact and self.preemptions:
            raise InvariantError("a request was preempted under full reservation")
        plan = self._in_flight
        in_flight = set(self._swap_leases)
        if plan is not None and plan.lease is not None:
            in_flight.add(plan.lease)
        for lease_id, owner in ledger.leases().items():
            if not owner:
                raise InvariantError(f"lease {lease_id} has no owner: nothing will ever end it")
            if owner.startswith(self.lease_owner + " ") and lease_id not in in_flight:
                raise InvariantError(f"lease {lease_id} ({owner}) outlived its step: its blocks are never released")
