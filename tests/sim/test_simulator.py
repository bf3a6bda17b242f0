"""The simulator: exact timings on a stub profile, the pool breakdown, preemption, prefix hits, sweeps,
and the report folder."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from kvledger.core.ledger import KVLedger
from kvledger.errors import ConfigError
from kvledger.scheduler import GenRequest, Scheduler, SchedulerConfig
from kvledger.sim.cost_model import DeviceProfile
from kvledger.sim.report import write_fragmentation, write_report, write_sweep
from kvledger.sim.simulator import (
    BREAKDOWN_KEYS,
    SimConfig,
    Simulator,
    Timeline,
    parse_sweep,
    percentile,
    prefix_hit_bound,
    run_sweep,
    simulate,
)
from kvledger.workloads import SimRequest, Uniform, synthetic

STEP = 0.01  # the stub device: every step costs its fixed overhead and (almost) nothing else
STUB = DeviceProfile(name="stub", peak_flops=1e30, mem_bandwidth_Bps=1e30, flops_efficiency=1.0,
                     bw_efficiency=1.0, step_overhead_s=STEP, host_link_Bps=1e30, transfer_overhead_s=0.0,
                     source="test stub")
SMALL = SimConfig(model="smollm2-135m", gpu="stub", profile=STUB, pool_blocks=64, block_size=16,
                  check_every=1)


def req(rid: str, t: float, prompt: int, out: int, base: int = 0, **kw) -> SimRequest:
    return SimRequest(rid, t, list(range(base, base + prompt)), out, **kw)


def by_id(result):
    return {r.request_id: r for r in result.requests}


def test_exact_timings_on_a_stub_profile():
    # a: 32-token prompt, 4 tokens; b arrives mid-run; c arrives after an idle gap.
    reqs = [req("a", 0.0, 32, 4), req("b", 0.025, 16, 3, base=1000), req("c", 1.0, 16, 1, base=2000)]
    res = Simulator(SMALL).run(reqs)
    r = by_id(res)
    # a: prefill at [0, .01) samples token 1; decodes end at .02, .03, .04.
    assert r["a"].ttft_s == pytest.approx(0.01)
    assert r["a"].e2e_s == pytest.approx(0.04)
    assert r["a"].tpot_s == pytest.approx(0.01)
    # b arrives at .025, joins the step starting at .03 (prefill beside a's last decode), ends at .06.
    assert r["b"].admitted_s == pytest.approx(0.03)
    assert r["b"].ttft_s == pytest.approx(0.015)
    assert r["b"].e2e_s == pytest.approx(0.035)
    assert r["b"].tpot_s == pytest.approx(0.01)
    # c: the simulator idles until 1.0; one prefill step is its whole life.
    assert r["c"].ttft_s == pytest.approx(0.01)
    assert r["c"].e2e_s == pytest.approx(0.01)
    assert r["c"].tpot_s is None
    assert [x.generated for x in res.requests] == [4, 3, 1]
    assert all(x.finish_reason == "length" for x in res.requests)
    assert res.steps == 7
    s = res.summary()
    assert s["output_tokens"] == 8
    assert s["sim_duration_s"] == pytest.approx(1.01)
    assert s["throughput_tok_s"] == pytest.approx(8 / 1.01)
    assert s["preemptions"] == {"recompute": 0, "swap": 0}


def test_breakdown_sums_to_the_pool_under_pressure():
    reqs = synthetic(60, arrivals=[0.001 * i for i in range(60)], prompt_len=Uniform(20, 120),
                     output_len=Uniform(5, 60), system_prompts=2, system_prompt_len=64, shared_fraction=0.5,
                     n=Uniform(1, 2), seed=4)
    res = simulate(reqs, SMALL, policy="incremental", pool_blocks=48, max_running=12)
    pool = res.pool_slots
    assert len(res.timeline) == res.steps
    for row in zip(*(getattr(res.timeline, k) for k in BREAKDOWN_KEYS), strict=True):
        assert sum(row) == pool
        assert min(row) >= 0
    s = res.summary()
    assert sum(s["memory_time_avg"].values()) == pytest.approx(1.0)
    assert sum(s["preemptions"].values()) > 0  # the small pool forces growth failures
    assert s["completed"] == 60
    assert s["prefix_hit_tokens"] > 0  # the system prompts are shared


def test_breakdown_matches_the_ledger_token_usage():
    ledger = KVLedger(40, 16)
    sched = Scheduler(ledger, SchedulerConfig(policy="incremental", prefill_chunk=40))
    for i in range(5):
        sched.add(GenRequest(f"r{i}", list(range(100 * i, 100 * i + 30 + 7 * i)), 20, n=1 + i % 2))
    for _ in range(25):
        plan = sched.schedule()
        tl = Timeline()
        Simulator._sample(tl, sched, ledger.sequence, ledger.pool, ledger, 16, 0.0)
        usage = ledger.token_usage()
        assert tl.tokens[0] == usage["token_slots_used"]
        assert tl.slack[0] == usage["tail_slack_slots"]
        assert sum(getattr(tl, k)[0] for k in BREAKDOWN_KEYS) == 40 * 16
        sched.confirm(plan, {w.seq_id: [7] for w in (*plan.prefills, *plan.decodes) if w.sample})


def test_swap_recovery_uses_the_host_tier():
    reqs = synthetic(30, arrivals=[0.0] * 30, prompt_len=Uniform(30, 90), output_len=Uniform(20, 80), seed=2)
    res = simulate(reqs, SMALL, policy="incremental", pool_blocks=40, recovery="swap",
                   host_pool_bytes=SMALL_BLOCK_BYTES * 400)
    assert res.preemptions["swap"] > 0
    assert res.summary()["completed"] == 30
    assert res.deployment.host_blocks == 400


SMALL_BLOCK_BYTES = 16 * 30 * 2 * 3 * 64 * 2  # smollm2-135m: 30 layers x K,V x 3 KV heads x 64 x bf16, 16 tokens


def test_trust_isolation_removes_sharing_and_bound():
    reqs = [req(f"r{i}", 0.01 * i, 64, 2) for i in range(4)]  # identical prompts
    shared = simulate(reqs, SMALL)
    isolated = simulate(reqs, SMALL, trust_groups="request")
    # All 4 full blocks of the 3 later requests are hits, but the last prompt token is always run again
    # (its logits give the first output token): 63 tokens skipped each.
    assert shared.summary()["prefix_hit_tokens"] == 3 * (64 - 1)
    assert isolated.summary()["prefix_hit_tokens"] == 0
    assert prefix_hit_bound(reqs, 16) == {"hit_tokens": 192, "prompt_tokens": 256, "bound": 0.75,
                                          "bound_with_partial_blocks": 0.75, "requests_with_hits": 3,
                                          "block_size": 16}
    assert prefix_hit_bound(reqs, 16, isolate="request")["bound"] == 0.0


def test_prefix_bound_counts_leading_full_blocks_only():
    a = req("a", 0.0, 40, 1)  # blocks [0,16) [16,32), tail 8
    b = SimRequest("b", 1.0, list(range(0, 16)) + list(range(500, 524)), 1)  # first block only
    c = SimRequest("c", 2.0, list(range(900, 916)) + list(range(16, 32)), 1)  # second block alone: no hit
    bound = prefix_hit_bound([a, b, c], 16)
    assert bound["hit_tokens"] == 16
    assert bound["prompt_tokens"] == 40 + 40 + 32


def test_declared_allowance_stops_at_the_trace_length():
    reqs = [req(f"r{i}", 0.0, 32, 5 + i, base=100 * i) for i in range(6)]
    oracle = simulate(reqs, SMALL, pool_blocks=24)
    declared = simulate(reqs, SMALL, pool_blocks=24, declared_max_new=100)
    for res in (oracle, declared):
        assert [r.generated for r in res.requests] == [5 + i for i in range(6)]
    assert {r.finish_reason for r in declared.requests} == {"stop"}
    # full reservation of 100 tokens: 9 blocks each instead of 3, so fewer run at once and it takes longer
    assert declared.summary()["peak_running"] < oracle.summary()["peak_running"]
    assert declared.summary()["sim_duration_s"] > oracle.summary()["sim_duration_s"]


def test_clamping_to_the_model_context_is_noted():
    reqs = [req("long", 0.0, 100, 50), req("zero", 0.0, 10, 0, base=500)]
    res = simulate(reqs, SMALL, max_model_len=64)
    r = by_id(res)
    assert r["long"].prompt_len == 63 and r["long"].output_len == 1
    assert r["zero"].output_len == 1
    notes = " ".join(res.notes)
    assert "cut to 63 tokens" in notes and "output_len 0" in notes


def test_never_and_stuck_requests_are_rejected_not_hung():
    reqs = [req("huge", 0.0, 64 * 16 + 1, 4), req("ok", 0.0, 16, 2, base=5000)]
    res = simulate(reqs, SMALL)
    r = by_id(res)
    assert r["huge"].finish_reason.startswith("never")
    assert r["ok"].finish_reason == "length"
    # n larger than max_running can never be admitted: the scheduler (or, failing that, the simulator's
    # stuck-queue guard) rejects it, and the queue behind it moves on.
    res = simulate([req("wide", 0.0, 16, 2, n=4), req("ok", 0.0, 16, 2, base=5000)], SMALL, max_running=2)
    r = by_id(res)
    assert r["wide"].finish_reason.startswith(("rejected", "never"))
    # A request filling most of the pool still runs once it is alone (no watermark deadlock).
    res = simulate([req("big", 0.0, 60 * 16, 2), req("ok", 0.0, 16, 2, base=5000)], SMALL, policy="incremental",
                   watermark=0.1)
    assert {r.finish_reason for r in res.requests} == {"length"}
    assert r["ok"].finish_reason == "length"


def test_finished_requests_are_dropped_from_the_scheduler():
    reqs = [req(f"r{i}", 0.0, 20, 3, base=100 * i) for i in range(10)]
    sim = Simulator(SMALL)
    res = sim.run(reqs)
    assert res.summary()["completed"] == 10
    assert not sim.scheduler.finished and not sim.scheduler.has_work()
    assert not sim.scheduler._all and not getattr(sim.scheduler, "_by_seq", {})  # token lists dropped


def test_pool_from_the_inventory_and_config_errors():
    res = simulate([req("a", 0.0, 16, 2)], SimConfig(model="smollm2-135m", gpu="l4"))
    assert res.deployment.pool_blocks > 1000 and "inventory" in res.deployment.pool_source
    with pytest.raises(ConfigError, match="no memory size"):
        simulate([req("a", 0.0, 16, 2)], SimConfig(model="smollm2-135m", gpu="stub", profile=STUB))
    with pytest.raises(ConfigError, match="policy"):
        SimConfig(policy="greedy")
    with pytest.raises(ConfigError, match="trust_groups"):
        SimConfig(trust_groups="tenants")


def test_sweep_parsing_and_grid():
    grid = parse_sweep(["policy=full,incremental", "block-size=16,32", "prefix_cache=on,off",
                        "host-pool=0,1GiB"])
    assert grid == [("policy", ["full", "incremental"]), ("block_size", [16, 32]),
                    ("prefix_cache", [True, False]), ("host_pool_bytes", [0, 2**30])]
    with pytest.raises(ConfigError, match="unknown sweep key"):
        parse_sweep(["colour=red"])
    with pytest.raises(ConfigError, match="key=v1"):
        parse_sweep(["policy"])
    with pytest.raises(ConfigError, match="integer"):
        parse_sweep(["block_size=big"])
    # A byte size needs its unit, as on the command line: device_memory=80 is not 80 bytes.
    with pytest.raises(ConfigError, match=r"size '80' has no unit: write 80GiB \(binary\), 80GB"):
        parse_sweep(["device_memory=80GiB,80"])
    assert parse_sweep(["host-pool=4096B"]) == [("host_pool_bytes", [4096])]
    reqs = [req(f"r{i}", 0.01 * i, 40, 5, base=100 * i) for i in range(6)]
    runs = run_sweep(reqs, SMALL, parse_sweep(["policy=full,incremental", "block_size=16,32"]))
    assert [v for v, _ in runs] == [{"policy": p, "block_size": b} for p in ("full", "incremental")
                                    for b in (16, 32)]
    assert all(r.summary()["completed"] == 6 for _, r in runs)


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_report_folder(tmp_path: Path):
    reqs = synthetic(20, arrivals=[0.002 * i for i in range(20)], prompt_len=Uniform(20, 60),
                     output_len=Uniform(2, 20), system_prompts=1, system_prompt_len=32, shared_fraction=0.5,
                     seed=1)
    res = simulate(reqs, SMALL)
    files = write_report(res, tmp_path / "run")
    for name in ("metrics.json", "requests.csv", "steps.csv", "occupancy.png", "latency_cdf.png",
                 "concurrency.png", "hit_rate.png"):
        path = tmp_path / "run" / name
        assert path.is_file() and path.stat().st_size > 0, name
    metrics = json.loads(files["metrics"].read_text())
    assert metrics["completed"] == 20 and metrics["config"]["policy"] == "full"
    with files["requests"].open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 20 and {"ttft_s", "tpot_s", "e2e_s", "hit_tokens", "preemptions"} <= set(rows[0])
    with files["steps"].open() as fh:
        assert sum(1 for _ in fh) == res.steps + 1
    runs = run_sweep(reqs, SMALL, parse_sweep(["policy=full,incremental"]))
    sweep = write_sweep(runs, tmp_path / "sweep")
    assert sweep["comparison_csv"].read_text().count("\n") == 3
    assert (tmp_path / "sweep" / "sweep.png").is_file()
    assert (tmp_path / "sweep" / "policy-incremental" / "metrics.json").is_file()
    from kvledger.sim.fragmentation import fragmentation_study

    frag = write_fragmentation(fragmentation_study([(10, 5)] * 6, 48, max_len=32, block_sizes=(8,)),
                               tmp_path / "frag")
    assert frag["fragmentation_png"].is_file() and frag["fragmentation_csv"].is_file()


def test_sim_config_embeds_the_scheduler_config_and_sweeps_every_key():
    """Regression: SimConfig mirrored eight scheduler settings and dropped the rest (headroom ran with
    zero headroom blocks)."""
    cfg = SimConfig(policy="incremental", on_growth_failure="headroom", headroom_blocks=4, predicted_quantile=0.5)
    assert cfg.scheduler == SchedulerConfig(policy="incremental", on_growth_failure="headroom", headroom_blocks=4,
                                            predicted_quantile=0.5)
    assert cfg.policy == "incremental" and cfg.to_dict()["headroom_blocks"] == 4
    assert SimConfig(scheduler=cfg.scheduler, watermark=0.2).scheduler.headroom_blocks == 4
    with pytest.raises(ConfigError, match="unknown simulation setting"):
        SimConfig(colour="red")
    with pytest.raises(ConfigError, match="eviction"):
        SimConfig(eviction="fifo")
    grid = parse_sweep(["headroom_blocks=0,8", "on_growth_failure=preempt,headroom", "eviction=lru,priority"])
    assert grid == [("headroom_blocks", [0, 8]), ("on_growth_failure", ["preempt", "headroom"]),
                    ("eviction", ["lru", "priority"])]
    reqs = [req(f"r{i}", 0.001 * i, 40, 30, base=100 * i) for i in range(8)]
    runs = run_sweep(reqs, SMALL.with_values(policy="incremental", pool_blocks=24, watermark=0.0), grid)
    by = {(v["headroom_blocks"], v["on_growth_failure"], v["eviction"]): r for v, r in runs}
    assert by[(8, "headroom", "lru")].config.scheduler.headroom_blocks == 8
    assert by[(8, "headroom", "priority")].config.eviction == "priority"
    # Headroom is real now: 8 of 24 blocks kept free at admission changes the run; without the
    # headroom action the setting is inert.
    peak = {k: r.summary()["peak_running"] for k, r in by.items()}
    assert peak[(8, "headroom", "lru")] < peak[(0, "headroom", "lru")] == peak[(8, "preempt", "lru")]
    assert all(r.summary()["completed"] == 8 for r in by.values())
