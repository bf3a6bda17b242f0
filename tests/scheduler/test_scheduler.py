"""The step scheduler driven end to end by a tiny deterministic executor.

``FakeEngine`` carries out each ``StepPlan`` against a model of KV memory: every device and host block
is a list of slots, each slot holding the KV value of one token position, which (like real KV) depends
on every token up to and including that position. Copies, swaps and the forward pass move and write
those values in the executor's order (copies, swap_out, swap_in, then the forward pass), and every
position a step reads as context is checked against the value it must hold. So a plan that reads KV
that was never computed, was overwritten, or came back from the host tier wrong fails the test that ran
it, whatever the ledger's own books say. Sampled tokens are a function of (sequence, position) only.

Pools are tiny and exact (4-token blocks) so that every preemption below is computed by hand.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kvledger.core.ledger import KVLedger
from kvledger.core.tiers import TierLedger
from kvledger.errors import LedgerError
from kvledger.scheduler import (
    Admission,
    GenRequest,
    HostPool,
    RecoveryCosts,
    Scheduler,
    SchedulerConfig,
    Status,
    StepPlan,
    TransferModel,
    Work,
)
from kvledger.scheduler.queue import WaitingQueue

BS = 4  # block size of every pool in this file


def toks(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def sample_token(seq_id: str, position: int) -> int:
    """The fake model: the token at ``position`` of ``seq_id`` (never a draft's value)."""
    return 10 + zlib.crc32(f"{seq_id}@{position}".encode()) % 1000


def draft_token(seq_id: str, position: int) -> int:
    """A draft the verifier rejects: always differs from ``sample_token``."""
    return sample_token(seq_id, position) + 5000


def kv_chain(tokens: list[int]) -> list[int]:
    """KV value of each position: a hash of the whole prefix up to it."""
    out, h = [], 0
    for t in tokens:
        h = zlib.crc32(t.to_bytes(4, "little"), h)
        out.append(h)
    return out


class FakeEngine:
    """Executes plans on fake KV memory; ``accept(work)`` says how many tokens a decode with
    lookahead returns (1 .. lookahead + 1; the default accepts every draft)."""

    def __init__(self, s: Scheduler, accept: Callable[[Work], int] | None = None) -> None:
        self.s = s
        self.accept = accept or (lambda w: w.lookahead + 1)
        self.dev: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.drafts: list[tuple[str, int]] = []  # (seq_id, position) of every draft slot written
        self.shared_tokens = 0  # positions works read from another work of the same plan

    def block(self, b: int) -> list:
        return self.dev.setdefault(b, [None] * BS)

    def run(self, plan: StepPlan) -> dict[str, list[int]]:
        led = self.s.ledger
        pool = led.pool
        # Tier transfers in the order scheduler/transfers.py gives: demotions read their device blocks before
        # anything overwrites them; moves run before write-backs (one may reuse a moved entry's slot). A slot
        # this engine never wrote (a test may fill the tiers by hand) carries nothing, and any read of what
        # it brings back to the device fails the position check below.
        unwritten = [None] * BS
        for d, t in plan.demote:
            self.host[t] = list(self.block(d))
        for src, dst in plan.tier_moves:
            self.host[dst] = list(self.host.get(src, unwritten))
        for d, t in plan.writeback:
            self.host[t] = list(self.block(d))
        for c in plan.copies:
            self.block(c.dst)[: c.slots] = self.block(c.src)[: c.slots]
        for d, h in plan.swap_out:
            assert pool.leased[d], f"step {plan.step}: device block {d} swapped out but not leased"
            self.host[h] = list(self.block(d))
        for t, d in plan.promote:
            self.dev[d] = list(self.host.get(t, unwritten))
        for h, d in plan.swap_in:
            assert h in self.host, f"step {plan.step}: host block {h} read back but never written"
            self.dev[d] = list(self.host[h])
        works = [*plan.prefills, *plan.decodes]
        # The plan carries what an executor needs; it must agree with the ledger behind it.
        for w in works:
            assert w.request is not None and w.request_id == w.seq_id.split("/")[0], w
            assert w.seq_id == (w.request_id if w.branch == 0 else f"{w.request_id}/{w.branch}"), w
            assert list(w.blocks) == led.sequence(w.seq_id).table.blocks, (plan.step, w.seq_id)
            assert list(w.tokens[: w.end]) == led.sequence(w.seq_id).tokens[: w.end], (plan.step, w.seq_id)
        # The executor contract: every work's K/V is written before any work reads (a batched forward
        # pass writes each layer's new K/V before attending in that layer). So a work may read what
        # another work of this very plan writes -- and then the plan must say so (StepPlan.shared_reads).
        writers: dict[tuple[int, int], set[str]] = {}
        before: dict[tuple[int, int], object] = {}  # what a slot written in this step held before it
        for w in works:
            table = w.blocks
            # A scheduled sequence is leased as a whole (its blocks are leased only if it is dropped).
            assert led.is_leased(w.seq_id), f"step {plan.step}: {w.seq_id} runs unleased"
            assert w.end <= len(w.tokens) and w.end + w.lookahead <= len(table) * BS, (plan.step, w)
            chain = kv_chain(list(w.tokens[: w.end]))
            for p in range(w.start, w.end):
                slot = (table[p // BS], p % BS)
                before.setdefault(slot, self.block(slot[0])[slot[1]])
                self.block(slot[0])[slot[1]] = chain[p]
                writers.setdefault(slot, set()).add(w.seq_id)
        assert all(r.start < r.end for r in plan.shared_reads), f"step {plan.step}: an empty shared read"
        declared = {(r.seq_id, p): r.writer for r in plan.shared_reads for p in range(r.start, r.end)}
        self.shared_tokens += len(declared)
        for w in works:
            table, tokens = w.blocks, w.tokens
            chain = kv_chain(list(tokens[: w.start]))
            for p in range(w.start):
                got = self.block(table[p // BS])[p % BS]
                assert got == chain[p], (f"step {plan.step}: {w.seq_id} reads position {p} (block "
                                         f"{table[p // BS]}) but its KV was never written there")
                slot = (table[p // BS], p % BS)
                by = writers.get(slot)
                if by is not None and w.seq_id not in by and before[slot] != chain[p]:
                    assert declared.get((w.seq_id, p)) in by, (
                        f"step {plan.step}: {w.seq_id} reads position {p}, written in this step by {sorted(by)}, "
                        "and the plan does not say so")
        sampled: dict[str, list[int]] = {}
        for w in works:
            table = w.blocks
            if not w.sample:
                continue
            n = self.accept(w) if w.lookahead else 1
            assert 1 <= n <= w.lookahead + 1
            drafts = [sample_token(w.seq_id, w.end + i) if i < n - 1 else draft_token(w.seq_id, w.end + i)
                      for i in range(w.lookahead)]
            dchain = kv_chain(list(w.tokens[: w.end]) + drafts)
            for i in range(w.lookahead):
                p = w.end + i
                self.block(table[p // BS])[p % BS] = dchain[p]
                self.drafts.append((w.seq_id, p))
            sampled[w.seq_id] = [sample_token(w.seq_id, w.end + i) for i in range(n)]
        return sampled

    def step(self, before_confirm: Callable[[StepPlan], None] | None = None) -> StepPlan:
        plan = self.s.schedule()
        self.s.check()
        sampled = self.run(plan)
        if before_confirm is not None:
            before_confirm(plan)
        self.s.confirm(plan, sampled)
        self.s.check()
        return plan

    def drain(self, limit: int = 500) -> list[StepPlan]:
        plans = []
        while self.s.has_work():
            assert len(plans) < limit, "the scheduler did not finish its work"
            plans.append(self.step())
        return plans


def assert_drained(s: Scheduler) -> None:
    """Nothing running, nothing leaked: the end of every test."""
    for rid in list(s.running):
        s.cancel(rid)
    u = s.ledger.usage()
    assert (u.active, u.promised, u.deferred, u.sequences) == (0, 0, 0, 0), u
    assert s.ledger.outstanding_leases() == 0
    if s.host is not None:
        assert s.host.num_free == s.host.num_blocks
    s.check()


def reasons(s: Scheduler) -> dict[str, list[tuple[str | None, int]]]:
    return {rid: [(b.finish_reason, b.num_generated) for b in brs] for rid, brs in s._all.items()}


def expected_output(seq_id: str, prompt_len: int, max_new: int) -> list[int]:
    return [sample_token(seq_id, prompt_len + i) for i in range(max_new)]


@dataclass
class Snapshot:
    tokens: list[int]
    digests: list[bytes]
    blocks: list[int]
    contents: dict[bytes, list]  # digest -> slots of its block
    ledger_tokens: int


def spy_preempt(s: Scheduler, engine: FakeEngine) -> dict[str, list[Snapshot]]:
    """Record each sequence's ledger state at the instant the scheduler preempts it."""
    snaps: dict[str, list[Snapshot]] = {}
    led = s.ledger
    original = led.preempt

    def preempt(seq_id: str, *, counted: bool = True) -> list[int]:
        seq = led.sequence(seq_id)
        br = next(b for b in s.branches(seq.family) if b.seq_id == seq_id)
        snaps.setdefault(seq_id, []).append(Snapshot(
            list(br.tokens), list(seq.digests), list(seq.table.blocks),
            {d: list(engine.block(b)) for d, b in zip(seq.digests, seq.table.blocks, strict=False)},
            len(seq.tokens)))
        return original(seq_id, counted=counted)

    led.preempt = preempt  # type: ignore[method-assign]
    return snaps


# ---- full reservation ---------------------------------------------------------------------------
def test_full_never_preempts_and_rejects_what_can_never_fit() -> None:
    led = KVLedger(10, BS)
    s = Scheduler(led, SchedulerConfig(policy="full", token_budget=64, prefill_chunk=8))
    s.add(GenRequest("a", toks(6, 100), 9))  # 15 tokens: 4 blocks
    s.add(GenRequest("b", toks(5, 200), 6, n=2))  # 3 blocks + the branch's 1 + tail copy 1 = 5 blocks
    s.add(GenRequest("big", toks(30, 300), 11))  # 41 tokens = 11 blocks > the whole pool of 10
    s.add(GenRequest("c", toks(3, 400), 5))  # 2 blocks: waits until someone finishes
    engine = FakeEngine(s)
    first = engine.step()
    assert first.admitted == ["a", "b"]  # c would overcommit: 4 + 5 + 2 > 10
    assert ("big", "never: larger than the whole pool") in first.ended
    for plan in [first, *engine.drain()]:
        assert not plan.preempted and not plan.swap_out
        assert s.preemptions == 0
        u = led.usage()
        assert u.promised <= u.free + u.evictable
    assert reasons(s) == {"a": [("length", 9)], "b": [("length", 6), ("length", 6)],
                          "big": [("never: larger than the whole pool", 0)], "c": [("length", 5)]}
    assert s.branches("b")[1].output == expected_output("b/1", 5, 6)
    assert s.finished["big"][0].finish_reason.startswith("never")
    assert_drained(s)


def test_full_growth_cannot_fail_even_with_branches_and_lookahead() -> None:
    led = KVLedger(9, BS)
    s = Scheduler(led, SchedulerConfig(policy="full"))
    s.add(GenRequest("x", toks(6, 10), 7, n=2, lookahead=2))
    s.add(GenRequest("y", toks(2, 50), 3))
    engine = FakeEngine(s, accept=lambda w: 1 + (w.start % (w.lookahead + 1)))
    engine.drain()
    assert s.preemptions == 0
    assert reasons(s) == {"x": [("length", 7), ("length", 7)], "y": [("length", 3)]}
    assert_drained(s)


@pytest.mark.parametrize("policy", ["full", "incremental"])
def test_siblings_drafting_from_a_shared_tail_read_their_own_draft_kv(policy: str) -> None:
    """n = 2 with lookahead, reaching the last prompt token while both branches share the partial
    tail: a one-token prompt, and a prompt cached up to its last token (its first block written by an
    earlier request). Every draft is accepted, so each branch next reads the KV its own drafts wrote;
    had the siblings drafted into one shared block, one would read the other's (the fake engine's
    position check fails)."""
    led = KVLedger(32, BS)
    s = Scheduler(led, SchedulerConfig(policy=policy))
    engine = FakeEngine(s)  # one fake KV memory for the whole test: the cached block must be there
    s.add(GenRequest("one", toks(1, 10), 6, n=2, lookahead=2))
    engine.drain()
    s.add(GenRequest("warm", toks(4, 300), 1))
    engine.drain()
    s.add(GenRequest("cached", toks(4, 300) + [77], 6, n=2, lookahead=2))
    engine.drain()
    assert led.stats()["prefix_cache"]["hit_blocks"] >= 1  # the second case really started from a hit
    assert reasons(s)["one"] == [("length", 6), ("length", 6)]
    assert reasons(s)["cached"] == [("length", 6), ("length", 6)]
    assert s.branches("cached")[1].output == expected_output("cached/1", 5, 6)
    assert s.branches("one")[0].output == expected_output("one", 1, 6)
    assert_drained(s)


# ---- incremental + preempt: the victim policies -------------------------------------------------
SHARED = toks(8, 500)  # two blocks C and D share


def victim_scenario(victim: str, recovery: str = "recompute", host: HostPool | None = None,
                    costs: RecoveryCosts | None = None) -> tuple[Scheduler, FakeEngine]:
    """Pool of 10 four-token blocks, incremental (one token reserved), no watermark.

    B (priority -1, a batch job) arrives first and is admitted alone in step 0; A, C and D (priority 0)
    arrive next and are admitted in step 1, in this order (admission is by priority, then first come
    first served, so a low-priority request admitted early is not the latest admitted):

      request                   prompt                 blocks at admission
      B  priority -1 (step 0)   8 tokens               2 + 1 promised (spent in step 1)
      A  priority 0  (step 1)   5 tokens               2 (no promise: 6 tokens fit 2 blocks)
      C  priority 0  (step 1)   SHARED + 1 = 9 tokens  3 (no promise)
      D  priority 0  (step 1)   SHARED + 4 = 12 tokens 2 shared with C + 1 new + 1 promised
    = exactly 10 blocks. In step 5, B (first in admission order) appends its 13th token (position 12),
    needs a fourth block, and none is left: the first growth failure. The helper runs step 0.
    """
    led = KVLedger(10, BS)
    cfg = SchedulerConfig(policy="incremental", on_growth_failure="preempt", victim=victim,
                          recovery=recovery, watermark=0.0)
    s = Scheduler(led, cfg, host=host, costs=costs)
    engine = FakeEngine(s)
    s.add(GenRequest("B", toks(8, 200), 20, priority=-1))
    assert engine.step().admitted == ["B"]
    s.add(GenRequest("A", toks(5, 100), 20))
    s.add(GenRequest("C", [*SHARED, 7], 20))
    s.add(GenRequest("D", [*SHARED, 1, 2, 3, 4], 20))
    return s, engine


# At the failure (step 5, B grows first): tokens = scheduler's tokens, computed = KV written,
# held = distinct blocks, replay = tokens - blocks still held by another request x 4.
#        order tokens computed held replay            waste = held x replay
#   B     0    13     12       3   13                  39
#   A     1     9      8       2    9                  18
#   C     2    13     12       3   13 - 2*4 = 5        15   (its SHARED blocks are held by D too)
#   D     3    16     15       4   16 - 2*4 = 8        32   (... and by C)
# latest: D (admitted last); priority: B (-1); least_computed: A (8); min_waste: C (15).
# After the first victim is recomputed, B's append is retried at once and A and C (later in admission
# order) append in the same step: A's 9th token needs a third block, C's 13th a fourth. So:
#   latest:         D freed 2 blocks (its SHARED blocks stay with C): B takes one, A the other; C finds
#                   none and is now the latest: it preempts itself.                    [D, C]
#   priority:       B (-1) preempts itself: 3 blocks free, A and C take one each.      [B]
#   least_computed: A (8 computed) preempts itself: 2 blocks free for B and C.          [A]
#   min_waste:      C (15) frees 1 block (SHARED stays with D): B takes it; A then finds none. Now
#                   B 4 x 13 = 52, A 2 x 9 = 18, D 4 x 16 = 64 (C left, so D's SHARED blocks are its
#                   own and all 16 tokens replay): A preempts itself.                   [C, A]
# Each victim goes back to the front of the waiting queue, so the last one is first.
# Totals over the whole run (counted, then kept as a regression figure): 5, 4, 6, 5.
@pytest.mark.parametrize("victim,expected,total", [("latest", ["D", "C"], 5), ("priority", ["B"], 4),
                                                   ("least_computed", ["A"], 6), ("min_waste", ["C", "A"], 5)])
def test_each_victim_policy_picks_its_hand_computed_victim(victim: str, expected: list[str], total: int) -> None:
    s, engine = victim_scenario(victim)
    plans = [engine.step() for _ in range(5)]
    assert [p.preempted for p in plans[:4]] == [[], [], [], []]
    got = plans[4].preempted
    assert [p.request_id for p in got] == expected
    assert all(p.mode == "recompute" for p in got)
    assert got[0].reason == "B needed a block"
    for rid in expected:
        assert s.branches(rid)[0].status is Status.WAITING and rid not in s.running
    assert [u[0].request.request_id for u in s.waiting] == expected[::-1]  # re-queued at the front
    engine.drain()
    assert s.preemptions == total
    for rid in "ABCD":
        br = s.branches(rid)[0]
        assert (br.finish_reason, br.output) == ("length", expected_output(rid, len(br.request.prompt), 20))
    assert_drained(s)


# ---- recompute ----------------------------------------------------------------------------------
def test_recompute_replays_exactly_prompt_plus_generated_tokens() -> None:
    s, engine = victim_scenario("latest")
    snaps = spy_preempt(s, engine)
    plans = [engine.step() for _ in range(5)]
    assert plans[4].preempted[0].request_id == "D"
    (snap,) = snaps["D"]
    d = s.branches("D")[0]
    assert (d.status, d.computed, d.in_ledger, d.tokens) == (Status.WAITING, 0, 0, snap.tokens)
    assert len(snap.tokens) == 12 + 4  # prompt + the 4 tokens generated so far
    replay: list[Work] = []
    while "D" not in s.running or not replay or not replay[-1].sample:
        plan = engine.step()
        replay += [w for w in plan.prefills if w.seq_id == "D"]
        assert not [w for w in plan.decodes if w.seq_id == "D"]
    # SHARED is still held by C, so the re-admission hits it; the rest is replayed, in order, ending
    # exactly at len(prompt) + generated, and only the last chunk samples (the 5th output token).
    assert [(w.start, w.end, w.sample) for w in replay] == [(8, 16, True)]
    seq = s.ledger.sequence("D")
    assert (seq.num_prompt, seq.tokens, seq.hit_blocks) == (16, snap.tokens, 2)
    assert d.tokens[16] == sample_token("D", 16)
    engine.drain()
    assert d.output == expected_output("D", 12, 20)
    assert_drained(s)


def test_recompute_preempts_and_readmits_a_family_together() -> None:
    """Gang semantics: both branches of a request leave and come back in one unit."""
    led = KVLedger(8, BS)
    s = Scheduler(led, SchedulerConfig(policy="incremental", victim="latest", watermark=0.0))
    s.add(GenRequest("G", toks(4, 100), 14))
    s.add(GenRequest("F", toks(6, 200), 10, n=2))
    engine = FakeEngine(s)
    preempted_at = None
    lens: dict[str, int] = {}
    gen: dict[str, int] = {}

    def before_confirm(plan: StepPlan) -> None:  # tokens as the plan saw them
        for br in s.branches("F"):
            lens[br.seq_id], gen[br.seq_id] = len(br.tokens), br.num_generated

    for _ in range(40):
        plan = engine.step(before_confirm)
        if plan.preempted and preempted_at is None:
            preempted_at = plan.step
            assert [p.request_id for p in plan.preempted] == ["F"]
            assert all(b.status is Status.WAITING for b in s.branches("F"))
            assert "F" not in led and "F/1" not in led
            assert len(s.waiting[0]) == 2
        elif preempted_at is not None and "F" in plan.admitted:
            # Both branches come back in the same step. At the preemption (step 7) F's append of
            # position 12 had marked its third block written; F/1 never got that far. So 4 blocks were
            # cached, released tail first: F's block 2, F's block 1, F/1's block 1, the shared block 0.
            # G's growth in step 13 evicted the least recently released, F's block 2 (the refused
            # re-admission attempts in between touched nothing, so the order stayed). Each branch then
            # hits 2 blocks and replays positions 8..12 -- up to exactly prompt + generated.
            works = {w.seq_id: w for w in plan.prefills + plan.decodes}
            assert set(works) == {"F", "F/1"}
            assert plan.step == 14
            assert [(w.start, w.end) for w in (works["F"], works["F/1"])] == [(8, 13), (8, 13)]
            assert all(w.sample for w in works.values())
            assert all(lens[sid] == 6 + gen[sid] == works[sid].end for sid in works)
            break
    else:
        pytest.fail("F was never preempted and re-admitted")
    engine.drain()
    assert reasons(s) == {"G": [("length", 14)], "F": [("length", 10), ("length", 10)]}
    assert_drained(s)


# ---- swap ---------------------------------------------------------------------------------------
@dataclass
class Restored:
    tokens: list[int]
    digests: list[bytes]
    blocks: list[int]
    hit_blocks: int
    contents: list[list]  # slots of each block, in table order


def swap_scenario(clear_cache: bool) -> tuple[Scheduler, FakeEngine, Snapshot, list[StepPlan], Restored]:
    """Pool 6, incremental, victim latest, swap. G (4-token prompt, 12 new) and V (6-token prompt,
    9 new) grow in lock step; in step 7 V appends position 12, finds no block and, being the latest,
    swaps itself out (3 blocks). G runs alone until it finishes in step 11; V comes back in step 12."""
    led = KVLedger(6, BS)
    cfg = SchedulerConfig(policy="incremental", victim="latest", recovery="swap", watermark=0.0)
    s = Scheduler(led, cfg, host=HostPool(8))
    s.add(GenRequest("G", toks(4, 100), 12))
    s.add(GenRequest("V", toks(6, 200), 9))
    engine = FakeEngine(s)
    snaps = spy_preempt(s, engine)
    plans: list[StepPlan] = []
    restored = None
    while s.has_work():
        assert len(plans) < 60
        plan = engine.step()
        plans.append(plan)
        if plan.swap_out and clear_cache:
            led.clear_cache()  # evict V's retained blocks: the restore must read every one back
        if plan.step > 0 and "V" in plan.admitted:
            seq = led.sequence("V")
            restored = Restored(list(seq.tokens), list(seq.digests), list(seq.table.blocks), seq.hit_blocks,
                                [list(engine.block(b)) for b in seq.table.blocks])
    assert restored is not None and len(snaps["V"]) == 1
    return s, engine, snaps["V"][0], plans, restored


@pytest.mark.parametrize("clear_cache", [False, True])
def test_swap_then_restore_gives_back_the_same_blocks(clear_cache: bool) -> None:
    s, engine, snap, plans, back = swap_scenario(clear_cache)
    (out,) = [p for p in plans if p.swap_out]
    (restore,) = [p for p in plans if p.step > 0 and "V" in p.admitted]
    assert (out.step, restore.step) == (7, 12)
    assert out.preempted[0].request_id == "V" and out.preempted[0].mode == "swap"
    assert out.transfer_wait_s == pytest.approx(TransferModel().time_s(3, RecoveryCosts().block_bytes))
    # Every device block V held went out, each to its own host block.
    assert sorted(d for d, _ in out.swap_out) == sorted(snap.blocks) and len(snap.blocks) == 3
    host_of = dict(out.swap_out)
    assert len(set(host_of.values())) == 3
    # Read back: each host block lands at the table index it left from; prefix hits need no copy.
    assert restore.swap_in == [(host_of[snap.blocks[i]], back.blocks[i])
                               for i in range(back.hit_blocks, len(back.blocks))]
    if clear_cache:
        assert back.hit_blocks == 0 and {h for h, _ in restore.swap_in} == set(host_of.values())
    else:  # V's blocks were cached tail first after the copy; G's growth evicted only the tail
        assert back.hit_blocks == 2 and len(restore.swap_in) == 1
    for i in range(back.hit_blocks):
        assert s.ledger.pool.index[back.digests[i]] == back.blocks[i]
    # Same tokens at the same positions, same digests, and the same contents under each digest.
    assert back.tokens == snap.tokens[: snap.ledger_tokens]
    assert back.digests == snap.digests
    assert {d: c for d, c in zip(back.digests, back.contents, strict=False)} == snap.contents
    v = s.branches("V")[0]
    assert (v.finish_reason, v.output) == ("length", expected_output("V", 6, 9))
    assert v.preemptions == 1 and v.host_blocks == []
    assert s.host.num_free == s.host.num_blocks
    assert_drained(s)


def test_swap_transfer_wait_is_the_whole_link_time_whatever_the_overlap_flag() -> None:
    """The scheduler plans before any compute is known, so ``transfer_wait_s`` is the swap's whole link
    time (staging rounds included); whether a part hides behind compute is the executor's to say. (It was
    ``rounds x overhead_s`` with overlap on: overlap taken for a guarantee.)"""
    block_bytes = 1_000_000
    for overlap in (False, True):
        transfer = TransferModel(link_Bps=1e9, overhead_s=1e-3, staging_blocks=2, overlap=overlap)
        led = KVLedger(6, BS)
        cfg = SchedulerConfig(policy="incremental", victim="latest", recovery="swap", watermark=0.0)
        costs = RecoveryCosts(block_bytes=block_bytes, transfer=transfer)
        s = Scheduler(led, cfg, host=HostPool(8), costs=costs)
        s.add(GenRequest("G", toks(4, 100), 12))
        s.add(GenRequest("V", toks(6, 200), 9))
        engine = FakeEngine(s)
        plans = engine.drain()
        (out,) = [p for p in plans if p.swap_out]
        blocks = len(out.swap_out)  # 3 blocks: 2 staging rounds
        rounds = math.ceil(blocks / 2)
        full = blocks * block_bytes / 1e9 + rounds * 1e-3
        assert out.transfer_wait_s == pytest.approx(full)
        assert_drained(s)


def test_auto_chooses_by_the_cost_formulas() -> None:
    """recompute_s = replay x flops_per_token / flops_per_s; swap_s = 2 x (blocks x block_bytes /
    link_Bps + rounds x overhead_s). The victim is D of the victim scenario: 16 tokens, 4 blocks, the
    first 2 held by C as well, so replay = 16 - 2 x 4 = 8 tokens."""
    flops_per_token, flops_per_s, block_bytes = 1e9, 1e12, 1_000_000
    replay, blocks = 8, 4
    recompute_s = replay * flops_per_token / flops_per_s  # 8 ms
    for link_Bps in (1e12, 1e8):
        transfer = TransferModel(link_Bps=link_Bps, overhead_s=5e-6, staging_blocks=64)
        swap_s = 2 * (blocks * block_bytes / link_Bps + math.ceil(blocks / 64) * 5e-6)
        expected = "swap" if swap_s < recompute_s else "recompute"
        assert expected == ("swap" if link_Bps == 1e12 else "recompute")  # 8 us+ vs 80 ms
        costs = RecoveryCosts(flops_per_token, flops_per_s, block_bytes, transfer)
        s, engine = victim_scenario("latest", recovery="auto", host=HostPool(16), costs=costs)
        plans = [engine.step() for _ in range(5)]
        p = plans[4].preempted[0]
        assert (p.request_id, p.mode) == ("D", expected)
        assert f"auto chose {expected} (recompute {recompute_s * 1e3:.3f} ms vs swap {swap_s * 1e3:.3f} ms)" \
            in p.reason
        assert bool(plans[4].swap_out) == (expected == "swap")
        engine.drain()
        assert all(b.finish_reason == "length" for brs in s._all.values() for b in brs)
        assert_drained(s)


@pytest.mark.parametrize("host", [None, HostPool(3)])
def test_swap_without_host_room_falls_back_to_recompute(host: HostPool | None) -> None:
    """D holds 4 blocks: no host tier, or one of 3 blocks, cannot take it. C, preempted next in the
    same step (see the victim table), holds 3: the 3-block host takes it, no host does not."""
    s, engine = victim_scenario("latest", recovery="swap", host=host)
    plans = [engine.step() for _ in range(5)]
    d, c = plans[4].preempted
    assert (d.request_id, d.mode) == ("D", "recompute")
    assert "host pool cannot hold the blocks" in d.reason
    if host is None:
        assert (c.request_id, c.mode) == ("C", "recompute") and not plans[4].swap_out
    else:
        assert (c.request_id, c.mode, c.reason) == ("C", "swap", "C needed a block")
        assert len(plans[4].swap_out) == 3 and host.num_free == 0
    engine.drain()
    assert all(b.finish_reason == "length" for brs in s._all.values() for b in brs)
    assert_drained(s)


# ---- defer and reject ---------------------------------------------------------------------------
def test_defer_skips_the_stuck_request_until_memory_frees() -> None:
    """Pool 4. X: prompt 4, 4 new (1 block + 1 promised); Z: prompt 7, 5 new (2 blocks, no promise).
    Step 2: Z appends position 8, needs a third block, none is unpromised: deferred (no work that
    step), and again in step 3; X finishes in step 3 and frees its blocks; Z resumes in step 4."""
    led = KVLedger(4, BS)
    s = Scheduler(led, SchedulerConfig(policy="incremental", on_growth_failure="defer", watermark=0.0))
    s.add(GenRequest("X", toks(4, 100), 4))
    s.add(GenRequest("Z", toks(7, 300), 5))
    engine = FakeEngine(s)
    deferred = {}
    while s.has_work():
        plan = engine.step()
        ran = {w.seq_id for w in plan.prefills + plan.decodes}
        stuck = {b.seq_id for b in s._all["Z"] if b.deferred}
        assert not stuck & ran  # a deferred request does not run that step
        deferred[plan.step] = sorted(stuck)
    assert deferred == {0: [], 1: [], 2: ["Z"], 3: ["Z"], 4: [], 5: [], 6: []}
    assert s.preemptions == 0
    assert reasons(s) == {"X": [("length", 4)], "Z": [("length", 5)]}
    assert_drained(s)


def test_defer_breaks_a_deadlock_by_recomputing_one_victim() -> None:
    # Pool 4: X and Y both need a third block at position 8 in the same step; nobody can finish.
    led = KVLedger(4, BS)
    s = Scheduler(led, SchedulerConfig(policy="incremental", on_growth_failure="defer", watermark=0.0))
    s.add(GenRequest("X", toks(4, 100), 8))
    s.add(GenRequest("Y", toks(4, 200), 8))
    engine = FakeEngine(s)
    plans = engine.drain()
    pre = [p for plan in plans for p in plan.preempted]
    assert [(p.request_id, p.mode, p.reason) for p in pre] == [
        ("Y", "recompute", "every running request was deferred")]
    assert reasons(s) == {"X": [("length", 8)], "Y": [("length", 8)]}
    assert_drained(s)


def test_reject_ends_the_request_that_cannot_grow() -> None:
    led = KVLedger(4, BS)
    s = Scheduler(led, SchedulerConfig(policy="incremental", on_growth_failure="reject", watermark=0.0))
    s.add(GenRequest("X", toks(4, 100), 8))
    s.add(GenRequest("Y", toks(4, 200), 8, n=1))
    engine = FakeEngine(s)
    plans = engine.drain()
    ended = [e for p in plans for e in p.ended]
    # Each holds 2 of the 4 blocks; both append position 8 in step 5. X grows first, finds no block
    # and is rejected (its 5 sampled tokens kept; the 5th never reached the ledger); its blocks are
    # freed at once, so Y's append in the same step succeeds.
    assert ended == [("X", "rejected: no memory to grow")]
    assert reasons(s) == {"X": [("rejected: no memory to grow", 5)], "Y": [("length", 8)]}
    assert s.preemptions == 0
    assert_drained(s)


def test_headroom_keeps_blocks_free_at_admission() -> None:
    led = KVLedger(6, BS)
    cfg = SchedulerConfig(policy="incremental", on_growth_failure="headroom", headroom_blocks=2,
                          watermark=0.0)
    s = Scheduler(led, cfg)
    s.add(GenRequest("X", toks(8, 100), 4))  # 2 blocks + 1 promised
    s.add(GenRequest("Y", toks(4, 200), 4))  # 1 block + 1 promised: would leave 1 < 2 free
    engine = FakeEngine(s)
    first = engine.step()
    assert first.admitted == ["X"]
    engine.drain()
    assert reasons(s) == {"X": [("length", 4)], "Y": [("length", 4)]}
    assert_drained(s)


def test_predicted_reserves_the_observed_quantile_after_enough_samples() -> None:
    led = KVLedger(64, BS)
    cfg = SchedulerConfig(policy="predicted", predicted_min_samples=2, predicted_quantile=1.0)
    s = Scheduler(led, cfg)
    s.add(GenRequest("a", toks(4, 100), 6))
    engine = FakeEngine(s)
    engine.step()
    assert led.sequence("a").promised == 2  # the whole allowance: 10 tokens = 3 blocks, 1 held
    engine.drain()
    s.add(GenRequest("b", toks(4, 200), 6))
    engine.drain()
    s.add(GenRequest("c", toks(4, 300), 40))
    engine.step()
    assert led.sequence("c").promised == 2  # quantile 6 tokens: 10 tokens = 3 blocks, not 11
    engine.drain()
    assert s.branches("c")[0].finish_reason == "length"
    assert_drained(s)


# ---- speculative lookahead ----------------------------------------------------------------------
def test_lookahead_slots_are_trimmed_when_drafts_are_rejected_and_never_indexed() -> None:
    led = KVLedger(8, BS)
    s = Scheduler(led, SchedulerConfig(policy="full"))
    s.add(GenRequest("A", toks(6, 100), 10, lookahead=3))
    accepts = iter([1, 1, 4, 2, 1, 1, 1, 1, 1, 1])
    engine = FakeEngine(s, accept=lambda w: next(accepts))
    trims: list[tuple[int, list[int]]] = []
    original = led.trim_lookahead

    def trim(seq_id: str) -> int:
        seq = led.sequence(seq_id)
        before = list(seq.table.blocks)
        freed = original(seq_id)
        gone = before[len(seq.table.blocks):]
        for b in gone:  # a rejected draft's block leaves with no identity and no reference
            assert led.pool.ref[b] == 0 and led.pool.digest[b] is None
        trims.append((len(seq.tokens), gone))
        return freed

    led.trim_lookahead = trim  # type: ignore[method-assign]
    reserved = led.usage().promised
    while s.has_work():
        plan = engine.step()
        if "A" in led:
            seq = led.sequence("A")
            # no digest covers a position beyond the real tokens; blocks beyond them carry none
            assert len(seq.digests) * BS <= len(seq.tokens)
            for b in seq.table.blocks[-(-len(seq.tokens) // BS):]:
                assert led.pool.digest[b] is None
            if plan.decodes:
                assert len(seq.table.blocks) == -(-(len(seq.tokens) + 3) // BS)
        if plan.step == 0:
            reserved = led.usage().promised
    # Step 1 decodes position 6 with drafts at 7, 8, 9: block 2 exists only for drafts. All rejected
    # (1 token accepted), so step 2 trims it before appending position 7.
    assert trims[1] == (7, [2])
    assert reserved == 3  # full: 6 + 10 + 3 lookahead = 19 tokens = 5 blocks, 2 held by the prompt
    assert ("A", 8) in engine.drafts and ("A", 9) in engine.drafts
    # Every draft slot was either accepted (and its position later read back with the right KV) or
    # overwritten by a real token before anything read it: the engine checks each read.
    a = s.branches("A")[0]
    assert (a.finish_reason, a.output) == ("length", expected_output("A", 6, 10))
    assert_drained(s)


# ---- cancellation -------------------------------------------------------------------------------
def test_cancel_mid_flight_defers_release_until_confirm() -> None:
    led = KVLedger(10, BS)
    s = Scheduler(led, SchedulerConfig(policy="full"))
    s.add(GenRequest("A", toks(5, 100), 8, n=2))
    s.add(GenRequest("B", toks(5, 200), 4))
    engine = FakeEngine(s)
    engine.step()
    plan = s.schedule()
    sampled = engine.run(plan)
    held = {b for sid in ("A", "A/1") for b in led.sequence(sid).table.blocks}
    assert s.cancel("A") is True
    assert "A" not in led and "A/1" not in led
    u = led.usage()
    assert u.deferred == len(held - set(led.sequence("B").table.blocks)) > 0
    free = set(led.pool.free_blocks())
    assert not held & free  # still leased by the in-flight step
    s.confirm(plan, sampled)  # the sampled tokens of A are ignored
    s.check()
    assert led.usage().deferred == 0
    assert [b.finish_reason for b in s.branches("A")] == ["cancelled", "cancelled"]
    assert s.cancel("A") is False
    engine.drain()
    assert s.branches("B")[0].finish_reason == "length"
    assert_drained(s)


def test_cancel_waiting_and_swapped_requests_frees_their_host_blocks() -> None:
    led = KVLedger(6, BS)
    host = HostPool(8)
    s = Scheduler(led, SchedulerConfig(policy="incremental", victim="latest", recovery="swap",
                                       watermark=0.0), host=host)
    s.add(GenRequest("G", toks(4, 100), 12))
    s.add(GenRequest("V", toks(6, 200), 9))
    s.add(GenRequest("W", toks(30, 300), 1))  # 8 blocks: never
    engine = FakeEngine(s)
    while not s.swapped:
        engine.step()
    s.add(GenRequest("Q", toks(5, 400), 3))
    assert host.num_used > 0
    assert s.cancel("V") is True
    assert host.num_free == host.num_blocks and not s.swapped
    assert s.cancel("Q") is True  # still waiting
    assert s.cancel("nobody") is False
    engine.drain()
    assert reasons(s) == {"G": [("length", 12)], "V": [("cancelled", s.branches("V")[0].num_generated)],
                          "W": [("never: larger than the whole pool", 0)], "Q": [("cancelled", 0)]}
    assert_drained(s)


# ---- bugs found: these fail until src/ is fixed ---------------------------------------------------
def test_swap_restore_does_not_skip_an_unfinished_prefill() -> None:
    """G holds 2 blocks and decodes; V (15-token prompt, 4 blocks, no promise: the pool is full) is
    prefilled in chunks of 4. In step 5 G needs a block for position 8 and swaps out V, the latest,
    with 12 of its 15 prompt positions computed. On restore (step 9) ``_admit_unit`` sets
    ``computed = in_ledger - 1`` (scheduler.py:278) and decodes position 14, reading positions 12 and
    13, whose KV was never computed. The restore must resume the prefill at position 12."""
    led = KVLedger(6, BS)
    s = Scheduler(led, SchedulerConfig(policy="incremental", victim="latest", recovery="swap", watermark=0.0,
                                       prefill_chunk=4, token_budget=5), host=HostPool(8))
    s.add(GenRequest("G", toks(4, 100), 8))  # 1 block + 1 promised; position 8 (step 5) needs another
    engine = FakeEngine(s)
    engine.step()
    engine.step()
    s.add(GenRequest("V", toks(15, 200), 3))
    computed_at_swap = None
    while s.has_work():
        plan = s.schedule()
        s.check()
        if plan.swap_out:
            assert plan.preempted[0].request_id == "V" and plan.step == 5
            computed_at_swap = 12
            assert [w for w in plan.prefills if w.seq_id == "V"] == []
        if computed_at_swap is not None and "V" in plan.admitted:
            first = [w for w in plan.prefills + plan.decodes if w.seq_id == "V"]
            assert not first or first[0].start <= computed_at_swap, \
                f"restored V starts at position {first[0].start}; only {computed_at_swap} were ever computed"
        s.confirm(plan, engine.run(plan))
        s.check()
    assert s.branches("V")[0].preemptions == 1
    assert reasons(s) == {"G": [("length", 8)], "V": [("length", 3)]}
    assert_drained(s)


def test_swap_victim_is_not_restored_in_the_step_it_was_swapped_out() -> None:
    """G needs a block at position 8 (step 5) while B (16-token prompt, 4 blocks + 1 promised) is
    mid-prefill. B, the latest, is swapped out -- and ``_swap_in`` (run right after ``_grow``) admits
    it again in the same step: its promise was just cancelled, and its own still-leased blocks are
    prefix hits, including the unwritten ones. G, deferred so that the transfer could free memory,
    gets nothing; the swap-out was pure cost; and B resumes by decoding position 15 over positions
    12..14 that were never computed. A unit swapped out in a step should not be restored in it."""
    led = KVLedger(7, BS)
    s = Scheduler(led, SchedulerConfig(policy="incremental", victim="latest", recovery="swap", watermark=0.0,
                                       prefill_chunk=4), host=HostPool(16))
    s.add(GenRequest("G", toks(4, 100), 12))
    engine = FakeEngine(s)
    engine.step()
    engine.step()
    s.add(GenRequest("B", toks(16, 200), 4))
    swaps = 0
    while s.has_work():
        plan = s.schedule()
        s.check()
        swapped = {p.request_id for p in plan.preempted if p.mode == "swap"}
        swaps += len(swapped)
        assert not swapped & set(plan.admitted), f"step {plan.step}: {swapped} swapped out and back in"
        s.confirm(plan, engine.run(plan))
        s.check()
    assert swaps == 1
    assert reasons(s) == {"G": [("length", 12)], "B": [("length", 4)]}
    assert_drained(s)


@pytest.mark.parametrize(("prefill_chunk", "token_budget"), [(4, 2), (2, 3)])
def test_swap_restore_does_not_treat_a_pending_prefix_hit_as_written(prefill_chunk: int, token_budget: int) -> None:
    """V (8-token prompt SH, priority -1) is swapped out for G in step 32 and its cached blocks are
    then cleared. W (prompt SH + 8) is admitted and prefilled a few tokens a step, so W's second
    block -- SH[4:8] -- is indexed but pending. G is cancelled once W has computed 4 positions; in
    the next step V is restored: it hits W's two SH blocks, and the swap-in copies only from
    ``seq.hit_blocks`` on, so V must recompute (or read, as W writes it) the pending one.

    With a budget of 2 V waits for W (the filler is ahead). With a chunk of 2 and a budget of 3 V
    had the token it sampled before the swap appended in the next step, and appending a token
    confirms every earlier one as written: the pending block was marked written, V skipped it and
    read positions 4..7 while W was still writing them (step 34: position 6, no SharedRead). A
    restored branch now recomputes up to what the ledger knows before its sampled token goes in."""
    SH = toks(8, 500)
    led = KVLedger(17, BS)
    cfg = SchedulerConfig(policy="incremental", victim="priority", recovery="swap", watermark=0.0,
                          prefill_chunk=prefill_chunk, token_budget=token_budget)
    s = Scheduler(led, cfg, host=HostPool(32))
    s.add(GenRequest("V", SH, 60, priority=-1))
    s.add(GenRequest("G", toks(4, 100), 60))
    engine = FakeEngine(s)
    phase = "running"
    refill = 0
    while s.has_work():
        assert engine.s._step < 200
        plan = s.schedule()
        s.check()
        if phase == "G cancelled":
            assert "V" in plan.admitted
            seq = led.sequence("V")
            assert seq.hit_blocks == 2 and not led.pool.written[seq.table.blocks[1]]
            swapped_in = {d for _, d in plan.swap_in}
            for w in [w for w in plan.prefills + plan.decodes if w.seq_id == "V"]:
                context = sorted({seq.table.blocks[p // BS] for p in range(w.start)})
                unreadable = [b for b in context if not led.pool.written[b] and b not in swapped_in]
                assert unreadable == [], f"restored V runs {w} over pending blocks {unreadable}"
            phase = "checked"
        elif phase == "checked":
            refill += sum(w.end - w.start for w in plan.prefills if w.seq_id == "V" and not w.sample)
        s.confirm(plan, engine.run(plan))
        s.check()
        if phase == "running" and plan.swap_out:
            assert plan.preempted[0].request_id == "V"
            led.clear_cache()
            s.add(GenRequest("W", SH + toks(8, 900), 30))
            phase = "W added"
        elif phase == "W added" and "W" in led and s.branches("W")[0].computed == 4:
            s.cancel("G")
            phase = "G cancelled"
    assert phase == "checked"
    # Only what could not come back from the host is computed again: the pending block is read as W
    # writes it (or waited for), the blocks after it came back whole, so one token is recomputed.
    assert refill == 1
    assert [b.finish_reason for rid in "VW" for b in s.branches(rid)] == ["length", "length"]
    assert_drained(s)


def test_swap_of_self_does_not_make_the_other_grower_look_too_big() -> None:
    """A (priority 0) and B (priority 9) each fill 2 of 4 blocks and both need a third in step 5.
    A fails first and, being the lowest priority, swaps itself out; its blocks stay leased until
    confirm. B then fails, finds itself alone in ``running`` and is rejected as 'outgrew the whole
    pool' (scheduler.py:150) -- but B (4 + 10 tokens = 4 blocks) fits the pool alone, and A's blocks
    come free at confirm. B should defer for one step, as a grower does after any swap-out."""
    led = KVLedger(4, BS)
    s = Scheduler(led, SchedulerConfig(policy="incremental", victim="priority", recovery="swap",
                                       watermark=0.0), host=HostPool(8))
    s.add(GenRequest("A", toks(4, 100), 10, priority=0))
    s.add(GenRequest("B", toks(4, 200), 10, priority=9))
    engine = FakeEngine(s)
    engine.drain()
    assert reasons(s) == {"A": [("length", 10)], "B": [("length", 10)]}
    assert_drained(s)


def test_a_readmitted_request_is_not_left_idle_by_a_stale_deferred_flag() -> None:
    """Pool 4: X and Y (4 + 8 tokens each) both need a third block in step 5; both defer, so the
    deadlock breaker recomputes Y. Y still carries ``deferred = True`` from that step (nothing resets
    it on preemption), so when Y is re-admitted in step 8 ``_schedule_branch`` skips it: the step is
    empty although Y was just admitted with room to run."""
    led = KVLedger(4, BS)
    s = Scheduler(led, SchedulerConfig(policy="incremental", on_growth_failure="defer", watermark=0.0))
    s.add(GenRequest("X", toks(4, 100), 8))
    s.add(GenRequest("Y", toks(4, 200), 8))
    engine = FakeEngine(s)
    plans = engine.drain()
    (readmit,) = [p for p in plans if p.step > 0 and p.admitted]
    assert readmit.admitted == ["Y"]
    assert [w.seq_id for w in readmit.prefills + readmit.decodes] == ["Y"], f"step {readmit.step} is empty"
    assert_drained(s)


def test_every_block_a_plan_names_is_leased_until_confirm() -> None:
    """The module's promise: 'Every block the plan touches is leased until confirm'. In the swap
    scenario V comes back in step 12 with its sampled token not yet appended, so it is not scheduled
    that step and ``plan.lease`` does not cover it: the swap-in destinations are unleased. Cancelling
    V mid-flight then puts blocks the executor is still copying into straight on the free list."""
    led = KVLedger(6, BS)
    s = Scheduler(led, SchedulerConfig(policy="incremental", victim="latest", recovery="swap", watermark=0.0),
                  host=HostPool(8))
    s.add(GenRequest("G", toks(4, 100), 12))
    s.add(GenRequest("V", toks(6, 200), 9))
    engine = FakeEngine(s)
    while True:
        plan = s.schedule()
        s.check()
        if plan.swap_in:
            break
        s.confirm(plan, engine.run(plan))
    sampled = engine.run(plan)
    targets = [d for _, d in plan.swap_in] + [c.dst for c in plan.copies] + [c.src for c in plan.copies]
    assert s.cancel("V")
    free = set(led.pool.free_blocks())
    assert [b for b in targets if b in free] == [], "blocks the in-flight plan writes were freed"
    s.confirm(plan, sampled)
    s.check()
    assert_drained(s)


def test_finished_requests_stay_cached_tail_first() -> None:
    """The ledger releases a sequence tail first so that LRU evicts its deepest block before the head
    every deeper block depends on (core/eviction.py, LRUPolicy). Under the scheduler a request
    finishes inside ``confirm`` while the step's lease still holds its blocks; the lease then ends in
    table order (core/lifetimes.py, end_lease), so the blocks become retained head first and the next
    eviction strands the whole chain. (The swap lease, scheduler.py:201-212, leases ``sorted`` block
    ids: the same effect for swapped-out requests.)"""
    led = KVLedger(8, BS)
    s = Scheduler(led, SchedulerConfig(policy="full"))
    s.add(GenRequest("A", toks(12, 100), 2))  # 3 full prompt blocks
    engine = FakeEngine(s)
    engine.step()
    digests = list(led.sequence("A").digests)
    table = list(led.sequence("A").table.blocks)
    engine.drain()
    assert led.pool.retained.blocks() == table[2::-1]  # first victim first: the tail of the chain
    # One block of pressure evicts exactly one of A's: the chain's head must survive it.
    s.add(GenRequest("B", toks(24, 300), 1))  # 7 blocks: 5 free + 1 evicted + 1 promised
    engine.step()
    assert [led.pool.index.get(d) for d in digests] == [table[0], table[1], None]
    engine.drain()
    assert_drained(s)


def test_a_family_larger_than_max_running_ends_instead_of_waiting_forever() -> None:
    """n = 2 branches with max_running = 1: ``_admit`` stops at ``len(live) + len(unit) >
    max_running`` (scheduler.py:299) every step, so the request is never admitted, never rejected,
    and blocks the queue behind it for good. It should end with a 'never' reason like a request
    larger than the pool."""
    led = KVLedger(8, BS)
    s = Scheduler(led, SchedulerConfig(policy="full", max_running=1))
    s.add(GenRequest("pair", toks(3, 100), 2, n=2))
    s.add(GenRequest("next", toks(3, 200), 2))
    engine = FakeEngine(s)
    for _ in range(20):
        if not s.has_work():
            break
        engine.step()
    assert not s.has_work(), "the request with n > max_running is still waiting"
    assert all(b.finish_reason.startswith("never") for b in s.branches("pair"))
    assert s.branches("next")[0].finish_reason == "length"
    assert_drained(s)


@pytest.mark.parametrize("cfg", [
    SchedulerConfig(policy="incremental", watermark=0.25),  # keeps int(0.25 x 8) = 2 blocks free
    SchedulerConfig(policy="full", on_growth_failure="headroom", headroom_blocks=1),
])
def test_kept_free_blocks_do_not_starve_a_request_that_fits_the_pool(cfg: SchedulerConfig) -> None:
    """A request that fits the whole pool (so admission does not say 'never') but needs more than
    ``num_blocks - keep_free`` blocks is 'not now' forever, even with the pool empty: the watermark /
    headroom (scheduler.py:46-48, passed to every ``ledger.admit``) is reserved for growth of running
    requests, and there are none. It waits for good at the head of the queue."""
    led = KVLedger(8, BS)
    s = Scheduler(led, cfg)
    s.add(GenRequest("wide", toks(28, 100), 4))  # 7 prompt blocks + 1 for the output: 8 = the pool
    engine = FakeEngine(s)
    for _ in range(20):
        if not s.has_work():
            break
        engine.step()
    assert not s.has_work(), "a request that fits the empty pool is waiting forever"
    assert s.branches("wide")[0].finish_reason is not None
    assert_drained(s)


def sample_all(plan: StepPlan, token: int) -> dict[str, list[int]]:
    return {w.seq_id: [token] for w in (*plan.prefills, *plan.decodes) if w.sample}


def test_waiting_queue_empty_popleft_message_and_index_one_is_the_second_unit() -> None:
    """``q[1]`` is the second unit, not the head; popping an empty queue says it is empty."""
    q = WaitingQueue()
    with pytest.raises(IndexError, match=r"^the waiting queue is empty$"):
        q.popleft()

    def unit(rid: str) -> list:
        return [type("B", (), {"request": GenRequest(rid, [1], 1)})()]

    a, b, c = unit("a"), unit("b"), unit("c")
    for u in (a, b, c):
        q.append(u)
    assert q[0] is a and q[1] is b and q[2] is c


def test_a_decode_with_one_draft_slot_spends_two_tokens_of_the_budget() -> None:
    """token_budget=4. X (3-token prompt, lookahead=1) decodes in step 2: its token plus one draft slot,
    2 tokens. Y, admitted that step, gets the 4 - 2 = 2 tokens left as its first prefill chunk."""
    s = Scheduler(KVLedger(32, BS), SchedulerConfig(policy="full", token_budget=4))
    s.add(GenRequest("X", toks(3, 100), 8, lookahead=1))
    engine = FakeEngine(s)
    engine.step()
    s.add(GenRequest("Y", toks(8, 200), 4))
    plan = engine.step()
    assert plan.admitted == ["Y"]
    assert [(w.seq_id, w.start, w.end, w.lookahead) for w in plan.works] == [("Y", 0, 2, 0), ("X", 3, 4, 1)]
    assert plan.num_tokens == 4


def test_forget_of_an_unfinished_request_says_it_is_not_finished() -> None:
    s = Scheduler(KVLedger(8, BS))
    with pytest.raises(LedgerError, match=r"^request 'nope' is not finished$"):
        s.forget("nope")
    s.add(GenRequest("a", toks(3, 100), 2))
    with pytest.raises(LedgerError, match=r"request 'a' is not finished"):
        s.forget("a")


def test_decodes_keep_running_order_when_one_branch_finished_its_prefill_without_sampling() -> None:
    """With ``prefill_chunk=4``, "a" (5 prompt tokens) computes 4 in step 0 and "b" (3 tokens) all 3 and
    samples. In step 1 both decode one token; the plan lists them in running order, "a" first."""
    s = Scheduler(KVLedger(16, BS), SchedulerConfig(prefill_chunk=4))
    s.add(GenRequest("a", toks(5, 100), 3))
    s.add(GenRequest("b", toks(3, 200), 3))
    plan = s.schedule()
    assert [(w.request_id, w.start, w.end) for w in plan.prefills] == [("a", 0, 4), ("b", 0, 3)]
    s.confirm(plan, sample_all(plan, 7))
    plan = s.schedule()
    assert [(w.request_id, w.start, w.end) for w in plan.decodes] == [("a", 4, 5), ("b", 3, 4)]
    assert plan.prefills == []


def test_a_copy_on_write_copy_of_a_running_request_is_owned_by_it() -> None:
    """Two branches share the partial tail of a 7-token prompt; their first decode copies it once (3
    tokens) for branch "A": ``transfer_owners`` names "A" as the owner of that copy."""
    s = Scheduler(KVLedger(16, BS))
    s.add(GenRequest("A", toks(7, 10), 2, n=2))
    plan = s.schedule()
    s.confirm(plan, sample_all(plan, 7))
    plan = s.schedule()
    assert len(plan.copies) == 1 and plan.copies[0].slots == 3
    assert s.transfer_owners(plan) == (["A"], [], [])


def _run_one(s: Scheduler, engine: FakeEngine, request: GenRequest) -> list[StepPlan]:
    s.add(request)
    plans = engine.drain()
    s.forget(request.request_id)
    return plans


def _offload(pool: int = 8, host: int = 8, **cfg: object) -> tuple[Scheduler, _TierEngine]:
    s = Scheduler(KVLedger(pool, BS), SchedulerConfig(offload_prefixes=True, writeback_blocks=0, **cfg),  # type: ignore[arg-type]
                  host=TierLedger([("host", host)]))
    return s, _TierEngine(s)


class _TierEngine(FakeEngine):
    """FakeEngine plus the tier transfers (tests/scheduler/test_scheduler_tiers.py has the full one): a tier slot
    holds what its device block held, so a wrong promotion shows up as a read of KV never written."""

    def run(self, plan: StepPlan) -> dict[str, list[int]]:
        for b, slot in (*plan.demote, *plan.writeback):
            self.host[slot] = list(self.block(b))
        for slot, d in plan.promote:
            assert slot in self.host, f"step {plan.step}: tier slot {slot} promoted but never written"
            self.dev[d] = list(self.host[slot])
        for src, dst in plan.tier_moves:
            self.host[dst] = list(self.host[src])
        return super().run(plan)


def test_sampled_tokens_must_come_back_for_every_sampling_work() -> None:
    s = Scheduler(KVLedger(16, BS), SchedulerConfig(policy="full"))
    s.add(GenRequest("a", toks(3, 0), 4))
    plan = s.schedule()
    with pytest.raises(LedgerError, match="'a' was scheduled to sample but no token came back"):
        s.confirm(plan, {})


def test_auto_recovery_swaps_only_when_strictly_cheaper_and_nothing_to_replay_costs_nothing() -> None:
    """1 FLOP per token at 1 FLOP/s; blocks of 1 byte over a 1 B/s link with no per-round overhead: a
    recompute costs its replay tokens in seconds, a swap 2 x its blocks (out and back)."""
    costs = RecoveryCosts(flops_per_token=1.0, flops_per_s=1.0, block_bytes=1,
                          transfer=TransferModel(link_Bps=1.0, overhead_s=0.0, staging_blocks=64))
    assert costs.choose(4, 2) == ("recompute", 4.0, 4.0)  # a tie keeps the request off the host tier
    assert costs.choose(5, 2) == ("swap", 5.0, 4.0)
    assert costs.choose(3, 2) == ("recompute", 3.0, 4.0)
    # A victim whose every token sits in blocks others keep replays nothing: recompute is free.
    assert RecoveryCosts().recompute_s(0) == 0.0 and RecoveryCosts().recompute_s(-3) == 0.0
    assert RecoveryCosts().choose(0, 1)[0] == "recompute"


def test_the_first_request_admitted_comes_back_as_a_readmission() -> None:
    """The first request ever admitted has admission order 0; requeued before it sampled anything, it is
    still a readmission (counted apart by the ledger, reported so in the plan), not a fresh request."""
    led = KVLedger(16, BS)
    s = Scheduler(led, SchedulerConfig(prefill_chunk=4, token_budget=4))
    s.add(GenRequest("a", toks(10, 100), 2))
    engine = FakeEngine(s)
    first = engine.step()
    assert first.admissions == [Admission("a", 0, False)]
    assert [(w.start, w.end, w.sample) for w in first.prefills] == [(0, 4, False)]
    assert s.requeue("a")
    again = engine.step()
    assert again.admissions == [Admission("a", 4, True)]  # its one full written block is a prefix hit
    assert [(w.start, w.end) for w in again.prefills] == [(4, 8)]
    engine.drain()
    assert (led.counters.admitted, led.counters.readmitted) == (1, 1)
    assert led.stats()["prefix_cache_readmissions"]["hit_tokens"] == 4
    assert_drained(s)


@pytest.mark.parametrize("restore_ahead", [False, True])
def test_a_fresh_request_gets_its_prefix_promoted_from_the_tier_below(restore_ahead: bool) -> None:
    """With offload_prefixes, a fresh request whose prompt blocks were demoted gets them promoted back at
    its admission, and counts them as cached; with restore_ahead it computes from the next step."""
    s, engine = _offload(restore_ahead=restore_ahead)
    _run_one(s, engine, GenRequest("A", toks(16, 0), 2))  # 4 full prompt blocks cached on the device
    _run_one(s, engine, GenRequest("B", toks(24, 500), 2))  # evicts 3 of A's: demoted to the host tier
    assert len(s.host.index) == 3
    s.add(GenRequest("C", toks(16, 0) + toks(3, 900), 2))
    s.add(GenRequest("D", toks(2, 950), 2))  # admitted in the same step, behind C
    plans = engine.drain()
    admit = plans[0]
    assert admit.admitted == ["C", "D"]
    assert len(admit.promote) == 3 and admit.admissions == [Admission("C", 16, False), Admission("D", 0, False)]
    assert s.ledger.counters.promoted_blocks == 3 and s.promoted_tokens == 12
    assert sum(w.end - w.start for p in plans for w in p.prefills if w.seq_id == "C") == 3  # only its new tokens
    assert [w.seq_id for w in admit.works] == (["D"] if restore_ahead else ["C", "D"])
    s.check()


@pytest.mark.parametrize("restore_ahead", [False, True])
def test_a_requeued_request_gets_its_demoted_prefix_promoted_when_it_comes_back(restore_ahead: bool) -> None:
    """A recomputed family (not a swapped one) may find its prompt below the device when it comes back."""
    s, engine = _offload(restore_ahead=restore_ahead)
    s.add(GenRequest("A", toks(16, 0), 3))
    assert engine.step().admissions == [Admission("A", 0, False)]
    assert s.requeue("A")
    s.add(GenRequest("B", toks(24, 500), 2, priority=1))  # goes first and evicts A's cached blocks
    plans = engine.drain()
    assert plans[0].admitted == ["B"] and len(plans[0].demote) == 2
    back = next(p for p in plans if "A" in p.admitted)
    assert back.admissions == [Admission("A", 16, True)] and len(back.promote) == 3
    assert s.ledger.counters.promoted_blocks == 3 and s.promoted_tokens == 12
    assert all(w.start >= 16 for p in plans for w in (*p.prefills, *p.decodes) if w.seq_id == "A")
    assert [w.seq_id for w in back.works] == ([] if restore_ahead else ["A"])
    s.check()


def test_a_readmitted_family_leaves_the_headroom_free_while_others_run() -> None:
    """The headroom kept for the growth of running requests also holds back a readmission."""
    led = KVLedger(13, BS)
    s = Scheduler(led, SchedulerConfig(policy="incremental", watermark=0, on_growth_failure="headroom",
                                       headroom_blocks=3))
    s.add(GenRequest("X", toks(4, 0), 40))
    s.add(GenRequest("A", toks(8, 100), 20))
    engine = FakeEngine(s)
    assert engine.step().admitted == ["X", "A"]
    assert s.requeue("A")
    s.add(GenRequest("Z", toks(20, 700), 2, priority=1))  # admitted first
    plan = engine.step()
    assert plan.admitted == ["Z"]  # A would eat into the headroom kept for X's growth: it waits
    u = led.usage()
    assert u.free == 4 and u.evictable == 2
    engine.drain()
    assert [br.finish_reason for br in s.finished["A"]] == ["length"]
    assert_drained(s)


@pytest.mark.parametrize("clear_cache", [False, True])
def test_a_swap_restore_counts_its_prefix_hits_and_resumes_at_the_pending_token(clear_cache: bool) -> None:
    """tests/scheduler/test_scheduler.py's swap scenario: V (12 tokens in the ledger, 3 full blocks) comes back in
    step 12, with 2 blocks still cached on the device (or none, cache cleared): those are counted as
    cached and need no transfer, the rest is swapped in (and timed), and V computes only its pending
    position 11 and the sampled token after it -- nothing before is recomputed."""
    s, _engine, _snap, plans, back = swap_scenario(clear_cache)
    restore = plans[12]
    assert restore.admitted == ["V"]
    hits = 0 if clear_cache else 2
    assert back.hit_blocks == hits
    assert restore.admissions == [Admission("V", hits * BS, True)]
    assert len(restore.swap_in) == 3 - hits
    assert restore.transfer_wait_s == pytest.approx(
        TransferModel().time_s(3 - hits, RecoveryCosts().block_bytes, "in"))
    assert [(w.seq_id, w.start, w.end) for w in plans[13].works] == [("V", 11, 13)]
    assert_drained(s)


def test_a_swap_restore_with_every_block_still_cached_counts_all_but_the_last_token() -> None:
    """Same two requests, but G is cancelled right after it swapped V out: V's three full blocks stay cached,
    so V comes back with no transfer at all and 11 cached tokens (the last one is always computed)."""
    led = KVLedger(6, BS)
    s = Scheduler(led, SchedulerConfig(policy="incremental", victim="latest", recovery="swap", watermark=0.0),
                  host=HostPool(8))
    s.add(GenRequest("G", toks(4, 100), 12))
    s.add(GenRequest("V", toks(6, 200), 9))
    engine = FakeEngine(s)
    plans = []
    while s.has_work():
        plans.append(engine.step())
        if plans[-1].swap_out:
            assert plans[-1].step == 7 and len(plans[-1].swap_out) == 3
            s.cancel("G")
    restore = plans[8]
    assert restore.admissions == [Admission("V", 11, True)] and restore.swap_in == []
    assert restore.transfer_wait_s == 0
    assert [(w.seq_id, w.start, w.end) for w in plans[9].works] == [("V", 12, 13)]
    assert [br.finish_reason for br in s.finished["V"]] == ["length"]
    assert_drained(s)


def test_max_running_caps_the_admissions_of_a_step_and_of_later_steps() -> None:
    s = Scheduler(KVLedger(32, BS), SchedulerConfig(max_running=2))
    for rid in "abc":
        s.add(GenRequest(rid, toks(3, 10 * ord(rid)), 4))
    engine = FakeEngine(s)
    assert engine.step().admitted == ["a", "b"]  # c waits: two run already
    s.add(GenRequest("d", toks(3, 999), 4))
    assert engine.step().admitted == []  # still two running
    plans = engine.drain()
    assert [p.admitted for p in plans if p.admitted] == [["c", "d"]]
    assert_drained(s)


def test_a_family_of_exactly_max_running_branches_is_admitted() -> None:
    s = Scheduler(KVLedger(8, BS), SchedulerConfig(max_running=2))
    s.add(GenRequest("n2", toks(2, 0), 3, n=2))
    s.add(GenRequest("n3", toks(2, 50), 3, n=3))
    plan = s.schedule()
    assert plan.admitted == ["n2"]
    assert plan.ended == [(sid, "never: more branches than max_running") for sid in ("n3", "n3/1", "n3/2")]


def test_admission_stops_when_the_step_token_budget_is_spent() -> None:
    s = Scheduler(KVLedger(32, BS), SchedulerConfig(token_budget=4, prefill_chunk=4))
    s.add(GenRequest("a", toks(4, 0), 2))
    s.add(GenRequest("b", toks(4, 100), 2))
    engine = FakeEngine(s)
    first = engine.step()
    assert first.admitted == ["a"] and [(w.seq_id, w.start, w.end) for w in first.works] == [("a", 0, 4)]
    assert engine.step().admitted == ["b"]
    engine.drain()
    assert_drained(s)


def test_a_prompt_cached_whole_still_computes_its_last_token() -> None:
    s = Scheduler(KVLedger(8, BS), SchedulerConfig())
    engine = FakeEngine(s)
    s.add(GenRequest("a", toks(8, 0), 2))
    engine.drain()
    s.add(GenRequest("b", toks(8, 0), 2))  # both prompt blocks cached and written
    plan = engine.step()
    assert plan.admissions == [Admission("b", 7, False)]
    assert [(w.seq_id, w.start, w.end, w.sample) for w in plan.works] == [("b", 7, 8, True)]
    engine.drain()
    assert [br.finish_reason for br in s.finished["b"]] == ["length"]
    assert_drained(s)


def test_a_family_of_max_running_branches_too_big_for_the_pool_is_told_it_is_the_pool() -> None:
    s = Scheduler(KVLedger(4, BS), SchedulerConfig(max_running=2))
    s.add(GenRequest("big", toks(20, 0), 3, n=2))
    assert s.schedule().ended == [("big", "never: larger than the whole pool"),
                                  ("big/1", "never: larger than the whole pool")]


def test_a_swap_restore_is_timed_on_the_inbound_link() -> None:
    """The restore's link time uses the tier -> device rate (``in_link_Bps``), not the outbound one."""
    link = TransferModel(link_Bps=10e9, in_link_Bps=2e9)
    costs = RecoveryCosts(transfer=link)
    led = KVLedger(6, BS)
    s = Scheduler(led, SchedulerConfig(policy="incremental", victim="latest", recovery="swap", watermark=0.0),
                  host=HostPool(8), costs=costs)
    s.add(GenRequest("G", toks(4, 100), 12))
    s.add(GenRequest("V", toks(6, 200), 9))
    engine = FakeEngine(s)
    plans = []
    while s.has_work():
        plans.append(engine.step())
        if plans[-1].swap_out:
            led.clear_cache()  # every block comes back from the host
    (out,) = [p for p in plans if p.swap_out]
    (back,) = [p for p in plans if p.swap_in]
    assert out.transfer_wait_s == pytest.approx(link.time_s(3, costs.block_bytes, "out"))
    assert back.transfer_wait_s == pytest.approx(link.time_s(3, costs.block_bytes, "in"))
    assert link.time_s(3, costs.block_bytes, "in") > link.time_s(3, costs.block_bytes, "out")
    assert_drained(s)


def test_a_prefill_of_a_request_cancelled_mid_step_does_not_stop_the_others_being_confirmed() -> None:
    from kvledger.scheduler import GenRequest, Scheduler, SchedulerConfig
    s = Scheduler(KVLedger(16, BS), SchedulerConfig(policy="full", prefill_chunk=4, token_budget=16))
    for rid, base in (("a", 100), ("b", 200)):
        s.add(GenRequest(rid, toks(8, base), 2))
    engine = FakeEngine(s)
    plan = s.schedule()
    assert [w.seq_id for w in plan.prefills] == ["a", "b"]
    sampled = engine.run(plan)
    assert s.cancel("a")  # between the executor and confirm, as the driver applies cancels
    s.confirm(plan, sampled)
    assert s.branches("b")[0].computed == 4
    s.check()


def test_a_swap_that_falls_back_to_recompute_keeps_why_it_preempted() -> None:
    s, engine = victim_scenario("latest", recovery="swap", host=None)
    plans = [engine.step() for _ in range(5)]
    assert [(p.request_id, p.reason) for p in plans[4].preempted] == [
        ("D", "B needed a block; host pool cannot hold the blocks, recomputing instead"),
        ("C", "C needed a block; host pool cannot hold the blocks, recomputing instead")]
