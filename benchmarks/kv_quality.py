"""How far a KV format moves SmolLM2's next-token distribution on the 32 peer prompts, beside bf16's.

Every format runs in lockstep with an fp32-KV runner of the same decoder (fp32 compute, 16-token
blocks): one prefill of the prompts, then 127 decode steps, every runner fed the fp32 reference ids of
``../shared/peers/reference_outputs_fp32.json`` (teacher forcing, the cache written exactly as a served
decode writes it: an open block stays in its residual page where the format keeps one). At each of the
128 positions per prompt:

* ``KL(p_fp32 || p_fmt)`` of the next-token distributions (mean over positions);
* teacher-forced greedy agreement: the format's argmax equals the fp32 runner's (pooled, and the worst
  prompt);
* teacher-forced perplexity of the reference ids, its change against the fp32 runner's (pooled, and the
  largest ``|change|`` of one prompt).

Figures are given for three prompt sets: ``tune`` (prompts ``i`` with ``(i // 2) % 2 == 0``: half of
them open with the shared 256-token header, half do not), ``heldout`` (the other 16) and ``all``.
Choose a format's tunables on ``tune``; report ``heldout``. Prints one line per format and set, then one
JSON line of every figure (bytes per token include every scale and minimum).

Usage: python benchmarks/kv_quality.py [--formats bf16,int8,int8-token] [--prompts all|tune|heldout] [--threads 2]
       [--backend auto] [--batch 32]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kvledger.core.sizing.kv_formats import KV_FORMATS, KVFormat  # noqa: E402
from kvledger.runtime.engine import kv_spec_for, load_decoder, resolve_model  # noqa: E402
from kvledger.runtime.model import ModelRunner, SeqStep  # noqa: E402

PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers"
SETS = ("tune", "heldout", "all")


# Variants measured while choosing int8's scheme, registered only in this process (--formats may name them).
EXPERIMENTS = {
    "x-int8-hadamard-kv": ("token-head", "kv", ""),  # K and V turned, one scale per token
    "x-int8-channel-k": ("channel", "", ""),  # int8 (per-channel keys) with values not turned
    # keys smoothed by int4-smooth's static constants, then K and V turned, one scale per token: no per-block fold
    # of the query in decode (the per-token integer kernels)
    "x-int8-smooth": ("token-head", "kv", "k"),
}


def register_experiments() -> None:
    for name, (scales, rotation, smooth) in EXPERIMENTS.items():
        if name not in KV_FORMATS:
            KV_FORMATS.register(name, KVFormat(name, "experiment", 8, True, scales, "int8", rotation, smooth),
                                "experiment")


def in_set(i: int, name: str) -> bool:
    return name == "all" or ((i // 2) % 2 == 0) == (name == "tune")


def load(peers: Path) -> tuple[list[list[int]], list[list[int]]]:
    wl = json.loads((peers / "workload.json").read_text())
    ref = json.loads((peers / "reference_outputs_fp32.json").read_text())
    return [r["ids"] for r in wl["requests"]], ref["outputs"]


def _slots(table: list[int], start: int, end: int, bs: int) -> list[int]:
    return [table[p // bs] * bs + p % bs for p in range(start, end)]


@torch.inference_mode()
def run(model, specs: dict[str, object], prompts: list[list[int]], forced: list[list[int]], backend: str,
        batch: int) -> dict[str, dict[str, list[float]]]:
    """Per format, per prompt: summed KL, argmax matches, summed NLL and the fp32 runner's summed NLL."""
    new = len(forced[0])
    stats = {name: {"kl": [0.0] * len(prompts), "match": [0] * len(prompts), "nll": [0.0] * len(prompts)}
             for name in specs}
    stats["fp32"]["ref_match"] = [0] * len(prompts)
    for lo in range(0, len(prompts), batch):
        idx = list(range(lo, min(len(prompts), lo + batch)))
        bs = 16
        need = [-(-(len(prompts[i]) + new) // bs) for i in idx]
        tables, at = [], 0
        for n in need:
            tables.append(list(range(at, at + n)))
            at += n
        runners = {name: ModelRunner(model, spec, at, backend=backend,
                                     residual_slots=len(idx) if spec.format.has_residual else None)
                   for name, spec in specs.items()}
        for step in range(new):
            if step == 0:
                steps = [SeqStep(prompts[i], 0, t, _slots(t, 0, len(prompts[i]), bs))
                         for i, t in zip(idx, tables, strict=True)]
            else:
                steps = [SeqStep([forced[i][step - 1]], len(prompts[i]) + step - 1, t,
                                 _slots(t, len(prompts[i]) + step - 1, len(prompts[i]) + step, bs))
                         for i, t in zip(idx, tables, strict=True)]
            logp = {name: F.log_softmax(r.forward(steps).float(), dim=-1) for name, r in runners.items()}
            base = logp["fp32"]
            target = torch.tensor([forced[i][step] for i in idx])
            top = base.argmax(-1)
            for name, lp in logp.items():
                kl = (base.exp() * (base - lp)).sum(-1).clamp_min(0)
                nll = -lp.gather(1, target[:, None])[:, 0]
                match = lp.argmax(-1) == top
                s = stats[name]
                for j, i in enumerate(idx):
                    s["kl"][i] += float(kl[j])
                    s["match"][i] += int(match[j])
                    s["nll"][i] += float(nll[j])
            for j, i in enumerate(idx):
                stats["fp32"]["ref_match"][i] += int(top[j] == target[j])
    return stats


def figures(stats: dict[str, list[float]], base: dict[str, list[float]], prompts: list[int], new: int) -> dict:
    n = len(prompts) * new
    ppl = math.exp(sum(stats["nll"][i] for i in prompts) / n)
    ppl_b = math.exp(sum(base["nll"][i] for i in prompts) / n)
    per = [(math.exp(stats["nll"][i] / new) - math.exp(base["nll"][i] / new)) / math.exp(base["nll"][i] / new)
           for i in prompts]
    agree = [stats["match"][i] / new for i in prompts]
    return {"kl_mean": sum(stats["kl"][i] for i in prompts) / n,
            "agreement": sum(stats["match"][i] for i in prompts) / n, "agreement_worst": min(agree),
            "ppl_change": (ppl - ppl_b) / ppl_b, "ppl_change_worst_abs": max(abs(x) for x in per),
            "identical_prompts": sum(a == 1.0 for a in agree), "prompts": len(prompts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--formats", default="bf16,int8,int8-token")
    ap.add_argument("--prompts", default="all", choices=SETS, help="which prompts to run (figures per set)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--batch", type=int, default=32, help="prompts decoded together")
    ap.add_argument("--peers", default=str(PEERS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    register_experiments()
    prompts, ref = load(Path(args.peers))
    chosen = [i for i in range(len(prompts)) if in_set(i, args.prompts)]
    ckpt = resolve_model(args.model)
    model = load_decoder(ckpt, torch.float32)
    formats = [f.strip() for f in args.formats.split(",") if f.strip() and f.strip() != "fp32"]
    specs = {name: kv_spec_for(ckpt, torch.float32, name, 16) for name in ["fp32", *formats]}
    t0 = time.perf_counter()
    sub = run(model, specs, [prompts[i] for i in chosen], [ref[i][:args.new_tokens] for i in chosen], args.backend,
              args.batch)
    seconds = time.perf_counter() - t0
    out: dict = {"model": args.model, "backend": args.backend, "new_tokens": args.new_tokens,
                 "seconds": round(seconds, 1),
                 "fp32_matches_reference": sum(sub["fp32"]["ref_match"]) / (len(chosen) * args.new_tokens),
                 "formats": {}}
    local = {name: list(range(len(chosen))) for name in SETS}
    for name in SETS:
        local[name] = [j for j, i in enumerate(chosen) if in_set(i, name)]
    for fmt in formats:
        spec = specs[fmt]
        row = {"kv_format": spec.kv_format_id, "bytes_per_token": spec.bytes_per_token}
        for name in SETS:
            if local[name]:
                row[name] = figures(sub[fmt], sub["fp32"], local[name], args.new_tokens)
        out["formats"][fmt] = row
        for name in SETS:
            if name in row:
                f = row[name]
                print(f"{fmt:>14} {name:>7}: KL {f['kl_mean']:.2e}  agreement {100 * f['agreement']:.2f}% "
                      f"(worst {100 * f['agreement_worst']:.1f}%)  ppl {100 * f['ppl_change']:+.3f}% "
                      f"(worst |{100 * f['ppl_change_worst_abs']:.2f}|%)  {spec.bytes_per_token} B/token")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
