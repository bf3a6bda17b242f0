"""The cost of `GroupLedger`'s operations: one request's whole life (admit, a 2,048-token prompt in one step, 257
decode steps, release) on a uniform pool (one full group) and on Gemma 3's seven groups, 24 running at once.

    PYTHONPATH=src .venv/bin/python benchmarks/hybrid_ledger_ops.py

Prints one JSON line: microseconds per request and per decode step of one request, for each pool.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvledger.core.groups import GroupLedger, KVCacheGroup  # noqa: E402

POOLS = {
    "uniform": [KVCacheGroup("full", 62, None, 1)],
    "gemma3": [KVCacheGroup("sliding", n, 1024, 1) for n in (9, 9, 9, 9, 8, 8)] + [KVCacheGroup("full", 10, None, 1)],
}


def run(groups: list[KVCacheGroup], nreq: int = 96, running: int = 24) -> dict[str, float]:
    led = GroupLedger(40_000, 16, groups, step_tokens=2048)
    prompts = [[(i * 7919 + t) % 50_000 for t in range(2048)] for i in range(nreq)]
    t0 = time.perf_counter()
    live: list[str] = []
    nxt = 0
    decode_steps = 0
    while nxt < nreq or live:
        while nxt < nreq and len(live) < running:
            rid = f"r{nxt}"
            led.admit(rid, prompts[nxt], 257).admitted or sys.exit("pool too small")
            led.schedule(rid, 2048)
            led.confirm(rid, 1)
            live.append(rid)
            nxt += 1
        for rid in list(live):
            req = led.requests[rid]
            led.schedule(rid, 1)
            led.confirm(rid, 2)
            decode_steps += 1
            if req.computed >= req.max_tokens - 1:
                led.release(rid)
                live.remove(rid)
    dt = time.perf_counter() - t0
    led.check()
    return {"us_per_request": round(1e6 * dt / nreq, 1), "us_per_decode_step": round(1e6 * dt / decode_steps, 2)}


if __name__ == "__main__":
    out = {name: run(groups) for name, groups in POOLS.items()}
    print(json.dumps({**out, "loadavg": os.getloadavg()[0]}))
