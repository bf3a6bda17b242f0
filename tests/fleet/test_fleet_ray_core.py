"""Ray core, no model: three ledger actors (each a real KVLedger behind its admission door) hammered by
routers whose views are deliberately stale. Every acceptance is honoured by its ledger, every law holds
after every admission, and nobody overcommits; the cluster listens on loopback only."""

from __future__ import annotations

import random
import threading
import time

import pytest

from kvledger.core.identity import CacheContext, prompt_digests
from kvledger.core.ledger import KVLedger
from kvledger.core.sizing.geometry import KVSpec
from kvledger.core.types import Request
from kvledger.placement.door import AdmissionDoor, CacheEventTap
from kvledger.placement.score import ReplicaLoad, make_route_request
from kvledger.placement.view import RouterView

from .conftest import is_loopback, listeners, ray_processes, run_with_ray

BS = 16
POOL = 40


class LedgerReplica:
    """A replica without a model: its door decides, its ledger admits at once, the caller releases."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tap = CacheEventTap()
        self.ledger = KVLedger(POOL, BS, events=self.tap)
        self.door = AdmissionDoor(self.ledger)
        self.admitted = 0
        self.broken_promises = 0

    def load(self) -> dict:
        return self.door.load().to_dict()

    def decide(self, rid: str, prompt: list[int], max_new: int, group: str) -> dict:
        request = Request(rid, prompt, max_new, CacheContext(trust_group=group))
        answer = self.door.decide(request)
        if answer.accepted:
            decision = self.ledger.admit(request)  # the only commitment: the ledger's own, atomic
            if not decision.admitted:
                self.broken_promises += 1
            self.door.admitted(rid)
            self.ledger.mark_computed(rid, len(prompt))
            self.ledger.check()
            self.door.check()
            self.admitted += 1
        events, nxt, _ = self.tap.since(0)
        return {"outcome": answer.outcome, "load": answer.load.to_dict(), "seq": answer.seq, "events": len(events)}

    def release(self, rid: str) -> dict:
        self.ledger.release(rid)
        seq = self.door.finished(rid)
        self.ledger.check()
        self.door.check()
        return {"seq": seq, "load": self.load()}

    def audit(self) -> dict:
        self.ledger.check()
        self.door.check()
        return {"admitted": self.admitted, "broken_promises": self.broken_promises, **self.door.counters(),
                "usage": self.ledger.usage().as_dict()}


def test_three_ledger_actors_under_routers_with_stale_views(ray_cluster):
    import ray

    actor_cls = ray.remote(num_cpus=0)(LedgerReplica)
    names = ["r0", "r1", "r2"]
    actors = {n: actor_cls.remote(n) for n in names}
    snapshot = {n: ReplicaLoad.from_dict(ray.get(a.load.remote())) for n, a in actors.items()}
    errors: list[BaseException] = []
    stats = {"sent": 0, "refused": 0, "accepted": 0}
    lock = threading.Lock()

    def router(k: int) -> None:
        rng = random.Random(k)
        view = RouterView(BS, seed=k)
        view.set_replicas(names)
        for n in names:  # the snapshot taken before anyone sent anything, never refreshed: stale on purpose
            view.update_load(n, snapshot[n], 0.0)
        held: list[tuple[str, str]] = []
        try:
            for i in range(40):
                group = f"t{rng.randrange(2)}"
                shared = rng.randrange(3)
                own = [k * 100_000 + i] * rng.randrange(1, 3 * BS)
                prompt = list(range(shared * 1000, shared * 1000 + 2 * BS)) + own
                max_new = rng.randrange(1, 6 * BS)
                c = CacheContext(trust_group=group)
                rid = f"k{k}-{i}"
                route = make_route_request(rid, group, prompt_digests(c.root_digest(), prompt, BS), len(prompt),
                                           max_new, BS)
                avoid: list[str] = []
                while True:
                    if len(avoid) == len(names):  # every replica said "not now": free something, new round
                        avoid = []
                        if held:
                            rid_done, where = held.pop(rng.randrange(len(held)))
                            ray.get(actors[where].release.remote(rid_done))
                        else:
                            time.sleep(0.01)  # the others hold the memory: wait for them
                    choice = view.rank(route, 0.0, avoid)[0].replica
                    view.routed(route, choice)
                    with lock:
                        stats["sent"] += 1
                    answer = ray.get(actors[choice].decide.remote(rid, prompt, max_new, group))
                    if answer["outcome"] == "accepted":
                        view.accepted(rid, choice, answer["seq"], None, 0.0)  # its load is dropped: stays stale
                        held.append((rid, choice))
                        with lock:
                            stats["accepted"] += 1
                        break
                    assert answer["outcome"] == "not_now"
                    with lock:
                        stats["refused"] += 1
                    view.refused(rid, choice, None, 0.0)
                    avoid.append(choice)
                if held and rng.random() < 0.3:
                    rid_done, where = held.pop(rng.randrange(len(held)))
                    ray.get(actors[where].release.remote(rid_done))
            for rid_done, where in held:
                ray.get(actors[where].release.remote(rid_done))
        except BaseException as exc:  # noqa: BLE001 -- reported by the test below
            errors.append(exc)

    threads = [threading.Thread(target=router, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    audits = [ray.get(a.audit.remote()) for a in actors.values()]  # every law, in every actor, once more
    assert sum(a["admitted"] for a in audits) == stats["accepted"] == 120
    assert all(a["broken_promises"] == 0 and a["overcommits"] == 0 for a in audits)
    assert stats["refused"] > 0  # the stale views did send requests where they no longer fitted
    assert all(a["usage"]["promised"] == 0 and a["usage"]["active"] == 0 for a in audits)
    for a in actors.values():
        ray.kill(a)


def test_every_ray_listener_is_on_loopback(ray_cluster):
    import ray

    @ray.remote(num_cpus=0)
    def ping() -> int:
        return 1

    assert ray.get(ping.remote()) == 1  # a worker is up and listening too
    found = listeners(ray_processes())
    assert found, "no Ray listener found: the check would prove nothing"
    outside = [x for x in found if not is_loopback(x[0])]
    assert not outside, f"Ray listens beyond loopback: {outside}"


@pytest.mark.parametrize("ip, ok", [("127.0.0.1", True), ("::ffff:127.0.0.1", True), ("0.0.0.0", False),
                                    ("10.1.2.3", False), ("::", False)])
def test_loopback_rule(ip, ok):
    assert is_loopback(ip) is ok


def test_the_live_router_and_the_simulator_rank_with_one_cost_function(monkeypatch):
    """Both deciders call the same ``replica_cost`` through the same ``RouterView.rank``: patched once, it
    is seen by Ray's request router and by the fleet simulator alike."""
    import asyncio
    from types import SimpleNamespace

    from kvledger.fleet.router import LedgerRequestRouter
    from kvledger.placement import view as view_module
    from kvledger.sim.fleet import FleetConfig, FleetSimulator
    from kvledger.sim.simulator import SimConfig
    from kvledger.workloads import Poisson, synthetic

    calls = {"n": 0}
    real = view_module.replica_cost

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(view_module, "replica_cost", counted)

    # Ray's router, built the way Ray builds it (initialize_state from request_router_kwargs), over two
    # stand-in replicas; no cluster needed to rank.
    router = LedgerRequestRouter.__new__(LedgerRequestRouter)
    router.initialize_state(view_key="one-cost-test", block_size=BS, min_match_tokens=BS)

    def replica(name: str, free: int) -> SimpleNamespace:
        rid = SimpleNamespace(to_full_id_str=lambda: name)
        load = ReplicaLoad(POOL, free, 0, 0, seq=1, stamp=0.0).to_dict()
        return SimpleNamespace(replica_id=rid, routing_stats={"load": load})

    ctx = CacheContext(trust_group="t")
    prompt = list(range(3 * BS))
    route = make_route_request("q", "t", prompt_digests(ctx.root_digest(), prompt, BS), len(prompt), BS, BS)
    router.view.routed(route, "warm")  # a name the router has never seen is ignored
    pending = SimpleNamespace(args=[{"route": route, "avoid": []}])
    ranks = asyncio.run(router.choose_replicas([replica("full", 2), replica("roomy", POOL)], pending))
    assert [r[0].replica_id.to_full_id_str() for r in ranks] == ["roomy", "full"]  # fits first
    live = calls["n"]
    assert live == 2

    sim = SimConfig(model="smollm2-135m", gpu="h100-80gb", pool_blocks=64, block_size=BS)
    FleetSimulator(FleetConfig(sim=sim, replicas=2, routers=1, staleness_s=0.0)).run(
        synthetic(5, arrivals=Poisson(10.0), prompt_len=32, output_len=4, seed=1))
    assert calls["n"] > live


def test_the_ingress_answers_never_itself_and_salts_digests_like_the_engine():
    """The ingress backend's own checks, no cluster: "never" (too long, too large for a replica's pool or
    the tenant's quota, more sequences than a replica runs) is answered at once without asking any
    replica; a cache_salt changes the digest chain exactly as the engine's context does."""
    from kvledger.errors import AdmissionError, ConfigError, QuotaError
    from kvledger.fleet.serve import FleetBackend, FleetSpec
    from kvledger.runtime.sampling import SamplingParams

    spec = FleetSpec(pool_blocks=8, block_size=BS, max_running=4, view_key="never-test")
    backend = FleetBackend(None, spec, vocab_size=100, max_context=200,
                           kv_spec=KVSpec(layers=1, kv_heads=1, head_dim=4, kv_dtype="fp32", block_size=BS))
    backend.set_quota("small", 3)
    ids, max_new, ctx = backend.check_request([1, 2, 3], 10, trust_group="t")
    assert (ids, max_new) == ([1, 2, 3], 10)
    assert ctx.root_digest() == CacheContext(trust_group="t", model=spec.model, kv_dtype="fp32").root_digest()
    salted = backend.check_request([1, 2, 3], 10, trust_group="t", cache_salt="s")[2]
    assert salted.root_digest() == CacheContext(trust_group="t", model=spec.model, kv_dtype="fp32",
                                                extra=(("cache_salt", "s"),)).root_digest()
    assert salted.root_digest() != ctx.root_digest()
    with pytest.raises(AdmissionError, match="too small"):
        backend.check_request([1] * 150, 40, trust_group="t")  # 12 blocks > a replica's 8
    with pytest.raises(QuotaError, match="quota"):
        backend.check_request([1] * 40, 20, trust_group="small")
    with pytest.raises(AdmissionError, match="context"):
        backend.check_request([1] * 200, 1, trust_group="t")
    with pytest.raises(AdmissionError, match="at once"):
        backend.check_request([1, 2], 1, SamplingParams(temperature=1.0, n=5), trust_group="t")
    with pytest.raises(ConfigError):
        backend.check_request([1, 2, 300], 1, trust_group="t")
    with pytest.raises(ConfigError):
        backend.check_request([1, 2], 1, trust_group="t", cache_salt="")


def test_local_ray_refuses_a_ray_imported_before_the_loopback_setting():
    """Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it is imported: imported first, it listens on the
    machine's private address and on every interface even with the node's address set to 127.0.0.1.
    local_ray checks every listener after ray.init and refuses (and stops) such a Ray; imported after
    kvledger.fleet, the same call gives a loopback-only Ray. (Regression: local_ray used to trust the
    setting it made too late.)"""
    import subprocess
    import sys

    def run(first: str) -> subprocess.CompletedProcess:
        code = (f"import os; os.environ.pop('RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER', None); {first}; "
                "from kvledger.fleet.serve import local_ray, ray_listeners, is_loopback; import ray; "
                "local_ray(num_cpus=1, object_store_memory=80 * 2**20, log_to_driver=False); "
                "found = ray_listeners(); ray.shutdown(); "
                "print('LISTENERS', len(found), sum(not is_loopback(x[0]) for x in found))")
        return run_with_ray([sys.executable, "-c", code])

    bad = run("import ray")
    assert bad.returncode != 0 and "ConfigError: Ray listens beyond 127.0.0.1" in bad.stderr, bad.stderr[-2000:]
    good = run("import kvledger.fleet")
    assert good.returncode == 0, good.stderr[-2000:]
    count, outside = (int(x) for x in good.stdout.split("LISTENERS")[1].split())
    assert count > 0 and outside == 0
