"""KV formats side by side: bytes with metadata, what the seed's pool holds, decode speed and quality.

For each format (bf16, fp8-scaled, int8, int4 by default):

* bytes per token with metadata (scales, minimums) and per block, from ``KVSpec`` (the planner's and the
  store's single source), for the seed's synthetic decoder (32 layers, 8 KV heads of 128, 16-token
  blocks) and for SmolLM2-135M; int4 also charges its unquantised residual pages (one per running
  sequence);
* blocks in the seed's 512 MiB pool and their ratio to bf16, and how many of the seed's eight requests
  (one trust group, a shared 2,048-token prompt, 257 new tokens, full reservation) the ledger admits;
* decode tokens/s of the real engine (SmolLM2-135M on CPU, greedy, a batch of --batch prompts) relative to
  the uncompressed engine, runs interleaved (base, format, base, format, ...) so load hits both alike;
* the quality figures of ``kvledger quality`` (prose, code and chat at --contexts, --new-tokens greedy
  tokens, and the held-out prompts: the bundled slice of the peer chat prompts or --held-out FILE, each
  format beside a bf16 cache on the same prompts), judged against the format's shipped contract.
  ``--record DIR`` stores reports that pass on the full protocol and the held-out prompts there (the
  shipped records in ``kvledger/data/quality/records`` were made this way); ``--no-held-out`` records
  nothing.

Prints one line per format, then one JSON line of every figure.
Usage: python benchmarks/kv_formats.py [--formats fp8-scaled,int8,int4] [--contexts 256,2048] [--new-tokens 128]
       [--batch 8] [--prompt 256] [--new 32] [--reps 3] [--threads 2] [--record DIR] [--skip-quality]
       [--held-out FILE | --no-held-out]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see the runtime docs)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from kvledger.core.identity import CacheContext  # noqa: E402
from kvledger.core.ledger import KVLedger, Request  # noqa: E402
from kvledger.core.sizing.geometry import KVSpec  # noqa: E402
from kvledger.runtime.engine import Engine, kv_spec_for, resolve_model  # noqa: E402
from kvledger.runtime.measure.corpus import corpus_tokens  # noqa: E402

SEED_POOL = 512 * 2**20
SEED_PROMPT, SEED_NEW, SEED_REQUESTS = 2048, 257, 8


def seed_figures(fmt: str, block_size: int) -> dict[str, object]:
    """The seed's decoder and pool in ``fmt``: bytes, blocks, and the eight shared requests admitted."""
    spec = KVSpec(32, 8, 128, kv_dtype=fmt, block_size=block_size)
    residual = SEED_REQUESTS if spec.format.has_residual else 0
    blocks = spec.pool_blocks(SEED_POOL, residual_slots=residual)
    ledger = KVLedger(blocks, block_size)
    prompt = list(range(1000, 1000 + SEED_PROMPT))
    admitted = 0
    for i in range(SEED_REQUESTS):
        decision = ledger.admit(Request(f"r{i}", prompt, SEED_NEW, context=CacheContext(trust_group="seed")))
        admitted += decision.admitted
    ledger.check()
    return {"bytes_per_token": spec.bytes_per_token, "block_bytes": spec.block_bytes,
            "residual_page_bytes": spec.residual_page_bytes, "residual_pages": residual,
            "blocks_in_512MiB": blocks, "seed_requests_admitted": admitted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--formats", default="fp8-scaled,int8,int4")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--contexts", default="256,2048")
    ap.add_argument("--new-tokens", type=int, default=128, help="greedy tokens of the quality protocol")
    ap.add_argument("--batch", type=int, default=8, help="prompts decoded together for tok/s")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens for tok/s")
    ap.add_argument("--new", type=int, default=32, help="tokens generated per prompt for tok/s")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--record", default=None, help="folder to store passing quality reports in")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--held-out", default=None, metavar="FILE",
                    help="held-out prompts (JSON) [the bundled slice of the peer chat prompts]")
    ap.add_argument("--no-held-out", action="store_true", help="score the texts only (nothing is recorded)")
    args = ap.parse_args()
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    bs = args.block_size
    ckpt = resolve_model(args.model)
    base_dtype = "bf16"
    seed_base = seed_figures(base_dtype, bs)
    model_base = kv_spec_for(ckpt, torch.bfloat16, base_dtype, bs)
    figures: dict[str, object] = {"model": args.model, "block_size": bs, "threads": args.threads,
                                  "load_average_at_start": [round(x, 2) for x in load],
                                  "baseline": base_dtype, "seed": {base_dtype: seed_base},
                                  "model_geometry": {base_dtype: {"bytes_per_token": model_base.bytes_per_token}},
                                  "formats": {}}

    # ---- decode speed: every format's engine against the uncompressed one, interleaved ----------------
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt.path))
    tokens = list(corpus_tokens(lambda text: tok(text, add_special_tokens=False).input_ids, key=str(ckpt.path)))
    prompts = [tokens[i * 97: i * 97 + args.prompt] for i in range(args.batch)]
    per = -(-(args.prompt + args.new) // bs)
    engines = {name: Engine.from_model(ckpt, num_blocks=args.batch * per + 8, block_size=bs, kv_dtype=name,
                                       allow_untested_kv=True)
               for name in [None, *formats]}

    def decode_seconds(engine: Engine, new: int) -> float:
        t = time.perf_counter()
        engine.generate(prompts, new)
        return time.perf_counter() - t

    for engine in engines.values():
        decode_seconds(engine, 2)  # one-off initialisation
    times: dict[object, dict[str, list[float]]] = {k: {"one": [], "n": []} for k in engines}
    for _ in range(args.reps):
        for name, engine in engines.items():
            times[name]["one"].append(decode_seconds(engine, 1))
            times[name]["n"].append(decode_seconds(engine, args.new))
    tps = {}
    for name, t in times.items():
        decode = statistics.median(t["n"]) - statistics.median(t["one"])
        tps[name] = args.batch * (args.new - 1) / decode if decode > 0 else float("nan")  # noise swamped it
    figures["decode"] = {"batch": args.batch, "prompt_tokens": args.prompt, "new_tokens": args.new,
                         "reps": args.reps, "uncompressed_tokens_per_s": round(tps[None], 2),
                         "uncompressed_kv": engines[None].spec.kv_format_id}
    del engines

    run = None
    if not args.skip_quality:
        from kvledger.runtime.measure.quality import QualityRun, judge
        from kvledger.runtime.measure.quality_records import load_contract, record_blocker, save_record
        from kvledger.runtime.measure.quality_texts import load_held_out

        run = QualityRun(ckpt, args.model, block_size=bs)
        held = None if args.no_held_out else load_held_out(args.held_out)
    contexts = [int(x) for x in args.contexts.split(",")]
    for fmt in formats:
        seed = seed_figures(fmt, bs)
        spec = kv_spec_for(ckpt, torch.bfloat16, fmt, bs)
        row: dict[str, object] = {
            "seed": seed,
            "seed_blocks_vs_bf16": round(seed["blocks_in_512MiB"] / seed_base["blocks_in_512MiB"], 3),
            "model_bytes_per_token": spec.bytes_per_token,
            "model_blocks_vs_bf16_same_bytes": round(model_base.block_bytes / spec.block_bytes, 3),
            "kv_format": spec.kv_format_id,
            "decode_tokens_per_s": round(tps[fmt], 2),
            "decode_vs_uncompressed": round(tps[fmt] / tps[None], 3),
        }
        if run is not None:
            t = time.perf_counter()
            report = run.measure(fmt, contexts=contexts, new_tokens=args.new_tokens)
            report["held_out"] = None if held is None else run.measure_held_out(fmt, held[0], held[1],
                                                                                 new_tokens=args.new_tokens)
            report = judge(report, load_contract(fmt))
            hs = report["held_out"]["summary"] if report["held_out"] else None
            row["quality"] = {"passed": report["passed"], "complete_protocol": report["protocol"]["complete"],
                              "verdict_line": report["verdict_line"],
                              "summary": report["summary"], "seconds": round(time.perf_counter() - t, 1),
                              "cases": [{k: c[k] for k in ("kind", "context", "ppl_base", "ppl", "ppl_rel_change",
                                                         "kl_mean", "attn_rel_err", "greedy_matching",
                                                         "first_divergence")} for c in report["cases"]],
                              "held_out": None if hs is None else {
                                  "origin": report["held_out"]["origin"], "summary": hs,
                                  "cases": [{k: c[k] for k in ("prompt", "tokens", "ppl_change", "kl_mean",
                                                             "greedy_agreement", "common_prefix", "bf16")}
                                            for c in report["held_out"]["cases"]]}}
            blocker = record_blocker(report)
            if args.record and blocker is None:
                row["quality"]["record"] = str(save_record(report, Path(args.record)))  # type: ignore[index]
            elif args.record:
                row["quality"]["not_recorded"] = blocker  # type: ignore[index]
        figures["formats"][fmt] = row  # type: ignore[index]
        q = row.get("quality") or {}
        s = q.get("summary") if isinstance(q, dict) else None
        quality = (f"; ppl change max {100 * s['ppl_rel_change_max']:.3f}%, greedy agreement mean "
                   f"{100 * s['greedy_agreement_mean']:.1f}% (min {100 * s['greedy_agreement_min']:.1f}%), "
                   f"contract {'passed' if q['passed'] else 'FAILED'}") if s else ""
        h = q.get("held_out") if isinstance(q, dict) else None
        if h:
            hs = h["summary"]
            quality += (f"; held out: ppl pooled {100 * hs['ppl_change_pooled']:+.3f}% (bf16 "
                        f"{100 * hs['ppl_change_pooled_bf16']:+.3f}%), worst {100 * hs['ppl_rel_change_worst']:.3f}%, "
                        f"KL {hs['kl_vs_bf16']:.2f}x bf16's, common prefix {hs['common_prefix_mean']:.1f} "
                        f"(bf16 {hs['common_prefix_mean_bf16']:.1f}); {q['verdict_line']}")
        print(f"{fmt:>5}: {seed['bytes_per_token']:,} B/token (seed decoder, bf16 {seed_base['bytes_per_token']:,}); "
              f"{seed['blocks_in_512MiB']} blocks in 512 MiB = x{row['seed_blocks_vs_bf16']} bf16's "
              f"({seed_base['blocks_in_512MiB']}); seed requests admitted {seed['seed_requests_admitted']}/8 "
              f"(bf16 {seed_base['seed_requests_admitted']}/8); "
              f"SmolLM2 blocks x{row['model_blocks_vs_bf16_same_bytes']}; "
              f"decode x{row['decode_vs_uncompressed']} of uncompressed{quality}", flush=True)
    figures["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
