"""Decode speed of quantised KV formats against the fp32-KV engine, side by side in one invocation (issue 36).

For every shape (--batches sizes at --prompt tokens, then each of --long-batch sizes at --long tokens) it builds one
engine per KV format (the uncompressed fp32 one first) on SmolLM2-135M, fp32 compute, and times greedy
generation interleaved (fp32, int8, ..., fp32, int8, ...) so that load on a shared machine hits every
format alike (the order reversed every other repetition). Decode tok/s = B * (new - 1) / (fastest time of `new`
tokens - fastest time of 1 token): the prefill (served from the prefix cache after the first call) and the first
token are subtracted out. Beside the ratio of those fastest times, each format's **paired** ratio: every
repetition's own fp32-over-format decode-time ratio (the two engines timed next to each other), as first quartile,
median and third quartile over the repetitions (``--reps`` of 15 or more resolve a few percent on a busy host). Both
clocks are kept: wall time, and the process's CPU time (both threads' work; far steadier than wall time
on a shared, oversubscribed machine, where a descheduled thread stalls the other at every barrier).

Prints the CPU's vector flags that pick the decode kernels (AVX-512 VNNI: the integer-dot kernels for
int8 (per-channel) / int4 keys and int8-token / 4-bit values; ``--int-dot off`` takes the float kernels), one line per
shape with each format's ratio to fp32, the load average at start and end, then one JSON line of every figure.
``--formats`` may name ``benchmarks/kv_quality.py``'s experiments (``x-...``), registered in this process only.
Usage: python benchmarks/kv_decode_speed.py [--formats int8,int8-token,int4,fp8-scaled] [--batches 1,8,32]
       [--prompt 256] [--long 2048] [--long-batch 4,8,32] [--new 16] [--reps 3] [--threads 2] [--int-dot on|off]
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

from kvledger.runtime import native  # noqa: E402
from kvledger.runtime.cpu_features import cpu_flags, cpu_model  # noqa: E402
from kvledger.runtime.engine import Engine, resolve_model  # noqa: E402
from kvledger.runtime.measure.corpus import corpus_tokens  # noqa: E402


def paired_ratio(base: dict[str, list[tuple[float, float]]], other: dict[str, list[tuple[float, float]]],
                 at: int) -> list[float] | None:
    """First quartile, median and third quartile of the repetitions' own speed ratios (``base``'s decode time
    over ``other``'s, each repetition's two engines timed next to each other): a slow spell on the host hits
    both sides of one ratio, where the ratio of the fastest times compares two different moments. None with
    fewer than 2 repetitions or a repetition whose decode time is not positive."""
    ratios = []
    for i in range(len(base["n"])):
        db, do = base["n"][i][at] - base["one"][i][at], other["n"][i][at] - other["one"][i][at]
        if db <= 0 or do <= 0:
            return None
        ratios.append(db / do)
    if len(ratios) < 2:
        return None
    q1, med, q3 = statistics.quantiles(ratios, n=4)
    return [round(q1, 3), round(statistics.median(ratios), 3), round(q3, 3)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--formats", default="int8,int8-token,int4,fp8-scaled")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--long", type=int, default=2048, help="context of the long shape (0: none)")
    ap.add_argument("--long-batch", default="4", help="batch sizes of the long shape, comma-separated")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--int-dot", choices=["on", "off"], default="on",
                    help="integer-dot decode kernels where the build has them (off: the float kernels)")
    args = ap.parse_args()
    ops = native.load()
    int_dot = bool(ops.int_dot(1 if args.int_dot == "on" else 0)) if ops is not None and hasattr(ops, "int_dot") \
        else False
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx_vnni")))
    print(f"CPU: {cpu_model() or 'unknown'}, {os.cpu_count()} logical CPUs", flush=True)
    print(f"CPU flags: {' '.join(flags) or 'none of AVX-512 / AMX'}; integer-dot kernels {'on' if int_dot else 'off'}",
          flush=True)
    torch.set_num_threads(args.threads)
    formats = ["fp32", *[f.strip() for f in args.formats.split(",") if f.strip()]]
    if any(f.startswith("x-") for f in formats):  # kv_quality.py's experiments, registered in this process only
        from kv_quality import register_experiments  # this folder is on sys.path when a benchmark runs as a script

        register_experiments()
    ckpt = resolve_model(args.model)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt.path))
    tokens = list(corpus_tokens(lambda text: tok(text, add_special_tokens=False).input_ids, key=str(ckpt.path)))
    shapes = [(int(b), args.prompt) for b in args.batches.split(",") if b.strip()]
    if args.long:
        shapes += [(int(b), args.long) for b in args.long_batch.split(",") if b.strip()]
    figures: dict[str, object] = {"model": args.model, "threads": args.threads, "new": args.new, "reps": args.reps,
                                  "cpu": cpu_model(), "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
                                  "shapes": [], "cpu_flags": flags, "int_dot": int_dot}
    for batch, prompt in shapes:
        text = tokens * (1 + prompt // max(1, len(tokens)))
        prompts = [text[(i * 997) % (len(text) - prompt + 1):][:prompt] for i in range(batch)]
        blocks = batch * -(-(prompt + args.new) // args.block_size) + 8
        engines = {f: Engine.from_model(ckpt, num_blocks=blocks, block_size=args.block_size, kv_dtype=f,
                                        allow_untested_kv=True) for f in formats}

        def run(engine: Engine, new: int, prompts: list[list[int]] = prompts) -> tuple[float, float]:
            t, c = time.perf_counter(), time.process_time()
            engine.generate(prompts, new)
            return time.perf_counter() - t, time.process_time() - c

        for engine in engines.values():
            run(engine, 2)  # prefill once (the prefix cache serves it after) and initialise
        times: dict[str, dict[str, list[tuple[float, float]]]] = {f: {"one": [], "n": []} for f in formats}
        load0 = os.getloadavg()[0]
        for rep in range(args.reps):  # the order reversed every other repetition: no format always runs first
            for f in (formats if rep % 2 == 0 else formats[::-1]):
                times[f]["one"].append(run(engines[f], 1))
                times[f]["n"].append(run(engines[f], args.new))
        row: dict[str, object] = {"batch": batch, "context": prompt}
        for clock, at in (("wall", 0), ("cpu", 1)):
            tps = {}
            for f, t in times.items():
                dt = min(x[at] for x in t["n"]) - min(x[at] for x in t["one"])
                tps[f] = batch * (args.new - 1) / dt if dt > 0 else float("nan")
            row[f"{clock}_tokens_per_s"] = {f: round(v, 1) for f, v in tps.items()}
            row[f"{clock}_vs_fp32"] = {f: round(tps[f] / tps["fp32"], 3) for f in formats[1:]}
            row[f"{clock}_vs_fp32_paired"] = {f: paired_ratio(times["fp32"], times[f], at) for f in formats[1:]}
        row["load"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
        figures["shapes"].append(row)  # type: ignore[attr-defined]
        paired = row["cpu_vs_fp32_paired"]
        ratios = "; ".join(f"{f} x{row['cpu_vs_fp32'][f]} (wall x{row['wall_vs_fp32'][f]}"  # type: ignore[index]
                           + (f"; paired CPU x{paired[f][1]}, q1-q3 {paired[f][0]}-{paired[f][2]})"  # type: ignore[index]
                              if paired[f] else ")") for f in formats[1:])  # type: ignore[index]
        print(f"batch {batch:>2} x {prompt:>4} tokens, CPU time (wall): fp32 "
              f"{row['cpu_tokens_per_s']['fp32']} tok/s per CPU-s ({row['wall_tokens_per_s']['fp32']} tok/s); "  # type: ignore[index]
              f"{ratios} (load {row['load'][0]} -> {row['load'][1]})", flush=True)
        del engines
    figures["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
