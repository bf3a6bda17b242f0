"""Ledger throughput, driven as an engine would drive it.

10,000 requests of 2,048 prompt + 257 output tokens, block size 16, a pool of 4,096 blocks, prefix
identity hashing on; every other request starts with one of 8 shared 1,024-token prefixes. Up to 24
requests run at once; a new one is admitted when one finishes; each step advances every running request
by one token; finished requests are released.

Prints microseconds per request lifecycle and per operation, then one JSON line of the figures.
Usage: python benchmarks/ledger_ops.py [--requests N] [--running R] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import deque

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Request


def make_prompts(n: int, prompt_len: int, shared_len: int, n_prefixes: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32000) for _ in range(shared_len)] for _ in range(n_prefixes)]
    prompts = []
    for i in range(n):
        if i % 2 == 0:
            head = prefixes[rng.randrange(n_prefixes)]
            prompts.append(head + [rng.randrange(32000) for _ in range(prompt_len - shared_len)])
        else:
            prompts.append([rng.randrange(32000) for _ in range(prompt_len)])
    return prompts


def run(args: argparse.Namespace) -> dict:
    prompts = make_prompts(args.requests, args.prompt, args.shared, args.prefixes, args.seed)
    ctx = CacheContext(model="bench", trust_group="tenant-0")
    ledger = KVLedger(args.pool_blocks, args.block_size, prefix_caching=True)
    pending = deque(Request(f"r{i}", p, args.max_new, ctx) for i, p in enumerate(prompts))
    running: dict[str, int] = {}  # request id -> tokens still to generate
    t_admit = t_step = t_release = 0.0
    n_admit = n_steps = n_tokens = n_release = 0
    hit_blocks = 0
    clock = time.perf_counter
    start = clock()
    while pending or running:
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
            n_admit += 1
            hit_blocks += decision.blocks_hit
            running[req.request_id] = args.max_new
        step = [(rid, 7) for rid in running]
        t0 = clock()
        ledger.decode_step(step)
        t_step += clock() - t0
        n_steps += 1
        n_tokens += len(step)
        done = []
        for rid in running:
            running[rid] -= 1
            if running[rid] == 0:
                done.append(rid)
        t0 = clock()
        for rid in done:
            ledger.release(rid)
            del running[rid]
        t_release += clock() - t0
        n_release += len(done)
    wall = clock() - start
    ledger.check()
    ledger_time = t_admit + t_step + t_release
    return {
        "requests": args.requests,
        "us_per_request": ledger_time / args.requests * 1e6,
        "us_per_request_wall": wall / args.requests * 1e6,
        "us_per_admit": t_admit / max(n_admit, 1) * 1e6,
        "us_per_token_append": t_step / max(n_tokens, 1) * 1e6,
        "us_per_release": t_release / max(n_release, 1) * 1e6,
        "steps": n_steps,
        "prefix_hit_blocks_per_request": hit_blocks / args.requests,
        "final_usage": ledger.usage().as_dict(),
    }


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
    args = ap.parse_args(argv)
    r = run(args)
    print(f"ledger_ops: {r['requests']} requests, {r['steps']} steps")
    print(f"  per request lifecycle : {r['us_per_request']:8.1f} us (ledger calls; "
          f"{r['us_per_request_wall']:.1f} us with the driver loop)")
    print(f"  admit (+prefill mark) : {r['us_per_admit']:8.1f} us")
    print(f"  token append          : {r['us_per_token_append']:8.3f} us")
    print(f"  release               : {r['us_per_release']:8.1f} us")
    print(f"  prefix hit blocks/req : {r['prefix_hit_blocks_per_request']:8.1f}")
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
