"""How much a better coder could still buy `kvtc` at its bytes: three headroom figures measured on SmolLM2-135M's
K (before RoPE) and V rows through the shipped tables (``kvledger/data/kv_transform/<revision>.pt``), on the
screen's tuning texts only (``kv_4bit_screen.texts``: never a contract text or a held-out prompt).

- **Across tokens:** the whitened coefficients (``y = (x - mu) T``, the tables' basis, where squared error is what
  an error costs) of a 16-row block also turned by a DCT along its rows; the distortion at the head's own bits a
  coefficient by reverse water-filling over the coefficients' variances, with and without that turn (Gaussian
  rate-distortion bound: the gain an inter-token transform could give at best).
- **At the decoder:** each symbol read back at its bin's centroid under the coefficient's model (Gaussian or
  Laplacian at its calibrated deviation) instead of the bin's middle, on the real coded blocks; the squared error
  in the whitened basis with each (no byte changes).
- **Across blocks:** the spread of the step code the rate control gives a layer-head's blocks (8 codes an
  octave): a rate shared by the heads of a page could only gain where steps spread.

One process, side by side; the load is printed. Ends with one JSON line.

Usage: cd benchmarks && PYTHONPATH=.:../src python kv_transform_headroom.py [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import kv_4bit_screen as screen  # beside this script: the tuning texts and the tapped forward
import torch

from kvledger.runtime import kv_entropy as ke
from kvledger.runtime.kv_transform import STATE_BYTES, STEP_BYTES
from kvledger.runtime.kv_transform_pages import for_model
from kvledger.runtime.loading import load_decoder, resolve_model

BS = 16


def dct(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix ``[n, n]``."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None]
    m = torch.cos(math.pi * (i + 0.5) * k / n) * math.sqrt(2 / n)
    m[0] /= math.sqrt(2)
    return m


def waterfill(var: torch.Tensor, bits: float) -> float:
    """The least total squared error of independent Gaussians of variances ``var`` coded in ``bits`` in all."""
    lo, hi = 1e-30, float(var.max())
    for _ in range(200):
        d = math.sqrt(lo * hi)
        if float((0.5 * torch.log2(var / d)).clamp_min(0).sum()) > bits:
            lo = d
        else:
            hi = d
    return float(torch.minimum(var, torch.tensor(math.sqrt(lo * hi))).sum())


def centroid(k: torch.Tensor, sd: torch.Tensor, laplace: bool) -> torch.Tensor:
    """``E[x | round(x) = k]`` in steps for a zero-mean Gaussian or Laplacian of deviation ``sd`` steps."""
    a, b = k.abs() - 0.5, k.abs() + 0.5
    if laplace:
        s = sd / math.sqrt(2)
        c = a + s - 1 / torch.expm1(1 / s)
    else:
        def pdf(z: torch.Tensor) -> torch.Tensor:
            return torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)

        def cdf(z: torch.Tensor) -> torch.Tensor:
            return 0.5 * torch.special.erfc(-z / math.sqrt(2))
        mass = cdf(b / sd) - cdf(a / sd)
        c = sd * (pdf(a / sd) - pdf(b / sd)) / mass.clamp_min(1e-300)
        c = torch.where((mass > 1e-12) & torch.isfinite(c), c, k.abs())
    c = torch.minimum(torch.maximum(c, a), b)
    return torch.where(k == 0, torch.zeros_like(k), torch.sign(k) * c)


def symbols(code, layer: int, head: int, slots: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """The coded symbols of whole blocks (no held rows), as :meth:`SideCode.decode` reads them."""
    sigma, laplace, base = code.sigma[layer, head], code.laplace[layer, head], code.base[layer, head]
    cap = (slots.shape[1] - STEP_BYTES) // 2
    b = slots[:, STEP_BYTES:STEP_BYTES + 2 * cap].to(torch.int32)
    words = b[:, 0::2] | (b[:, 1::2] << 8)
    n = slots.shape[0]
    class0 = ke.class_of(sigma / base)[None].expand(n, sigma.shape[0])
    return ke.decode_blocks(words, torch.zeros(n, dtype=torch.int32), codes.int(), torch.full((n,), BS),
                            class0, laplace, BS).double()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    t0 = time.time()
    load = os.getloadavg()[0]
    ckpt = resolve_model("smollm2-135m")
    model = load_decoder(ckpt, torch.float32, cached=False)
    tok = AutoTokenizer.from_pretrained(str(ckpt.path))
    tables = for_model(model)
    c = dct(BS)
    moments: dict[tuple[str, int, int], list] = {}
    acc = {side: {"flat": 0.0, "dct": 0.0, "mid": 0.0, "centroid": 0.0, "codes": []} for side in ("keys", "values")}
    for _name, ids in screen.texts(tok):
        taps: list[dict] = []
        screen.forward(model, ids, taps=taps)
        n = len(ids) // BS * BS
        for side, code, tap in (("keys", tables.keys, "kpre"), ("values", tables.values, "v")):
            a = acc[side]
            for layer, t in enumerate(taps):
                for head in range(t[tap].shape[1]):
                    x = t[tap][:n, head].reshape(-1, BS, t[tap].shape[2])
                    mu, turn, sigma = code.mu[layer, head], code.turn[layer, head], code.sigma[layer, head]
                    y = (x.double() - mu) @ turn
                    z = torch.einsum("fr,nrd->nfd", c, y)
                    m = moments.setdefault((side, layer, head), [0, 0.0, 0.0])
                    m[0] += y.shape[0]
                    m[1] = m[1] + y.pow(2).sum((0, 1))
                    m[2] = m[2] + z.pow(2).sum(0)
                    slots, codes, _ = code.encode(layer, head, x)
                    k = symbols(code, layer, head, slots, codes)
                    step = (code.base[layer, head] * ke.step_rel(codes.int()))[:, None, None]
                    a["mid"] += float((y - k * step).pow(2).sum())
                    sd = (sigma / step).expand_as(k)
                    rec = torch.empty_like(k)
                    for lap in (False, True):
                        m = (code.laplace[layer, head] == lap)[None, None].expand_as(k)
                        rec[m] = centroid(k[m], sd[m], lap)
                    a["centroid"] += float((y - rec * step).pow(2).sum())
                    a["codes"].append(codes.double() - codes.double().mean())
    # the variances pooled over every text (a short prompt's few blocks alone would flatter the DCT's 16x more)
    for (side, layer, head), (blocks, flat, turned) in moments.items():
        code = tables.keys if side == "keys" else tables.values
        # the head's coded bits a block: its slot less the step byte and the coder's state
        bits = (int(code.slot_bytes[layer, head]) - STEP_BYTES - STATE_BYTES) * 8
        acc[side]["flat"] += waterfill((flat / (blocks * BS)).repeat(BS), bits)
        acc[side]["dct"] += waterfill((turned / blocks).flatten(), bits)
    out = {"benchmark": "kv_transform_headroom", "model": "smollm2-135m", "texts": [n for n, _ in screen.texts(tok)],
           "load_1min": round(load, 2), "seconds": round(time.time() - t0, 1)}
    for side, a in acc.items():
        codes = torch.cat(a["codes"])
        out[side] = {"across_tokens_db": round(10 * math.log10(a["flat"] / a["dct"]), 3),
                     "centroid_db": round(10 * math.log10(a["mid"] / a["centroid"]), 3),
                     "step_code_std": round(float(codes.std()), 2),
                     "step_code_range": [int(codes.min()), int(codes.max())]}
        o = out[side]
        print(f"{side}: across tokens (DCT over a block's rows, water-filling bound) {o['across_tokens_db']:+.2f} dB;"
              f" centroid reads {o['centroid_db']:+.2f} dB; a layer-head's step codes spread "
              f"{o['step_code_std']:.2f} codes (8 an octave), {o['step_code_range']}")
    print(f"load {load:.2f} at start, {out['seconds']} s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
