"""`kvledger simulate --replicas N --routers R --staleness S`: the fleet simulator's face.

Called by ``simulate`` when ``--replicas`` is given; the simulator is imported here, lazily.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError


def run_fleet(base: Any, requests: list[Any], *, replicas: int, routers: int, staleness: float, arm: str,
              routing: str, transit_ms: float, retries: int | None, min_match: int, queue_weight: float,
              label: str, as_json: bool, emit_json: Any, console: Any, sweep: bool, folder: Path | None = None,
              progress_bar: Any = None) -> None:
    """Run one fleet and print it; ``folder`` (``--out``, unless ``--no-report``) gets its report, and
    ``progress_bar`` (the simulator's rich bar, inert off a terminal) shows how far the run is."""
    from ..placement.score import ScoreConfig
    from ..sim.fleet import FleetConfig, FleetSimulator

    if sweep:
        raise ConfigError("--replicas runs one fleet; --sweep is for single-replica simulations")
    if base.scheduler.policy != "full":
        raise ConfigError("fleet replicas reserve exactly: use --policy full (the default)")
    if base.pool_blocks is None:
        raise ConfigError("give --pool-blocks: the KV pool of each replica")
    config = FleetConfig(sim=base, replicas=replicas, routers=routers, staleness_s=staleness, arm=arm,
                         routing=routing, transit_s=transit_ms / 1e3, max_retries=retries, seed=base.seed,
                         score=ScoreConfig(min_match_tokens=min_match, queue_weight=queue_weight))
    if progress_bar is None:
        result = FleetSimulator(config).run(requests)
    else:
        update, bar, _task = progress_bar("fleet")
        with bar:
            result = FleetSimulator(config).run(requests, progress=update)
    if folder is not None:
        from ..sim.report import write_fleet_report

        write_fleet_report(result, folder)
    s = result.summary
    if as_json:
        emit_json({**s, "per_replica": result.per_replica, "wall_s": result.wall_s,
                   "report": str(folder) if folder else None})
        return
    from rich.table import Table

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:,.1f}"

    t = Table(title=f"Fleet simulation of {label} ({s['requests']:,} requests)", show_header=False)
    t.add_row("fleet", f"{replicas} replicas x {s['pool_blocks']:,} blocks of {s['block_size']} tokens; {routers} "
              f"router(s), view staleness {staleness:g} s; arm {arm} "
              f"({'the router decides' if arm == 'A' else 'the replica ledger decides'}); routing {routing}")
    t.add_row("requests", f"{s['completed']:,} completed, {s['rejected']:,} rejected ({s['rejected_429']} x 429)")
    t.add_row("overcommitted admissions", f"{s['overcommits']:,} (largest overshoot {s['max_overshoot']} blocks)")
    t.add_row("refusals", f"{s['refusals']:,} ({s['refusals_per_request']:.3f} per request); "
              f"{s['deferred_requests']:,} deferred, wait p50 {ms(s['deferral_p50_s'])} / p99 "
              f"{ms(s['deferral_p99_s'])} ms")
    t.add_row("prefix cache hits", f"{100 * s['hit_rate']:.1f}% of {s['prompt_tokens']:,} prompt tokens")
    t.add_row("TTFT ms (mean / p50 / p90 / p99)", f"{ms(s['ttft_mean_s'])} / {ms(s['ttft_p50_s'])} / "
              f"{ms(s['ttft_p90_s'])} / {ms(s['ttft_p99_s'])}")
    t.add_row("largest replica share of prefill", f"{100 * s['max_prefill_share']:.1f}%")
    t.add_row("mean pool use", f"{100 * s['mean_use']:.1f}%")
    age = s["view_age_mean_s"]
    t.add_row("view age at decision (mean / p99)", "-" if age is None else
              f"{age * 1e3:,.1f} / {s['view_age_p99_s'] * 1e3:,.1f} ms")
    if s["decision_us_p99"] is not None:
        t.add_row("routing decision (p50 / p99)", f"{s['decision_us_p50']:.0f} / {s['decision_us_p99']:.0f} us")
    t.add_row("simulated time", f"{s['sim_duration_s']:,.1f} s (wall {result.wall_s:.1f} s)")
    console.print(t)
    for note in s["notes"]:
        console.print(f"[dim]note: {note}[/dim]")
    if folder is not None:
        console.print(f"report: {folder}")


__all__ = ["run_fleet"]
