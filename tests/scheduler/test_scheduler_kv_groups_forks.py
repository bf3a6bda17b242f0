"""Forks on a hybrid KV pool through the real scheduler: ``n > 1`` and beam search over KV cache groups, with
sliding windows shorter than the prompts, preemption by recompute and by swap, prefix caching and cancels. A fake
KV memory holds every group's pages: each work writes its positions into each group's table and reads every
position its layers attend to (a full group the whole prefix, a sliding group the window), so a shared block
written by the wrong branch, a missed or wrong copy-on-write, or a window block released too early is caught."""

from __future__ import annotations

import random

import pytest

from kvledger.core import KVLedger, Request
from kvledger.core.groups import NULL_BLOCK, KVCacheGroup
from kvledger.scheduler import GenRequest, HostPool, Scheduler, SchedulerConfig, StepOutput
from kvledger.scheduler.driver import Driver
from kvledger.scheduler.plan import StepPlan

from .test_scheduler import BS, FakeEngine, kv_chain, sample_token

WINDOW = 6
GROUPS = (KVCacheGroup("full", 2), KVCacheGroup("sliding", 2, WINDOW), KVCacheGroup("sliding", 2, WINDOW),
          KVCacheGroup("full", 2))


def beam_candidates(tokens: list[int], k: int) -> list[tuple[float, int]]:
    h = sum((i + 1) * t for i, t in enumerate(tokens)) % 9973
    return [(-0.1 * (i + 1) - (h % 97) / 1000 - i * 0.013, 10 + (h >> (i % 8)) % 50 + 60 * i) for i in range(k)]


class GroupEngine(FakeEngine):
    """FakeEngine's first-group KV memory, plus every other group's pages under the same block ids."""

    def __init__(self, s: Scheduler) -> None:
        super().__init__(s)
        self.copied = 0  # copies of shared group blocks the plans carried
        self.group_reads = 0
        self.violations: list[str] = []  # the driver fails a request whose step raises: note why, fail the test

    def run(self, plan: StepPlan) -> dict[str, list[int]]:
        led = self.s.ledger
        groups = led.groups.groups
        group_blocks = {b for gs in led.groups.seqs.values() for t in gs.tables for b in t if b != NULL_BLOCK}
        self.copied += sum(1 for c in plan.copies if c.src in group_blocks or c.dst in group_blocks)
        sampled = super().run(plan)  # copies, swaps, and the first group's writes and reads
        works = [*plan.prefills, *plan.decodes]
        written: dict[tuple[int, int], int] = {}
        for w in works:
            assert len(w.groups) == len(groups), (plan.step, w.seq_id)
            chain = kv_chain(list(w.tokens[: w.end]))
            for g, table in enumerate(w.groups[1:], start=1):
                for p in range(w.start, w.end):
                    b = table[p // BS]
                    assert b != NULL_BLOCK, (plan.step, w.seq_id, g, p)
                    slot = (b, p % BS)
                    assert written.setdefault(slot, chain[p]) == chain[p], (
                        f"step {plan.step}: {w.seq_id} writes group {g} position {p} into block {b}, which another "
                        "work of the step writes with other KV")
                    self.block(b)[p % BS] = chain[p]
        for w in works:
            chain = kv_chain(list(w.tokens[: w.start]))
            for g, (group, table) in enumerate(zip(groups, w.groups, strict=True)):
                if g == 0:
                    continue
                lo = 0 if group.kind == "full" else max(0, w.start - group.window + 1)
                for p in range(lo, w.start):
                    b = table[p // BS]
                    got = None if b == NULL_BLOCK else self.block(b)[p % BS]
                    assert got == chain[p], (f"step {plan.step}: {w.seq_id} reads group {g} position {p} from "
                                             f"block {b} but its KV is not there")
                    self.group_reads += 1
        return sampled

    def execute(self, plan: StepPlan) -> StepOutput:
        self.s.ledger.check()
        try:
            sampled = self.run(plan)
        except AssertionError as exc:
            self.violations.append(str(exc))
            raise
        out = StepOutput(elapsed_s=0.01)
        for w in [*plan.prefills, *plan.decodes]:
            if w.sample and w.request is not None and w.request.beam:
                out.candidates[w.seq_id] = beam_candidates(list(w.tokens[: w.end]), 2 * w.request.n)
                sampled.pop(w.seq_id, None)
        out.sampled = sampled
        return out


def _episode(seed: int) -> tuple[GroupEngine, Scheduler, dict]:
    rng = random.Random(seed)
    caching = rng.random() < 0.6
    num_blocks = rng.randint(60, 90)
    ledger = KVLedger(num_blocks, BS, prefix_caching=caching, kv_groups=GROUPS, step_tokens=8)
    recovery = rng.choice(["recompute", "swap"])
    policy = rng.choice(["full", "incremental", "incremental", "incremental"])
    cfg = SchedulerConfig(policy=policy, recovery=recovery, token_budget=16, prefill_chunk=8,
                          victim=rng.choice(["latest", "priority"]), max_running=6)
    s = Scheduler(ledger, cfg, host=HostPool(400) if recovery == "swap" else None)
    engine = GroupEngine(s)
    driver = Driver(s, engine, check_every=1, stall_steps=200)
    heads = [[rng.randrange(1, 500) for _ in range(rng.randint(4, 14))] for _ in range(3)]
    requests = []
    t = 0.0
    for i in range(rng.randint(5, 10)):
        prompt = rng.choice(heads) + [rng.randrange(1, 500) for _ in range(rng.randint(1, 9))]
        beam = rng.random() < 0.25
        n = rng.choice([2, 3]) if beam else rng.choice([1, 2, 2, 3])
        requests.append(GenRequest(f"r{i}", prompt, rng.randint(1, 30), n=n, beam=beam, arrival_s=t,
                                   priority=rng.randint(0, 2)))
        t += rng.choice([0.0, 0.0, 0.0, 0.02])
    for r in requests:
        driver.submit(r)
    cancel_at = rng.randint(1, 30) if rng.random() < 0.3 else -1
    finished = {}
    steps = 0
    while driver.has_work():
        assert steps < 2000, "the driver did not finish"
        if steps == cancel_at:
            driver.cancel(requests[0].request_id)
        for f in driver.step().finished:
            finished[f.request.request_id] = f
        steps += 1
    assert not engine.violations, engine.violations[:3]
    ledger.check()
    u = ledger.usage()
    assert (u.active, u.promised, u.deferred, u.sequences) == (0, 0, 0, 0), u
    assert ledger.outstanding_leases() == 0
    assert not ledger.groups.seqs and ledger.groups.total == 0
    for req in requests:
        f = finished[req.request_id]
        for i, (out, reason) in enumerate(zip(f.outputs, f.finish_reasons, strict=True)):
            if not req.beam and reason in ("length", "stop"):
                sid = req.request_id if i == 0 else f"{req.request_id}/{i}"
                assert out == [sample_token(sid, len(req.prompt) + j) for j in range(len(out))], (seed, sid)
            if reason == "length":
                assert len(out) == req.max_new_tokens
            assert not reason.startswith("error"), (seed, req.request_id, reason)
    return engine, s, finished


@pytest.mark.parametrize("seed", range(24))
def test_forks_beams_preemption_and_swap_on_groups_read_only_their_own_kv(seed: int) -> None:
    _episode(seed)


def test_the_episodes_exercise_what_they_claim() -> None:
    """Across a few seeds the fuzz really forks (copies of shared group blocks), preempts by both modes and
    runs beams: a harness that stopped doing so would pass vacuously."""
    copied = reads = beams = 0
    preempted = {"recompute": 0, "swap": 0}
    for seed in range(24):
        engine, s, finished = _episode(seed)
        copied += engine.copied
        preempted[s.config.recovery] += s.preemptions
        reads += engine.group_reads
        beams += sum(1 for f in finished.values() if f.request.beam and any(f.outputs))
    assert copied > 20 and min(preempted.values()) > 3 and reads > 1000 and beams > 3, (copied, preempted, reads,
                                                                                       beams)


def test_n_branches_share_the_first_groups_prompt_and_write_their_own_windows() -> None:
    """A request with n=3 on a hybrid pool: the first group's prompt blocks are shared (its partial tail copied on
    each later branch's first write), every other group's tables are the branch's own (a budget may run the
    branches' prompt works in different steps, and a window one branch released cannot serve another)."""
    ledger = KVLedger(200, BS, prefix_caching=False, kv_groups=GROUPS, step_tokens=8)
    s = Scheduler(ledger, SchedulerConfig(token_budget=32, prefill_chunk=8))
    engine = GroupEngine(s)
    s.add(GenRequest("a", list(range(1, 11)), 5, n=3))  # 10 tokens: a partial tail at entry 2
    plan = engine.step()
    tables = [w.groups for w in plan.prefills]
    assert len(tables) == 3 and len({tuple(t[0]) for t in tables}) == 1
    for g in range(1, 4):
        assert len({tuple(t[g]) for t in tables}) == 3
    engine.step()
    plan = engine.step()  # the first decode of every branch
    assert len(plan.decodes) == 3 and len(plan.copies) == 2  # the first group's shared tail, for 2 branches
    engine.drain()
    assert engine.copied == 0
    for i in range(3):
        sid = "a" if i == 0 else f"a/{i}"
        assert s.finished["a"][i].output == [sample_token(sid, 10 + j) for j in range(5)]
    ledger.check()
    assert ledger.usage().active == 0


def test_a_fork_shares_the_window_and_the_prefix_and_refuses_atomically() -> None:
    ledger = KVLedger(60, BS, prefix_caching=False, kv_groups=GROUPS, step_tokens=8)
    ledger.admit(Request("a", list(range(1, 20)), 8)).raise_for_outcome()
    for start, end in ((0, 8), (8, 16), (16, 19)):
        ledger.group_tables("a", start, end)
        ledger.mark_computed("a", end)
    before = ledger.usage()
    ledger.fork("a", "b")
    ledger.check()
    ga, gb = ledger.groups.seqs["a"], ledger.groups.seqs["b"]
    assert ga.tables == gb.tables  # every group's live blocks held by both
    full_group, sliding = ga.tables[2], ga.tables[0]
    assert NULL_BLOCK not in full_group and len(full_group) == 5  # the whole prefix
    assert sliding[:2] == [NULL_BLOCK] * 2 and NULL_BLOCK not in sliding[2:]  # only what the window reads (11..)
    assert ledger.usage().active == before.active  # nothing allocated: shared
    refs = ledger.pool.ref
    assert all(refs[b] == 2 for t in ga.tables for b in t if b != NULL_BLOCK)
    # The child is promised its own reservation in every group; a pool without it refuses and changes nothing.
    small = KVLedger(30, BS, prefix_caching=False, kv_groups=GROUPS, step_tokens=8)
    small.admit(Request("a", list(range(1, 20)), 8)).raise_for_outcome()
    snapshot = (small.usage(), {k: (list(v.promised), list(v.held)) for k, v in small.groups.seqs.items()})
    with pytest.raises(Exception, match="cannot fork"):
        small.fork("a", "b")
    assert snapshot == (small.usage(), {k: (list(v.promised), list(v.held)) for k, v in small.groups.seqs.items()})
    small.check()


def test_a_dropped_branch_keeps_its_group_blocks_until_the_steps_lease_ends() -> None:
    ledger = KVLedger(80, BS, prefix_caching=False, kv_groups=GROUPS, step_tokens=8)
    ledger.admit(Request("a", list(range(1, 11)), 8)).raise_for_outcome()
    ledger.group_tables("a", 0, 8)
    ledger.mark_computed("a", 8)
    ledger.group_tables("a", 8, 10)
    ledger.mark_computed("a", 10)
    ledger.fork("a", "b")
    ledger.append_token("b", 3)
    tables = ledger.group_tables("b", 10, 11)
    own = [t[10 // BS] for t in tables[1:]]  # b's copied tails
    lease = ledger.lease(["b"], owner="step")
    ledger.beam_step([], ["b"])
    ledger.check()
    assert all(ledger.pool.ref[b] == 1 or ledger.pool.leased[b] for b in own)
    assert all(ledger.pool.leased[b] for b in own)
    ledger.end_lease(lease)
    assert not any(ledger.pool.leased[b] for b in own)
    ledger.check()

