"""Paged decode attention alone, quantised KV against fp32 KV, out of cache, side by side in one invocation.

One query token per sequence over --batch sequences of --context tokens, for --layers layers of SmolLM2-135M's
shape (3 KV heads, 3 query heads each, head dim 64, 16-token blocks), each layer in its own store so that a step
walks more KV than the caches hold (30 layers x 4 x 2,048 tokens: 377 MB fp32, 105 MB int8, 60 MB int4); the
native kernels are called directly (paged_decode / paged_decode_q), formats interleaved rep by rep. Prints CPU
and wall nanoseconds per (token x KV head) and each format's CPU ratio to fp32, the load average, then one
JSON line. --same-layer walks layer 0 every time (the data then sits in L3: the kernels' compute floor).
Usage: python benchmarks/kv_decode_attention.py [--formats fp32,int8,int4] [--batch 4] [--context 2048]
       [--layers 30] [--threads 1] [--reps 5] [--shuffle] [--same-layer]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from kvledger.core import BlockTable, KVSpec  # noqa: E402
from kvledger.runtime import KVStore, native  # noqa: E402
from kvledger.runtime.attention import _quant_layout  # noqa: E402
from kvledger.runtime.cpu_features import cpu_model  # noqa: E402

KV_HEADS, GROUP, DIM, BS = 3, 3, 64, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="fp32,int8,int4")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shuffle", action="store_true", help="scatter the sequences' blocks")
    ap.add_argument("--same-layer", action="store_true", help="walk layer 0 every time (in cache)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = native.require()
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if "fp32" not in formats:
        formats.insert(0, "fp32")
    per_seq = args.context // BS + 1
    ids = list(range(args.batch * per_seq))
    if args.shuffle:
        random.Random(0).shuffle(ids)
    tables = [ids[b * per_seq:(b + 1) * per_seq] for b in range(args.batch)]
    gen = torch.Generator().manual_seed(0)
    stores = {}
    for f in formats:
        store = KVStore(KVSpec(args.layers, KV_HEADS, DIM, kv_dtype=f, block_size=BS), len(ids))
        for layer in range(args.layers):
            for table in tables:
                slots = torch.tensor(BlockTable(BS, table).slot_mapping(0, args.context))
                store.write(layer, slots, torch.randn(args.context, KV_HEADS, DIM, generator=gen),
                            torch.randn(args.context, KV_HEADS, DIM, generator=gen))
        stores[f] = store
    q = torch.randn(args.batch, KV_HEADS * GROUP, DIM, generator=gen)
    block_tables = torch.tensor(tables, dtype=torch.int32)
    lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    rows, none = torch.arange(args.batch), torch.empty(0)

    def step(f: str) -> tuple[float, float]:
        store, out = stores[f], torch.empty_like(q)
        t, c = time.perf_counter(), time.process_time()
        for layer in range(args.layers):
            at = 0 if args.same_layer else layer
            if store.plain:
                kc, vc = store.blocks(at)
                ops.paged_decode(out, q, kc, vc, block_tables, lens, rows, 0.125, 0, -1)
            else:
                ops.paged_decode_q(out, q, store.kv[at], _quant_layout(store), BS, KV_HEADS, none, none,
                                   block_tables, lens, rows, 0.125, 0, -1)
        return time.perf_counter() - t, time.process_time() - c

    load0 = os.getloadavg()[0]
    times: dict[str, list[tuple[float, float]]] = {f: [] for f in formats}
    for _ in range(args.reps):
        for f in formats:
            times[f].append(step(f))
    n = args.layers * args.batch * args.context * KV_HEADS
    figures: dict[str, object] = {"batch": args.batch, "context": args.context, "layers": args.layers,
                                  "threads": args.threads, "reps": args.reps, "same_layer": args.same_layer,
                                  "cpu": cpu_model(), "shuffle": args.shuffle, "ns_per_token_head": {},
                                  "cpu_vs_fp32": {}}
    best = {f: (min(x[0] for x in t) / n * 1e9, min(x[1] for x in t) / n * 1e9) for f, t in times.items()}
    for f in formats:
        wall, cpu = best[f]
        figures["ns_per_token_head"][f] = {"cpu": round(cpu, 2), "wall": round(wall, 2)}  # type: ignore[index]
        figures["cpu_vs_fp32"][f] = round(best["fp32"][1] / cpu, 3)  # type: ignore[index]
        ratio = best["fp32"][1] / cpu
        print(f"{f:>12}: {cpu:6.1f} ns CPU ({wall:6.1f} wall) per token x KV head; fp32 / {f} x{ratio:.2f}")
    figures["load"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    print(f"load average {figures['load'][0]} -> {figures['load'][1]}")  # type: ignore[index]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
