"""The eviction study's parts (issue 38): the conversation sharing model, one trace's study on a committed
Mooncake slice (Belady above every policy, the bound's bracket around the honest optimum), the verdict,
and the simulator's ``demotion`` and ``eviction`` settings with the new policies and the cost rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvledger.errors import ConfigError
from kvledger.sim.eviction_study import SharingModel, plot_study, study_trace, verdict, with_conversations
from kvledger.sim.simulator import SimConfig, Simulator, build_deployment
from kvledger.workloads import SimRequest, load_trace

DATA = Path(__file__).resolve().parent.parent / "data" / "traces"
MOONCAKE = DATA / "mooncake_conversation_head300.jsonl"


def _requests(n: int) -> list[SimRequest]:
    return [SimRequest(f"r{i}", float(i), [1] * (100 + i), 10 + i) for i in range(n)]


def test_the_conversation_model_shares_system_prompts_and_extends_recent_conversations() -> None:
    reqs = with_conversations(_requests(40), SharingModel(followup=0.5, system_prompts=2, system_tokens=64))
    assert [r.arrival_s for r in reqs] == [float(i) for i in range(40)]
    heads = {r.prompt_tokens[:64].runs for r in reqs}
    assert len(heads) <= 2 + sum(1 for r in reqs if r.prompt_len > 64 + 139)  # system prompts or histories
    grown = [r for r, base in zip(reqs, _requests(40), strict=True) if r.prompt_len > 64 + base.prompt_len]
    assert grown, "some requests continue a conversation"
    prompts = [r.prompt_tokens.tolist() for r in reqs]
    for r in grown:
        mine = r.prompt_tokens.tolist()
        assert any(len(p) < len(mine) and mine[:len(p)] == p for p in prompts)  # an earlier prompt is its prefix
    again = with_conversations(_requests(40), SharingModel(followup=0.5, system_prompts=2, system_tokens=64))
    assert [r.prompt_tokens.runs for r in again] == [r.prompt_tokens.runs for r in reqs]  # seeded


def test_one_trace_study_on_the_mooncake_slice() -> None:
    reqs = load_trace(MOONCAKE)[:80]
    dep = build_deployment(SimConfig(block_size=512))
    study = study_trace("mooncake-head", reqs, 512, [40, 120, 400], dep.block_cost, ["lru", "gdsf", "s3fifo"])
    assert study.requests + study.dropped == 80 and study.requests > 40
    for row in study.rows:
        for p in ("lru", "gdsf", "s3fifo"):
            assert row.hit_rate[p] <= row.hit_rate["belady"] + 1e-12
            assert row.saved_s[p] <= row.saved_s["bound_upper"] * (1 + 1e-6)
        assert row.saved_s["belady"] <= row.saved_s["bound_lower"] <= row.saved_s["bound_upper"] * (1 + 1e-6)
        assert row.hit_rate["belady"] <= study.unbounded_hit_rate + 1e-12
    assert [r.hit_rate["belady"] for r in study.rows] == sorted(r.hit_rate["belady"] for r in study.rows)
    shares = verdict(study, "lru")
    assert all(0 <= v["hit_share"] <= 1 + 1e-9 for v in shares) and len(shares) == 3


def test_the_study_plot_is_written(tmp_path: Path) -> None:
    reqs = load_trace(MOONCAKE)[:30]
    dep = build_deployment(SimConfig(block_size=512))
    study = study_trace("m", reqs, 512, [60, 200], dep.block_cost, ["lru"])
    plot_study(study, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_the_simulator_takes_the_demotion_rule_by_name() -> None:
    with pytest.raises(ConfigError, match="demotion must be one of always, cost"):
        SimConfig(demotion="never")
    assert SimConfig(demotion="cost").to_dict()["demotion"] == "cost"


def test_cost_aware_demotion_declines_what_the_disk_cannot_give_back_in_time() -> None:
    """Mooncake slice, a 64-block pool of 512-token blocks, a disk tier: with ``always`` every evicted block
    is copied down urgently; with ``cost`` (gdsf knows each block's depth) an urgent disk copy of a shallow
    block is declined, since writing and reading 64 MiB takes longer than recomputing it."""
    reqs = load_trace(MOONCAKE)[:40]
    out = {}
    for demotion in ("always", "cost"):
        cfg = SimConfig(block_size=512, pool_blocks=300, eviction="gdsf", disk_pool_bytes=4000 * 64 * 2**20,
                        offload_prefixes=True, demotion=demotion)
        res = Simulator(cfg).run(reqs)
        tiers = res.counters["tiers"]
        out[demotion] = (res.summary(), tiers.get("declined", 0), tiers["flow"]["demoted"])
    assert out["always"][1] == 0 and out["always"][2] > 0
    assert out["cost"][1] > 0 and out["cost"][2] < out["always"][2]
    assert all(s["completed"] == 40 for s, _, _ in out.values())
