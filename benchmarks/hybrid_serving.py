"""Gemma 3 27B (or a Mamba-2 / linear-attention model, its state layers one block a request) served from a hybrid KV
pool against a uniform one, on Mooncake's conversation trace: requests per second at the same SLO (docs/hybrid.md;
`kvledger.sim.hybrid`: the simulator's one step loop, the hybrid pool charged by KV cache group, neither pool with a
prefix cache).

    PYTHONPATH=src .venv/bin/python benchmarks/hybrid_serving.py --limit 200 --out docs/img/hybrid_serving.png
    PYTHONPATH=src .venv/bin/python benchmarks/hybrid_serving.py --model examples/configs/granite-4-h-small-style.json \
        --kv-budget 4e9 --rates 1,2,4,8

Both pools get the KV bytes `kvledger plan` leaves on the GPU (vLLM's accounting); the trace's arrivals are
replayed at a sweep of rates; a rate meets the SLO when p90 TTFT and TPOT are within the targets and at least
95% of the offered rate is served. Prints one JSON line per run and a summary line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvledger.core.sizing.geometry import KVSpec, state_geometry  # noqa: E402
from kvledger.core.sizing.inventory import build_inventory  # noqa: E402
from kvledger.core.sizing.models import load_model_config  # noqa: E402
from kvledger.sim.hybrid import config, meets, pools, serve  # noqa: E402
from kvledger.workloads.readers import load_mooncake  # noqa: E402
from kvledger.workloads.transforms import at_rate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "examples" / "configs" / "gemma-3-27b.json"))
    ap.add_argument("--gpu", default="h200-141gb")
    ap.add_argument("--trace", default="/work/shared/traces/mooncake_fast25_conversation_trace.jsonl")
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--rates", default="0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,1.0")
    ap.add_argument("--slo-ttft", type=float, default=10000.0, help="p90 TTFT target, ms")
    ap.add_argument("--slo-tpot", type=float, default=100.0, help="p90 TPOT target, ms")
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--kv-budget", type=float, default=None,
                    help="KV bytes of both pools (default: what `kvledger plan` leaves on the GPU)")
    ap.add_argument("--out", default=None, help="write the plot here (PNG)")
    ap.add_argument("--plot-from", nargs="*", default=None,
                    help="draw --out from these runs' JSON lines instead of running (merges sweeps)")
    args = ap.parse_args()
    if args.plot_from:
        runs = [json.loads(line) for path in args.plot_from for line in Path(path).read_text().splitlines()
                if line.startswith('{"requests"')]
        results = {name: sorted((r for r in runs if r["pool"] == name), key=lambda r: r["rate"])
                   for name in ("hybrid", "uniform")}
        best = {name: max((r["rate"] for r in rs if r["meets_slo"]), default=0.0) for name, rs in results.items()}
        print(json.dumps({"max_rate_meeting_slo": best}))
        _plot(results, best, args)
        return

    cfg = load_model_config(args.model)
    spec = KVSpec.from_hf_config(cfg)
    inv = build_inventory(spec, cfg, gpu=args.gpu, engine="vllm")
    step = inv.max_batched_tokens or 8192
    seqs = inv.max_seqs or 256
    budget = int(args.kv_budget) if args.kv_budget else inv.kv_budget_bytes
    # A Mamba / linear-attention model: its state layers are state groups, one block a request.
    plan, _ = pools(spec, budget, max_model_len=args.max_model_len, step_tokens=step, state=state_geometry(cfg))
    trace = [r for r in load_mooncake(args.trace) if r.prompt_len + max(1, r.output_len) <= args.max_model_len]
    trace = trace[: args.limit]
    rates = [float(x) for x in args.rates.split(",")]
    results: dict[str, list[dict]] = {"hybrid": [], "uniform": []}
    for rate in rates:
        reqs = at_rate(trace, rate)
        for name in ("hybrid", "uniform"):
            t0 = time.perf_counter()
            run = serve(reqs, config(args.model, args.gpu, plan.uniform_pool_blocks, hybrid=name == "hybrid",
                                     max_num_batched_tokens=step, max_num_seqs=seqs, max_model_len=args.max_model_len))
            run.update(pool=name, rate=rate, meets_slo=meets(run, args.slo_ttft, args.slo_tpot),
                       wall_s=round(time.perf_counter() - t0, 1))
            results[name].append(run)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in run.items()}), flush=True)
    best = {name: max((r["rate"] for r in runs if r["meets_slo"]), default=0.0) for name, runs in results.items()}
    print(json.dumps({"model": args.model, "gpu": args.gpu, "kv_budget_bytes": budget,
                      "requests": len(trace), "slo_ttft_ms": args.slo_ttft, "slo_tpot_ms": args.slo_tpot,
                      "max_rate_meeting_slo": best, "hybrid_plan": plan.to_dict()["by_kind"]}))
    if args.out:
        _plot(results, best, args)


def _plot(results: dict[str, list[dict]], best: dict[str, float], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for name, runs, color in (("hybrid", results["hybrid"], "#2b8cbe"), ("uniform", results["uniform"], "#e6550d")):
        x = [r["rate"] for r in runs]
        axes[0].plot(x, [r["ttft_p90_ms"] / 1e3 for r in runs], "o-", color=color, label=f"{name} pool")
        axes[1].plot(x, [r["tpot_p90_ms"] for r in runs], "o-", color=color, label=f"{name} pool")
        axes[2].plot(x, [r["served_rps"] for r in runs], "o-", color=color,
                     label=f"{name} (SLO met up to {best[name]:g} req/s)")
    axes[0].axhline(args.slo_ttft / 1e3, color="grey", ls=":")
    axes[1].axhline(args.slo_tpot, color="grey", ls=":")
    axes[2].plot([0, max(r["rate"] for r in results["hybrid"])], [0, max(r["rate"] for r in results["hybrid"])],
                 color="grey", ls=":", label="offered")
    for ax, title in zip(axes, ("p90 TTFT (s)", "p90 TPOT (ms)", "served (requests / s)"), strict=True):
        ax.set_xlabel("offered rate (requests / s)")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle(f"{Path(args.model).stem} on one {args.gpu}, Mooncake conversation trace ({args.limit} requests): "
                 "hybrid vs uniform KV pool", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
