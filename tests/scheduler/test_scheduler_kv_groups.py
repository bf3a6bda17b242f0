"""The real scheduler over a hybrid KV pool (`KVLedger(kv_groups=...)`, `core.windows.GroupTables`): admission
charges a sliding group only its window, every work carries one block table per group, the sliding groups' blocks
leave while requests run, and preemption recomputes; a uniform pool's plans are unchanged."""

from __future__ import annotations

import pytest

from kvledger.core import KVLedger, Request
from kvledger.core.groups import NULL_BLOCK, KVCacheGroup
from kvledger.errors import ConfigError, InvariantError, LedgerError
from kvledger.scheduler import GenRequest, Scheduler, SchedulerConfig
from kvledger.scheduler.driver import Driver
from kvledger.scheduler.execution import ConstantExecutor

BS = 4
WINDOW = 8
GROUPS = (KVCacheGroup("full", 2), KVCacheGroup("sliding", 2, WINDOW), KVCacheGroup("sliding", 2, WINDOW))


def _hybrid(num_blocks: int = 256, step: int = 16) -> KVLedger:
    return KVLedger(num_blocks, BS, prefix_caching=False, kv_groups=GROUPS, step_tokens=step)


class Recorder(ConstantExecutor):
    """Records every work's group tables, checks the ledger each step, and samples token 7."""

    def __init__(self, ledger: KVLedger) -> None:
        super().__init__()
        self.ledger = ledger
        self.works: list = []
        self.held: list[list[int]] = []

    def execute(self, plan):  # type: ignore[no-untyped-def]
        self.ledger.check()
        for w in plan.works:
            self.works.append((w.seq_id, w.start, w.end, tuple(tuple(t) for t in w.groups)))
        self.held.append(self.ledger.groups.held_by_group())
        return super().execute(plan)


def _run(ledger: KVLedger, requests: list[GenRequest], config: SchedulerConfig | None = None):
    sched = Scheduler(ledger, config or SchedulerConfig(token_budget=16, prefill_chunk=16))
    ex = Recorder(ledger)
    metrics = Driver(sched, ex, check_every=1).run(requests)
    ledger.check()
    return sched, ex, metrics


def test_every_work_carries_each_groups_table_and_the_window_groups_let_go_while_it_runs() -> None:
    ledger = _hybrid()
    sched, ex, metrics = _run(ledger, [GenRequest("a", list(range(30)), 40)])
    assert [m.generated for m in metrics] == [40]
    for _seq, start, end, tables in ex.works:
        full, *windows = tables
        assert len(tables) == 3 and len(full) * BS >= end  # the full group keeps every block
        for t in windows:
            first = max(0, start - WINDOW + 1) // BS
            assert all(b == NULL_BLOCK for b in t[:first])  # out of the window: no block
            assert all(b != NULL_BLOCK for b in t[first:-(-end // BS)])  # the window and the work: blocks
            assert not set(t) & set(full)  # distinct block ids from one pool
    # 70 tokens: the full group ends with 18 blocks; a window group holds at most its prefill bound (7 blocks for
    # 16-token chunks) and, once decoding, the decode step's (3) -- what a user sees as memory coming back.
    last_full = len(ex.works[-1][3][0])
    assert last_full == 18
    assert max(h for step in ex.held for h in step) <= GROUPS[1].reserved_blocks(70, BS, 16) == 7
    assert ex.held[-1] == [3, 3] and GROUPS[1].reserved_blocks(70, BS, 1) == 3
    assert ledger.usage().active == 0 and ledger.usage().promised == 0


def test_admission_charges_a_sliding_group_its_window_not_the_request() -> None:
    ledger = _hybrid(num_blocks=64)
    d = ledger.admit(Request("a", list(range(100)), 100))
    # 200 tokens: 50 full blocks; each sliding group min(50, ceil((8 - 1 + 16) / 4) + 1 = 7) blocks.
    assert d.admitted and d.blocks_total == 50 + 7 + 7
    ledger.check()
    # Charged as if every layer were global it would need 3 x 50 blocks: never in 64.
    never = ledger.admit(Request("b", list(range(200)), 100))
    assert never.outcome.value == "never" and "full-attention" in never.reason
    ledger.release("a")
    ledger.check()


def test_more_requests_run_at_once_than_a_uniform_pool_of_the_same_bytes_holds() -> None:
    """96 pages of one group = 32 blocks of a uniform pool (each three groups' pages). A request of 80 tokens
    reserves 20 uniform blocks (one runs at a time) but 20 + 7 + 7 = 34 hybrid pages while it prefills and
    20 + 3 + 3 = 26 once it decodes (the window's bound shrinks to a decode step's): three run at once."""
    reqs = [GenRequest(f"r{i}", list(range(i, i + 40)), 40) for i in range(8)]
    peaks = {}
    for name, ledger in (("hybrid", _hybrid(num_blocks=96)), ("uniform", KVLedger(32, BS, prefix_caching=False))):
        sched = Scheduler(ledger, SchedulerConfig(token_budget=16, prefill_chunk=16))
        seen: list[int] = []

        class Count(ConstantExecutor):
            def execute(self, plan):  # type: ignore[no-untyped-def]
                seen.append(len(sched.running))  # noqa: B023 -- read while this run steps
                return super().execute(plan)

        metrics = Driver(sched, Count(), check_every=1).run(reqs)
        assert len(metrics) == 8
        peaks[name] = max(seen)
    assert peaks == {"hybrid": 3, "uniform": 1}


def test_growth_failure_preempts_by_recompute_and_every_request_finishes() -> None:
    ledger = _hybrid(num_blocks=60)
    cfg = SchedulerConfig(policy="incremental", on_growth_failure="preempt", recovery="swap", token_budget=16,
                          prefill_chunk=16)
    reqs = [GenRequest(f"r{i}", list(range(i, i + 20)), 30) for i in range(6)]
    sched, ex, metrics = _run(ledger, reqs, cfg)
    assert sorted(m.request_id for m in metrics) == [f"r{i}" for i in range(6)]
    assert all(m.generated == 30 for m in metrics)
    assert sched.preemptions > 0  # swap asked for: a hybrid pool recomputes instead
    assert ledger.usage().active == 0 and ledger.usage().promised == 0


def test_a_uniform_pools_works_carry_no_group_tables() -> None:
    ledger = KVLedger(64, BS)
    sched = Scheduler(ledger, SchedulerConfig(token_budget=16, prefill_chunk=16))
    sched.add(GenRequest("a", list(range(10)), 3))
    plan = sched.schedule()
    assert [w.groups for w in plan.works] == [()]
    sched.confirm(plan, {"a": [7]})
    plan = sched.schedule()
    assert [w.groups for w in plan.decodes] == [()]


def test_what_a_hybrid_pool_does_not_take_yet_is_refused_in_one_error() -> None:
    ledger = _hybrid()
    sched = Scheduler(ledger, SchedulerConfig(token_budget=16, prefill_chunk=16))
    with pytest.raises(ConfigError, match="hybrid KV pool"):
        sched.add(GenRequest("l", [1, 2, 3], 2, lookahead=2))
    with pytest.raises(ConfigError, match="at most 16 tokens"):
        Scheduler(ledger, SchedulerConfig(token_budget=64, prefill_chunk=32))
    from kvledger.core.tiers import TierLedger

    with pytest.raises(ConfigError, match="hybrid KV pool demotes"):
        KVLedger(64, BS, kv_groups=GROUPS).attach_tiers(TierLedger([("host", 8)]))
    ledger.admit(Request("a", [1, 2, 3, 4, 5], 4)).raise_for_outcome()
    with pytest.raises(LedgerError, match="speculative"):
        ledger.reserve_lookahead("a", 2)


def test_the_audit_catches_a_window_block_kept_past_the_window() -> None:
    ledger = _hybrid()
    ledger.admit(Request("a", list(range(30)), 10)).raise_for_outcome()
    ledger.group_tables("a", 0, 16)
    ledger.mark_computed("a", 16)
    ledger.group_tables("a", 16, 30)
    ledger.check()
    gs = ledger.groups.seqs["a"]
    gs.nulled[0] = 0
    gs.tables[0][0] = gs.tables[0][2]  # a live block before the window
    with pytest.raises(InvariantError):
        ledger.check()



def test_a_request_cancelled_mid_step_keeps_its_window_blocks_until_the_step_is_confirmed() -> None:
    """The executor may still read a cancelled request's window blocks: they stay leased (not free for anyone)
    until the step that names them is confirmed."""
    ledger = _hybrid(num_blocks=64)
    sched = Scheduler(ledger, SchedulerConfig(token_budget=16, prefill_chunk=16))
    sched.add(GenRequest("a", list(range(12)), 4))
    plan = sched.schedule()
    window = [b for t in plan.prefills[0].groups[1:] for b in t if b != NULL_BLOCK]
    assert window
    sched.cancel("a")
    assert all(ledger.pool.leased[b] and ledger.pool.ref[b] == 0 for b in window)
    assert not set(window) & set(ledger.pool._free)
    ledger.check()
    sched.confirm(plan, {"a": [7]})
    assert set(window) <= set(ledger.pool._free)
    ledger.check()


def test_a_prefix_hit_through_the_groups_is_the_longest_every_group_serves() -> None:
    """The second prompt shares 40 tokens (10 blocks) with the first, which has finished: the full group serves
    all 10 from the cache, the window groups only need their last blocks ([8, 10): W = 8), which they dropped out
    of the first request's window but kept as retained cache. So the second request computes from token 40, and
    its window tables start with the first's blocks."""
    ledger = KVLedger(256, BS, kv_groups=GROUPS, step_tokens=16)
    head = list(range(100, 140))
    _, ex_a, _ = _run(ledger, [GenRequest("a", head + [1, 2, 3, 4], 6)])
    a_windows = [t for _s, start, end, (_full, *ws) in ex_a.works if start == 32 for t in ws]
    assert ledger.usage().active == 0
    _, ex_b, metrics = _run(ledger, [GenRequest("b", head + [5, 6, 7, 8, 9], 6)])
    assert [m.generated for m in metrics] == [6]
    _seq, start, _end, (full, *windows) = ex_b.works[0]
    assert start == 40  # not 0: the hit every group agreed on
    assert ledger.stats()["prefix_cache"]["hit_blocks"] == 10
    for mine, theirs in zip(windows, a_windows, strict=True):
        assert mine[:8] == (NULL_BLOCK,) * 8  # out of the window at position 40: nothing taken
        assert mine[8:10] == theirs[8:10]  # the first request's window blocks, back from the retained cache
    assert ledger.usage().active == 0 and ledger.usage().promised == 0


def test_requests_sharing_a_head_at_once_hand_their_window_blocks_on() -> None:
    """Eight requests with one 24-token head run together; the ones admitted later hit the first's blocks (every
    group's), and as each one's window moves on the shared blocks pass to whoever still holds them: the audit
    holds every step, every request finishes and the pool ends empty of promises."""
    ledger = KVLedger(160, BS, kv_groups=GROUPS, step_tokens=16)
    head = list(range(50, 74))
    reqs = [GenRequest(f"r{i}", head + [i, i + 1, i + 2], 12) for i in range(8)]
    sched = Scheduler(ledger, SchedulerConfig(token_budget=16, prefill_chunk=16))
    ex = Recorder(ledger)
    metrics = Driver(sched, ex, check_every=1).run(reqs[:1])
    metrics += Driver(sched, ex, check_every=1).run(reqs[1:])
    ledger.check()
    assert sorted(m.generated for m in metrics) == [12] * 8
    assert ledger.stats()["prefix_cache"]["hit_blocks"] >= 7 * 6
    assert ledger.usage().active == 0 and ledger.usage().promised == 0


def test_a_window_groups_missing_block_caps_the_hit_below_it() -> None:
    """vLLM's rule: a sliding group that lost block 9 can serve a hit of 9 blocks (it needs [7, 9) there), so the
    whole hit is 9 blocks even though the full group has all 10."""
    ledger = KVLedger(256, BS, kv_groups=GROUPS, step_tokens=16)
    head = list(range(100, 140))
    _, ex_a, _ = _run(ledger, [GenRequest("a", head + [1, 2, 3, 4], 6)])
    lost = next(ws[0][9] for _s, start, _e, (_full, *ws) in ex_a.works if start == 32)
    ledger.pool.evict(lost)
    ledger.check()
    d = ledger.admit(Request("b", head + [5, 6, 7, 8, 9], 6))
    assert d.admitted and d.blocks_hit == 9
    assert ledger.ready_tokens("b") == 36
    tables = ledger.group_tables("b", 36, 45)
    assert tables[2][9] != NULL_BLOCK and tables[1][9] != lost
    ledger.check()
    ledger.release("b")
    ledger.check()


def test_a_swap_preemption_moves_every_groups_blocks_out_and_back() -> None:
    """With a host pool, a hybrid pool's victim is swapped, not recomputed: its full group's table and its window
    groups' live blocks go to the host, come back into fresh blocks of each group at the entries the window reads,
    and the request resumes where it was; the audit holds every step."""
    from kvledger.scheduler.replica import Replica

    cfg = SchedulerConfig(policy="incremental", on_growth_failure="preempt", recovery="swap", token_budget=16,
                          prefill_chunk=16)
    replica = Replica.assemble(60, BS, cfg, host_blocks=200, kv_groups=GROUPS)
    ledger = replica.ledger
    moved: list[tuple[int, int]] = []
    window_blocks: set[int] = set()

    class Swaps(Recorder):
        def execute(self, plan):  # type: ignore[no-untyped-def]
            window_blocks.update(b for w in plan.works for t in w.groups[1:] for b in t if b != NULL_BLOCK)
            moved.append((len(plan.swap_out), len(plan.swap_in)))
            swapped_window = [d for d, _h in plan.swap_out if d in window_blocks]
            if plan.swap_out:
                assert swapped_window  # the window groups' blocks travel with the full group's
            return super().execute(plan)

    reqs = [GenRequest(f"r{i}", list(range(i, i + 20)), 30) for i in range(6)]
    metrics = Driver(replica.scheduler, Swaps(ledger), check_every=1).run(reqs)
    ledger.check()
    assert sorted(m.generated for m in metrics) == [30] * 6
    assert replica.scheduler.preemptions > 0
    assert sum(o for o, _i in moved) > 0 and sum(i for _o, i in moved) > 0
    assert ledger.usage().active == 0 and ledger.usage().promised == 0


def test_a_restore_fills_the_window_entries_from_the_host_or_gives_up_on_a_missing_one() -> None:
    """After 30 tokens a window group (W = 8, 4-token blocks) reads entries 5 to 7: those come back from the host into
    fresh blocks; with entry 5's copy missing nothing comes back and every group's table is empty (recompute)."""
    ledger = _hybrid()
    prompt = list(range(30))
    for host in ({(g, j): 100 * g + j for g in (1, 2) for j in range(5, 8)}, {(1, 6): 16, (1, 7): 17}):
        ledger.admit(Request("a", prompt, 10)).raise_for_outcome()
        copies = ledger.restore_group_tables("a", 29, host)
        ledger.check()
        tables = ledger.groups.seqs["a"].tables
        if len(host) == 6:
            assert copies is not None and sorted(h for h, _b in copies) == sorted(host.values())
            for g in (1, 2):
                assert tables[g - 1][:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in tables[g - 1][5:8]
                assert {(100 * g + j, tables[g - 1][j]) for j in range(5, 8)} <= set(copies)
            ledger.group_tables("a", 29, 30)  # the work that resumes there
        else:
            assert copies is None and tables == [[], []]
            ledger.group_tables("a", 0, 16)  # it computes from 0
        ledger.check()
        ledger.release("a")
        ledger.check()
    assert ledger.usage().active == 0 and ledger.usage().promised == 0
