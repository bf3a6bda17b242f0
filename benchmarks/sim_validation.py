"""Does the simulator predict the real runtime? The same workload through both, side by side.

The workload: ``--requests`` (200) synthetic requests, prompts uniform in [--prompt-min, --prompt-max]
tokens (a third of them opening with one of two shared 32-token system prompts), outputs uniform in
[--out-min, --out-max] tokens, Poisson arrivals at ``--rate`` requests/s, seeded.

* **runtime**: :class:`kvledger.runtime.engine.Engine` on the bundled SmolLM2-135M (CPU, fp32, greedy,
  no stop tokens), fed in real time: each request is submitted when the wall clock passes its arrival.
  TTFT/TPOT come from the engine's own RequestResult timestamps.
* **simulator**: :class:`kvledger.sim.simulator.Simulator` with the calibrated ``cpu-local`` profile
  (run ``kvledger calibrate`` first), the same pool, block size, policy and scheduler limits, fp32 KV and
  weights.

Prints throughput (output tokens/s over the run), median TTFT and median TPOT for both and the ratio
(the target is within 20%), then one JSON line. ``--sim-only`` skips the runtime (no torch needed).
Usage: python benchmarks/sim_validation.py [--requests 200] [--rate 1.0] [--sim-only] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from kvledger.sim import Poisson, Uniform, synthetic
from kvledger.sim.simulator import SimConfig, Simulator

MODEL = "smollm2-135m"
VOCAB_SAFE = 40000  # token ids below SmolLM2's 49,152-entry vocabulary


def workload(args: argparse.Namespace):
    reqs = synthetic(args.requests, arrivals=Poisson(args.rate), prompt_len=Uniform(args.prompt_min, args.prompt_max),
                     output_len=Uniform(args.out_min, args.out_max), system_prompts=2, system_prompt_len=32,
                     shared_fraction=1 / 3, seed=args.seed, token_base=100)
    top = max(max(r.prompt_tokens.runs[-1][0] + r.prompt_tokens.runs[-1][1] for r in reqs), 0)
    if top >= VOCAB_SAFE:
        sys.exit(f"workload uses token ids up to {top}; lower --requests or the prompt lengths")
    return reqs


def sim_side(reqs, args: argparse.Namespace) -> dict:
    cfg = SimConfig(model=MODEL, gpu="cpu-local", kv_dtype="fp32", weight_dtype="fp32", pool_blocks=args.pool_blocks,
                    block_size=16, policy=args.policy, max_running=args.max_running,
                    token_budget=args.token_budget, prefill_chunk=args.prefill_chunk)
    res = Simulator(cfg).run(reqs)
    s = res.summary()
    return {"throughput_tok_s": s["throughput_tok_s"], "ttft_p50_s": s["ttft_s"]["p50"],
            "tpot_p50_s": s["tpot_s"]["p50"], "duration_s": s["sim_duration_s"], "steps": res.steps,
            "completed": s["completed"], "preemptions": sum(s["preemptions"].values())}


def runtime_side(reqs, args: argparse.Namespace) -> dict:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        from kvledger.runtime.engine import Engine
        from kvledger.runtime.sampling import SamplingParams
    except ImportError as exc:
        sys.exit(f"the runtime engine is not available ({exc}); run with --sim-only")
    from kvledger.scheduler import SchedulerConfig

    engine = Engine.from_model(MODEL, num_blocks=args.pool_blocks, block_size=16,
                               scheduler_config=SchedulerConfig(policy=args.policy, max_running=args.max_running,
                                                                token_budget=args.token_budget,
                                                                prefill_chunk=args.prefill_chunk))
    # Warm-up outside the measurement (first-call allocations, thread pools).
    engine.generate([[1, 2, 3, 4, 5, 6, 7, 8]], 4)
    greedy = SamplingParams(temperature=0.0)
    handles = []
    t0 = time.perf_counter()
    i = 0
    while i < len(reqs) or engine.has_work():
        now = time.perf_counter() - t0
        while i < len(reqs) and reqs[i].arrival_s <= now:
            r = reqs[i]
            handles.append(engine.submit(r.prompt_tokens.tolist(), r.output_len, greedy, request_id=r.request_id,
                                         arrival_s=t0 + r.arrival_s))
            i += 1
        if engine.has_work():
            engine.step()
        elif i < len(reqs):
            time.sleep(max(0.0, reqs[i].arrival_s - (time.perf_counter() - t0)))
    results = [h.result() for h in handles]
    end = max(r.finish_s for r in results)
    tokens = sum(r.num_generated for r in results)
    ttft = [r.ttft_s for r in results if r.ttft_s is not None]
    tpot = [r.tpot_s for r in results if r.tpot_s is not None]
    return {"throughput_tok_s": tokens / (end - t0 - reqs[0].arrival_s), "ttft_p50_s": statistics.median(ttft),
            "tpot_p50_s": statistics.median(tpot), "duration_s": end - t0 - reqs[0].arrival_s,
            "steps": engine.stats.steps, "completed": len(results),
            "preemptions": sum(r.preemptions for r in results)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--rate", type=float, default=1.0, help="arrivals per second")
    p.add_argument("--prompt-min", type=int, default=16)
    p.add_argument("--prompt-max", type=int, default=96)
    p.add_argument("--out-min", type=int, default=4)
    p.add_argument("--out-max", type=int, default=24)
    p.add_argument("--policy", default="full")
    p.add_argument("--pool-blocks", type=int, default=512)
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--token-budget", type=int, default=512)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sim-only", action="store_true")
    args = p.parse_args()
    reqs = workload(args)
    sim = sim_side(reqs, args)
    real = None if args.sim_only else runtime_side(reqs, args)
    print(f"{len(reqs)} requests, Poisson {args.rate}/s, prompts {args.prompt_min}-{args.prompt_max}, outputs "
          f"{args.out_min}-{args.out_max}; {MODEL} fp32, pool {args.pool_blocks} blocks, policy {args.policy}")
    print(f"{'metric':<22}{'runtime':>12}{'simulator':>12}{'sim / real':>12}")
    for key, label, scale in (("throughput_tok_s", "throughput tok/s", 1), ("ttft_p50_s", "median TTFT ms", 1e3),
                              ("tpot_p50_s", "median TPOT ms", 1e3), ("duration_s", "duration s", 1),
                              ("steps", "steps", 1), ("preemptions", "preemptions", 1)):
        r = real[key] * scale if real else None
        s = sim[key] * scale
        ratio = f"{s / r:.2f}" if r else "-"
        print(f"{label:<22}{(f'{r:,.1f}' if r is not None else '-'):>12}{s:>12,.1f}{ratio:>12}")
    print(json.dumps({"simulator": sim, "runtime": real}))


if __name__ == "__main__":
    main()
