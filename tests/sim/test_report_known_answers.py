"""Every percentile a simulator report prints, against answers worked out by hand.

Nine hand-built requests go through every report: the run summary (`simulate`'s table, its JSON and
metrics.json), a sweep row (the curve table, comparison.csv/json, the SLO), the saturation verdict, a real
run's summary (`serve-trace`'s metrics.json) and `compare`. Percentiles interpolate linearly between order
statistics: p(q) of n sorted values sits at position (n - 1) * q / 100 (docs: kvledger.scheduler.metrics).
Each expected value below is that rule applied by hand, so a report that switched to nearest-rank, truncated
the position, or counted the wrong requests gives other numbers."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from kvledger.cli import sim_cmds
from kvledger.cli.main import main
from kvledger.scheduler import RequestMetrics
from kvledger.sim.cost_model import DeviceProfile
from kvledger.sim.report import (
    best_under_slo,
    comparison_row,
    keeps_up,
    run_summary,
    saturation,
    write_report,
    write_run_report,
)
from kvledger.sim.simulator import SimConfig, SimResult, Timeline, build_deployment

STUB = DeviceProfile(name="stub", peak_flops=1e30, mem_bandwidth_Bps=1e30, flops_efficiency=1.0, bw_efficiency=1.0,
                     step_overhead_s=0.01, host_link_Bps=1e30, transfer_overhead_s=0.0, source="test stub")
CONFIG = SimConfig(model="smollm2-135m", gpu="stub", profile=STUB, pool_blocks=64, block_size=16)

# (id, arrival s, TTFT s, output tokens, TPOT s): first token = arrival + TTFT,
# finish = first token + TPOT x (tokens - 1), end-to-end = finish - arrival.
PLAN = [
    ("r0", 0.0, 0.10, 5, 0.02),   # finish 0.18, e2e 0.18
    ("r1", 1.0, 0.20, 3, 0.05),   # finish 1.30, e2e 0.30
    ("r2", 2.0, 0.30, 1, None),   # one token: no TPOT; finish 2.30, e2e 0.30
    ("r3", 3.0, 0.40, 11, 0.01),  # finish 3.50, e2e 0.50
    ("r4", 4.0, 0.50, 2, 0.40),   # finish 4.90, e2e 0.90
    ("r5", 5.0, 0.60, 6, 0.04),   # finish 5.80, e2e 0.80
    ("r6", 6.0, 0.70, 4, 0.10),   # finish 7.00, e2e 1.00
    ("r7", 7.0, 1.70, 3, 0.15),   # finish 9.00, e2e 2.00
]

# TTFT, 8 values sorted: 0.1 0.2 0.3 0.4 0.5 0.6 0.7 1.7.
#   p50 at 3.5: 0.4 + 0.5 x 0.1 = 0.45; p90 at 6.3: 0.7 + 0.3 x 1.0 = 1.0; p99 at 6.93: 0.7 + 0.93 x 1.0 = 1.63
#   mean 4.5 / 8 = 0.5625 (the rejected request never had a first token and does not count)
TTFT = {"mean": 0.5625, "p50": 0.45, "p90": 1.0, "p99": 1.63, "max": 1.7}
# TPOT, 7 values (r2 has none) sorted: 0.01 0.02 0.04 0.05 0.10 0.15 0.40.
#   p50 at 3: 0.05; p90 at 5.4: 0.15 + 0.4 x 0.25 = 0.25; p99 at 5.94: 0.15 + 0.94 x 0.25 = 0.385; mean 0.77 / 7
TPOT = {"mean": 0.11, "p50": 0.05, "p90": 0.25, "p99": 0.385, "max": 0.4}
# End-to-end over completed requests, 8 values sorted: 0.18 0.30 0.30 0.50 0.80 0.90 1.00 2.00.
#   p50 at 3.5: 0.5 + 0.5 x 0.3 = 0.65; p90 at 6.3: 1.0 + 0.3 x 1.0 = 1.3; p99 at 6.93: 1.93; mean 5.98 / 8
E2E = {"mean": 0.7475, "p50": 0.65, "p90": 1.3, "p99": 1.93, "max": 2.0}


def records() -> list[RequestMetrics]:
    out = []
    for rid, arrival, ttft, tokens, tpot in PLAN:
        first = arrival + ttft
        finish = first + (tpot or 0.0) * (tokens - 1)
        out.append(RequestMetrics(rid, "default", arrival, prompt_len=32, output_len=tokens, admitted_s=arrival,
                                  first_token_s=first, finish_s=finish, generated=tokens, longest=tokens,
                                  finish_reason="length"))
    # Larger than the pool: rejected on arrival, no token. It counts in no latency (its end-to-end time of 0
    # would pull E2E p50 down to 0.5) and the saturation verdict leaves it out.
    out.append(RequestMetrics("big", "default", 3.5, prompt_len=9999, output_len=8, finish_s=3.5,
                              finish_reason="never: larger than the whole pool"))
    return sorted(out, key=lambda r: (r.arrival_s, r.request_id))


def sim_result() -> SimResult:
    return SimResult(CONFIG, build_deployment(CONFIG), records(), Timeline(), steps=0,
                     preemptions={"recompute": 0, "swap": 0}, counters={}, notes=[], wall_s=0.0)


def approx(expected: dict[str, float]) -> dict[str, object]:
    return {k: pytest.approx(v) for k, v in expected.items()}


def test_the_request_metrics_are_the_planned_ones() -> None:
    by_id = {r.request_id: r for r in records()}
    assert by_id["r3"].ttft_s == pytest.approx(0.4) and by_id["r3"].tpot_s == pytest.approx(0.01)
    assert by_id["r3"].e2e_s == pytest.approx(0.5)
    assert by_id["r2"].tpot_s is None and by_id["big"].ttft_s is None and not by_id["big"].completed


def test_the_simulated_run_summary() -> None:
    s = sim_result().summary()
    assert s["ttft_s"] == approx(TTFT)
    assert s["tpot_s"] == approx(TPOT)
    assert s["e2e_s"] == approx(E2E)
    assert (s["requests"], s["completed"]) == (9, 8)


def test_the_saturation_verdict() -> None:
    """Quarters of the 8 arrivals the verdict counts: TTFT medians of r0, r1 (0.1, 0.2 -> 0.15) and r6, r7
    (0.7, 1.7 -> 1.2). offered = 7 gaps / 7 s = 1 req/s; served = 8 completed / 9 s (first arrival to last
    finish) = 0.889 req/s: below 95%, and the late TTFT more than twice the early one."""
    sat = saturation([r.to_row() for r in records()])
    assert sat["ttft_early_s"] == pytest.approx(0.15)
    assert sat["ttft_late_s"] == pytest.approx(1.2)
    assert sat["offered_req_s"] == pytest.approx(1.0)
    assert sat["served_req_s"] == pytest.approx(8 / 9)
    assert sat["saturated"] and sat["reason"] == "served 0.89 of 1.00 req/s offered; median TTFT grew from 150 ms " \
                                                 "to 1200 ms"
    assert not keeps_up(sat)


def test_the_sweep_row_and_its_slo() -> None:
    row = comparison_row({"rate": 1}, sim_result())
    assert row["ttft_p50_s"] == pytest.approx(0.45)
    assert row["ttft_p90_s"] == pytest.approx(1.0)
    assert row["ttft_p99_s"] == pytest.approx(1.63)
    assert row["tpot_p50_s"] == pytest.approx(0.05)
    assert row["tpot_p90_s"] == pytest.approx(0.25)
    assert row["tpot_p99_s"] == pytest.approx(0.385)
    assert row["e2e_p99_s"] == pytest.approx(1.93)
    assert row["served_req_s"] == pytest.approx(8 / 9) and row["keeps_up"] is False
    # The SLO reads the same percentiles (targets 1 us either side of each). The row stands for a run that
    # kept up (not saturated, served all it was offered) so only the latency decides.
    kept_up = {**row, "saturated": False, "keeps_up": True, "served_req_s": 1.0}
    for pct, ttft, tpot in ((50, 0.45, 0.05), (90, 1.0, 0.25), (99, 1.63, 0.385)):
        assert best_under_slo([kept_up], "rate", ttft_s=ttft + 1e-6, tpot_s=tpot + 1e-6, pct=pct) is kept_up
        assert best_under_slo([kept_up], "rate", ttft_s=ttft - 1e-6, pct=pct) is None
        assert best_under_slo([kept_up], "rate", tpot_s=tpot - 1e-6, pct=pct) is None
    assert best_under_slo([row], "rate", ttft_s=10.0, pct=50) is None  # served 89% of the offered rate


def test_a_real_runs_summary_uses_the_same_definitions() -> None:
    s = run_summary([r.to_row() for r in records()], wall_s=1.0)
    assert s["ttft_s"] == approx(TTFT)
    assert s["tpot_s"] == approx(TPOT)
    assert s["e2e_s"] == approx(E2E)
    assert s["saturation"]["ttft_early_s"] == pytest.approx(0.15)
    assert s["saturation"]["ttft_late_s"] == pytest.approx(1.2)


def test_report_folders_and_compare_print_the_known_percentiles(tmp_path: Path, capsys) -> None:
    result = sim_result()
    write_report(result, tmp_path / "sim", plots=False)
    rows = [r.to_row() for r in result.requests]
    write_run_report(run_summary(rows, wall_s=1.0), rows, tmp_path / "real", plots=False)
    for name in ("sim", "real"):
        metrics = json.loads((tmp_path / name / "metrics.json").read_text())
        assert metrics["ttft_s"] == approx(TTFT) and metrics["tpot_s"] == approx(TPOT), name
        assert metrics["e2e_s"] == approx(E2E), name
        assert metrics["saturation"]["ttft_early_s"] == pytest.approx(0.15), name
    assert main(["compare", str(tmp_path / "sim"), str(tmp_path / "real"), "--json"]) == 0
    got = {m["metric"]: (m["first"], m["second"]) for m in json.loads(capsys.readouterr().out)["metrics"]}
    for key, expected in (("ttft", TTFT), ("tpot", TPOT), ("e2e", E2E)):
        for pct in ("p50", "p90", "p99"):
            assert got[f"{key}_{pct}_s"] == (pytest.approx(expected[pct]), pytest.approx(expected[pct])), (key, pct)
    assert main(["compare", str(tmp_path / "sim"), str(tmp_path / "real")]) == 0
    table = capsys.readouterr().out
    for text in ("450.0 ms", "1,000.0 ms", "1,630.0 ms", "385.0 ms", "650.0 ms", "1,930.0 ms"):
        assert text in table, text


def _render(table) -> str:
    console = Console(width=240, file=io.StringIO())
    console.print(table)
    return " ".join(console.file.getvalue().split())


def test_the_simulate_tables_print_the_known_percentiles_in_ms() -> None:
    result = sim_result()
    summary = result.summary()
    summary["saturation"] = saturation([r.to_row() for r in result.requests])
    text = _render(sim_cmds._summary_table(summary, "known answers"))
    assert "TTFT ms (mean / p50 / p90 / p99) │ 562.5 / 450.0 / 1,000.0 / 1,630.0" in text
    assert "TPOT ms (mean / p50 / p90 / p99) │ 110.0 / 50.0 / 250.0 / 385.0" in text
    assert "end-to-end ms (mean / p50 / p90 / p99) │ 747.5 / 650.0 / 1,300.0 / 1,930.0" in text
    row = comparison_row({"rate": 1}, result)
    text = _render(sim_cmds._curve_table([row], ["rate"]))
    # rate, offered, served, out tok/s (35 tokens / 9 s), then TTFT p50 / p90 / p99 and TPOT p50 / p90 / p99 in ms
    assert "│ 1 │ 1.00 │ 0.89 │ 3.9 │ 450.0 │ 1,000.0 │ 1,630.0 │ 50.0 │ 250.0 │ 385.0 │" in text
