"""Calls per request, by eviction policy, in ledger_ops' cases (issue 38: where a policy's extra time goes).

Runs one case of ``benchmarks/ledger_ops.py`` under cProfile for each policy and prints, per request,
how many times each ledger, pool and policy function (Python) and each method of the C part
(``PolicyCore``, ``BlockOrder``, the module's batched entry points) was called, with its own time.
A policy that took a per-block Python path another does not would show here as a count that grows
with the blocks (tens to hundreds per request) in one column only. cProfile's own cost inflates the
times (use ledger_ops for timings); the counts are exact. Ends with one JSON line of the counts.

Usage: python benchmarks/eviction_calls.py [--case evict] [--requests 300]
       [--eviction lru,priority,lfu,gdsf,arc,s3fifo,sglang-priority]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ledger_ops  # noqa: E402

from kvledger.core import native  # noqa: E402

_OURS = ("ledger.py", "pool.py", "eviction.py", "eviction_tree.py", "lifetimes.py", "admission.py")


def _name(key: tuple[str, int, str]) -> str | None:
    """A short name for the functions this counts (ours and the C part's), None for the rest."""
    path, line, func = key
    base = os.path.basename(path)
    if base in _OURS and "kvledger" in path:
        return f"{base}:{func}"
    if path == "~" and "kvledger.core._native" in func:
        return func.replace("<method '", "").replace("' of 'kvledger.core._native.", " of ").replace(
            "' objects>", "").replace("<built-in method kvledger.core._native.", "native.").rstrip(">")
    return None


def profile(policy: str, case: str, requests: int) -> dict[str, tuple[float, float]]:
    """Per request: name -> (calls, own microseconds) for one run of the case."""
    args = argparse.Namespace(requests=requests, running=24, prompt=2048, max_new=257, block_size=16, shared=1024,
                              prefixes=8, seed=0, pool_blocks=4096, clock="cpu")
    prof = cProfile.Profile()
    prof.enable()
    ledger_ops.run(args, case, policy)
    prof.disable()
    out: dict[str, tuple[float, float]] = {}
    for key, (_cc, calls, own, _cum, _callers) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        name = _name(key)
        if name is not None:
            c, t = out.get(name, (0.0, 0.0))
            out[name] = (c + calls / requests, t + own / requests * 1e6)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="evict", choices=("base", "n4", "evict"))
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--eviction", default="lru,priority,lfu,gdsf,arc,s3fifo,sglang-priority")
    args = ap.parse_args(argv)
    if args.requests < 1:
        ap.error("--requests must be >= 1")
    policies = [p.strip() for p in args.eviction.split(",") if p.strip()]
    runs = {p: profile(p, args.case, args.requests) for p in policies}
    names = sorted({n for r in runs.values() for n in r},
                   key=lambda n: -max(r.get(n, (0, 0))[0] for r in runs.values()))
    print(f"eviction_calls: case {args.case}, {args.requests} requests, core "
          f"{'native' if native.MODULE is not None else 'python'}; calls per request (own us per request)")
    print(f"{'':44s}" + "".join(f"{p:>18s}" for p in policies))
    for n in names:
        cells = [runs[p].get(n) for p in policies]
        print(f"{n[:44]:44s}" + "".join(f"{'-':>18s}" if c is None else f"{c[0]:9.2f} ({c[1]:5.1f})" for c in cells))
    print(json.dumps({"case": args.case, "requests": args.requests, "load": ledger_ops.load_str(),
                      "calls_per_request": {p: {n: round(c, 2) for n, (c, _t) in r.items()} for p, r in runs.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
