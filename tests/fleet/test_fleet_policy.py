"""The fleet's policy without Ray: the admission door, the router's view and score, and the fleet simulator
(arm A: the router decides on a stale view; arm B: the replica's ledger decides)."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from kvledger.core.identity import CacheContext, prompt_digests
from kvledger.core.ledger import KVLedger
from kvledger.core.tiers import TierLedger
from kvledger.core.types import Request
from kvledger.errors import ConfigError, InvariantError
from kvledger.placement.door import ACCEPTED, NEVER, NOT_NOW, AdmissionDoor, CacheEventTap
from kvledger.placement.score import (
    ReplicaLoad,
    RouteRequest,
    ScoreConfig,
    make_route_request,
    replica_cost,
    request_blocks,
)
from kvledger.placement.view import Placement, PrefixIndex, RouterView
from kvledger.sim.cost_model import DeviceProfile
from kvledger.sim.fleet import FleetConfig, FleetSimulator
from kvledger.sim.simulator import SimConfig
from kvledger.workloads import Poisson, synthetic

BS = 16
STUB = DeviceProfile(name="stub", peak_flops=1e30, mem_bandwidth_Bps=1e30, flops_efficiency=1.0,
                     bw_efficiency=1.0, step_overhead_s=0.01, host_link_Bps=1e30, transfer_overhead_s=0.0,
                     source="test stub")


def ctx(group: str = "acme") -> CacheContext:
    return CacheContext(trust_group=group, model="m")


def ledger_request(rid: str, blocks: int, group: str = "acme", base: int = 0) -> Request:
    """A request of ``blocks`` blocks at full reservation: a one-block prompt and the rest as output."""
    return Request(rid, list(range(base, base + BS)), (blocks - 1) * BS, ctx(group))


def route(rid: str, tokens: list[int], max_new: int, group: str = "acme"):
    c = ctx(group)
    return make_route_request(rid, group, prompt_digests(c.root_digest(), tokens, BS), len(tokens), max_new, BS)


# ---- the seed's two lines: a snapshot says 10 free, two routers each send 6 -------------------------


@pytest.mark.parametrize("arm", ["A", "B"])
def test_two_routers_on_one_snapshot_of_ten_free_blocks(arm):
    ledger = KVLedger(10, BS)
    door = AdmissionDoor(ledger, enforce=arm == "B")
    snapshot = door.load()
    assert snapshot.available == 10
    routers = [RouterView(BS, seed=k) for k in range(2)]
    answers = []
    for k, view in enumerate(routers):
        view.set_replicas(["r0"])
        view.update_load("r0", snapshot, now=0.0)  # the same stale snapshot: neither sees the other's send
        req = route(f"q{k}", list(range(1000 * k, 1000 * k + BS)), 5 * BS)
        assert req.charge == 6
        choice = view.rank(req, now=0.0)[0]
        assert choice.fits  # each router's view says 6 <= 10
        view.routed(req, "r0")
        answers.append(door.decide(ledger_request(f"q{k}", 6, base=1000 * k)))
    first, second = answers
    assert first.outcome == ACCEPTED and first.overshoot == 0
    if arm == "A":  # the replica commits what it was sent: 12 promised or booked against 10
        assert second.outcome == ACCEPTED
        assert second.overshoot == 2
        assert door.overcommits == 1 and door.max_overshoot == 2
        with pytest.raises(InvariantError, match="overcommitted"):
            door.check()
    else:  # the ledger decides: the second is told "not now", holding nothing, with a fresh load
        assert second.outcome == NOT_NOW
        assert second.load.available == 4 and second.load.booked == 6
        assert door.overcommits == 0
        door.check()
        ledger.check()
        assert ledger.usage().active == 0  # booked is a claim on capacity, not a block
        routers[1].refused("q1", "r0", second.load, now=0.001)
        assert routers[1].available("r0") == 4  # the fresh load replaced the stale snapshot


def test_door_books_the_worst_case_and_admission_releases_the_booking():
    ledger = KVLedger(40, BS)
    door = AdmissionDoor(ledger)
    prompt = list(range(3 * BS))
    a = door.decide(Request("a", prompt, BS, ctx()))
    assert a.accepted and a.booked == 4  # 3 prompt blocks + 1 output block, nothing cached yet
    ledger.admit(Request("a", prompt, BS, ctx()))
    door.admitted("a")
    assert door.booked == 0
    ledger.mark_computed("a", len(prompt))
    ledger.release("a")  # its prompt blocks stay cached: retained
    b = door.decide(Request("b", prompt + [7] * BS, BS, ctx()))
    # 3 hits on retained blocks may be taken from the evictable pool: booked as part of the worst case.
    assert b.accepted and b.booked == 3 + 1 + 1
    door.check()
    assert door.decide(Request("huge", list(range(BS)), 100 * BS, ctx())).outcome == NEVER
    door.finished("b")
    assert door.booked == 0
    door.booked = 5  # a book whose total disagrees with its entries is a bug the check reports
    with pytest.raises(InvariantError, match="book"):
        door.check()


def test_cache_event_tap_numbers_events_and_reports_gaps():
    tap = CacheEventTap(maxlen=2)
    ledger = KVLedger(16, BS, events=tap)
    ledger.admit(Request("a", list(range(4 * BS)), 1, ctx()))
    events, nxt, complete = tap.since(0)
    assert [k for k, _ in events] == ["stored"] * 4 and complete  # 4 <= 2 * maxlen: nothing dropped yet
    ledger.admit(Request("b", list(range(1000, 1000 + 4 * BS)), 1, ctx()))
    events, nxt2, complete = tap.since(0)
    assert not complete  # the oldest were dropped: a reader this far behind must resync
    assert nxt2 == tap.seq == 8


def _held(tap: CacheEventTap, block_size: int, digests: list[bytes]) -> int:
    """How many leading ``digests`` a router fed only with ``tap``'s events believes the replica holds."""
    view = RouterView(block_size, ScoreConfig(min_match_tokens=0), seed=0)
    view.set_replicas(["r0"])
    events, nxt, complete = tap.since(0)
    assert complete
    view.apply_events("r0", events, nxt)
    return view.index.matches(digests, ["r0"])["r0"]


def test_a_prefix_demoted_to_the_host_tier_still_counts_as_the_replicas_until_the_tier_drops_it():
    """The replica publishes what it holds anywhere: a block demoted to host memory is a hit there (it is
    promoted, not recomputed), so routers must not forget it when the device evicts it."""
    tiers = TierLedger([("host", 8)])
    tap = CacheEventTap()
    ledger = KVLedger(5, BS, events=tap)
    ledger.attach_tiers(tiers)
    tap.attach_tiers(tiers)
    tokens = list(range(4 * BS))
    digests = prompt_digests(ctx().root_digest(), tokens, BS)
    ledger.admit(Request("a", tokens, 1, ctx())).raise_for_outcome()
    ledger.mark_computed("a", len(tokens))
    ledger.release("a")
    assert _held(tap, BS, digests) == 4
    # Another prompt needs 4 blocks: 1 free + 3 of a's evicted from the device, demoted to the host tier.
    ledger.admit(Request("b", list(range(500, 500 + 4 * BS)), 1, ctx())).raise_for_outcome()
    tiers.complete()
    assert len(tiers.index) == 3 and ledger.pool.evictions == 3
    assert _held(tap, BS, digests) == 4  # without the tiers attached to the tap: 1
    kinds = [k for k, _ in tap.since(0)[0]]
    assert "evicted" not in kinds  # the device evictions were no news: the blocks were still held below
    # Promotion takes them off the tier and onto the device: held all along.
    ledger.mark_computed("b", 4 * BS)
    ledger.release("b")
    again = Request("c", tokens + [1], 1, ctx())
    pairs, lease = ledger.promote_from_tiers(again, owner="promote")
    assert len(pairs) == 3 and lease is not None
    assert _held(tap, BS, digests) == 4
    ledger.end_lease(lease)
    tiers.complete()
    ledger.check()
    tiers.check()
    # A cache reset drops the tiers' entries and the device's: now the replica holds nothing of it.
    ledger.admit(again).raise_for_outcome()
    ledger.release("c")
    tiers.complete()  # the demotions c's admission decided are written: the reset refuses while they run
    assert ledger.reset_prefix_cache()  # the ledger's own reset clears the tiers attached to it
    assert tiers.index == {}
    assert _held(tap, BS, digests) == 0


@pytest.mark.parametrize("seed", range(8))
def test_what_the_tap_publishes_is_what_the_device_and_its_tiers_hold_after_every_operation(seed: int):
    """The tap's law: replaying its events gives exactly the digests indexed on the device or in any tier
    below it -- through demotions, promotions, moves one tier down, holds that drop cached entries,
    failed transfers, resets and clears."""
    rng = random.Random(seed)
    tiers = TierLedger([("host", rng.randint(1, 5)), ("disk", rng.randint(1, 5))])
    tap = CacheEventTap(maxlen=1 << 16)
    ledger = KVLedger(rng.randint(6, 12), BS, events=tap)
    ledger.attach_tiers(tiers)
    tap.attach_tiers(tiers)
    prompts = [list(range(k * 1000, k * 1000 + rng.randint(1, 4) * BS + rng.randint(0, 3))) for k in range(6)]
    believed: set[bytes] = set()
    read = 0
    held: list[list[int]] = []
    leases: list[int] = []
    for n in range(250):
        op = rng.random()
        rid = f"r{n}"
        if op < 0.45:
            r = Request(rid, rng.choice(prompts), rng.randint(1, 3), ctx(rng.choice(["acme", "globex"])))
            if rng.random() < 0.7:
                _, lease = ledger.promote_from_tiers(r, owner=f"p{n}")
                if lease is not None:
                    leases.append(lease)
            if ledger.admit(r).admitted:
                ledger.mark_computed(rid, len(r.prompt))
                ledger.release(rid)
        elif op < 0.55:
            tiers.spill(0, rng.randint(1, 3))
        elif op < 0.62 and tiers.holdable:
            held.append(tiers.hold(rng.randint(1, tiers.holdable)))
        elif op < 0.68 and held:
            tiers.free(held.pop())
        elif op < 0.72:
            tiers.discard(rng.sample(range(tiers.num_blocks), k=min(2, tiers.num_blocks)))
        elif op < 0.75 and not leases:
            ledger.reset_prefix_cache()
            tiers.clear_cache()
        else:
            tiers.take_ops()
            for lease in leases:
                ledger.end_lease(lease)
            leases.clear()
            tiers.complete()
        events, read, complete = tap.since(read)
        assert complete
        for kind, digest in events:
            if kind == "stored":
                assert digest not in believed  # a digest is news once, not per copy
                believed.add(digest)
            else:
                assert digest in believed
                believed.discard(digest)
        assert believed == set(ledger.pool.index) | set(tiers.index)
        ledger.check()
    assert tiers.flow["demoted"] > 0 and tiers.flow["moved"] + tiers.flow["promoted"] > 0


def test_a_tap_attaches_tiers_only_before_anything_is_cached():
    tiers = TierLedger([("host", 4)])
    tap = CacheEventTap()
    ledger = KVLedger(8, BS, events=tap)
    ledger.admit(Request("a", list(range(2 * BS)), 1, ctx())).raise_for_outcome()
    with pytest.raises(ConfigError, match="before anything is cached"):
        tap.attach_tiers(tiers)
    with pytest.raises(ConfigError, match="TierLedger"):
        CacheEventTap().attach_tiers(object())


# ---- the view and the score -----------------------------------------------------------------------


def test_the_tenant_is_in_every_digest_so_no_prefix_scores_across_tenants():
    tokens = list(range(40 * BS))
    view = RouterView(BS, ScoreConfig(min_match_tokens=0), seed=1)
    view.set_replicas(["r0", "r1"])
    acme = route("a", tokens, 16, "acme")
    view.routed(acme, "r0")
    again = view.rank(route("a2", tokens, 16, "acme"), now=0.0)
    assert again[0].replica == "r0" and again[0].matched == 40
    globex = view.rank(route("g", tokens, 16, "globex"), now=0.0)
    assert all(c.matched == 0 for c in globex)  # identical tokens, another tenant: no affinity anywhere


def test_minimum_match_gate_keeps_a_shared_system_prompt_from_attracting_everything():
    system = list(range(BS))  # one block every request shares, cached on r0 only
    system_digest = route("s", system, 16).digests[0]
    picks: dict[int, set[str]] = {}
    for gate in (0, 4 * BS):
        view = RouterView(BS, ScoreConfig(min_match_tokens=gate), seed=0)
        view.set_replicas(["r0", "r1", "r2"])
        for r in ("r0", "r1", "r2"):
            view.update_load(r, ReplicaLoad(pool=100, free=100, evictable=0, promised=0, seq=1, stamp=0.0), 0.0)
        view.apply_events("r0", [("stored", system_digest)])
        picks[gate] = set()
        for i in range(30):
            base = 10_000 * (i + 1)
            picks[gate].add(view.rank(route(f"x{i}", system + list(range(base, base + 8 * BS)), 16), 0.0)[0].replica)
    assert picks[0] == {"r0"}  # without the gate, one shared block sends everything to one replica
    assert picks[4 * BS] == {"r0", "r1", "r2"}  # with it, ties broken at random


def test_own_requests_count_until_the_replica_load_does():
    view = RouterView(BS, seed=0)
    view.set_replicas(["r0"])
    view.update_load("r0", ReplicaLoad(pool=100, free=100, evictable=0, promised=0, seq=5, stamp=10.0), now=10.0)
    req = route("a", list(range(3 * BS)), 2 * BS)
    view.routed(req, "r0")
    assert view.available("r0") == 100 - req.charge  # in flight: not in the load yet
    view.accepted("a", "r0", seq=6, load=None, now=10.1)
    assert view.available("r0") == 100 - req.charge  # accepted, but the load still predates it
    counted = ReplicaLoad(pool=100, free=100, evictable=0, promised=2, booked=req.charge - 2, seq=7, stamp=10.2)
    view.update_load("r0", counted, now=10.2)
    assert view.available("r0") == counted.available  # the load counts it now: no double count
    view.finished("a", "r0", seq=9, load=None, now=11.0)
    assert view.available("r0") == counted.available + req.charge  # finished: its blocks came back
    assert view.update_load("r0", ReplicaLoad(pool=100, free=1, evictable=0, promised=0, seq=3), now=12.0) is False
    assert view.age("r0", now=12.0) == pytest.approx(1.8)  # the age of the load, not of its arrival


def test_prefix_index_forgets_on_eviction_events_and_dead_replicas():
    idx = PrefixIndex(max_digests=3)
    idx.add("r0", [b"a", b"b", b"c"])
    idx.add("r1", [b"a"])
    assert idx.matches([b"a", b"b", b"c"], ["r0", "r1"]) == {"r0": 3, "r1": 1}
    idx.remove("r0", [b"b"])
    assert idx.matches([b"a", b"b", b"c"], ["r0", "r1"]) == {"r0": 1, "r1": 1}
    idx.drop("r1")
    assert idx.matches([b"a"], ["r0", "r1"]) == {"r0": 1, "r1": 0}
    idx.add("r0", [b"d", b"e"])
    assert len(idx) <= 3  # bounded: the digests learned longest ago go first


def test_placement_dedicates_replicas_to_a_tenant():
    p = Placement.of({"vip": ["r2"]})
    assert p.allowed("vip", ["r0", "r1", "r2"]) == ["r2"]
    assert p.allowed("acme", ["r0", "r1", "r2"]) == ["r0", "r1"]
    with pytest.raises(ConfigError):
        Placement.of({"a": ["r1"], "b": ["r1"]})


def test_request_blocks_match_the_ledgers_full_reservation():
    # The seed: 2,048 + 257 tokens in 16-token blocks = 145 blocks, 128 of them the prompt's.
    assert request_blocks(2048, 257, 16) == (128, 17, 145)
    ledger = KVLedger(256, 16)
    d = ledger.admit(Request("s", list(range(2048)), 257, ctx()))
    assert d.blocks_total == 145


def test_loads_from_elsewhere_are_checked():
    with pytest.raises(ConfigError):
        ReplicaLoad.from_dict({"pool": -1})
    with pytest.raises(ConfigError):
        ReplicaLoad.from_dict({"pool": 1, "stamp": float("nan")})
    assert ReplicaLoad.from_dict(ReplicaLoad(4, 3, 1, 2, seq=1, stamp=2.5).to_dict()).available == 2


# ---- the fleet simulator ----------------------------------------------------------------------------


def workload(seed: int, count: int = 40, groups: int = 2):
    return synthetic(count, arrivals=Poisson(40.0), prompt_len=48, output_len=24, system_prompts=2,
                     system_prompt_len=64, shared_fraction=0.7, trust_groups=groups, seed=seed)


def fleet(seed: int, routers: int, staleness: float, arm: str, pool: int = 48, **kw) -> dict:
    sim = SimConfig(model="smollm2-135m", gpu="stub", profile=STUB, pool_blocks=pool, block_size=BS)
    cfg = FleetConfig(sim=sim, replicas=3, routers=routers, staleness_s=staleness, arm=arm, check=True,
                      seed=seed, score=ScoreConfig(min_match_tokens=32), **kw)
    return FleetSimulator(cfg).run(workload(seed)).summary


FLEETS = st.tuples(st.integers(0, 10_000), st.integers(1, 4), st.sampled_from([0.0, 0.05, 0.5, 5.0]),
                   st.integers(20, 60))


@settings(max_examples=12, suppress_health_check=[HealthCheck.too_slow])
@given(FLEETS)
def test_arm_b_never_overcommits(params):
    seed, routers, staleness, pool = params
    s = fleet(seed, routers, staleness, "B", pool)  # check=True: every law after every acceptance and admission
    assert s["overcommits"] == 0 and s["max_overshoot"] == 0
    assert s["completed"] + s["rejected"] == s["requests"]
    assert s["cross_tenant_hit_blocks"] == 0


def test_hypothesis_finds_an_overcommit_when_routers_decide():
    found = find(FLEETS.filter(lambda p: p[1] >= 2),
                 lambda p: fleet(p[0], p[1], p[2], "A", p[3])["overcommits"] > 0,
                 settings=settings(max_examples=40, database=None, suppress_health_check=list(HealthCheck)))
    assert found[1] >= 2


def test_one_router_with_a_fresh_view_never_overcommits_either_arm():
    for arm in ("A", "B"):
        assert fleet(3, 1, 0.0, arm)["overcommits"] == 0


def test_round_robin_and_score_both_complete_and_score_hits_more():
    sim = SimConfig(model="smollm2-135m", gpu="stub", profile=STUB, pool_blocks=400, block_size=BS)
    reqs = synthetic(60, arrivals=Poisson(20.0), prompt_len=32, output_len=8, system_prompts=6,
                     system_prompt_len=256, shared_fraction=1.0, seed=4)
    out = {}
    for routing in ("score", "round-robin"):
        cfg = FleetConfig(sim=sim, replicas=4, routers=1, staleness_s=0.0, routing=routing,
                          score=ScoreConfig(min_match_tokens=64))
        out[routing] = FleetSimulator(cfg).run(reqs).summary
        assert out[routing]["completed"] == 60
    assert out["score"]["hit_rate"] > out["round-robin"]["hit_rate"]
    assert out["score"]["decision_us_p99"] is not None  # measured and reported, never asserted on


def test_replicas_with_a_host_tier_promote_demoted_prefixes_and_arm_b_still_never_overcommits():
    """Pools too small to keep the shared prefixes on the device: with a host tier below each replica and
    offload_prefixes, evicted prefix blocks come back as hits (promoted), the router keeps sending their
    requests to the replica that holds them, and every law holds after every admission."""
    reqs = synthetic(80, arrivals=Poisson(20.0), prompt_len=32, output_len=8, system_prompts=8,
                     system_prompt_len=256, shared_fraction=1.0, seed=5)
    base = SimConfig(model="smollm2-135m", gpu="stub", profile=STUB, pool_blocks=40, block_size=BS)
    block_bytes = FleetSimulator(FleetConfig(sim=base)).dep.block_bytes
    out = {}
    for name, sim in (("device only", base),
                      ("host tier", base.with_values(host_pool_bytes=400 * block_bytes, offload_prefixes=True))):
        for routers, staleness in ((1, 0.0), (3, 0.5)):
            cfg = FleetConfig(sim=sim, replicas=3, routers=routers, staleness_s=staleness, arm="B", check=True,
                              seed=2, score=ScoreConfig(min_match_tokens=64))
            s = FleetSimulator(cfg).run(reqs).summary
            assert s["overcommits"] == 0 and s["completed"] == 80 and s["cross_tenant_hit_blocks"] == 0
            out[name, routers] = s
    for routers in (1, 3):
        tier, device = out["host tier", routers], out["device only", routers]
        assert device["promoted_tokens"] == 0 and tier["promoted_tokens"] > 0
        assert tier["hit_rate"] > device["hit_rate"] + 0.2
    # Affinity survives demotion: a router that forgets a prefix once the device evicts it (the tap not
    # publishing the tier's entries) sends its requests elsewhere and gets 0.64 here, against 0.76.
    assert out["host tier", 1]["hit_rate"] > 0.72


@pytest.mark.parametrize("pool, seed", [(24, 5), (24, 6), (40, 5), (40, 6)])
def test_waiting_for_the_replica_that_holds_the_prefix_hits_more_and_never_overcommits(pool, seed):
    """Pools that fill in bursts: with affinity_wait_s a request whose cheapest replica (the one holding
    its prefix) does not fit yet waits for it instead of going to the cheapest replica that fits, where it
    misses and its prefix is cached a second time. Measured here: 0.21 -> 0.43, 0.18 -> 0.34, 0.46 -> 0.59,
    0.40 -> 0.58; every law holds after every acceptance and admission, and every request completes."""
    reqs = synthetic(80, arrivals=Poisson(40.0), prompt_len=32, output_len=8, system_prompts=8,
                     system_prompt_len=256, shared_fraction=1.0, seed=seed)
    sim = SimConfig(model="smollm2-135m", gpu="stub", profile=STUB, pool_blocks=pool, block_size=BS)
    out = {}
    for wait in (0.0, 5.0):
        cfg = FleetConfig(sim=sim, replicas=3, routers=1, staleness_s=0.0, arm="B", check=True, seed=2,
                          score=ScoreConfig(min_match_tokens=64), affinity_wait_s=wait)
        out[wait] = s = FleetSimulator(cfg).run(reqs).summary
        assert s["overcommits"] == 0 and s["completed"] == 80 and s["cross_tenant_hit_blocks"] == 0
    assert out[5.0]["hit_rate"] > out[0.0]["hit_rate"] + 0.1


def test_ttft_splits_into_routing_replica_wait_and_prefill_above_its_floor():
    """The summary says where the mean TTFT goes: routing (transit, refusals, retries, the router's queue),
    the wait in a replica's book, and the prefill from admission to the first token, which is never below
    the floor of computing each uncached prompt alone on an idle replica. Round-robin's requests share
    steps with each other's prefills: measured here 47 ms of prefill against 41 ms alone."""
    reqs = synthetic(80, arrivals=Poisson(40.0), prompt_len=32, output_len=8, system_prompts=8,
                     system_prompt_len=256, shared_fraction=1.0, seed=5)
    slow = DeviceProfile(name="slow", peak_flops=1e12, mem_bandwidth_Bps=1e12, flops_efficiency=1.0, bw_efficiency=1.0,
                         step_overhead_s=0.001, host_link_Bps=1e30, transfer_overhead_s=0.0, source="test stub")
    sim = SimConfig(model="smollm2-135m", gpu="stub", profile=slow, pool_blocks=80, block_size=BS)
    out = {}
    for routing in ("score", "round-robin"):
        cfg = FleetConfig(sim=sim, replicas=3, routers=2, staleness_s=0.1, routing=routing, seed=2,
                          score=ScoreConfig(min_match_tokens=64))
        out[routing] = s = FleetSimulator(cfg).run(reqs).summary
        parts = s["ttft_routing_mean_s"] + s["ttft_replica_wait_mean_s"] + s["ttft_prefill_mean_s"]
        assert parts == pytest.approx(s["ttft_mean_s"], rel=1e-9)
        assert s["ttft_routing_mean_s"] >= cfg.transit_s  # the trip to the replica at least
        assert 0 < s["ttft_alone_mean_s"] <= s["ttft_prefill_mean_s"] * (1 + 1e-9)
    rr = out["round-robin"]
    assert rr["ttft_prefill_mean_s"] > 1.05 * rr["ttft_alone_mean_s"]


def test_fleet_config_is_checked():
    sim = SimConfig(model="smollm2-135m", gpu="stub", profile=STUB, pool_blocks=48, block_size=BS)
    for bad in ({"arm": "C"}, {"replicas": 0}, {"staleness_s": -1.0}, {"routing": "random"},
                {"dedicated": (("t", (7,)),)}, {"affinity_wait_s": -1.0}, {"affinity_wait_s": float("nan")},
                {"affinity_wait_s": "5"}):
        with pytest.raises(ConfigError):
            FleetConfig(sim=sim, **bad)
    with pytest.raises(ConfigError, match="reserve exactly"):
        FleetConfig(sim=sim.with_values(policy="incremental"))


def test_cli_simulates_a_fleet(tmp_path):
    trace = "tests/data/traces/mooncake_conversation_head300.jsonl"
    cmd = [sys.executable, "-m", "kvledger.cli.main", "simulate", "--trace", trace, "--limit", "60",
           "--block-size", "512", "--pool-blocks", "120", "--replicas", "3", "--routers", "2", "--staleness", "1",
           "--arm", "B", "--no-report", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["replicas"] == 3 and s["overcommits"] == 0 and s["completed"] + s["rejected"] == 60
    bad = subprocess.run(cmd[:-1] + ["--replicas", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("kvledger: error:") and "Traceback" not in bad.stderr
    # A host tier below each replica, with evicted prefix blocks demoted to it and promoted back.
    tiered = subprocess.run(cmd + ["--host-pool", "8GiB", "--offload-prefixes"], capture_output=True, text=True,
                            timeout=300)
    assert tiered.returncode == 0, tiered.stderr
    t = json.loads(tiered.stdout)
    assert t["overcommits"] == 0 and t["completed"] + t["rejected"] == 60 and "promoted_tokens" in t
    lone = subprocess.run(cmd + ["--offload-prefixes"], capture_output=True, text=True, timeout=120)
    assert lone.returncode == 2 and lone.stderr.count("\n") == 1 and "--host-pool" in lone.stderr


def test_the_policy_imports_neither_ray_nor_torch():
    code = ("import sys, kvledger.placement.score, kvledger.placement.view, kvledger.placement.door, "
            "kvledger.sim.fleet; print(sorted(m for m in ('ray', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _route(rid: str, prompt_blocks: int, max_new: int, bs: int = 16) -> RouteRequest:
    tokens = list(range(1000 * len(rid), 1000 * len(rid) + prompt_blocks * bs))
    root = CacheContext(trust_group="acme", model="m").root_digest()
    return make_route_request(rid, "acme", prompt_digests(root, tokens, bs), len(tokens), max_new, bs)


def test_score_errors_name_the_bad_field() -> None:
    with pytest.raises(ConfigError, match="^block size must be at least 1$"):
        request_blocks(16, 16, 0)
    with pytest.raises(ConfigError, match="^min_match_tokens must be a non-negative integer, got -1$"):
        ScoreConfig(min_match_tokens=-1)


def test_a_router_ranks_by_the_prefill_of_all_its_requests_in_flight() -> None:
    view = RouterView(16, seed=0)
    view.set_replicas(["r0"])
    view.update_load("r0", ReplicaLoad(pool=100, free=100, evictable=0, promised=0, seq=5, stamp=10.0), now=10.0)
    a, b, c = _route("a", 3, 32), _route("bb", 2, 16), _route("ccc", 1, 16)
    view.routed(a, "r0")
    view.routed(b, "r0")
    (choice,) = view.rank(c, now=10.0)
    expected = replica_cost(c, 0, a.decode_blocks + b.decode_blocks, 3 + 2, 16, view.config)
    assert choice.cost == pytest.approx(expected)


def test_a_request_the_load_counted_when_accepted_gives_its_blocks_back_when_it_finishes() -> None:
    view = RouterView(16, seed=0)
    view.set_replicas(["r0"])
    view.update_load("r0", ReplicaLoad(pool=100, free=100, evictable=0, promised=0, seq=5, stamp=10.0), now=10.0)
    req = _route("a", 3, 32)
    view.routed(req, "r0")
    view.accepted("a", "r0", seq=6, load=None, now=10.1)
    # The replica's next load is stamped with the very decision that accepted it: it counts the request.
    counted = ReplicaLoad(pool=100, free=100, evictable=0, promised=0, booked=req.charge, seq=6, stamp=10.2)
    view.update_load("r0", counted, now=10.2)
    assert view.available("r0") == counted.available
    view.finished("a", "r0", seq=9, load=None, now=11.0)
    assert view.available("r0") == counted.available + req.charge


def test_a_replica_that_joins_after_another_left_does_not_inherit_a_live_replicas_prefixes() -> None:
    index = PrefixIndex()
    index.add("r0", [b"d0"])
    index.add("r1", [b"d1"])
    index.drop("r1")
    index.add("r2", [b"d2"])  # takes the bit r1 left free, not r0's
    assert (index.held_by("r0"), index.held_by("r2")) == (1, 1)
    assert index.matches([b"d2"], ["r0", "r2"]) == {"r0": 0, "r2": 1}
