"""The pool ledger in bytes: states, tiers and trust groups with their conservation law, and capacity
held for no live owner -- a ledger sequence the scheduler does not run (``check()`` passes on it) and a
lease no step in flight owns. Driven through the real scheduler and driver (no torch work)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.core import CacheContext, Request
from kvledger.core.ledger import KVLedger
from kvledger.runtime.measure.diagnostics.pool import pool_sample
from kvledger.scheduler import ConstantExecutor, Driver, GenRequest, HostPool, Scheduler

BS = 4
BLOCK_BYTES = 1000


def make(num_blocks: int = 64, host: int = 0):
    ledger = KVLedger(num_blocks, BS)
    sched = Scheduler(ledger, host=HostPool(host, BLOCK_BYTES) if host else None)
    return ledger, sched, Driver(sched, ConstantExecutor())


def req(rid: str, n: int, start: int, new: int = 6, group: str = "default") -> GenRequest:
    return GenRequest(rid, tuple(range(start, start + n)), new, CacheContext(trust_group=group))


def conserved(p) -> None:
    assert p.free + p.active + p.retained == p.total
    d = p.as_dict()
    assert d["free_bytes"] + d["active_bytes"] + d["retained_bytes"] == d["total_bytes"]
    assert sum(g["active_bytes"] for g in d["by_trust_group"].values()) >= d["live_bytes"]


def test_states_and_trust_groups_in_bytes():
    ledger, sched, driver = make(host=8)
    driver.submit(req("a", 10, 100, group="tenant-a"))
    driver.submit(req("b", 7, 500, group="tenant-b"))
    driver.step()
    p = pool_sample(ledger, BLOCK_BYTES, scheduler=sched, host_pool=sched.host)
    conserved(p)
    d = p.as_dict()
    assert d["by_trust_group"]["tenant-a"]["active_bytes"] == 3 * BLOCK_BYTES  # 11 tokens after step 1
    assert d["by_trust_group"]["tenant-b"]["active_bytes"] == 2 * BLOCK_BYTES
    assert d["live_bytes"] == 5 * BLOCK_BYTES and not p.orphans
    assert d["host"] == {"total_bytes": 8000, "used_bytes": 0, "free_bytes": 8000}
    assert d["token_state_bytes"] + d["tail_slack_bytes"] == d["live_bytes"]
    driver.run()
    p = pool_sample(ledger, BLOCK_BYTES, scheduler=sched)
    conserved(p)
    assert p.active == 0 and p.retained > 0 and not p.orphans  # finished: blocks back, full ones cached


def test_a_sequence_behind_the_schedulers_back_is_an_orphan_and_check_passes():
    ledger, sched, driver = make()
    driver.submit(req("a", 10, 100))
    driver.step()
    leak = ledger.admit(Request("leaked", list(range(900, 912)), 1, CacheContext(trust_group="tenant-x")))
    assert leak.admitted
    driver.run()
    sched.check()  # the ledger and the scheduler see nothing wrong ...
    p = pool_sample(ledger, BLOCK_BYTES, scheduler=sched)
    [orphan] = p.orphans  # ... the pool ledger does
    assert (orphan.kind, orphan.ident, orphan.trust_group) == ("sequence", "leaked", "tenant-x")
    assert len(orphan.blocks) == 3 and orphan.promised == 1  # 12 tokens = 3 full blocks; the 13th promised
    assert p.as_dict()["orphans"][0]["bytes"] == 3 * BLOCK_BYTES
    conserved(p)


def test_a_lease_no_step_owns_holds_its_blocks_after_release():
    ledger, sched, driver = make()
    driver.submit(req("a", 8, 100, new=2))
    driver.step()
    blocks = list(ledger.sequence("a").table.blocks)
    lease = ledger.lease(blocks=blocks, owner="transfer-9")  # never ended
    p = pool_sample(ledger, BLOCK_BYTES, scheduler=sched)
    [orphan] = p.orphans
    assert orphan.kind == "lease" and orphan.owner == "transfer-9" and orphan.blocks == ()  # "a" still holds them
    driver.run()
    p = pool_sample(ledger, BLOCK_BYTES, scheduler=sched)
    [orphan] = p.orphans
    assert sorted(orphan.blocks) == sorted(blocks) and p.deferred == len(blocks)  # released, still leased
    ledger.end_lease(lease)
    assert not pool_sample(ledger, BLOCK_BYTES, scheduler=sched).orphans


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(1, 8), st.sampled_from(["g1", "g2", "g3"])),
                min_size=1, max_size=8),
       st.integers(0, 12))
def test_conservation_at_every_step_boundary(jobs, steps):
    ledger, sched, driver = make(num_blocks=48)
    for i, (n, new, group) in enumerate(jobs):
        driver.submit(req(f"r{i}", n, 1000 * (i + 1), new, group))
    for _ in range(steps):
        if not driver.has_work():
            break
        driver.step()
        p = pool_sample(ledger, BLOCK_BYTES, scheduler=sched)
        conserved(p)
        assert not p.orphans
        assert p.live == len({b for rid in ledger.sequences() for b in ledger.sequence(rid).table.blocks})
