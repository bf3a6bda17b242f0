"""What a transform-coded KV page costs to write (seal) and to read, through the runtime's slots
(kvledger.runtime.kv_transform.SideCode), against reading the same rows from a bf16 page: SmolLM2-135M's shape
(30 layers, 3 KV heads of 64; keys 33 and values 40 bytes a row on average, each head's share set by its tables),
synthetic tables (a random turn, coefficient deviations spread as the calibrated ones are, a third Laplacian) and
rows drawn from them. Per block of 16 tokens: seal = every layer-head of both sides coded into its slot (the rate
control included); read = every slot decoded and turned back. One thread, side by side in one run; the load is
printed. Ends with one JSON line.

Usage: PYTHONPATH=src python benchmarks/kv_transform_codec.py [--blocks 32] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from kvledger.runtime import kv_transform as kt

LAYERS, HEADS, DIM, BS = 30, 3, 64, 16


def side(row_bytes: float, seed: int) -> kt.SideCode:
    g = torch.Generator().manual_seed(seed)
    turn = torch.linalg.qr(torch.randn(LAYERS, HEADS, DIM, DIM, generator=g, dtype=torch.float64))[0]
    # deviations in base steps from 2^-6 to 2^5 (a calibrated head's spread: most coefficients below the step)
    sigma = (2.0 ** torch.linspace(-6, 5, DIM, dtype=torch.float64)).expand(LAYERS, HEADS, DIM).clone()
    # each head its own share around the average, as a weighted allocation gives (the total unchanged)
    share = 1 + 0.3 * torch.randn(LAYERS, HEADS, generator=g, dtype=torch.float64).clamp(-2, 2)
    return kt.SideCode(mu=torch.zeros(LAYERS, HEADS, DIM, dtype=torch.float64), turn=turn, back=turn.transpose(-1, -2),
                       sigma=sigma, laplace=(torch.arange(DIM) % 3 == 0).expand(LAYERS, HEADS, DIM).clone(),
                       base=torch.ones(LAYERS, HEADS, dtype=torch.float64), row_bytes=row_bytes * share / share.mean(),
                       block_size=BS)


def rows(code: kt.SideCode, n: int, seed: int) -> torch.Tensor:
    """``[L, H, n, BS, D]`` rows whose coefficients follow the code's models."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(LAYERS, HEADS, n, BS, DIM, generator=g, dtype=torch.float64) * code.sigma[:, :, None, None]
    return (y @ code.back[:, :, None] + code.mu[:, :, None, None]).float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=32, help="16-token blocks sealed and read per repetition")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    codes = {"k": side(33.0, 0), "v": side(40.0, 1)}
    data = {s: rows(c, args.blocks, 2 + i) for i, (s, c) in enumerate(codes.items())}
    page = sum(int(c.slot_bytes.sum()) for c in codes.values())
    best = {"seal": float("inf"), "read": float("inf"), "bf16_read": float("inf")}
    bf16 = {s: d.bfloat16() for s, d in data.items()}
    for _ in range(args.reps):
        t0 = time.perf_counter()
        slots = {s: [[c.encode(li, h, data[s][li, h])[0] for h in range(HEADS)] for li in range(LAYERS)]
                 for s, c in codes.items()}
        t1 = time.perf_counter()
        back = {s: [[c.decode(li, h, slots[s][li][h]) for h in range(HEADS)] for li in range(LAYERS)]
                for s, c in codes.items()}
        t2 = time.perf_counter()
        plain = {s: b.float() for s, b in bf16.items()}
        t3 = time.perf_counter()
        best["seal"] = min(best["seal"], (t1 - t0) / args.blocks)
        best["read"] = min(best["read"], (t2 - t1) / args.blocks)
        best["bf16_read"] = min(best["bf16_read"], (t3 - t2) / args.blocks)
    err = max(float((back[s][li][h] - data[s][li, h]).abs().max()) for s in codes for li in (0, LAYERS - 1)
              for h in range(HEADS))
    assert plain["k"].shape == data["k"].shape and err < 50  # everything was read back (and roughly right)
    load = os.getloadavg()[0]
    per_token = {k: v / BS for k, v in best.items()}
    seq = {k: v * 2048 for k, v in per_token.items()}
    print(f"page of {BS} tokens: {page:,} B (bf16 {2 * LAYERS * HEADS * BS * DIM * 2:,} B, "
          f"{2 * LAYERS * HEADS * BS * DIM * 2 / page:.2f}x)")
    print(f"seal {best['seal'] * 1e3:.2f} ms a block, read {best['read'] * 1e3:.2f} ms a block, bf16 read "
          f"{best['bf16_read'] * 1e3:.3f} ms a block ({best['read'] / best['bf16_read']:.0f}x); a 2,048-token "
          f"sequence: seal {seq['seal']:.2f} s, read {seq['read']:.2f} s, bf16 {seq['bf16_read'] * 1e3:.1f} ms "
          f"(one thread, load {load:.2f})", flush=True)
    print(json.dumps({"layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM, "block_size": BS, "blocks": args.blocks,
                      "page_bytes": page, "seconds_per_block": best, "seconds_per_2048_tokens": seq,
                      "load_1min": round(load, 2)}))


if __name__ == "__main__":
    main()
