"""State groups (Mamba-2 / gated-delta-net layers) in the scheduler's hybrid pool (`KVLedger(kv_groups=...)`,
`core.windows.GroupTables`): admission reserves one block per state group per request in its one decision, the block
holds the request's state from its first work to its end (freed at finish and on preemption by recompute; on swap the
state goes to the host and comes back only to resume exactly where it stood), a state group that caches no state caps
every prefix hit to 0, and `check()` states its law. The fuzz runs an executor that keeps each state block's content
(the tokens its state has taken in): a work reads a state that stands exactly at its start, or starts from 0."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.core import KVLedger, Request
from kvledger.core.groups import NULL_BLOCK, KVCacheGroup, longest_hit
from kvledger.errors import InvariantError, LedgerError
from kvledger.scheduler import GenRequest, Scheduler, SchedulerConfig
from kvledger.scheduler.driver import Driver
from kvledger.scheduler.execution import ConstantExecutor
from kvledger.scheduler.replica import Replica

BS = 4
WINDOW = 8
# Granite-4.0-H / Qwen3-Next style: attention groups beside two state groups (each layer's fixed state one page).
GROUPS = (KVCacheGroup("full", 2), KVCacheGroup("sliding", 2, WINDOW), KVCacheGroup("state", 2),
          KVCacheGroup("state", 2))
STATES = (2, 3)  # the state groups' places in a work's tables
FUZZ_SEEN = {"preemptions": 0, "restored states": 0}  # what the fuzz exercised (read when tuning it)


def _ledger(num_blocks: int = 256, *, prefix_caching: bool = False, groups=GROUPS) -> KVLedger:  # type: ignore[no-untyped-def]
    return KVLedger(num_blocks, BS, prefix_caching=prefix_caching, kv_groups=groups, step_tokens=16)


class StateExecutor(ConstantExecutor):
    """Keeps what each state block holds (the tokens its state has taken in) through works, swap-outs and swap-ins,
    and fails a work that reads a state standing elsewhere than its start -- the wrong output a user would get.
    Checks the ledger before every step and records every work's group tables."""

    def __init__(self, ledger: KVLedger) -> None:
        super().__init__()
        self.ledger = ledger
        self.state: dict[int, int] = {}  # device block -> tokens its state holds
        self.host: dict[int, int] = {}  # host block -> the same
        self.works: list[tuple[str, int, int, tuple[tuple[int, ...], ...]]] = []
        self.restored = 0  # states taken back from the host

    def execute(self, plan):  # type: ignore[no-untyped-def]
        self.ledger.check()
        for d, h in plan.swap_out:
            if d in self.state:
                self.host[h] = self.state[d]
        for h, d in plan.swap_in:
            if h in self.host:
                self.state[d] = self.host.pop(h)
                self.restored += 1
        live: set[int] = set()
        for w in plan.works:
            tables = tuple(tuple(t) for t in w.groups)
            self.works.append((w.seq_id, w.start, w.end, tables))
            for g in STATES:
                assert len(tables[g]) == 1 and tables[g][0] != NULL_BLOCK  # one block, whatever the length
                b = tables[g][0]
                assert b not in live  # no two works share a state
                live.add(b)
                if w.start:
                    assert self.state.get(b) == w.start, f"{w.seq_id} reads a state at {self.state.get(b)}"
                self.state[b] = w.end
        return super().execute(plan)


def test_admission_reserves_one_block_per_state_group_in_the_one_decision() -> None:
    """40 tokens, 4-token blocks, 16-token steps: full 10 blocks, sliding min(10, ceil((8 - 1 + 16) / 4) + 1) = 7,
    each state group 1: 19 blocks, all promised by the one admission; a pool of 18 never takes it, and a second
    request that does not fit promises nothing."""
    assert _ledger(18).admit(Request("a", list(range(30)), 10)).outcome.value == "never"
    ledger = _ledger(30)
    d = ledger.admit(Request("a", list(range(30)), 10))
    assert d.admitted and d.blocks_total == 10 + 7 + 1 + 1
    # The first group allocates the prompt's 8 blocks at admission; everything else is promised.
    assert (ledger.usage().active, ledger.usage().promised) == (8, 11) and ledger.groups.need(40) == 7 + 1 + 1
    ledger.check()
    refused = ledger.admit(Request("b", list(range(30)), 10))
    assert not refused.admitted and (ledger.usage().active, ledger.usage().promised) == (8, 11)
    assert "b" not in ledger.groups.seqs
    tables = ledger.group_tables("a", 0, 16)
    assert [len(t) for t in tables] == [8, 4, 1, 1]  # the state groups' one block each, from their promise
    assert (ledger.usage().active, ledger.usage().promised) == (8 + 4 + 1 + 1, 11 - 4 - 1 - 1)
    ledger.check()
    ledger.release("a")
    ledger.check()
    assert ledger.usage().active == 0 and ledger.usage().promised == 0


def test_a_requests_state_block_is_its_own_for_its_whole_life_and_freed_at_the_end() -> None:
    ledger = _ledger()
    sched = Scheduler(ledger, SchedulerConfig(token_budget=16, prefill_chunk=16))
    ex = StateExecutor(ledger)
    reqs = [GenRequest(f"r{i}", list(range(i, i + 30)), 20) for i in range(3)]
    metrics = Driver(sched, ex, check_every=1).run(reqs)
    assert sorted(m.generated for m in metrics) == [20] * 3
    for rid in ("r0", "r1", "r2"):
        mine = {tables[g] for seq, _s, _e, tables in ex.works if seq == rid for g in STATES}
        assert len(mine) == 2  # one block per state group, the same in every work of the request
    assert ledger.usage().active == 0 and ledger.usage().promised == 0 and ledger.groups.seqs == {}


def test_a_state_group_that_caches_no_state_makes_a_prefix_hit_recompute() -> None:
    """The second prompt shares 40 tokens with the first, which finished: without a state group the hit is 10
    blocks (it computes from 40); with one, no state was cached at any block boundary, so the hit every group
    serves is 0 and it computes from 0 -- never from a state that is not there."""
    head = list(range(100, 140))
    starts = {}
    for name, groups in (("attention", GROUPS[:2]), ("with state", GROUPS)):
        ledger = _ledger(prefix_caching=True, groups=groups)
        for rid, tail in (("a", [1, 2, 3, 4]), ("b", [5, 6, 7, 8, 9])):
            sched = Scheduler(ledger, SchedulerConfig(token_budget=16, prefill_chunk=16))
            seen: list[int] = []

            class First(ConstantExecutor):
                def execute(self, plan):  # type: ignore[no-untyped-def]
                    ledger.check()  # noqa: B023 -- read while this run steps
                    seen.extend(w.start for w in plan.works)  # noqa: B023
                    return super().execute(plan)

            Driver(sched, First(), check_every=1).run([GenRequest(rid, head + tail, 6)])
            starts[name] = seen[0]
        ledger.check()
        assert ledger.usage().active == 0 and ledger.usage().promised == 0
    assert starts == {"attention": 40, "with state": 0}


def test_the_hit_rule_takes_a_state_cached_at_a_block_boundary() -> None:
    """`longest_hit` (the one owner of the rule): a state group serves n blocks only with the state after block
    n - 1 cached ('align' mode); the hit drops to the last such boundary, and a sliding group is asked again there.
    Full: blocks 0-9 cached; state: states after blocks 3 and 6; sliding (W = 8, 2 blocks): block 5 missing."""
    groups = (KVCacheGroup("full"), KVCacheGroup("sliding", 1, WINDOW), KVCacheGroup("state"))
    cache = {0: set(range(10)), 1: set(range(10)) - {5}, 2: {3, 6}}

    def cached(g: int, j: int) -> int | None:
        return 100 * g + j if j in cache[g] else None

    # The state caps 10 at 7 (state after block 6); the sliding group needs [5, 7) there, lacks 5: 5; the state
    # caps 5 at 4 (state after block 3); the sliding group needs [2, 4): cached. Hit: 4 blocks.
    hit, taken = longest_hit(groups, cached, 10, BS)
    assert hit == 4 and taken == [[0, 1, 2, 3], [102, 103], [203]]
    cache[2] = set()
    assert longest_hit(groups, cached, 10, BS) == (0, [[], [], []])


def test_a_swap_takes_the_state_out_and_back_only_to_resume_where_it_stood() -> None:
    """After a work over [0, 16) the states stand at 16: the swap-out's entries name that position; the restore at
    16 copies each state back into a fresh block of its group, one at 15 (a state cannot go back) gives up and
    empties every group's table (recompute from 0)."""
    ledger = _ledger()
    ledger.admit(Request("a", list(range(30)), 10)).raise_for_outcome()
    ledger.group_tables("a", 0, 16)
    entries = ledger.group_entries("a")
    assert [(g, j) for g, j, _b in entries if g in STATES] == [(2, 16), (3, 16)]
    host = {(g, j): 500 + k for k, (g, j, _b) in enumerate(entries)}
    ledger.preempt("a")
    ledger.check()
    for at, back in ((16, True), (15, False)):
        ledger.admit(Request("a", list(range(30)), 10)).raise_for_outcome()
        copies = ledger.restore_group_tables("a", at, host)
        ledger.check()
        if back:
            assert copies is not None
            states = ledger.groups.seqs["a"].tables[1:]
            assert [(host[(g, 16)], states[g - 2][0]) for g in STATES] == [c for c in copies if c[0] in
                                                                             (host[(2, 16)], host[(3, 16)])]
            ledger.group_tables("a", 16, 30)  # resumes where it stood
            with pytest.raises(LedgerError, match="state"):
                ledger.group_tables("a", 16, 17)  # ... and never from a state that moved on
        else:
            assert copies is None and ledger.groups.seqs["a"].tables == [[], [], []]
            ledger.group_tables("a", 0, 16)  # it computes from 0
        ledger.check()
        ledger.release("a")
        ledger.check()
    assert ledger.usage().active == 0 and ledger.usage().promised == 0


def test_a_swapped_request_resumes_from_its_state_never_from_0() -> None:
    """With a host pool, the scheduler swaps victims: every state comes back and its request resumes exactly where
    the state stood -- also a decoding request whose sampled token was not yet in the ledger (the scheduler would
    otherwise recompute its last token, which a state cannot take twice, and so the whole request) -- so no request
    computes from 0 twice."""
    cfg = SchedulerConfig(policy="incremental", on_growth_failure="preempt", recovery="swap", token_budget=16,
                          prefill_chunk=16)
    replica = Replica.assemble(60, BS, cfg, host_blocks=200, prefix_caching=False, kv_groups=GROUPS)
    ledger = replica.ledger
    ex = StateExecutor(ledger)
    reqs = [GenRequest(f"r{i}", list(range(i, i + 20)), 30) for i in range(6)]
    metrics = Driver(replica.scheduler, ex, check_every=1).run(reqs)
    ledger.check()
    assert sorted(m.generated for m in metrics) == [30] * 6
    assert replica.scheduler.preemptions > 0 and ex.restored >= 2 * replica.scheduler.preemptions
    starts = [seq for seq, start, _end, _t in ex.works if start == 0]
    assert sorted(starts) == [f"r{i}" for i in range(6)]  # one work from 0 each: none recomputed
    assert ledger.usage().active == 0 and ledger.usage().promised == 0


def test_the_audit_catches_a_state_block_handed_back_early() -> None:
    ledger = _ledger()
    ledger.admit(Request("a", list(range(30)), 10)).raise_for_outcome()
    ledger.group_tables("a", 0, 16)
    ledger.check()
    gs = ledger.groups.seqs["a"]
    b = gs.tables[1].pop()  # the state leaves while the request still runs, its promise given back
    gs.held[1] -= 1
    gs.promised[1] += 1
    ledger.groups.total += 1
    ledger.promises.claim(1)
    ledger.pool.release(b)
    with pytest.raises(InvariantError, match="state group"):
        ledger.check()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), recovery=st.sampled_from(["swap", "recompute"]),
       policy=st.sampled_from(["incremental", "full"]), blocks=st.integers(26, 60),
       host=st.sampled_from([0, 10, 200]), prefix=st.booleans())
def test_fuzz_state_sliding_and_full_groups_through_the_scheduler(seed: int, recovery: str, policy: str,
                                                                 blocks: int, host: int, prefix: bool) -> None:
    """Random workloads (shared heads, lengths past the window, preemption by recompute and by swap) through the
    real scheduler over full + sliding + two state groups: the audit holds before every step, every work reads a
    state that stands at its start, every request finishes with its tokens, and nothing is left held or
    promised."""
    rng = random.Random(seed)
    cfg = SchedulerConfig(policy=policy, on_growth_failure="preempt", recovery=recovery, token_budget=16,
                          prefill_chunk=16)
    replica = Replica.assemble(blocks, BS, cfg, host_blocks=host, prefix_caching=prefix, kv_groups=GROUPS)
    head = [rng.randint(0, 9) for _ in range(12)]
    reqs = [GenRequest(f"r{i}", (head if rng.random() < 0.5 else []) + [rng.randint(0, 9)
                                                                      for _ in range(rng.randint(1, 24))],
                       rng.randint(1, 30)) for i in range(rng.randint(2, 12))]
    ledger = replica.ledger
    ex = StateExecutor(ledger)
    metrics = Driver(replica.scheduler, ex, check_every=1).run(reqs)
    ledger.check()
    FUZZ_SEEN["preemptions"] += replica.scheduler.preemptions
    FUZZ_SEEN["restored states"] += ex.restored
    assert sorted((m.request_id, m.generated) for m in metrics) == sorted((r.request_id, r.max_new_tokens)
                                                                         for r in reqs)
    assert ledger.usage().active == 0 and ledger.usage().promised == 0 and ledger.groups.seqs == {}


def test_a_fork_on_a_pool_with_state_groups_is_refused_and_changes_nothing() -> None:
    """A state is its sequence's own (never shared): a fork would need a copy of each state, not built yet, so it is
    refused in one error before anything is promised; admitting n branches (each its own state) still works."""
    ledger = _ledger(64)
    ledger.admit(Request("a", list(range(10)), 6))
    before = ledger.usage()
    with pytest.raises(LedgerError, match="state groups"):
        ledger.fork("a", "a-1")
    assert ledger.usage() == before
    ledger.check()
    assert ledger.admit(Request("b", list(range(10)), 6, branches=2)).outcome.value == "admitted"
    ledger.check()
