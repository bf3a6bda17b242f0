"""vLLM's scheduler step at 256 running requests with vLLM's own KV cache manager against kvledger's
(``kvledger.integrations.vllm.Scheduler``), in one process, alternating so machine load hits both alike.

The workload, pool and loop are ``../shared/peers/vllm_scheduler_step.py``'s (kvledger's scheduler
benchmark's request stream: prompts log-uniform 128..4096, outputs 16..1024, a third opening with one of 4
shared system prompts, one in 8 fanned out n=2; block 16; max_num_seqs 256; 8,192 batched tokens; long
prefill threshold 2,048; sha256 prefix caching; watermark 0.01; the full reservation of the first 256
requests as usable blocks, plus vLLM's null block). A step is ``schedule()`` + ``update_from_output()``
with a fake model output between them (untimed). Timed twice: CPU time of the thread
(``time.thread_time``: what the scheduler costs, less exposed to other processes on a shared machine) and
wall clock. ``vllm`` is vLLM's ``Scheduler`` (the figure the peers README reports), ``vllm-async`` its
``AsyncScheduler`` (the class kvledger's derives from).

Prints one line per scheduler per round, then one JSON line with the medians and the ratios.
usage (vLLM venv python, kvledger on PYTHONPATH): python benchmarks/vllm_manager_step.py
    [--rounds 2] [--steps 200] [--warmup 80] [--admission full|incremental|predicted]
    [--schedulers vllm,vllm-async,kvledger]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import time

from kvledger.integrations.vllm.harness import build_scheduler

BLOCK = 16


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def workload(seed: int):
    """The request stream of benchmarks/scheduler_step.py (same RNG calls, same order)."""
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
        yield f"q{i}", prompt, log_uniform(rng, 16, 1024), n
        i += 1


def full_pool_blocks(requests) -> int:
    total = 0
    for _, prompt, max_new, n in requests:
        whole = -(-(len(prompt) + max_new) // BLOCK)
        total += whole + (n - 1) * (whole - len(prompt) // BLOCK)
    return total


def measure(name: str, args) -> dict:
    stream = workload(args.seed)
    pool = full_pool_blocks([next(stream) for _ in range(args.running)])
    cfg = {"kvledger": {"admission": args.admission}} if name == "kvledger" else None
    h = build_scheduler(name, num_blocks=pool + 1, max_num_seqs=args.running, max_num_batched_tokens=8192,
                        long_prefill_token_threshold=2048, watermark=0.01, additional_config=cfg,
                        log_stats=False)
    from vllm.utils.gc_utils import freeze_gc_heap
    freeze_gc_heap()  # as vLLM's EngineCore does after building its scheduler
    sched = h.scheduler
    stream = workload(args.seed)
    family: dict[str, str] = {}
    cpu: list[float] = []
    wall: list[float] = []
    running: list[int] = []
    preempted = 0
    from vllm.v1.outputs import ModelRunnerOutput
    for step in range(args.warmup + args.steps):
        while len({family[r.request_id] for r in sched.waiting}) < 32:
            rid, prompt, max_new, n = next(stream)
            for cid in ([rid] if n == 1 else [f"{i}_{rid}" for i in range(n)]):
                family[cid] = rid
                h.add(cid, prompt, max_new)
        c0, w0 = time.thread_time(), time.perf_counter()
        out = sched.schedule()
        c1, w1 = time.thread_time(), time.perf_counter()
        req_ids = list(out.num_scheduled_tokens)
        reqs = sched.requests
        sampled = []
        for rid in req_ids:
            r = reqs[rid]
            end = r.num_computed_tokens
            sampled.append([(end * 7919) % 32000] if end >= r.num_tokens else [])
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled)
        c2, w2 = time.thread_time(), time.perf_counter()
        sched.update_from_output(out, mro)
        c3, w3 = time.thread_time(), time.perf_counter()
        if step >= args.warmup:
            cpu.append((c1 - c0) + (c3 - c2))
            wall.append((w1 - w0) + (w3 - w2))
            running.append(len(sched.running))
            preempted += len(out.preempted_req_ids or ())
    gc.unfreeze()
    return {"scheduler": name, "cpu_us_per_step": round(statistics.fmean(cpu) * 1e6, 1),
            "wall_us_per_step": round(statistics.fmean(wall) * 1e6, 1),
            "running_avg": round(statistics.fmean(running), 1), "preemptions": preempted,
            "loadavg_1m": round(os.getloadavg()[0], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--admission", choices=("full", "incremental", "predicted"), default="full")
    ap.add_argument("--schedulers", default="vllm,vllm-async,kvledger")
    args = ap.parse_args()
    names = args.schedulers.split(",")
    results: dict[str, list[dict]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for n in names:
            r = measure(n, args)
            results[n].append(r)
            print(json.dumps(r), flush=True)
    med = {n: {k: statistics.median(r[k] for r in rs) for k in ("cpu_us_per_step", "wall_us_per_step")}
           for n, rs in results.items()}
    summary: dict = {"benchmark": "vllm_manager_step", "admission": args.admission, "medians": med}
    if "kvledger" in med:
        for base in ("vllm", "vllm-async"):
            if base in med:
                summary[f"ratio_cpu_vs_{base}"] = round(med["kvledger"]["cpu_us_per_step"]
                                                        / med[base]["cpu_us_per_step"], 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
