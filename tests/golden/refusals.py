"""Known answers at the edges: every public entry point of the ledger, the tiers and the scheduler, called
with good and bad arguments on a small fixed state.

Each case builds the same ledger (16 blocks of 4; two admitted requests, one half computed; one cached
prefix), makes one call and records what it returned or raised (type and message: the refusal a user
reads) and a digest of the whole state after it, so a refusal that changes anything, or a call that
changes something else, shows. ``check()`` runs after every case; a failure is recorded as the answer.

``tests/data/golden/refusals.json`` holds the answers; ``tests/test_golden.py`` compares. After a deliberate
change, regenerate and review the diff::

    .venv/bin/python tests/golden/refusals.py --update
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if __package__ in (None, ""):
    sys.path.insert(0, str(HERE))

from golden_common import Recorder, main, plain  # noqa: E402

from kvledger.core import native  # noqa: E402
from kvledger.core.identity import CacheContext  # noqa: E402
from kvledger.core.ledger import KVLedger, Request, Retention  # noqa: E402
from kvledger.core.tiers import TierLedger, TierSpec  # noqa: E402
from kvledger.scheduler import (  # noqa: E402
    Driver,
    GenRequest,
    HostPool,
    RecoveryCosts,
    Scheduler,
    SchedulerConfig,
    TransferModel,
)
from kvledger.scheduler.execution import ConstantExecutor, VirtualClock, WallClock  # noqa: E402

GOLDEN = HERE.parent / "data" / "golden" / "refusals.json"
BS = 4
TENANT = CacheContext(trust_group="t1")
OTHER = CacheContext(trust_group="t2")
NASTY: tuple[Any, ...] = (None, -1, 0, 1, 2**31, 10**30, 1.5, 2.0, True, "3", b"x", [1], float("nan"))


def state(led: KVLedger) -> str:
    pool = led.pool
    seqs = [(rid, list(s.tokens), list(s.table.blocks), s.promised, s.computed_mark)
            for rid, s in sorted((r, led.sequence(r)) for r in led.sequences())]
    value = [led.usage(), seqs, list(pool.ref), list(pool.leased), list(pool.written),
             sorted(pool.index.values()), list(pool.free_blocks()), led.pins(), sorted(led.leases()), led.promised,
             led.stats(), led.quotas()]
    return hashlib.blake2b(json.dumps(plain(value), sort_keys=True, default=repr).encode(),
                           digest_size=6).hexdigest()


def fixture() -> KVLedger:
    led = KVLedger(16, BS, clock=lambda: 0.0)
    led.admit(Request("done", list(range(1, 10)), 2, TENANT)).raise_for_outcome()
    led.mark_computed("done", 9)
    led.release("done")  # its two full blocks stay cached
    led.admit(Request("a", list(range(1, 11)), 8, TENANT)).raise_for_outcome()
    led.mark_computed("a", 10)
    led.admit(Request("b", [7, 7, 7, 7, 7, 7], 4, OTHER, reserve_new_tokens=1)).raise_for_outcome()
    led.mark_computed("b", 3)
    led.set_quota("t2", 6)
    return led


def answer(call: Callable[[], Any], check: Callable[[], None]) -> Any:
    """What ``call()`` returned or raised; wrapped with the failure when ``check()`` fails after it."""
    try:
        out: Any = {"ok": plain(call())}
    except Exception as exc:  # noqa: BLE001 -- the refusal is the answer
        out = plain(exc)
    try:
        check()
    except Exception as exc:  # noqa: BLE001
        out = {"check failed": plain(exc), "answer": out}
    return out


def on_ledger(fn: Callable[[KVLedger], Any]) -> Callable[[], Any]:
    def run() -> Any:
        led = fixture()
        return [answer(lambda: fn(led), led.check), state(led)]
    return run


def _ledger_cases(rec: Recorder) -> None:
    for args, kw in (((0,), {}), ((-3,), {}), ((2**40,), {}), ((1.0,), {}), (("8",), {}), ((True,), {}),
                     ((8, 0), {}), ((8, 10**6), {}), ((8, 3.0), {}), ((8,), {"prefix_caching": 1}),
                     ((8,), {"policy": "lru"}), ((8,), {"policy": "fifo"}), ((8,), {"policy": 3}),
                     ((8,), {"max_pinned_fraction": 1.5}), ((8,), {"max_pinned_fraction": -0.1}),
                     ((8,), {"max_pinned_fraction": "x"}), ((8,), {"clock": 3}), ((8, 16), {"policy": "priority"})):
        rec(f"KVLedger{args} {kw}", lambda: (lambda led: [led.num_blocks, led.policy_name, led.usage()])(
            KVLedger(*args, **kw)))
    for kw in ({"prompt": None}, {"prompt": "abc"}, {"prompt": [1, 2]}, {"prompt": []}, {"max_new_tokens": "5"},
               {"max_new_tokens": -1}, {"max_new_tokens": 2.0}, {"reserve_new_tokens": 9},
               {"reserve_new_tokens": -1}, {"branches": 0}, {"branches": 1.5}, {"branches": 10**20},
               {"lookahead": -1}, {"context": "t1"}, {"retention": "x"}, {"retention": [1]},
               {"retention": [Retention(0, 4, 50)]}, {"family": ""}, {"family": 3},
               {"read_prefix_cache": 1}, {"readmission": "no"}, {"request_id": ""}, {"request_id": 5}):
        base = {"request_id": "r", "prompt": [1, 2, 3], "max_new_tokens": 4}
        rec(f"Request {kw}", lambda: Request(**{**base, **kw}))
    for args in ((0, 4, 50), (4, 0, 50), (0, 4, 101), (0, 4, -1), (0, 4, 50, -1.0), (0, 4, 50, float("inf")),
                 (0, 4, 50, "1"), (0, 4, 50, True), (0.5, 4, 50), (0, 4, 50, 2)):
        rec(f"Retention{args}", lambda: Retention(*args))
    for kw in ({"trust_group": None}, {"trust_group": 3}, {"model": 1}, {"adapter": 1}, {"adapter": "lora"},
               {"extra": "ab"}, {"extra": 5}, {"extra": [("k",)]}, {"extra": [(1, 2)]}, {"extra": [("k", 1), ("k", 2)]},
               {"extra": {"k": None, "j": True, "f": 1.5, "b": b"x"}}, {"extra": {"k": [1]}},
               {"extra": {"k": float("nan")}}, {"kv_dtype": None}):
        rec(f"CacheContext {kw}", lambda: [repr(CacheContext(**kw)), CacheContext(**kw).root_digest().hex()])

    def req(rid: str, prompt: list[int], new: int, ctx: CacheContext = TENANT, **kw: Any) -> Request:
        return Request(rid, prompt, new, ctx, **kw)

    admits: list[tuple[str, Callable[[], Request], Any]] = [
        ("hit", lambda: req("c", list(range(1, 13)), 4), 0),
        ("hit other tenant", lambda: req("c", list(range(1, 13)), 4, OTHER), 0),
        ("too big ever", lambda: req("c", list(range(60)), 10), 0),
        ("not now", lambda: req("c", list(range(20, 40)), 8), 0),
        ("quota", lambda: req("c", list(range(20, 40)), 8, OTHER), 0),
        ("branches", lambda: req("c", [1, 2, 3, 4, 5], 3, branches=3), 0),
        ("branches never", lambda: req("c", [1, 2, 3, 4, 5], 3, branches=10**9), 0),
        ("lookahead", lambda: req("c", [1, 2, 3], 2, lookahead=3), 0),
        ("partial reserve", lambda: req("c", [1, 2, 3], 20, reserve_new_tokens=1), 0),
        ("no read", lambda: req("c", list(range(1, 13)), 4, read_prefix_cache=False), 0),
        ("readmission", lambda: req("c", list(range(1, 13)), 4, readmission=True), 0),
        ("duplicate id", lambda: req("a", [1, 2], 2), 0),
        ("keep_free 3", lambda: req("c", [9, 9, 9], 2), 3),
        ("keep_free 99", lambda: req("c", [9, 9, 9], 2), 99),
        ("keep_free -1", lambda: req("c", [9, 9, 9], 2), -1),
        ("keep_free 1.0", lambda: req("c", [9, 9, 9], 2), 1.0),
        ("bad tokens", lambda: req("c", [1, -2, 3], 2), 0),
        ("huge token", lambda: req("c", [1, 2**32], 2), 0),
        ("float token", lambda: req("c", [1, 2.0], 2), 0),
        ("retention", lambda: req("c", [1, 2, 3, 4, 5, 6], 2, retention=(Retention(0, 4, 90, 5.0),)), 0),
        ("retention past prompt", lambda: req("c", [1, 2, 3], 2, retention=(Retention(0, 40, 90),)), 0),
    ]
    for name, make, keep in admits:
        rec(f"admit {name}", on_ledger(lambda led: led.admit(make(), keep)))
        rec(f"can_admit {name}", on_ledger(lambda led: led.can_admit(make(), keep)))
    rec("admit not a request", on_ledger(lambda led: led.admit("c")))
    rec("admit_family", on_ledger(lambda led: led.admit_family(
        [req("f", [1, 2, 3, 4, 5], 3), req("f/1", [1, 2, 3, 4, 5], 3, family="f")])))
    rec("admit_family empty", on_ledger(lambda led: led.admit_family([])))
    rec("admit_family too big", on_ledger(lambda led: led.admit_family(
        [req(f"f{i}", list(range(30)), 8, family="f") for i in range(3)])))
    for rid in ("a", "b", "zz", None, 5):
        for n in (-1, 0, 3, 6, 11, 100, "3", 3.0, True):
            rec(f"mark_computed {rid!r} {n!r}", on_ledger(lambda led: led.mark_computed(rid, n)))
        for tok in (0, 5, -1, 2**32, 1.5, "x", None):
            rec(f"append_token {rid!r} {tok!r}", on_ledger(lambda led: led.append_token(rid, tok)))
        for call in ("release", "retract", "preempt", "cancel", "trim_lookahead", "ready_tokens", "sequence",
                     "is_leased"):
            rec(f"{call} {rid!r}", on_ledger(lambda led: getattr(led, call)(rid)))
        for slots in (-1, 0, 1, 3, 8, 100, 1.0):
            rec(f"reserve_lookahead {rid!r} {slots!r}", on_ledger(lambda led: led.reserve_lookahead(rid, slots)))
        for child in ("a/1", "a", "b", "", None, 3):
            rec(f"fork {rid!r} {child!r}", on_ledger(lambda led: led.fork(rid, child)))
    rec("append_tokens", on_ledger(lambda led: led.append_tokens("a", [1, 2, 3, 4, 5])))
    rec("append_tokens too many", on_ledger(lambda led: led.append_tokens("a", list(range(20)))))
    rec("append_tokens bad", on_ledger(lambda led: led.append_tokens("a", [1, None])))
    rec("append_tokens not iterable", on_ledger(lambda led: led.append_tokens("a", 5)))
    for steps in ([("a", 1), ("b", 2)], [("a", 1), ("a", 2)], [("zz", 1)], [("a", -1)], [("b", 1), ("zz", 1)],
                  [("a",)], "ab", [], [("b", 1)] * 1):
        rec(f"decode_step {steps!r}", on_ledger(lambda led: led.decode_step(steps)))
    for forks, drops in (([("a", "a/1")], []), ([("a", "a/1")], ["b"]), ([("a", "a/1"), ("a", "a/2")], ["a"]),
                         ([], ["zz"]), ([("zz", "z/1")], []), ([("a", "b")], []), ([("a", "a/1")], ["a/1"]),
                         ("x", [])):
        rec(f"beam_step {forks!r} {drops!r}", on_ledger(lambda led: led.beam_step(forks, drops)))
    for ids, blocks, owner in ((["a"], [], "s"), (["a", "b"], [0], ""), (["zz"], [], ""), ([], [10**9], ""),
                               ([], [-1], ""), ([], ["0"], ""), ("a", [], ""), ([], [], 3), (["a", "a"], [], "")):
        rec(f"lease {ids!r} {blocks!r} {owner!r}", on_ledger(lambda led: (
            lambda lid: [lid, led.outstanding_leases(), led.is_leased("a"), led.leases()])(
                led.lease(ids, blocks, owner))))
    for lid in (1, 999, -1, "1", None):
        rec(f"end_lease {lid!r}", on_ledger(lambda led: led.end_lease(lid)))
    rec("lease then preempt then end", on_ledger(lambda led: (lambda lid: [led.preempt("a"), led.end_lease(lid),
                                                                            led.usage()])(led.lease(["a"]))))
    for name, prompt, ctx in (("p", list(range(1, 13)), TENANT), ("p", [1, 2, 3], TENANT), ("", [1, 2, 3, 4], TENANT),
                              ("p", list(range(100)), TENANT), ("p", [1, 2, 3, 4], "t1"), (3, [1, 2, 3, 4], TENANT),
                              ("p", [-1, 2, 3, 4], TENANT), ("p", list(range(1, 9)), OTHER)):
        rec(f"pin {name!r} {len(prompt)} {ctx!r}", on_ledger(lambda led: [led.pin(name, prompt, ctx), led.pins()]))
    rec("pin twice, unpin", on_ledger(lambda led: [led.pin("p", list(range(1, 9)), TENANT),
                                                   led.pin("p", list(range(1, 9)), TENANT), led.unpin("p"),
                                                   led.pins()]))
    for name in ("p", "", None):
        rec(f"unpin {name!r}", on_ledger(lambda led: led.unpin(name)))
    for group, cap in (("t1", 4), ("t1", None), ("t2", 0), ("t2", 2), ("t3", 100), (None, 3), ("t1", -1),
                       ("t1", 1.5), ("t1", True), (3, 3), ("t1", 10**20)):
        rec(f"set_quota {group!r} {cap!r}", on_ledger(lambda led: [led.set_quota(group, cap), led.quotas(),
                                                                   led.group_stats()]))
    for group in ("t1", "t2", "t9", None, 3):
        rec(f"group_usage {group!r}", on_ledger(lambda led: led.group_usage(group)))
        rec(f"tenant_stats {group!r}", on_ledger(lambda led: led.tenant_stats(group)))
    for n in (0, 1, 4, 5, 17, -1, 1.5, "4", 10**30):
        rec(f"blocks_for {n!r}", on_ledger(lambda led: led.blocks_for(n)))
    rec("reset_prefix_cache held", on_ledger(lambda led: led.reset_prefix_cache()))
    rec("reset_prefix_cache idle", on_ledger(lambda led: [led.release("a"), led.release("b"),
                                                          led.reset_prefix_cache(), led.usage()]))
    rec("clear_cache", on_ledger(lambda led: [led.clear_cache(), led.usage()]))
    rec("token_usage", on_ledger(lambda led: led.token_usage()))
    rec("stats", on_ledger(lambda led: [led.stats(), led.group_stats(), led.usage()]))
    rec("take_copies", on_ledger(lambda led: [led.fork("a", "a/1"), led.append_token("a/1", 3),
                                              led.take_copies(), led.take_copies()]))
    for tiers in (5, None, TierLedger([("host", 4)]), HostPool(2)):
        rec(f"attach_tiers {type(tiers).__name__}", on_ledger(lambda led: [led.attach_tiers(tiers),
                                                                            led.stats()]))
    rec("attach_tiers without caching", lambda: KVLedger(4, 4, prefix_caching=False).attach_tiers(HostPool(2)))


def _tier_cases(rec: Recorder) -> None:
    for tiers in ((), "host", [("host", 0)], [("host", -1)], [("host", 4), ("host", 2)], [("host", 2**25)],
                  [("host", 4), ("disk", 8)], [TierSpec("host", 3)], [("", 3)], [(3, 3)], [("host", 2.0)]):
        rec(f"TierLedger {tiers!r}", lambda: (lambda t: [t.names, t.sizes, t.bases, t.usage(), t.holdable,
                                                          t.stats()])(TierLedger(tiers)))

    def tiered(fn: Callable[[TierLedger], Any]) -> Callable[[], Any]:
        def run() -> Any:
            t = TierLedger([("host", 3), ("disk", 4)])
            t.hold(2)
            t.demote(5, b"d1" * 8, "g1")
            t.demote(6, b"d2" * 8, "g1", urgent=False)
            t.complete()
            out = answer(lambda: fn(t), t.check)
            return [out, t.usage(), t.stats(), t.holdable, t.num_free, t.num_used, t.num_evictable]
        return run

    for n in (0, 1, 3, 5, 6, 10, -1, 1.5, None):
        rec(f"tiers hold {n!r}", tiered(lambda t: t.hold(n)))
        rec(f"tiers allocate {n!r}", tiered(lambda t: t.allocate(n)))
    for slots in ([0], [0, 1], [2], [0, 0], [99], [-1], ["0"], 5):
        rec(f"tiers free {slots!r}", tiered(lambda t: t.free(slots)))
        rec(f"tiers discard {slots!r}", tiered(lambda t: t.discard(slots)))
        rec(f"tiers take {slots!r}", tiered(lambda t: t.take(slots)))
    for digests, start, group in (([b"d1" * 8], 0, "g1"), ([b"d1" * 8, b"d2" * 8], 0, "g1"), ([b"d1" * 8], 0, "g2"),
                                  ([b"x" * 16, b"d2" * 8], 1, "g1"), ([b"d1" * 8], 1, "g1"), ([], 0, None)):
        rec(f"tiers lookup {len(digests)} {start} {group}", tiered(lambda t: t.lookup(digests, start, group)))
    for urgent in (True, False):
        for block, digest, group in ((7, b"d3" * 8, "g1"), (8, b"d1" * 8, "g1"), (9, b"d4" * 8, None)):
            rec(f"tiers demote {block} {urgent}", tiered(lambda t: [t.demote(block, digest, group, urgent=urgent),
                                                                   t.take_ops()]))
        rec(f"tiers demote many {urgent}", tiered(lambda t: [
            [t.demote(20 + i, bytes([i]) * 16, "g1", urgent=urgent) for i in range(8)], t.take_ops()]))
    for tier, n in ((0, 1), (0, 5), (1, 1), (2, 1), (-1, 1), (0, -1)):
        rec(f"tiers spill {tier} {n}", tiered(lambda t: [t.spill(tier, n), t.take_ops()]))
    for tier in (0, 1, 2):
        rec(f"tiers free_in {tier}", tiered(lambda t: t.free_in(tier)))
    rec("tiers clear_cache", tiered(lambda t: t.clear_cache()))
    for slot in (0, 2, 3, 6, 7, -1):
        rec(f"tiers slot {slot}", tiered(lambda t: [t.tier_of(slot), t.tier_name(slot), t.local(slot)]))


def _scheduler_cases(rec: Recorder) -> None:
    for kw in ({}, {"policy": "x"}, {"victim": "x"}, {"recovery": "x"}, {"on_growth_failure": "x"},
               {"max_running": 0}, {"max_running": True}, {"token_budget": 0}, {"prefill_chunk": 0},
               {"headroom_blocks": -1}, {"writeback_blocks": -1}, {"predicted_min_samples": 0},
               {"watermark": 1.0}, {"watermark": -0.1}, {"watermark": float("nan")}, {"watermark": True},
               {"predicted_quantile": 0}, {"predicted_quantile": 1.0}, {"predicted_quantile": 1.01},
               {"offload_prefixes": 1}, {"restore_ahead": "yes"}, {"policy": "incremental", "watermark": 0.5}):
        rec(f"SchedulerConfig {kw}", lambda: SchedulerConfig(**kw))
    for kw in ({}, {"link_Bps": 0}, {"link_Bps": -1}, {"link_Bps": float("inf")}, {"link_Bps": True},
               {"overhead_s": -1}, {"overhead_s": 0}, {"staging_blocks": 0}, {"staging_blocks": 2.0},
               {"overlap": 1}, {"in_link_Bps": 0}, {"in_overhead_s": -1}, {"in_link_Bps": 1e9, "in_overhead_s": 1e-3}):
        def model(kw: dict[str, Any] = kw) -> Any:
            m = TransferModel(**kw)
            return [m, [m.time_s(n, 2**20) for n in (0, 1, 64, 65, 1000)],
                    [m.time_s(n, 2**20, "in") for n in (1, 65)],
                    [m.blocking_time_s(10, 2**20, concurrent_s=c) for c in (0.0, 1e-4, 1.0)]]
        rec(f"TransferModel {kw}", model)
    for kw in ({}, {"flops_per_token": 1e9, "flops_per_s": 1e12, "block_bytes": 10**6,
                    "transfer": TransferModel(link_Bps=1e8, staging_blocks=2)}):
        rec(f"RecoveryCosts {kw}", lambda: (lambda c: [c.recompute_s(100), c.recompute_s(-5), c.swap_s(3),
                                                       c.choose(100, 3), c.choose(1, 300), c.choose(0, 0)])(
            RecoveryCosts(**kw)))
    for n in (0, 1, 4, -1, 2.0):
        rec(f"HostPool {n!r}", lambda: HostPool(n).usage())

    def sched(fn: Callable[[Scheduler], Any], cfg: SchedulerConfig | None = None) -> Callable[[], Any]:
        def run() -> Any:
            led = KVLedger(12, BS, clock=lambda: 0.0)
            s = Scheduler(led, cfg or SchedulerConfig(max_running=2, token_budget=8, prefill_chunk=4),
                          host=HostPool(6))
            s.add(GenRequest("x", [1, 2, 3, 4, 5], 3, TENANT))
            s.add(GenRequest("y", [1, 2, 3, 4, 9, 9], 4, TENANT, n=2))
            return [answer(lambda: fn(s), s.check), led.usage(), [[b.seq_id for b in u] for u in s.waiting],
                    list(s.running)]
        return run

    for kw in ({"request_id": "z"}, {"request_id": ""}, {"request_id": "a/b"}, {"request_id": 3}, {"n": 0},
               {"n": 1.5}, {"max_new_tokens": 0}, {"lookahead": -1}, {"priority": 1.5}, {"prompt": []},
               {"arrival_s": float("nan")}, {"arrival_s": "0"}, {"request_id": "x"}, {"n": 99},
               {"prompt": list(range(100))}, {"beam": True, "n": 2}):
        base = {"request_id": "z", "prompt": [1, 2, 3], "max_new_tokens": 2, "context": TENANT}
        rec(f"Scheduler.add {kw}", sched(lambda s: s.add(GenRequest(**{**base, **kw}))))
    rec("Scheduler.add not a request", sched(lambda s: s.add("z")))
    for rid in ("x", "y", "zz", None):
        rec(f"Scheduler.cancel {rid!r}", sched(lambda s: s.cancel(rid)))
        rec(f"Scheduler.requeue {rid!r}", sched(lambda s: [s.schedule().admitted, s.requeue(rid)]))
        rec(f"Scheduler.branches {rid!r}", sched(lambda s: [b.seq_id for b in s.branches(rid)]))
    rec("Scheduler steps", sched(lambda s: [_step(s) for _ in range(8)]))
    rec("Scheduler reset_prefix_cache", sched(lambda s: [_step(s), s.reset_prefix_cache(),
                                                         s.reset_prefix_cache(requeue_running=True)]))
    rec("Scheduler confirm twice", sched(lambda s: (lambda p: [s.confirm(p, {}), s.confirm(p, {})])(s.schedule())))
    rec("Scheduler schedule twice", sched(lambda s: [s.schedule().admitted, s.schedule()]))
    for kw in ({"feed_window": 0}, {"check_every": -1}, {"idle_wait_s": -1}, {"stall_steps": 0},
               {"feed_window": 2, "check_every": 1}):
        def driver(kw: dict[str, Any] = kw) -> Any:
            s = Scheduler(KVLedger(12, BS, clock=lambda: 0.0), SchedulerConfig())
            d = Driver(s, ConstantExecutor(7, 0.01), **kw)
            for i in range(3):
                d.submit(GenRequest(f"q{i}", [1, 2, 3, i], 3, arrival_s=0.05 * i))
            out = d.run()
            return [sorted((m.request_id, m.generated, m.ttft_s, m.finish_s, m.finish_reason) for m in out),
                    d.has_work()]
        rec(f"Driver {kw}", driver)
    for start in (0.0, 5.0, -1.0, float("nan"), "0"):
        rec(f"VirtualClock {start!r}", lambda: (lambda c: [c.now(), c.advance(0.5), c.now(), c.wait_until(2.0),
                                                           c.now()])(VirtualClock(start)))
    rec("WallClock bad source", lambda: WallClock(3))


def _step(s: Scheduler) -> Any:
    plan = s.schedule()
    sampled = {w.seq_id: [5] for w in plan.works if w.sample}
    return [[[w.seq_id, w.start, w.end] for w in plan.works], [b.seq_id for b in s.confirm(plan, sampled)]]


def cases(rec: Recorder) -> None:
    saved = native.MODULE
    native.MODULE = None  # the pure-Python core: the answers must not depend on whether the C part built
    try:
        _ledger_cases(rec)
        _tier_cases(rec)
        _scheduler_cases(rec)
    finally:
        native.MODULE = saved


if __name__ == "__main__":
    raise SystemExit(main(cases, GOLDEN))
