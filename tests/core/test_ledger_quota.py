"""Per-trust-group quotas and the group ledgers: admission refuses what would take a group past its cap
(not now / never, with a reason that speaks of the group's own blocks only), growth is charged up front,
one group at its cap never holds up another, and the group ledgers partition the pool (check())."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Outcome, Request
from kvledger.core.quota import GroupUsage
from kvledger.errors import ConfigError, InvariantError

A, B = CacheContext(trust_group="acme"), CacheContext(trust_group="globex")
PROMPT = list(range(1000, 3048))  # the seed's 2,048-token prompt


def seed_request(i: int, ctx: CacheContext = A, max_new: int = 257, **kw) -> Request:
    return Request(f"{ctx.trust_group}-{i}", PROMPT, max_new, ctx, **kw)


def test_the_seed_example_under_a_quota_counts_the_shared_prefix_once() -> None:
    # The seed's pool: 256 blocks of 16 tokens; each request needs 145 blocks, 128 of them the shared prompt.
    ledger = KVLedger(256, 16)
    ledger.set_quota("acme", 200)
    decisions = [ledger.admit(seed_request(i)) for i in range(5)]
    # 128 shared prompt blocks + 17 per request: 145, 162, 179, 196 fit under 200; a fifth would be 213.
    assert [d.outcome for d in decisions] == [Outcome.ADMITTED] * 4 + [Outcome.NOT_NOW]
    refused = decisions[-1]
    assert refused.over_quota
    assert refused.reason == ("needs 17 blocks of its trust group's quota of 200 blocks, of which 196 are held or "
                              "committed to its running requests now")
    assert ledger.group_usage("acme") == {"acme": GroupUsage(128, 68, 0, 200)}
    assert ledger.group_usage()["acme"].charged == 196
    assert ledger.counters.quota_refusals == {"acme": 1}
    ledger.check()
    # acme's cap is acme's alone: another tenant's request that fits the pool's 60 remaining blocks is
    # admitted (a 512-token prompt and 257 new tokens: 49 blocks); one that does not is refused by the pool.
    assert ledger.admit(Request("globex-0", list(range(512)), 257, B)).admitted
    other = ledger.admit(seed_request(1, B))
    assert other.outcome is Outcome.NOT_NOW and not other.over_quota
    ledger.release("globex-0")
    # A request acme finishes gives its 17 back: the fifth fits now.
    ledger.release("acme-0")
    assert ledger.admit(seed_request(4)).admitted
    ledger.check()


def test_a_request_larger_than_its_quota_is_never_with_a_tenant_safe_reason() -> None:
    ledger = KVLedger(256, 16)
    ledger.admit(seed_request(0, B))  # another tenant's state must not show in acme's reasons
    ledger.set_quota("acme", 144)
    d = ledger.admit(seed_request(0))
    assert d.outcome is Outcome.NEVER and d.over_quota
    assert d.reason == "needs 145 blocks (2048 + 257 tokens) but its trust group's quota is 144 blocks"
    for word in ("free", "evictable", "globex", "promised"):
        assert word not in d.reason
    assert ledger.can_admit(seed_request(0)).outcome is Outcome.NEVER
    assert ledger.counters.rejected_never == 1 and ledger.counters.quota_refusals == {"acme": 1}
    # With --max-new 256 it needs exactly 144 blocks: it fits the cap (once the pool has room for it).
    ledger.release("globex-0")
    assert ledger.admit(seed_request(1, max_new=256)).admitted
    ledger.check()


def test_growth_past_the_reservation_is_charged_up_front() -> None:
    """Incremental admission reserves nothing of the output, but the quota charges the declared maximum:
    the group's active + promised blocks can never pass its cap, and the charge stays constant while
    the request grows (a block moves from growth to active)."""
    ledger = KVLedger(64, 4)
    ledger.set_quota("acme", 10)
    first = ledger.admit(Request("a", [1] * 8, 16, A, reserve_new_tokens=0))  # 2 prompt blocks, 6 at most
    assert first.admitted and first.blocks_promised == 0
    assert ledger.group_usage("acme")["acme"] == GroupUsage(2, 0, 4, 10)
    second = ledger.admit(Request("b", [2] * 8, 16, A, reserve_new_tokens=0))
    assert second.outcome is Outcome.NOT_NOW and second.over_quota  # 6 + 6 > 10, though the pool has room
    seen = []
    for i in range(16):
        ledger.append_token("a", 5 + i)
        u = ledger.group_usage("acme")["acme"]
        seen.append((u.active, u.growth))
        assert u.charged == 6 and u.active + u.promised <= 10
        ledger.check()
    assert seen[-1] == (6, 0)  # grown to its whole declared length: every block active, no growth left
    ledger.release("a")
    assert ledger.admit(Request("b", [2] * 8, 16, A, reserve_new_tokens=0)).admitted


def test_branches_and_families_are_charged_and_capped() -> None:
    ledger = KVLedger(128, 4)
    ledger.set_quota("acme", 11)
    # 6 prompt tokens: 2 blocks (1 full + a partial tail); 4 new tokens -> 3 blocks each branch at most.
    # n=3: 2 held + 3 x 1 more + 2 tail copies = 7.
    d = ledger.admit(Request("n3", list(range(6)), 4, A, branches=3))
    assert d.admitted
    assert ledger.group_usage("acme")["acme"].charged == 7
    n2 = ledger.admit(Request("n2", list(range(100, 106)), 4, A, branches=2))  # 2 + 2 x 1 + 1 = 5 > 11 - 7
    assert n2.outcome is Outcome.NOT_NOW and n2.over_quota
    ledger.check()
    # A preempted family comes back under the same cap: after preemption it charges nothing...
    toks = {rid: ledger.preempt(rid) for rid in ["n3", "n3/1", "n3/2"]}
    assert ledger.group_usage("acme")["acme"].charged == 0
    family = [Request(rid, t, 4, A, family="n3", readmission=True) for rid, t in toks.items()]
    assert ledger.admit(Request("x", [9] * 4, 4, A)).admitted  # 2 blocks of acme's
    ledger.set_quota("acme", 8)
    refused = ledger.admit_family(family)  # ... and the family needs its 7 again: 2 + 7 > 8
    assert refused.outcome is Outcome.NOT_NOW and refused.over_quota
    ledger.set_quota("acme", 6)
    assert ledger.admit_family(family).outcome is Outcome.NEVER  # 7 > 6 on its own
    ledger.set_quota("acme", 8)
    ledger.release("x")
    assert ledger.admit_family(family).admitted
    assert ledger.group_usage("acme")["acme"].charged == 7
    ledger.check()


def test_a_quota_refusal_changes_nothing_but_its_counters() -> None:
    ledger = KVLedger(64, 4)
    ledger.set_quota("acme", 6)
    ledger.admit(Request("a", list(range(8)), 8, A))  # 4 blocks at most
    ledger.mark_computed("a", 8)
    pool = ledger.pool
    before = (ledger.usage(), pool.free_blocks(), dict(pool.index), list(pool.ref), list(pool.written),
              ledger.counters.groups["acme"].queries, ledger.group_usage())
    # Shares a's two written prompt blocks (charged nothing) but needs 3 more of its own: 4 + 3 > 6.
    d = ledger.admit(Request("b", list(range(8)) + [99], 8, A))
    assert d.outcome is Outcome.NOT_NOW and d.over_quota and d.blocks_hit == 2
    after = (ledger.usage(), pool.free_blocks(), dict(pool.index), list(pool.ref), list(pool.written),
             ledger.counters.groups["acme"].queries, ledger.group_usage())
    assert after == before
    assert (ledger.counters.rejected_not_now, ledger.counters.quota_refusals) == (1, {"acme": 1})
    ledger.check()


def test_quota_input_is_checked_before_anything_changes() -> None:
    ledger = KVLedger(16, 4)
    for group, cap in [("", 4), (None, 4), (3, 4), ("acme", 0), ("acme", -1), ("acme", 1.5), ("acme", True),
                       ("acme", "4"), ("acme", 2**41)]:
        with pytest.raises(ConfigError):
            ledger.set_quota(group, cap)  # type: ignore[arg-type]
    assert ledger.quotas() == {}
    with pytest.raises(ConfigError):
        ledger.group_usage(5)  # type: ignore[arg-type]
    ledger.set_quota("acme", 4)
    ledger.set_quota("acme", None)
    assert ledger.quotas() == {}


def test_the_operator_view_lists_every_group_and_cap() -> None:
    ledger = KVLedger(64, 4)
    ledger.set_quota("idle", 9)
    ledger.admit(Request("a", [1] * 5, 3, A))
    ledger.admit(Request("b", [2] * 4, 4, B, reserve_new_tokens=0))
    usage = ledger.group_usage()
    assert usage == {"acme": GroupUsage(2, 0, 0, None), "globex": GroupUsage(1, 0, 1, None),
                     "idle": GroupUsage(0, 0, 0, 9)}
    stats = ledger.group_stats()
    assert stats["acme"]["charged"] == 2 and stats["acme"]["query_tokens"] == 5
    assert stats["idle"] == {"active": 0, "promised": 0, "growth": 0, "charged": 0, "cap": 9, "query_tokens": 0,
                             "hit_tokens": 0, "quota_refusals": 0}


def test_check_catches_a_block_held_by_two_groups() -> None:
    """The negative test of the group ledgers' law: corrupt one table so that a block of acme's is also
    referenced by a globex sequence (reference counts made consistent, so only the group law can tell)."""
    ledger = KVLedger(32, 4)
    ledger.admit(Request("a", list(range(8)), 4, A))
    ledger.admit(Request("b", list(range(50, 58)), 4, B))
    ledger.check()
    stolen = ledger.sequence("a").table.blocks[0]
    b_blocks = ledger.sequence("b").table.blocks
    own, b_blocks[0] = b_blocks[0], stolen
    ledger.pool.ref[stolen] += 1
    ledger._pins._pins["keeps-b's-block"] = [own]  # its reference moves to a pin: every count still agrees
    with pytest.raises(InvariantError, match="trust groups 'acme' and 'globex'"):
        ledger.check()


def test_concurrent_admissions_never_pass_the_cap() -> None:
    ledger = KVLedger(512, 4)
    ledger.set_quota("acme", 40)
    admitted: list[str] = []
    lock = threading.Lock()

    def worker(w: int) -> None:
        rng = random.Random(w)
        for i in range(40):
            rid = f"w{w}-{i}"
            d = ledger.admit(Request(rid, [rng.randrange(50)] * rng.randint(1, 9), rng.randint(1, 8), A,
                                     reserve_new_tokens=rng.choice([None, 0])))
            if d.admitted:
                with lock:
                    admitted.append(rid)
                assert ledger.group_usage("acme")["acme"].charged <= 40
                if rng.random() < 0.5:
                    ledger.release(rid)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert admitted and ledger.group_usage("acme")["acme"].charged <= 40
    ledger.check()


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2), st.integers(1, 12), st.integers(1, 10),
                          st.booleans(), st.integers(1, 3)), min_size=1, max_size=40),
       st.integers(4, 30), st.integers(4, 30))
def test_random_workloads_keep_every_capped_group_under_its_cap(ops, cap_a, cap_b) -> None:
    """Admissions (full or incremental, 1-3 branches, two capped groups and one free one), decode steps
    and releases in random order: after every operation the group ledgers partition the pool (check())
    and no capped group's active + promised + growth is past its cap."""
    ledger = KVLedger(48, 4)
    ledger.set_quota("acme", cap_a)
    ledger.set_quota("globex", cap_b)
    ctxs = [A, B, CacheContext(trust_group="free")]
    caps = {"acme": cap_a, "globex": cap_b}
    live: list[str] = []
    for n, (kind, group, plen, max_new, full, branches) in enumerate(ops):
        if kind <= 2:  # admit
            req = Request(f"r{n}", [group * 7 + (i % 5) for i in range(plen)], max_new, ctxs[group],
                          reserve_new_tokens=None if full else 0, branches=branches)
            d = ledger.admit(req)
            if d.admitted:
                live.append(req.request_id)
                live.extend(f"r{n}/{i}" for i in range(1, branches))
        elif kind <= 4 and live:  # one decode step for every sequence that can still grow
            steps = [(rid, 7) for rid in live if ledger.sequence(rid).num_tokens < ledger.sequence(rid).limit]
            try:
                ledger.decode_step(steps)
            except Exception as exc:  # a full pool is a scheduler's business; nothing else may fail
                assert type(exc).__name__ == "OutOfBlocksError"
        elif live:  # release a whole request (its branches go with it)
            rid = live[n % len(live)].split("/")[0]
            ledger.cancel(rid)
            live = [s for s in live if s.split("/")[0] != rid]
        ledger.check()
        for g, cap in caps.items():
            u = ledger.group_usage(g)[g]
            assert u.charged <= cap and u.active + u.promised <= cap
