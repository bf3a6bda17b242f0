"""The entropy coder of KV blocks (kvledger.runtime.kv_entropy, native csrc/kv_rans.h) on synthetic blocks: coded
bytes against the models' ideal bits (and against constriction's rANS where it is installed), and the time to
encode, decode and fit (the rate control) a 16 x 64 block, one thread. Side by side in one run; the load is printed.
Ends with one JSON line.

Usage: PYTHONPATH=src python benchmarks/kv_entropy_coder.py [--blocks 512] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from kvledger.runtime import kv_entropy as ke
from kvledger.runtime import kv_transform_fit as ktf

ROWS, DIM = 16, 64
RANGES = ((-5, 4), (-2, 2), (0, 6), (3, 8))  # log2 of the coefficients' deviations, in steps, lowest to highest


def blocks(n, lo, hi, seed=0):
    g = torch.Generator().manual_seed(seed)
    sig = 2.0 ** torch.linspace(lo, hi, DIM, dtype=torch.float64)
    lap = torch.arange(DIM) % 2 == 1
    gauss = torch.randn(n, ROWS, DIM, generator=g, dtype=torch.float64) * sig
    u = torch.rand(n, ROWS, DIM, generator=g, dtype=torch.float64) - 0.5
    laplace = -sig / math.sqrt(2) * torch.sign(u) * torch.log1p(-2 * u.abs())
    return torch.where(lap, laplace, gauss), sig, lap


def ideal_bits(k, sig, lap):
    """-log2 of each integer symbol's bin under its continuous model (step 1), summed per block."""
    return ktf.symbol_bits(k, torch.tensor(1.0, dtype=torch.float64), sig, lap).sum((1, 2))


def constriction_blocks(k, sig, lap):
    """constriction's rANS (the coder before ours; optional) on the same symbols and models: mean bytes a block and
    the seconds to encode and to decode a block from Python, or None where it is not installed."""
    try:
        import constriction
        import numpy as np
    except ImportError:
        return None
    m = constriction.stream.model
    fams = []
    for is_lap in (True, False):
        cols = np.nonzero(lap.numpy() == is_lap)[0]
        width = (sig.numpy() / (math.sqrt(2) if is_lap else 1))[cols]
        model = (m.QuantizedLaplace if is_lap else m.QuantizedGaussian)(-ke.SYMBOL_MAX, ke.SYMBOL_MAX - 1)
        fams.append((cols, model, np.ascontiguousarray(np.repeat(width[None], k.shape[1], 0).ravel())))
    total, words = 0, []
    t0 = time.perf_counter()
    for b in range(k.shape[0]):
        enc = constriction.stream.stack.AnsCoder()
        kb = k[b].numpy().astype(np.int32)
        for cols, model, w in fams:
            enc.encode_reverse(np.ascontiguousarray(kb[:, cols].ravel()), model, np.zeros_like(w), w)
        words.append(enc.get_compressed())
        total += 4 * len(words[-1])
    t1 = time.perf_counter()
    for wb in words:
        dec = constriction.stream.stack.AnsCoder(wb)
        for _cols, model, w in reversed(fams):
            dec.decode(model, np.zeros_like(w), w)
    t2 = time.perf_counter()
    return total / k.shape[0], (t1 - t0) / k.shape[0], (t2 - t1) / k.shape[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if not 1 <= args.blocks <= 100_000 or not 1 <= args.reps <= 100:
        ap.error("--blocks in [1, 100000], --reps in [1, 100]")
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    out = {"rows": ROWS, "dim": DIM, "blocks": args.blocks, "load_1min": round(load, 2), "sizes": []}
    for lo, hi in RANGES:
        y, sig, lap = blocks(min(args.blocks, 64), lo, hi)
        n = y.shape[0]
        rows = torch.full((n,), ROWS, dtype=torch.int32)
        codes = torch.full((n,), ke.CENTRE_CODE, dtype=torch.int32)
        nw, _ = ke.encode_blocks(y, rows, ke.class_of(sig)[None].expand(n, -1), lap, codes, cap=8192)
        k = ke.symbols(y, codes)
        ours, ideal = float(nw.double().mean() * 2), float(ideal_bits(k, sig, lap).mean() / 8)
        ref = constriction_blocks(k, sig, lap)
        out["sizes"].append({"log2_deviation": [lo, hi], "ours_bytes": round(ours, 1), "ideal_bytes": round(ideal, 1),
                             "constriction_bytes": ref and round(ref[0], 1)})
        print(f"deviations 2^{lo}..2^{hi} steps: ours {ours:.1f} B a block, ideal {ideal:.1f} B"
              + (f", constriction {ref[0]:.1f} B" if ref else ""), flush=True)
    y, sig, lap = blocks(args.blocks, -4, 3, seed=1)
    n = y.shape[0]
    rows = torch.full((n,), ROWS, dtype=torch.int32)
    c0 = ke.class_of(sig)[None].expand(n, -1).contiguous()
    budget = torch.full((n,), (ROWS * 33 - 1) // 2, dtype=torch.int32)  # 33 B a row, less the step's byte
    codes, nw, words = ke.fit_blocks(y, rows, c0, lap, budget)
    best = {}
    for _ in range(args.reps):
        for name, fn in (("fit", lambda: ke.fit_blocks(y, rows, c0, lap, budget)),
                         ("encode", lambda: ke.encode_blocks(y, rows, c0, lap, codes, int(budget.max()))),
                         ("decode", lambda: ke.decode_blocks(words, nw, codes, rows, c0, lap, ROWS))):
            t0 = time.perf_counter()
            fn()
            best[name] = min(best.get(name, math.inf), time.perf_counter() - t0)
    out["us_per_block"] = {k: round(1e6 * v / n, 1) for k, v in best.items()}
    ref = constriction_blocks(ke.symbols(y, codes)[:64], sig, lap)  # its step is the same for every block here
    if ref:
        out["constriction_us_per_block"] = {"encode": round(1e6 * ref[1], 1), "decode": round(1e6 * ref[2], 1)}
        print(f"constriction from Python (64 blocks): encode {1e6 * ref[1]:.1f} us a block, decode "
              f"{1e6 * ref[2]:.1f} us ({ref[2] / best['decode'] * n:.1f}x ours)", flush=True)
    print("one thread, fastest of", args.reps, ":",
          ", ".join(f"{k} {1e6 * v / n:.1f} us a block ({1e9 * v / n / (ROWS * DIM):.1f} ns a symbol)"
                    for k, v in best.items()), f"(load {load:.2f})", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
