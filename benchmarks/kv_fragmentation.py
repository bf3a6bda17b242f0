"""Fragmentation measured on the real allocator: one variable-length workload, three ways to hold its KV.

paged (one pool tensor + the ledger), grow (per-request per-layer K/V tensors grown by torch.cat, as
Hugging Face's dynamic cache does), max (per-request tensors sized for the declared maximum, first-fit in an
arena of the pool's size). Each way runs in a fresh subprocess, so one way's allocator state cannot leak
into the next; the table shows the seed's three forms of unusable capacity as separate rows (tail slack,
contiguous-hole failures, allocator fragmentation), then one JSON line.

    .venv/bin/python benchmarks/kv_fragmentation.py [--requests 40] [--capacity 128MiB] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, os, sys
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
torch.set_num_threads(1)
from kvledger.core import KVSpec
from kvledger.core.sizing.models import load_model_config
from kvledger.runtime.measure.diagnostics.fragmentation import run_way, variable_workload
a = json.loads(sys.argv[1])
cfg = load_model_config(a["model"])
spec = KVSpec.from_hf_config(cfg, kv_dtype=a["dtype"], block_size=a["block_size"])
reqs = variable_workload(a["requests"], seed=a["seed"], max_prompt=a["max_prompt"], max_new=a["max_new"])
r = run_way(a["way"], reqs, spec, a["capacity"], hf_config=cfg, device=a["device"])
print(json.dumps(r.as_dict()))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a bundled model config (KV geometry)")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--capacity", default="128MiB", help="KV capacity: the pool, the budget, the arena")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    from kvledger.runtime.measure.diagnostics.fragmentation import WAYS, WayResult, table_rows
    from kvledger.units import format_bytes, parse_bytes

    capacity = parse_bytes(args.capacity)
    load = os.getloadavg()
    results = []
    for way in WAYS:
        spec = {"way": way, "model": args.model, "dtype": args.dtype, "requests": args.requests,
                "max_prompt": args.max_prompt, "max_new": args.max_new, "capacity": capacity,
                "block_size": args.block_size, "seed": args.seed, "device": args.device}
        out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True,
                             timeout=1800, check=True)
        data = json.loads(out.stdout.strip().splitlines()[-1])
        r = WayResult(way)
        for k, v in data.items():
            setattr(r, k, v)
        results.append(r)
    print(f"{args.requests} requests (prompts 16..{args.max_prompt}, allowances 16..{args.max_new}, outputs stop "
          f"inside them), {args.model} {args.dtype} KV, capacity {format_bytes(capacity)}; load average "
          f"{load[0]:.2f}")
    rows = table_rows(results)
    width = max(len(name) for name, _ in rows)
    print(f"{'':{width}}  " + "  ".join(f"{w:>22}" for w in WAYS))
    for name, cells in rows:
        print(f"{name:{width}}  " + "  ".join(f"{c:>22}" for c in cells))
    print(json.dumps({"benchmark": "kv_fragmentation", "requests": args.requests, "capacity": capacity,
                      "load_average": [round(x, 2) for x in load],
                      "ways": {r.way: r.as_dict() for r in results}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
