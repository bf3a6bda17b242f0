"""The eviction study (issue 38), one command: every registered eviction policy against Belady's MIN and the
cost-aware bound, on Mooncake, Azure code and conversation and ShareGPT-length traces.

For each trace: hit rate and saved prefill time against cache size (the real ledger serving the requests one
at a time with each policy; the offline references on the same access sequence; ``kvledger.sim.optimal``),
then TTFT p50/p90 with each policy in the full simulator at the H100's own pool and a fixed load. Writes
``benchmarks/results/eviction_study.json`` and one plot per trace (``eviction_study_<trace>.png``) and
prints the tables docs/studies.md section (e) quotes, with the load average.

Traces are trimmed to their first ``--limit`` requests (default: Mooncake 1,000, the others 500; on 2 busy
cores the whole study then takes about 10 minutes).
Azure's and ShareGPT's tables carry no prefix information; they get the seeded conversation model of
``kvledger.sim.eviction_study.with_conversations`` (stated in the output).

Usage: python benchmarks/eviction_study.py [--traces mooncake,azure-code,azure-conv,sharegpt] [--limit N]
       [--policies lru,gdsf,...] [--no-ttft] [--out benchmarks/results] [--traces-dir ../shared/traces]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from kvledger.core.eviction import policy_names
from kvledger.sim.eviction_study import SharingModel, plot_study, study_trace, verdict, with_conversations
from kvledger.sim.simulator import SimConfig, Simulator, build_deployment
from kvledger.workloads import load_trace, scale_time
from kvledger.workloads.distributions import Poisson

REPO = Path(__file__).resolve().parent.parent
# name -> (file, block size, arrival speed-up for the TTFT run, needs the sharing model, default limit)
TRACES = {
    "mooncake": ("mooncake_fast25_conversation_trace.jsonl", 512, 0.2, False, 1000),
    "azure-code": ("azure_llm_2023_code.csv", 64, 1.0, True, 500),
    "azure-conv": ("azure_llm_2023_conv.csv", 64, 1.0, True, 500),
    "sharegpt": ("sharegpt_8k_filtered_lengths_llama2.csv", 64, 1.0, True, 500),
}
SIZE_FACTORS = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1, 2)
SHAREGPT_RATE = 4.0  # requests/s: ShareGPT's table has no arrivals


def load(name: str, traces_dir: Path, limit: int) -> list:
    file, _, _, synth, _ = TRACES[name]
    path = traces_dir / file
    reqs = load_trace(path, arrivals=Poisson(SHAREGPT_RATE), seed=0) if name == "sharegpt" else load_trace(path)
    reqs = reqs[:limit]
    return with_conversations(reqs, SharingModel()) if synth else reqs


def load_str() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=",".join(TRACES))
    ap.add_argument("--limit", type=int, default=None,
                    help="first N requests of each trace [Mooncake 1000, the others 500]")
    ap.add_argument("--policies", default=",".join(policy_names()))
    ap.add_argument("--no-ttft", action="store_true", help="skip the simulator's TTFT runs")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--traces-dir", default=str(REPO.parent / "shared" / "traces"))
    args = ap.parse_args(argv)
    names = [t.strip() for t in args.traces.split(",") if t.strip()]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for n in names:
        if n not in TRACES:
            ap.error(f"unknown trace {n!r}; choose from {', '.join(TRACES)}")
    for p in policies:
        if p not in policy_names():
            ap.error(f"unknown eviction policy {p!r}; choose from {', '.join(policy_names())}")
    if args.limit is not None and args.limit < 10:
        ap.error("--limit must be at least 10")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    report: dict = {"limit": args.limit, "policies": policies, "load_before": load_str(), "traces": {},
                    "sharing_model": vars(SharingModel()) if hasattr(SharingModel(), "__dict__") else
                    {f: getattr(SharingModel(), f) for f in SharingModel.__slots__}}
    for name in names:
        t0 = time.perf_counter()
        _, bs, speedup, synth, default_limit = TRACES[name]
        reqs = load(name, Path(args.traces_dir), args.limit or default_limit)
        base = SimConfig(model="llama-3.1-8b", gpu="h100-80gb", block_size=bs)
        dep = build_deployment(base)
        pool = dep.pool_blocks
        caps = sorted({max(2, round(f * pool)) for f in SIZE_FACTORS})
        print(f"\n== {name}: first {len(reqs)} requests{' (conversation model)' if synth else ''}, "
              f"{bs}-token blocks, H100 pool {pool} blocks; sizes {caps}; load {load_str()}", flush=True)
        study = study_trace(name, reqs, bs, caps, dep.block_cost, policies,
                            progress=lambda s: print(f"   {s}", file=sys.stderr, flush=True))
        print(f"   {study.requests} requests kept ({study.dropped} larger than the smallest cache dropped), "
              f"{study.prompt_tokens:,} prompt tokens; unbounded-cache hit rate {study.unbounded_hit_rate:.1%}")
        cols = ["belady", *policies]
        print(f"   {'blocks':>7} " + "".join(f"{c[:9]:>10}" for c in cols) + "   hit rate")
        for row in study.rows:
            print(f"   {row.capacity:>7} " + "".join(f"{100 * row.hit_rate[c]:>9.1f}%" for c in cols))
        print(f"   {'blocks':>7} " + "".join(f"{c[:9]:>10}" for c in ["bound_up", "bound_lo", *cols])
              + "   saved prefill s")
        for row in study.rows:
            print(f"   {row.capacity:>7} " + "".join(f"{row.saved_s[c]:>10.1f}"
                                                   for c in ["bound_upper", "bound_lower", *cols]))
        if not args.no_ttft:
            sim_reqs = [r for r in reqs if -(-(r.prompt_len + 1) // bs) <= caps[0]]
            if speedup != 1.0:
                sim_reqs = scale_time(sim_reqs, speedup)
            study.ttft_setup = {"pool_blocks": pool, "block_size": bs, "arrival_speedup": speedup,
                                "requests": len(sim_reqs), "model": "llama-3.1-8b", "gpu": "h100-80gb"}
            print(f"   TTFT at the H100 pool ({pool} blocks), arrivals x{speedup:g}:")
            for p in policies:
                res = Simulator(base.with_values(eviction=p)).run(sim_reqs)
                s = res.summary()
                study.ttft[p] = {"p50_s": s["ttft_s"]["p50"], "p90_s": s["ttft_s"]["p90"],
                                 "hit_rate": s["prefix_hit_rate"]}
                print(f"   {p:>16}: TTFT p50 {s['ttft_s']['p50']:8.3f} s  p90 {s['ttft_s']['p90']:8.3f} s  "
                      f"hit {s['prefix_hit_rate']:.1%}", flush=True)
        plot = out_dir / f"eviction_study_{name}.png"
        plot_study(study, str(plot))
        entry = study.to_dict()
        entry["verdict"] = {p: verdict(study, p) for p in policies}
        entry["wall_s"] = round(time.perf_counter() - t0, 1)
        entry["synthetic_sharing"] = synth
        report["traces"][name] = entry
        print(f"   plot {plot.relative_to(REPO) if plot.is_relative_to(REPO) else plot}; {entry['wall_s']} s; "
              f"load {load_str()}", flush=True)
    report["load_after"] = load_str()
    report["wall_s"] = round(time.perf_counter() - t_all, 1)
    # The default's verdict: per policy, the worst share over every trace and size.
    print("\nworst share over every trace and size (hit rate vs Belady; saved time vs the bound's upper / lower):")
    summary = {}
    for p in policies:
        rows = [v for t in report["traces"].values() for v in t["verdict"][p]]
        summary[p] = {"hit": min(r["hit_share"] for r in rows),
                      "saved_upper": min(r["saved_share_upper"] for r in rows),
                      "saved_lower": min(r["saved_share_lower"] for r in rows),
                      "mean_hit": sum(r["hit_share"] for r in rows) / len(rows),
                      "mean_saved_lower": sum(r["saved_share_lower"] for r in rows) / len(rows)}
        s = summary[p]
        print(f"   {p:>16}: hit {s['hit']:.0%} (mean {s['mean_hit']:.0%})   saved {s['saved_upper']:.0%} / "
              f"{s['saved_lower']:.0%} (mean vs lower {s['mean_saved_lower']:.0%})")
    report["summary"] = summary
    (out_dir / "eviction_study.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out_dir / 'eviction_study.json'}; {report['wall_s']} s; load {report['load_before']} -> "
          f"{report['load_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
