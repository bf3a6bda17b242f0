"""Known answers for the simulator: fixed-seed runs whose WHOLE outputs equal the stored answers.

Each case below runs something a user runs -- one simulated deployment per admission policy, victim
policy, recovery mode, tier layout and trust-group setting; a sweep; the fleet simulator with several
replicas, routers, arms and routings; the calibration fit; the fragmentation study; the report folders --
and records everything it produces: the result objects as dicts, metrics.json, the CSV files with their
headers, comparison tables, notes, counters and progress-callback sequences. The answer is compared with
``tests/sim/known_answers/<case>.json``; a difference names the first paths that changed, with both values.

Wall-clock figures (``wall_s``, the fleet's ``decision_us_*``) are replaced by their type. Floats are
rounded to 12 significant digits (10 for the calibration fit, whose optimiser runs through ``log`` and
``exp``), so a platform's last-bit differences in its maths library do not count, while any change in a
formula, a constant, a label or a key does.

After a deliberate change, regenerate and review the diff:

    KVLEDGER_UPDATE_KNOWN_ANSWERS=1 .venv/bin/python -m pytest -p no:cacheprovider tests/sim/test_sim_known_answers.py
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import kvledger.sim.plots as plots
from kvledger.sim.calibrate import (
    CALIBRATION_SHAPES,
    Measurement,
    fit_link,
    fit_links,
    fit_profile,
    fit_quality,
    step_measurements,
)
from kvledger.sim.cost_model import CostModel, DeviceProfile, get_profile
from kvledger.sim.fleet import FleetConfig, FleetSimulator
from kvledger.sim.fragmentation import fragmentation_study, run_contiguous, run_paged
from kvledger.sim.report import (
    best_under_slo,
    compare_reports,
    comparison_row,
    meets_latency,
    run_summary,
    saturation,
    write_fragmentation,
    write_report,
    write_run_report,
    write_sweep,
)
from kvledger.sim.simulator import (
    SimConfig,
    Simulator,
    build_deployment,
    prefix_hit_bound,
    prepare_workload,
    recovery_costs,
    run_sweep,
)
from kvledger.workloads import Choice, Gamma, LogNormal, Poisson, SimRequest, Uniform, synthetic

sys.path.insert(0, str(Path(__file__).resolve().parent / "known_answers"))
from known import canon, check, csv_answer, differences, json_answer  # noqa: E402

MODEL = "smollm2-135m"


# ---- workloads -----------------------------------------------------------------------------------


def mixed(count: int = 24, seed: int = 3, rate: float = 3000.0) -> list[SimRequest]:
    """Two shared system prompts, two trust groups, n of 1 to 3, three priorities, varied lengths."""
    return synthetic(count, arrivals=Poisson(rate), prompt_len=Uniform(8, 60), output_len=Uniform(1, 40),
                     system_prompts=2, system_prompt_len=32, shared_fraction=0.6, trust_groups=2,
                     n=Choice((1, 2, 3), (4.0, 1.0, 1.0)), priority=Choice((0, 1, 2)), seed=seed)


def bursty(count: int = 20, seed: int = 5) -> list[SimRequest]:
    """Gamma arrivals (cv 2), log-normal lengths, one trust group, n = 1 (the fleet's kind of workload)."""
    return synthetic(count, arrivals=Gamma(2000.0, 2.0), prompt_len=LogNormal(60, 0.8, low=4, high=200),
                     output_len=LogNormal(20, 0.7, low=1, high=60), system_prompts=3, system_prompt_len=48,
                     shared_fraction=0.7, seed=seed)


def edge_requests() -> list[SimRequest]:
    """Requests the workload preparation changes: an empty output, a prompt past the context, an output past it."""
    return [SimRequest("zero", 0.0, list(range(10)), 0), SimRequest("long", 0.001, list(range(100, 180)), 4),
            SimRequest("outgrow", 0.002, list(range(500, 530)), 40), SimRequest("ok", 0.003, list(range(900, 920)), 3)]


def base(**values: Any) -> SimConfig:
    return SimConfig(model=MODEL, gpu="h100-80gb", block_size=16, check_every=1, **values)


# ---- one simulated run ---------------------------------------------------------------------------


def sim_answer(config: SimConfig, requests: list[SimRequest], tmp: Path) -> dict[str, Any]:
    """Everything one run produces: the result, its summary, its report folder and its progress calls."""
    calls: list[tuple[float, int, int]] = []
    sim = Simulator(config)
    result = sim.run(requests, progress=lambda t, done, total: calls.append((t, done, total)), progress_every=7)
    files = write_report(result, tmp / "report", plots=False, prefix_bound=prefix_hit_bound(requests, 16))
    tl = result.timeline
    return {
        "summary": result.summary(),
        "requests": [r.to_row() for r in result.requests],
        "timeline": {c: getattr(tl, c) for c in tl.COLUMNS},
        "steps": result.steps, "preemptions": result.preemptions, "counters": result.counters,
        "notes": result.notes, "pool_slots": result.pool_slots,
        "progress": calls,
        "files": sorted(files),
        "metrics.json": json_answer(files["metrics"]),
        "requests.csv": csv_answer(files["requests"]),
        "steps.csv": csv_answer(files["steps"]),
    }


SIM_CASES: dict[str, Callable[[], tuple[SimConfig, list[SimRequest]]]] = {
    # Full reservation, prefix caching within trust groups, LRU eviction: no preemption.
    "full_lru": lambda: (base(pool_blocks=40), mixed()),
    # Incremental admission on a tight pool: growth failures preempt the latest request and recompute it.
    "incremental_latest_recompute": lambda: (base(pool_blocks=18, policy="incremental"), mixed()),
    # ... preempting the lowest priority, evicting retained blocks by priority.
    "incremental_priority": lambda: (base(pool_blocks=18, policy="incremental", victim="priority",
                                          eviction="priority"), mixed()),
    "incremental_least_computed": lambda: (base(pool_blocks=18, policy="incremental", victim="least_computed",
                                                prefix_cache=False), mixed()),
    "incremental_min_waste_headroom": lambda: (base(pool_blocks=20, policy="incremental", victim="min_waste",
                                                    on_growth_failure="headroom", headroom_blocks=2), mixed()),
    "incremental_defer": lambda: (base(pool_blocks=20, policy="incremental", on_growth_failure="defer"), mixed(12)),
    "incremental_reject": lambda: (base(pool_blocks=16, policy="incremental", on_growth_failure="reject"), mixed(12)),
    # Swap to a host tier: swap-outs, swap-ins, the link's timing.
    "swap_host": lambda: (base(pool_blocks=18, policy="incremental", recovery="swap", staging_blocks=4,
                               host_pool_bytes=64 * 147456), mixed()),
    # Host and disk tiers, evicted prefixes demoted and promoted, restores ahead, automatic recovery.
    "auto_tiers_offload": lambda: (base(pool_blocks=20, policy="incremental", recovery="auto",
                                        host_pool_bytes=8 * 147456, disk_pool_bytes=32 * 147456,
                                        offload_prefixes=True, restore_ahead=True, writeback_blocks=4,
                                        staging_blocks=2), mixed(30, seed=11)),
    # Clients declare an allowance; requests stop at their trace length; predicted reservation learns.
    "predicted_declared": lambda: (base(pool_blocks=30, policy="predicted", declared_max_new=24,
                                        predicted_min_samples=3, predicted_quantile=0.5), mixed(30, seed=7)),
    "full_declared": lambda: (base(pool_blocks=30, declared_max_new=20, max_model_len=64), mixed(16, seed=2)),
    # Trust groups per request, spread over 3 tenants, a context clamp, small steps, sampled timeline.
    "request_groups": lambda: (base(pool_blocks=40, trust_groups="request", sample_every=3), mixed()),
    "three_tenants_small_steps": lambda: (base(pool_blocks=40, trust_groups="3", seed=4, token_budget=40,
                                               prefill_chunk=24, max_running=3, watermark=0.1), mixed()),
    "context_clamps": lambda: (base(pool_blocks=12, max_model_len=64, tp=3), edge_requests()),
    # A request larger than the whole pool.
    "never_fits": lambda: (base(pool_blocks=4), [SimRequest("big", 0.0, list(range(200)), 4),
                                                 SimRequest("small", 0.1, list(range(300, 316)), 2)]),
    # Other device profiles and formats: the A100, an fp8 KV cache, TP 3.
    "a100_fp8": lambda: (SimConfig(model="qwen2.5-7b", gpu="a100-80gb", tp=2, block_size=32, pool_blocks=24,
                                   kv_dtype="fp8-scaled", check_every=1), bursty()),
    "l4_sliding": lambda: (SimConfig(model="gemma-2-9b", gpu="l4", block_size=16, pool_blocks=40, check_every=1,
                                     policy="incremental"), bursty(12)),
}


@pytest.mark.parametrize("case", sorted(SIM_CASES))
def test_simulated_runs_equal_their_known_answers(case: str, tmp_path: Path) -> None:
    config, requests = SIM_CASES[case]()
    check(f"sim-{case}", sim_answer(config, requests, tmp_path))


# ---- deployments, workload preparation, recovery prices ------------------------------------------


def deployment_answer() -> dict[str, Any]:
    out: dict[str, Any] = {}
    configs = {
        "h100_inventory": SimConfig(model=MODEL, gpu="h100-80gb"),
        "h100_tp2_util": SimConfig(model="llama-3.1-8b", gpu="H100-80GB", tp=2, utilization=0.5, max_running=64,
                                   token_budget=2048),
        "device_memory": SimConfig(model=MODEL, gpu="l4", device_memory=2 * 2**30, host_pool_bytes=2**30,
                                   disk_pool_bytes=3 * 2**30),
        "override": SimConfig(model="deepseek-v3", gpu="h200-141gb", pool_blocks=100, tp=8, max_model_len=4096),
    }
    for name, config in configs.items():
        dep = build_deployment(config)
        costs = recovery_costs(dep, 8)
        out[name] = {"pool_blocks": dep.pool_blocks, "pool_source": dep.pool_source, "inventory": dep.inventory,
                     "max_model_len": dep.max_model_len, "host_blocks": dep.host_blocks,
                     "disk_blocks": dep.disk_blocks, "block_bytes": dep.block_bytes,
                     "tiers": None if dep.tiers() is None else list(dep.tiers().names),
                     "profile": dep.profile.to_dict(), "config": config.to_dict(),
                     "recovery_costs": {"flops_per_token": costs.flops_per_token, "flops_per_s": costs.flops_per_s,
                                        "block_bytes": costs.block_bytes, "transfer": repr(costs.transfer)}}
    reqs = edge_requests()
    for groups in ("trace", "request", "2"):
        prepared, notes = prepare_workload(reqs, SimConfig(model=MODEL, trust_groups=groups, seed=1), 64)
        out[f"prepare_{groups}"] = {"requests": [[r.request_id, r.prompt_len, r.output_len, r.trust_group]
                                                 for r in prepared], "notes": notes}
    out["prefix_bound"] = {iso: prefix_hit_bound(mixed(), 16, isolate=iso) for iso in ("trace", "request")}
    out["prefix_bound"] |= {"bs8": prefix_hit_bound(mixed(), 8), "bs64": prefix_hit_bound(mixed(), 64)}
    return out


def test_deployments_and_workload_preparation_equal_their_known_answers() -> None:
    check("deployments", deployment_answer())


# ---- a sweep and its report folder ---------------------------------------------------------------


def test_a_sweep_and_its_report_equal_their_known_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: list[Any] = []
    monkeypatch.setattr(plots, "plot_sweep", lambda rows, keys, out, slo=None: drawn.append((keys, slo)) or {})
    calls: list[Any] = []
    grid = [("policy", ["full", "incremental"]), ("block_size", [16, 32])]
    runs = run_sweep(mixed(16), base(pool_blocks=30), grid, progress=lambda k, n, v: calls.append((k, n, dict(v))))
    rows = [comparison_row(v, r) for v, r in runs]
    slo = {"ttft_s": 0.01, "tpot_s": 0.005, "percentile": 90}
    files = write_sweep(runs, tmp_path / "sweep", slo=slo)
    folders = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    answer = {
        "progress": calls, "rows": rows, "files": sorted(files), "folders": folders, "plotted": drawn,
        "comparison.csv": csv_answer(files["comparison_csv"]),
        "comparison.json": json_answer(files["comparison_json"]),
        "per_run_metrics": {f: json_answer(tmp_path / "sweep" / f / "metrics.json") for f in folders},
        "per_run_files": {f: sorted(p.name for p in (tmp_path / "sweep" / f).iterdir()) for f in folders},
        "best": {f"{pct}-{t}": best_under_slo(rows, "block_size", ttft_s=t, tpot_s=t / 2, pct=pct)
                 for pct in (50, 90, 99) for t in (0.002, 0.02, 1.0)},
        "meets": [[meets_latency(r, ttft_s=0.01, tpot_s=None, pct=p) for p in (50, 90, 99)] for r in rows],
    }
    check("sweep", answer)


# ---- reports of real runs, comparisons, saturation ------------------------------------------------


def test_run_reports_comparisons_and_saturation_equal_their_known_answers(tmp_path: Path) -> None:
    result = Simulator(base(pool_blocks=14, policy="incremental")).run(mixed(30, rate=400.0))
    rows = [r.to_row() for r in result.requests]
    write_report(result, tmp_path / "a", plots=False)
    summary = run_summary(rows, wall_s=1.5, extra={"title": "replay"})
    files = write_run_report(summary, rows[:20], tmp_path / "b", plots=False)
    # Saturation of slices of the run and of hand-made rows (one request, all at once, unfinished).
    slices = {f"first_{n}": saturation(rows[:n]) for n in (1, 2, 5, 12, 30)}
    slices["unfinished"] = saturation([{**r, "finish_reason": None, "finish_s": None} if i % 3 == 0 else r
                                       for i, r in enumerate(rows)])
    slices["never"] = saturation([{**r, "finish_reason": "never: too large"} for r in rows[:3]] + rows[3:9])
    answer = {
        "run_summary": summary, "files": sorted(files),
        "metrics.json": json_answer(files["metrics"]), "requests.csv": csv_answer(files["requests"]),
        "compare": compare_reports(tmp_path / "a", tmp_path / "b"),
        "saturation": slices,
    }
    check("reports", answer)


# ---- the fleet simulator -------------------------------------------------------------------------


class FakeClock:
    """A stand-in for the fleet module's ``time``: every reading is a few microseconds after the last, so the
    routers' decision times (``decision_us_p50`` / ``p99``) are known answers too."""

    def __init__(self) -> None:
        self.readings = 0
        self.now = 0.0

    def perf_counter(self) -> float:
        self.readings += 1
        self.now += (1 + self.readings ** 3 % 97) * 1e-6
        return self.now


def fleet_answer(config: FleetConfig, requests: list[SimRequest]) -> dict[str, Any]:
    import kvledger.sim.fleet as fleet_module

    calls: list[tuple[float, int, int]] = []
    real = fleet_module.time
    fleet_module.time = FakeClock()  # type: ignore[assignment]
    try:
        result = FleetSimulator(config).run(requests, progress=lambda t, done, total: calls.append((t, done, total)))
    finally:
        fleet_module.time = real
    s = result.summary
    return {"summary": s, "per_replica": result.per_replica, "progress": calls,
            "decision_us_p50_p99_wall": [s["decision_us_p50"], s["decision_us_p99"], result.wall_s],
            "deployment_pool_blocks": result.deployment.pool_blocks}


FLEET_SIM = SimConfig(model=MODEL, gpu="h100-80gb", block_size=16, pool_blocks=24)
FLEET_CASES: dict[str, Callable[[], tuple[FleetConfig, list[SimRequest]]]] = {
    "B_score_stale": lambda: (FleetConfig(sim=FLEET_SIM, replicas=3, routers=2, staleness_s=0.05, check=True),
                              bursty(40)),
    "B_score_fresh": lambda: (FleetConfig(sim=FLEET_SIM, replicas=3, routers=1, staleness_s=0.0, check=True),
                              bursty(40)),
    "A_score_stale": lambda: (FleetConfig(sim=FLEET_SIM, replicas=3, routers=2, staleness_s=0.05, arm="A",
                                          check=True), bursty(40)),
    "A_round_robin": lambda: (FleetConfig(sim=FLEET_SIM, replicas=4, routers=2, staleness_s=0.02, arm="A",
                                          routing="round-robin", check=True), bursty(40)),
    "B_round_robin_no_usage": lambda: (FleetConfig(sim=FLEET_SIM, replicas=2, routers=3, staleness_s=0.03,
                                                   routing="round-robin", usage_on_reply=False, max_retries=0,
                                                   check=True), bursty(40)),
    "B_affinity_wait": lambda: (FleetConfig(sim=FLEET_SIM, replicas=3, routers=1, staleness_s=0.01,
                                            affinity_wait_s=0.05, probe_after_s=0.02, retry_s=0.01,
                                            transit_s=0.002, check=True), bursty(40, seed=9)),
    "B_small_queue_429": lambda: (FleetConfig(sim=SimConfig(model=MODEL, gpu="h100-80gb", block_size=16,
                                                            pool_blocks=10), replicas=2, max_queue=1,
                                              staleness_s=0.2, check=True), bursty(40, seed=2)),
    "B_dedicated_tenants": lambda: (FleetConfig(sim=FLEET_SIM, replicas=3, routers=1, staleness_s=0.05,
                                                dedicated=(("group-0", (0,)), ("group-1", (1, 2))), check=True),
                                    mixed(30)),
    "B_tiers_offload": lambda: (FleetConfig(sim=SimConfig(model=MODEL, gpu="h100-80gb", block_size=16,
                                                          pool_blocks=12, host_pool_bytes=64 * 147456,
                                                          offload_prefixes=True, recovery="swap"),
                                            replicas=2, staleness_s=0.05, check=True), bursty(40, seed=6)),
    "all_never": lambda: (FleetConfig(sim=SimConfig(model=MODEL, gpu="h100-80gb", block_size=16, pool_blocks=4),
                                      replicas=2, staleness_s=0.1),
                          [SimRequest("a", 0.0, list(range(100)), 2), SimRequest("b", 0.5, list(range(200, 300)), 2)]),
    "no_requests": lambda: (FleetConfig(sim=FLEET_SIM, replicas=3, staleness_s=0.1), []),
    "never_and_n": lambda: (FleetConfig(sim=SimConfig(model=MODEL, gpu="h100-80gb", block_size=16, pool_blocks=8),
                                        replicas=2, staleness_s=0.0),
                            [SimRequest("big", 0.0, list(range(300)), 2),
                             SimRequest("pair", 0.01, list(range(400, 420)), 3, n=2)]),
}


@pytest.mark.parametrize("case", sorted(FLEET_CASES))
def test_fleet_runs_equal_their_known_answers(case: str) -> None:
    config, requests = FLEET_CASES[case]()
    check(f"fleet-{case}", fleet_answer(config, requests))


def test_a_long_fleet_run_reports_progress_every_500_requests() -> None:
    """The progress callback fires each time 500 more requests are done, then once at the end."""
    reqs = [SimRequest(f"q{i}", i * 0.0005, [7000 + i], 1) for i in range(1100)]
    config = FleetConfig(sim=SimConfig(model=MODEL, gpu="h100-80gb", block_size=16, pool_blocks=4096,
                                       max_running=1024), replicas=2, staleness_s=0.5)
    answer = fleet_answer(config, reqs)
    done = [d for _, d, _ in answer["progress"]]
    assert done[-1] == 1100 and all(total == 1100 for _, _, total in answer["progress"])
    assert [d // 500 for d in done[:-1]] == [1, 2]
    check("fleet-progress", answer)


# ---- the calibration fit -------------------------------------------------------------------------


def calibration_answer() -> dict[str, Any]:
    truth = DeviceProfile(name="truth", peak_flops=4e11, mem_bandwidth_Bps=2e10, flops_efficiency=1.0,
                          bw_efficiency=1.0, step_overhead_s=2e-3, seq_overhead_s=3e-4, host_link_Bps=1e10,
                          transfer_overhead_s=1e-5, attention_efficiency=0.1, source="made up")
    cost = CostModel.for_model(MODEL, truth)
    # The true step times, disturbed by a fixed +-8% pattern: the fit cannot be exact.
    wobble = (1.08, 0.95, 1.02, 0.97, 1.05, 0.93, 1.0, 1.06, 0.96, 1.03, 0.99, 1.04)
    measured = [Measurement(s, cost.step_time(list(s.prefill), list(s.decode)) * w)
                for s, w in zip(CALIBRATION_SHAPES, wobble, strict=True)]
    link_points = {"block_bytes": 4096, "tiers": {
        "host": {"points": {"out": [[1, 2e-5], [4, 3.1e-5], [16, 7.9e-5]],
                            "in": [[1, 1.5e-5], [8, 4e-5], [32, 1.2e-4]]}},
        "disk": {"points": {"out": [[1, 1e-4], [64, 1e-4 + 64 * 4096 / 2e9]], "in": [[2, 9e-5], [16, 1.3e-4]]},
                 "compression": "int8", "compression_ratio": 0.53}}}
    links, link_report = fit_links(link_points)
    profile, report = fit_profile(cost, measured, host_link_Bps=1.2e10, transfer_overhead_s=2e-5, links=links,
                                  source="test fit")
    # A fit of a wildly disturbed machine: poor, with advice.
    noisy = [Measurement(m.shape, m.seconds * (3.0 if i % 4 == 0 else 1.0)) for i, m in enumerate(measured[:6])]
    poor_profile, poor_report = fit_profile(cost, noisy, host_link_Bps=1e10, transfer_overhead_s=0.0)
    # The fewest shapes a fit takes: three.
    least_profile, least_report = fit_profile(cost, measured[4:7], host_link_Bps=1e10, transfer_overhead_s=0.0)
    steps = [(((16, 0),), (), 0.01), ((), (), 0.5), ((), (40, 41), 0.002), (((8, 32), (4, 0)), (12,), 0.004),
             ((), (100,), 0.0015), (((64, 0),), (50, 60, 70), 0.02)]
    return {
        "profile": profile.to_dict(), "report": report, "links": links, "link_report": link_report,
        "poor_profile": poor_profile.to_dict(), "poor_report": poor_report,
        "least_profile": least_profile.to_dict(), "least_report": least_report,
        "fit_link": [fit_link([(1000, 1e-3), (2000, 1.5e-3), (4000, 2.6e-3)]),
                     fit_link([(1000, 1e-3), (2000, 2e-3)]), fit_link([(1000, 2e-3), (3000, 2.5e-3), (9000, 2e-3)])],
        "quality": fit_quality({"rms_log_error": 0.1, "points": [{"shape": "a", "error": 0.2},
                                                                 {"shape": "b", "error": -0.55}]}),
        "step_measurements": [[m.shape.name, m.shape.prefill, m.shape.decode, m.seconds]
                              for m in step_measurements(steps)],
        "step_measurements_limited": [m.shape.name for m in step_measurements(steps, limit=3, seed=5)],
        "shapes": [[s.name, s.prefill, s.decode] for s in CALIBRATION_SHAPES],
    }


def test_the_calibration_fit_equals_its_known_answer() -> None:
    check("calibration", calibration_answer(), digits=10)


# ---- the fragmentation study ---------------------------------------------------------------------


def test_the_fragmentation_study_equals_its_known_answer(tmp_path: Path) -> None:
    reqs = synthetic(60, arrivals=[0.0] * 60, prompt_len=LogNormal(300, 0.9, low=8, high=1500),
                     output_len=LogNormal(120, 1.0, low=1, high=700), seed=8)
    results = fragmentation_study(reqs, 8192, max_len=2048, block_sizes=(8, 16, 64))
    files = write_fragmentation(results, tmp_path / "frag", plots=False)
    # Lengths as pairs; one request longer than max_len, max_len past the capacity: rejections.
    pairs = [(700, 10), (100, 50), (300, 200), (50, 5), (900, 300), (20, 400), (256, 256), (1, 1)]
    small = fragmentation_study(pairs, 1000, max_len=1100, block_sizes=(16, 128))
    small += [run_paged(pairs, 1000, 32, watermark=0.2, max_len=600), run_contiguous(pairs, 1000, "pow2", 600)]
    answer = {"results": [r.to_dict() | {"extra": r.extra} for r in results],
              "small": [r.to_dict() | {"extra": r.extra, "fractions": r.fractions} for r in small],
              "files": sorted(files),
              "fragmentation.csv": csv_answer(files["fragmentation_csv"]),
              "fragmentation.json": json_answer(files["fragmentation_json"])}
    check("fragmentation", answer)


# ---- settings, sweeps and refusals ----------------------------------------------------------------


def refusals_answer(tmp: Path) -> dict[str, Any]:
    """Every setting's parser and every refusal of the simulator's public calls: answer or type and message."""
    from kvledger.sim.cost_model import cpu_profile_path, load_cpu_profile
    from kvledger.sim.simulator import parse_sweep, parse_value, sweep_configs

    def outcome(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 -- the refusal is the answer
            return {"error": type(exc).__name__, "message": str(exc).replace(str(tmp), "<tmp>")}

    out: dict[str, Any] = {}
    sim_bad = {"tp": 0, "block_size": True, "feed_window": 1.5, "sample_every": 0, "staging_blocks": -1,
               "host_pool_bytes": -1, "disk_pool_bytes": 1.0, "check_every": False, "seed": -2, "pool_blocks": 0,
               "device_memory": "1GiB", "max_model_len": 0, "declared_max_new": 0, "eviction": "fifo",
               "utilization": 0, "trust_groups": "0", "model": "", "profile": "h100", "colour": "red",
               "policy": "greedy", "scheduler": {"policy": "full"}}
    for key, value in sim_bad.items():
        out[f"SimConfig({key}={value!r})"] = outcome(lambda k=key, v=value: SimConfig(**{k: v}).to_dict())
    out["SimConfig(utilization=1, trust_groups=7)"] = outcome(lambda: SimConfig(utilization=1, trust_groups=7,
                                                                                policy="incremental").to_dict())
    out["SimConfig.with_values"] = outcome(lambda: SimConfig(model=MODEL).with_values(victim="priority", tp=2,
                                                                                      profile=PROFILE).to_dict())
    out["SimConfig.__getattr__"] = outcome(lambda: [SimConfig(headroom_blocks=3).headroom_blocks,
                                                    SimConfig().token_budget])
    out["SimConfig.nothing"] = outcome(lambda: SimConfig().nothing)
    texts = {"policy": "incremental", "block-size": "32", "prefix_caching": "off", "prefix_cache": "yes",
             "host_pool": "64GiB", "disk-pool": "0B", "device_memory": "none", "device": "a100-80gb",
             "isolate-groups": "on", "isolate_groups": "off", "pool_blocks": "1_024", "max_model_len": "none",
             "declared_max_new": "64", "utilization": "0.5", "watermark": "0.02", "kv_dtype": "NONE",
             "offload_prefixes": "1", "restore_ahead": "0", "seed": "7", "trust_groups": "request",
             "max_running": "x", "utilization ": "high", "prefix_cache ": "maybe", "isolate-groups ": "2",
             "colour": "red", "host_pool_bytes": "lots", "headroom_blocks": "1.5"}
    for key, text in texts.items():
        out[f"parse_value({key!r}, {text!r})"] = outcome(lambda k=key, t=text: list(parse_value(k, t)))
    for specs in (["policy=full,incremental", "block_size=16,32"], ["host-pool=1GiB, 2GiB,"], ["policy"],
                  ["=1"], ["policy="], ["policy=full", "policy=incremental"], ["block_size=16", "block-size=32"]):
        out[f"parse_sweep({specs})"] = outcome(lambda sp=specs: [[k, v] for k, v in parse_sweep(sp)])
    out["sweep_configs"] = outcome(lambda: [[v, c.to_dict()] for v, c in sweep_configs(
        SimConfig(model=MODEL), [("policy", ["full", "predicted"]), ("tp", [1, 3])])])
    fleet_bad = {"replicas": 0, "routers": True, "max_queue": -1, "max_retries": 1001, "staleness_s": -1,
                 "transit_s": float("inf"), "retry_s": 0, "probe_after_s": 86401, "affinity_wait_s": "1",
                 "arm": "C", "routing": "random", "sim": "x", "dedicated": (("t", (5,)),)}
    for key, value in fleet_bad.items():
        out[f"FleetConfig({key}={value!r})"] = outcome(lambda k=key, v=value: repr(FleetConfig(**{k: v})))
    out["FleetConfig(replicas=65)"] = outcome(lambda: repr(FleetConfig(replicas=65)))
    out["FleetConfig(dedicated empty)"] = outcome(lambda: repr(FleetConfig(dedicated=(("t", ()),))))
    out["FleetConfig(policy)"] = outcome(lambda: repr(FleetConfig(sim=SimConfig(policy="incremental"))))
    out["FleetConfig(declared)"] = outcome(lambda: repr(FleetConfig(sim=SimConfig(declared_max_new=5))))
    out["FleetConfig.retries"] = [FleetConfig(replicas=5).retries, FleetConfig(replicas=5, max_retries=0).retries]
    out["build_deployment(no memory)"] = outcome(lambda: build_deployment(SimConfig(model=MODEL, gpu="cpu-local",
                                                                                    profile=PROFILE)))
    out["build_deployment(no room)"] = outcome(lambda: build_deployment(SimConfig(model="llama-3.1-70b", gpu="l4")))
    out["build_deployment(unknown gpu)"] = outcome(lambda: build_deployment(SimConfig(model=MODEL, gpu="tpu")))
    # Reports: folders and files that cannot be written, reports that cannot be read.
    blocker = tmp / "file"
    blocker.write_text("x")
    result = Simulator(base(pool_blocks=40)).run(mixed(4))
    out["write_report(under a file)"] = outcome(lambda: write_report(result, blocker / "r", plots=False))
    (tmp / "ro" / "metrics.json").mkdir(parents=True)
    out["write_report(metrics is a folder)"] = outcome(lambda: write_report(result, tmp / "ro", plots=False))
    (tmp / "ro2" / "requests.csv").mkdir(parents=True)
    out["write_report(requests is a folder)"] = outcome(lambda: write_report(result, tmp / "ro2", plots=False))
    (tmp / "ro3" / "steps.csv").mkdir(parents=True)
    out["write_report(steps is a folder)"] = outcome(lambda: write_report(result, tmp / "ro3", plots=False))
    good = tmp / "good"
    write_report(result, good, plots=False)
    for name, content in (("missing", None), ("bad", "{"), ("list", "[1]"), ("deep", "[" * 100_000)):
        folder = tmp / name
        folder.mkdir()
        if content is not None:
            (folder / "metrics.json").write_text(content)
        out[f"compare_reports({name})"] = outcome(lambda f=folder: compare_reports(good, f))
        out[f"compare_reports({name}, reversed)"] = outcome(lambda f=folder: compare_reports(f, good))
    for pct in (50, 75):
        out[f"best_under_slo(pct={pct})"] = outcome(lambda p=pct: best_under_slo([], "rate", ttft_s=1.0, pct=p))
        out[f"meets_latency(pct={pct})"] = outcome(lambda p=pct: meets_latency({}, ttft_s=1.0, pct=p))
    out["run_summary(no rows)"] = outcome(lambda: run_summary([], wall_s=0.0))
    out["saturation(no rows)"] = outcome(lambda: saturation([]))
    empty = tmp / "empty"
    out["write_run_report(no rows)"] = outcome(lambda: sorted(write_run_report(run_summary([], wall_s=0.0), [],
                                                                               empty, plots=False)))
    out["write_run_report(no rows).csv"] = (empty / "requests.csv").read_text()
    out["write_fragmentation(nothing)"] = outcome(lambda: sorted(write_fragmentation([], tmp / "nofrag")))
    out["write_fragmentation(nothing).csv"] = (tmp / "nofrag" / "fragmentation.csv").read_text()
    out["write_sweep(nothing)"] = outcome(lambda: sorted(write_sweep([], tmp / "nosweep")))
    out["write_sweep(nothing).csv"] = (tmp / "nosweep" / "comparison.csv").read_text()
    # The fragmentation study, the calibration and the cost model.
    out["fragmentation(bad mode)"] = outcome(lambda: run_contiguous([(1, 1)], 100, "best", 50))
    out["fragmentation(no output)"] = outcome(lambda: run_paged([(4, 0)], 100, 16))
    out["fragmentation(no block)"] = outcome(lambda: run_paged([(4, 1)], 10, 16))
    out["fragmentation(token ids)"] = outcome(lambda: run_paged([(2**31, 1), (2**31, 1)], 2**33, 2**20))
    cost = CostModel.for_model(MODEL, PROFILE)
    shape = CALIBRATION_SHAPES[0]
    out["fit_profile(2 shapes)"] = outcome(lambda: fit_profile(cost, [Measurement(shape, 1.0)] * 2,
                                                               host_link_Bps=1.0, transfer_overhead_s=0.0))
    out["fit_profile(zero time)"] = outcome(lambda: fit_profile(cost, [Measurement(shape, 1.0)] * 3
                                                                + [Measurement(shape, 0.0)], host_link_Bps=1.0,
                                                                transfer_overhead_s=0.0))
    for limit in (2, 10_001, True, 3):
        out[f"step_measurements(limit={limit!r})"] = outcome(
            lambda lim=limit: [m.shape.name for m in step_measurements([(((1, 0),), (), 1.0)] * 4, limit=lim)])
    out["step_measurements(bad time)"] = outcome(lambda: step_measurements([(((1, 0),), (), 1.0), ((), (3,), "1")]))
    out["step_measurements(inf)"] = outcome(lambda: step_measurements([((), (3,), float("inf"))]))
    out["step_measurements(idle)"] = outcome(lambda: step_measurements([((), (), 1.0)] * 5 + [((), (3,), 1.0)] * 2))
    out["fit_link(one size)"] = outcome(lambda: fit_link([(100, 1.0), (100, 2.0)]))
    out["fit_link(zero time)"] = outcome(lambda: fit_link([(100, 1.0), (200, 0.0)]))
    out["fit_link(zero bytes)"] = outcome(lambda: fit_link([(0, 1.0), (200, 2.0)]))
    out["fit_quality(no points)"] = outcome(lambda: fit_quality({"rms_log_error": 0.0, "points": []}))
    out["fit_quality(edges)"] = [fit_quality({"rms_log_error": r, "points": [{"shape": "s", "error": e}]})
                                 for r, e in ((0.2, 0.5), (0.2000001, 0.0), (0.0, -0.5000001))]
    out["cost_model(bad spec)"] = outcome(lambda: CostModel({}, "spec", PROFILE))
    out["cost_model(bad profile)"] = outcome(lambda: CostModel({}, build_deployment(base(pool_blocks=4)).spec, "p"))
    other = build_deployment(SimConfig(model="qwen2.5-7b", pool_blocks=4))
    out["cost_model(layers)"] = outcome(lambda: CostModel(build_deployment(base(pool_blocks=4)).model_cfg,
                                                          other.spec, PROFILE))
    mla = build_deployment(SimConfig(model="deepseek-v3", pool_blocks=4))
    out["cost_model(mla)"] = outcome(lambda: CostModel({**mla.model_cfg, "kv_lora_rank": None}, mla.spec, PROFILE))
    out["cost_model(tp)"] = outcome(lambda: CostModel.for_model(MODEL, PROFILE, tp=2))
    out["cost_model(prefill)"] = [outcome(lambda e=e: cost.breakdown([e], [])) for e in
                                  ((0, 1), (1, -1), (True, 0), (1,), 5, (1, 2.0))]
    out["cost_model(decode)"] = [outcome(lambda d=d: cost.breakdown([], d)) for d in ([0], [1, True], [2.0], (3, -4))]
    out["cost_model(recompute)"] = [outcome(lambda n=n: cost.recompute_time(n)) for n in (-1, 1.0, False)]
    out["get_profile(unknown)"] = outcome(lambda: get_profile("tpu-v5"))
    out["get_profile(case)"] = outcome(lambda: get_profile(" H100-80GB ").name)
    out["load_cpu_profile(missing)"] = outcome(lambda: load_cpu_profile(tmp / "none.json"))
    (tmp / "bad.json").write_text('{"peak_flops": ')
    out["load_cpu_profile(bad json)"] = outcome(lambda: load_cpu_profile(tmp / "bad.json"))
    (tmp / "latin.json").write_bytes(b'{"name": "\xe9"}')
    out["load_cpu_profile(not utf8)"] = outcome(lambda: load_cpu_profile(tmp / "latin.json"))
    (tmp / "cpu.json").write_text(json.dumps({k: v for k, v in PROFILE.to_dict().items() if k != "name"}))
    out["load_cpu_profile(good)"] = outcome(lambda: load_cpu_profile(tmp / "cpu.json").to_dict())
    out["cpu_profile_path"] = str(cpu_profile_path().relative_to(cpu_profile_path().parents[1]))
    return out


PROFILE = DeviceProfile(name="round", peak_flops=1e12, mem_bandwidth_Bps=1e11, flops_efficiency=0.5,
                        bw_efficiency=0.8, step_overhead_s=2e-3, seq_overhead_s=1e-4, host_link_Bps=1e9,
                        transfer_overhead_s=5e-6, attention_efficiency=0.25, source="by hand")


def test_settings_and_refusals_equal_their_known_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLEDGER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(plots, "plot_sweep", lambda *a, **k: {})
    check("refusals", refusals_answer(tmp_path))


# ---- the cost model on every bundled model --------------------------------------------------------


def test_the_cost_model_on_every_bundled_model_equals_its_known_answer() -> None:
    from kvledger.core.sizing.models import list_models

    shapes = [((), (1,)), (((512, 0),), ()), (((128, 4000),), (100, 5000, 9000)), ((), (4096,) * 8)]
    answer: dict[str, Any] = {}
    for model in list_models():
        for gpu, tp in (("h100-80gb", 1), ("l4", 2)):
            try:
                cost = CostModel.for_model(model, get_profile(gpu), tp=tp)
            except Exception as exc:  # noqa: BLE001 -- the refusal is part of the answer
                answer[f"{model}/{gpu}/tp{tp}"] = {"error": type(exc).__name__, "message": str(exc)}
                continue
            answer[f"{model}/{gpu}/tp{tp}"] = {
                "weight_bytes_per_step": cost.weight_bytes_per_step, "weight_dtype": cost.weight_dtype,
                "heads_per_rank": cost.heads_per_rank, "prefill_dims": cost.prefill_dims,
                "decode_dims": cost.decode_dims, "window": cost.window,
                "steps": [dataclasses.asdict(cost.breakdown(list(p), list(d))) | {
                    "time_s": cost.step_time(list(p), list(d)), "bound": cost.breakdown(list(p), list(d)).bound}
                    for p, d in shapes],
                "recompute_700_at_300": cost.recompute_time(700, 300),
                "swap_1MiB_x3": cost.swap_time(2**20, 3), "kv_bytes_1000": cost.kv_bytes_for_tokens(1000),
            }
    check("cost-models", answer)


def test_a_changed_answer_is_reported() -> None:
    """The comparison can fail, and names where: one figure, one key, one length."""
    expected = {"a": [1, 2.5, {"x": "l"}], "b": 3}
    assert differences(expected, json.loads(json.dumps(expected))) == []
    assert differences(expected, {"a": [1, 2.5, {"x": "m"}], "b": 3}) == ['.a[2].x: expected "l", got "m"']
    assert differences(expected, {"a": [1, 2.5], "b": 3})[0] == ".a: length 3 != 2"
    assert differences(expected, {"b": 3, "a": [1, 2.5, {"x": "l"}]})[0].startswith(": keys")
    assert differences({"v": 1}, {"v": 1.0}) == [".v: expected 1, got 1.0"]
    assert canon({"wall_s": 3.2, "t": 1 / 3, "f": math.inf}) == {"wall_s": "<float>", "t": 0.333333333333, "f": "inf"}
