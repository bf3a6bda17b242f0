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

Prints mean / p50 / p99 milliseconds per step per policy, side by side, then one JSON line.
Usage: python benchmarks/scheduler_step.py [--running 256] [--steps 200] [--warmup 80] [--seed 0]
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
import sys
import time
from collections.abc import Iterator

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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default="full,predicted,incremental,incremental-pressure")
    ap.add_argument("--profile", default=None, help="cProfile the measured steps of this policy")
    ap.add_argument("--no-loop", action="store_true", help="skip timing the whole Driver.step() loop")
    args = ap.parse_args(argv)
    stream = workload(args.seed)
    pool = full_pool_blocks([next(stream) for _ in range(args.running)])
    policies = args.policies.split(",")
    results = {p: run_policy(p, args, pool, profile=(p == args.profile)) for p in policies}
    loops = {p: run_loop(p, args, pool) for p in policies} if not args.no_loop else {}
    print(f"scheduler step planning: {args.running} max running, block {BLOCK}, {args.steps} measured steps "
          f"after {args.warmup} warm-up steps; pool {pool} blocks (full reservation of {args.running})")
    print(f"{'policy':<22}{'pool':>8}{'running':>9}{'mean ms':>10}{'p50 ms':>9}{'p99 ms':>9}"
          f"{'preempt':>9}{'finished':>10}{'loop mean':>11}{'loop p50':>10}")
    for p, r in results.items():
        loop = loops.get(p)
        extra = f"{loop['mean_ms']:>11.3f}{loop['p50_ms']:>10.3f}" if loop else ""
        print(f"{p:<22}{r['pool_blocks']:>8}{r['running_avg']:>9.1f}{r['mean_ms']:>10.3f}{r['p50_ms']:>9.3f}"
              f"{r['p99_ms']:>9.3f}{r['preemptions']:>9}{r['finished']:>10}" + extra)
    target = 1.0
    over = [p for p, r in results.items() if r["mean_ms"] > target]
    print(f"target < {target:g} ms per step at {args.running} running: "
          + ("met" if not over else f"NOT met by {', '.join(over)}"))
    summary = {
        "benchmark": "scheduler_step",
        "running": args.running,
        "block_size": BLOCK,
        "ms_per_step": {p: round(r["mean_ms"], 4) for p, r in results.items()},
        "p50_ms": {p: round(r["p50_ms"], 4) for p, r in results.items()},
        "p99_ms": {p: round(r["p99_ms"], 4) for p, r in results.items()},
        "running_avg": {p: round(r["running_avg"], 1) for p, r in results.items()},
        "preemptions": {p: r["preemptions"] for p, r in results.items()},
        "loop_ms_per_step": {p: round(r["mean_ms"], 4) for p, r in loops.items()},
        "load_average": list(os.getloadavg()),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
