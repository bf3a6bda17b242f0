"""The scheduler with trust-group quotas: a group at its cap waits for its own requests, first come first
served within the group, while other groups' requests behind it are admitted (one tenant at its cap never
holds up another); a request its group's quota can never hold ends with a clear reason. Runs on
``FakeEngine`` (tests/scheduler/test_scheduler.py), which checks every KV position a step reads."""

from __future__ import annotations

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger
from kvledger.scheduler import GenRequest, HostPool, Scheduler, SchedulerConfig
from kvledger.scheduler.growth import NEVER_QUOTA

try:  # the module name pytest gives tests/scheduler/test_scheduler.py depends on its import mode
    from tests.scheduler.test_scheduler import BS, FakeEngine, assert_drained, expected_output, toks
except ImportError:  # pragma: no cover
    from test_scheduler import BS, FakeEngine, assert_drained, expected_output, toks

A, B = CacheContext(trust_group="acme"), CacheContext(trust_group="globex")


def _admitted_at(eng: FakeEngine) -> dict[str, int]:
    """Step at which each request was first admitted, draining the scheduler."""
    first: dict[str, int] = {}
    while eng.s.has_work():
        plan = eng.step()
        for rid in plan.admitted:
            first.setdefault(rid, plan.step)
        assert plan.step < 300
    return first


def test_a_group_at_its_cap_does_not_hold_up_another_group() -> None:
    # acme may hold 6 blocks: each of its requests (4-token prompt, 8 new: 3 blocks at most) takes 3.
    led = KVLedger(64, BS)
    led.set_quota("acme", 6)
    s = Scheduler(led, SchedulerConfig(policy="incremental", watermark=0.0))
    for i in range(4):
        s.add(GenRequest(f"a{i}", toks(4, 100 + 10 * i), 8, A))
    s.add(GenRequest("b0", toks(4, 500), 8, B))  # behind acme's four in the queue
    eng = FakeEngine(s)
    first = eng.step()
    # Two of acme's fit its cap; the third waits, and globex's request behind it goes ahead.
    assert first.admitted == ["a0", "a1", "b0"]
    assert [u[0].request.request_id for u in s.waiting] == ["a2", "a3"]  # still in arrival order
    assert led.group_usage("acme")["acme"].charged == 6
    admitted = {"a0": first.step, "a1": first.step, "b0": first.step, **_admitted_at(eng)}
    assert admitted["a2"] <= admitted["a3"]  # first come first served within the group
    for rid in ("a0", "a1", "a2", "a3", "b0"):
        (br,) = s.branches(rid)
        assert (br.finish_reason, br.output) == ("length", expected_output(rid, 4, 8))
    assert_drained(s)


def test_without_a_quota_the_head_of_the_queue_still_blocks() -> None:
    """The pool refusing the head is unchanged: nobody overtakes it (priority, first come first served)."""
    led = KVLedger(6, BS)
    s = Scheduler(led, SchedulerConfig(policy="full", watermark=0.0))
    s.add(GenRequest("big", toks(4, 100), 16, A))  # 5 blocks
    s.add(GenRequest("next", toks(4, 200), 16, A))  # 5 more: waits
    s.add(GenRequest("small", toks(2, 300), 2, B))  # 1 block would fit, but may not overtake
    eng = FakeEngine(s)
    assert eng.step().admitted == ["big"]
    assert [u[0].request.request_id for u in s.waiting] == ["next", "small"]
    eng.drain()
    assert_drained(s)


def test_a_quota_lowered_under_a_waiting_request_ends_it_with_a_reason() -> None:
    led = KVLedger(64, BS)
    s = Scheduler(led, SchedulerConfig(policy="full", watermark=0.0), host=HostPool(8))
    s.add(GenRequest("a0", toks(4, 100), 8, A))
    led.set_quota("acme", 2)  # after it was queued: its 3 blocks can never fit now
    s.add(GenRequest("b0", toks(4, 500), 8, B))
    eng = FakeEngine(s)
    plan = eng.step()
    assert plan.admitted == ["b0"]
    assert ("a0", NEVER_QUOTA) in plan.ended
    eng.drain()
    assert [br.finish_reason for br in s.branches("a0")] == [NEVER_QUOTA]
    assert_drained(s)


def test_swapped_requests_of_a_group_at_its_cap_let_others_come_back() -> None:
    """Preemption by swap under a quota: each group's requests come back as their own group's charge
    allows, and every output is the one an undisturbed run gives."""
    led = KVLedger(12, BS)
    led.set_quota("acme", 8)
    cfg = SchedulerConfig(policy="incremental", watermark=0.0, recovery="swap", victim="latest")
    s = Scheduler(led, cfg, host=HostPool(32))
    for i in range(3):
        s.add(GenRequest(f"a{i}", toks(4, 100 + 10 * i), 12, A))
        s.add(GenRequest(f"b{i}", toks(4, 500 + 10 * i), 12, B))
    eng = FakeEngine(s)
    eng.drain()
    for rid in ("a0", "a1", "a2", "b0", "b1", "b2"):
        (br,) = s.branches(rid)
        assert (br.finish_reason, br.output) == ("length", expected_output(rid, 4, 12)), rid
    assert s.preemptions > 0
    assert_drained(s)


def test_a_swapped_request_of_another_group_comes_back_past_one_held_by_its_quota() -> None:
    """Pool of 6 blocks, swap recovery, the latest request is the victim: acme's a0 and a2 and globex's
    b1 run until a2 and then b1 are swapped out (swapped queue: a2, b1; a0 runs). acme's quota is then
    set to 3 blocks: a0 holds 3 of them and a2 needs 2 more, so a2 is refused for its group's quota
    (not "never": 2 <= 3), and b1, behind it, comes back in the next step; a2 waits, then finishes.
    Every output is the fake model's own."""
    acme, globex = CacheContext(trust_group="acme"), CacheContext(trust_group="globex")
    led = KVLedger(6, BS)
    cfg = SchedulerConfig(policy="incremental", watermark=0.0, recovery="swap", victim="latest")
    s = Scheduler(led, cfg, host=HostPool(64))
    for i, g in enumerate("aba"):
        s.add(GenRequest(f"{g}{i}", toks(4, 100 + 10 * i), 8, acme if g == "a" else globex))
    eng = FakeEngine(s)
    for _ in range(20):
        eng.step()
        if [u[0].request.request_id for u in s.swapped] == ["a2", "b1"]:
            break
    assert [u[0].request.request_id for u in s.swapped] == ["a2", "b1"]
    assert list(s.running) == ["a0"]
    led.set_quota("acme", 3)
    plan = eng.step()
    assert plan.admitted == ["b1"] and plan.swap_in and not plan.ended
    assert [u[0].request.request_id for u in s.swapped] == ["a2"]
    eng.drain()
    for rid in ("a0", "b1", "a2"):
        (br,) = s.branches(rid)
        assert (br.finish_reason, br.output) == ("length", expected_output(rid, 4, 8)), rid
    assert_drained(s)
