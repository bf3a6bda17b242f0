"""Tiers below the device pool, measured: each tier's link, lossless compression of real KV, hidden vs
exposed transfer time on a workload that swaps and re-hits prefixes, and the prefix hit rate a tier buys on
a slice of the Mooncake trace.

1. **Links.** For each tier (host memory, a disk file, the disk file with zlib) whole SmolLM2-135M fp32
   blocks (737,280 bytes) are moved device -> tier and back through the engine's own transfer path, 1 to 32
   blocks at a time; ``fixed + bytes / bandwidth`` is fitted per direction with its rms error
   (:func:`kvledger.runtime.measure.links.measure_links`, :func:`kvledger.sim.calibrate.fit_link`).
2. **Lossless compression of real KV.** The engine computes the KV of real text (the bundled corpus) in fp32
   and in bf16; every written block is compressed with zlib (level 1): ratio and MB/s of each.
3. **Hidden vs exposed.** SmolLM2 on the real engine, a 48-block pool, 24 requests each opening with one of
   eight 160-token system prompts in turn (real text; more than the pool keeps) plus a private part,
   64 new tokens each, arriving all at once, incremental admission, preemption by swap: without tiers
   (recompute), and with a host + disk tier and prefix offload
   -- transfers overlapped, overlapped with restore-ahead, and not overlapped -- side by side in one run.
   Greedy outputs must be identical across every configuration (a swap-in or promotion is bit-identical).
4. **Hit rate on Mooncake.** The simulator (Llama-3.1-8B on an H100 profile; the disk link there is an
   assumed NVMe) replays the first ``--mooncake-requests`` requests of the conversation trace (the full trace
   in /work/shared/traces when present, else the 300-request slice in tests/data/traces; ``--trace`` for
   another), arrivals slowed by ``--speedup`` (one H100 cannot keep up with the trace's rate), with a small
   pool, without a tier and with tiers of growing size (host 2x the pool; disks 16x and 64x: the trace's
   re-uses are far apart); the unbounded-cache bound is printed beside them.

Timings depend on the machine and its load (noted before and after); only figures measured side by side in
this run are compared. Run with OMP_NUM_THREADS=1 on a shared machine. Ends with one JSON line.
Usage: OMP_NUM_THREADS=1 python benchmarks/offload.py [--requests 24] [--new 64] [--system-prompts 8]
       [--mooncake-requests 1000] [--speedup 0.2] [--trace PATH] [--disk-dir DIR] [--skip-runtime | --skip-mooncake]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import json  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MOONCAKE_SLICE = REPO / "tests" / "data" / "traces" / "mooncake_conversation_head300.jsonl"
FULL_TRACE = Path("/work/shared/traces/mooncake_fast25_conversation_trace.jsonl")


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---- 1. links -----------------------------------------------------------------------------------------


def links_section(args: argparse.Namespace, runner) -> dict:
    from kvledger.runtime.measure.links import measure_links
    from kvledger.sim.calibrate import fit_links

    out = {}
    print("\n1. Tier links (SmolLM2-135M fp32 blocks; time = fixed + bytes / bandwidth, fitted)")
    print(f"{'tier':<12}{'direction':<16}{'fixed us':>10}{'GB/s':>8}{'fit rms':>9}   points (blocks: ms)")
    for label, tier, codec in (("host", "host", "none"), ("disk", "disk", "none"), ("disk+zlib", "disk", "zlib")):
        measured = measure_links(runner.store, tiers=(tier,), repeats=args.link_repeats, disk_dir=args.disk_dir,
                                 compression=codec)
        links, report = fit_links(measured)
        link = links[tier]
        entry = {"block_bytes": measured["block_bytes"], **link,
                 "points": measured["tiers"][tier]["points"]}
        for direction, name in (("out", "device -> tier"), ("in", "tier -> device")):
            pts = " ".join(f"{n}:{t * 1e3:.2f}" for n, t in measured["tiers"][tier]["points"][direction])
            print(f"{label:<12}{name:<16}{link[f'{direction}_overhead_s'] * 1e6:>10.1f}"
                  f"{link[f'{direction}_Bps'] / 1e9:>8.2f}{link[f'{direction}_fit_rms_error_pct']:>8.1f}%   {pts}")
        out[label] = entry
    return out


# ---- 2. compression of real KV ------------------------------------------------------------------------


def compression_section(ckpt, prompts: list[list[int]]) -> dict:
    import torch

    from kvledger.runtime.engine import Engine
    from kvledger.runtime.host_store import BlockBytes

    out = {}
    print("\n2. Lossless compression of real KV (zlib level 1, per block, on the corpus's KV)")
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        engine = Engine.from_model(ckpt, num_blocks=256, block_size=16, dtype=dtype)
        engine.generate(prompts, 1)
        bb = BlockBytes(engine.runner.store)
        blocks = [b for b in range(engine.ledger.num_blocks) if engine.ledger.pool.written[b]]
        raw = stored = 0
        t_c = t_d = 0.0
        for b in blocks:
            data = bb.snapshot(b)
            t0 = time.perf_counter()
            packed = zlib.compress(data, 1)
            t1 = time.perf_counter()
            assert zlib.decompress(packed) == data
            t_d += time.perf_counter() - t1
            t_c += t1 - t0
            raw += len(data)
            stored += len(packed)
        entry = {"blocks": len(blocks), "bytes": raw, "compressed_bytes": stored, "ratio": raw / stored,
                 "compress_MBps": raw / t_c / 1e6, "decompress_MBps": raw / t_d / 1e6}
        out[name] = entry
        print(f"{name}: {len(blocks)} blocks of {raw // max(1, len(blocks)):,} bytes: ratio {entry['ratio']:.3f} "
              f"({stored / raw:.1%} of the bytes), compress {entry['compress_MBps']:,.0f} MB/s, decompress "
              f"{entry['decompress_MBps']:,.0f} MB/s")
    return out


# ---- 3. hidden vs exposed on the engine ---------------------------------------------------------------


CONFIGS = {
    "no tier (recompute)": dict(),
    "tiers, overlapped": dict(tiers=True, overlap=True),
    "tiers, overlapped, restore-ahead": dict(tiers=True, overlap=True, restore_ahead=True),
    "tiers, not overlapped": dict(tiers=True, overlap=False),
}


def engine_section(args: argparse.Namespace, ckpt, tokens: list[int]) -> dict:
    from kvledger.runtime.engine import Engine
    from kvledger.runtime.measure.corpus import PromptSynth
    from kvledger.runtime.sampling import SamplingParams
    from kvledger.scheduler import SchedulerConfig, summarize_requests

    synth = PromptSynth(tokens, 64)
    k_sys = args.system_prompts
    systems = [synth.chunk(10 + k)[:64] + synth.chunk(40 + k)[:64] + synth.chunk(70 + k)[:32] for k in range(k_sys)]
    prompts = [systems[i % k_sys] + synth.chunk(1000 + i)[: 24 + (i * 7) % 33] for i in range(args.requests)]
    greedy = SamplingParams(temperature=0.0)
    print(f"\n3. Hidden vs exposed transfer time: {args.requests} requests ({k_sys} shared 160-token system prompts, "
          f"taken in turn, + "
          f"24-56 private tokens, {args.new} new each), pool {args.pool_blocks} blocks of 16, max {args.max_running} "
          f"running, incremental admission")
    print(f"{'configuration':<34}{'tok/s':>7}{'TTFT p50':>10}{'hit rate':>9}{'swapped':>8}{'wrote back':>11}"
          f"{'demoted':>8}{'promoted':>9}{'transfer ms':>12}{'hidden':>8}{'exposed':>8}")
    out = {}
    outputs = {}
    for name, c in CONFIGS.items():
        cfg = SchedulerConfig(policy="incremental", max_running=args.max_running, token_budget=512,
                              prefill_chunk=256, recovery="swap" if c.get("tiers") else "recompute",
                              offload_prefixes=bool(c.get("tiers")), restore_ahead=bool(c.get("restore_ahead")))
        tiers = dict(host_blocks=args.host_blocks, disk_blocks=args.disk_blocks, disk_dir=args.disk_dir,
                     staging_blocks=16, overlap_transfers=c["overlap"]) if c.get("tiers") else {}
        engine = Engine.from_model(ckpt, num_blocks=args.pool_blocks, block_size=16, scheduler_config=cfg, **tiers)
        engine.generate([prompts[0][:8]], 2, greedy)  # warm-up outside the measurement
        t0 = engine.clock()
        handles = [engine.submit(p, args.new, greedy, arrival_s=t0) for p in prompts]
        engine.run_until_idle()
        results = [h.result() for h in handles]
        engine.check()
        summ = summarize_requests(r.metrics for r in results)
        s = engine.stats
        entry = {"throughput_tok_s": summ["throughput_tok_s"], "ttft_p50_s": summ["ttft_s"]["p50"],
                 "prefix_hit_rate": summ["prefix_hit_rate"], "preemptions": engine.scheduler.preemptions,
                 "swapped_out_blocks": s.swapped_out_blocks, "swapped_in_blocks": s.swapped_in_blocks,
                 "written_back_blocks": s.written_back_blocks, "demoted_blocks": s.demoted_blocks,
                 "promoted_blocks": s.promoted_blocks,
                 "moved_blocks": s.moved_blocks, "transfer_s": s.transfer_s, "hidden_s": s.transfer_hidden_s,
                 "exposed_s": s.transfer_exposed_s, "steps": s.steps, "forward_s": s.forward_s}
        if engine.transfers is not None:
            entry["links"] = engine.transfers.stats()["links"]
            engine.close()
        out[name] = entry
        outputs[name] = [r.output for r in results]
        print(f"{name:<34}{entry['throughput_tok_s']:>7.1f}{entry['ttft_p50_s'] * 1e3:>9.0f}ms"
              f"{entry['prefix_hit_rate']:>9.1%}{s.swapped_out_blocks:>8}{s.written_back_blocks:>11}"
              f"{s.demoted_blocks:>8}{s.promoted_blocks:>9}"
              f"{s.transfer_s * 1e3:>12.1f}{s.transfer_hidden_s * 1e3:>8.1f}{s.transfer_exposed_s * 1e3:>8.1f}")
    ref = next(iter(outputs.values()))
    same = all(o == ref for o in outputs.values())
    print(f"greedy outputs identical in every configuration: {'yes' if same else 'NO'}")
    return {"configs": out, "outputs_identical": same, "requests": args.requests, "new_tokens": args.new,
            "pool_blocks": args.pool_blocks, "host_blocks": args.host_blocks, "disk_blocks": args.disk_blocks}


# ---- 4. hit rate on Mooncake, simulated -----------------------------------------------------------------


def mooncake_section(args: argparse.Namespace) -> dict:
    from kvledger.sim.simulator import SimConfig, Simulator, prefix_hit_bound
    from kvledger.workloads import load_trace, scale_time

    path = Path(args.trace) if args.trace else (FULL_TRACE if FULL_TRACE.is_file() else MOONCAKE_SLICE)
    reqs = scale_time(load_trace(path)[: args.mooncake_requests], args.speedup)
    bound = prefix_hit_bound(reqs, 16)
    block_bytes = 16 * 32 * 8 * 128 * 2 * 2  # Llama-3.1-8B, bf16 KV: 2 MiB per 16-token block
    pool = args.mooncake_pool_blocks
    print(f"\n4. Prefix hit rate on the first {len(reqs)} Mooncake requests ({path.name}, arrivals x{args.speedup:g}), "
          f"simulated: Llama-3.1-8B on an H100 profile, pool {pool} blocks ({pool * block_bytes / 2**30:.1f} GiB); "
          f"unbounded-cache bound {bound['bound']:.1%}")
    print(f"{'tiers':<28}{'hit rate':>9}{'TTFT p50':>10}{'tok/s':>8}{'promoted tok':>13}{'transfer ms':>12}"
          f"{'hidden':>8}{'exposed':>8}")
    out: dict = {"requests": len(reqs), "trace": path.name, "speedup": args.speedup, "pool_blocks": pool,
                 "bound": bound["bound"]}
    cases = {"none": (0, 0), f"host {2 * pool}": (2 * pool, 0),
             f"host {2 * pool} + disk {16 * pool}": (2 * pool, 16 * pool),
             f"host {2 * pool} + disk {64 * pool}": (2 * pool, 64 * pool)}
    for name, (host, disk) in cases.items():
        cfg = SimConfig(model="llama-3.1-8b", gpu="h100-80gb", pool_blocks=pool, block_size=16,
                        host_pool_bytes=host * block_bytes, disk_pool_bytes=disk * block_bytes,
                        offload_prefixes=bool(host or disk), max_running=64)
        res = Simulator(cfg).run(reqs)
        summ = res.summary()
        tr = res.counters.get("transfers", {"transfer_s": 0.0, "hidden_s": 0.0, "exposed_s": 0.0})
        promoted = res.counters.get("tiers", {}).get("promoted_tokens", 0)
        entry = {"prefix_hit_rate": summ["prefix_hit_rate"], "ttft_p50_s": summ["ttft_s"]["p50"],
                 "throughput_tok_s": summ["throughput_tok_s"], "promoted_tokens": promoted,
                 "transfer_s": tr["transfer_s"], "hidden_s": tr["hidden_s"], "exposed_s": tr["exposed_s"],
                 "host_blocks": host, "disk_blocks": disk}
        out[name] = entry
        print(f"{name:<28}{entry['prefix_hit_rate']:>9.1%}{entry['ttft_p50_s'] * 1e3:>8.0f}ms"
              f"{entry['throughput_tok_s']:>8.0f}{promoted:>13,}{tr['transfer_s'] * 1e3:>12.1f}"
              f"{tr['hidden_s'] * 1e3:>8.1f}{tr['exposed_s'] * 1e3:>8.1f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--system-prompts", type=int, default=8, help="distinct shared system prompts, taken in turn")
    p.add_argument("--new", type=int, default=64, help="tokens generated per request (growth makes preemptions)")
    p.add_argument("--pool-blocks", type=int, default=48)
    p.add_argument("--max-running", type=int, default=6)
    p.add_argument("--host-blocks", type=int, default=32)
    p.add_argument("--disk-blocks", type=int, default=256)
    p.add_argument("--disk-dir", default=None, help="folder of the disk tier's file [the system temp dir]")
    p.add_argument("--link-repeats", type=int, default=5)
    p.add_argument("--trace", default=None, help=f"a Mooncake trace [{MOONCAKE_SLICE.relative_to(REPO)}]")
    p.add_argument("--mooncake-requests", type=int, default=1000)
    p.add_argument("--speedup", type=float, default=0.2, help="arrival-rate factor of the Mooncake replay")
    p.add_argument("--mooncake-pool-blocks", type=int, default=4096)
    p.add_argument("--skip-runtime", action="store_true", help="only the simulated Mooncake section")
    p.add_argument("--skip-mooncake", action="store_true", help="only the runtime sections")
    args = p.parse_args()
    before = load()
    print(f"offload benchmark; load average before: {before}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    out: dict = {"benchmark": "offload", "load_average_before": before}
    if not args.skip_runtime:
        import torch
        from transformers import AutoTokenizer

        from kvledger.runtime.engine import load_runner, resolve_model
        from kvledger.runtime.measure.corpus import PromptSynth, corpus_tokens

        ckpt = resolve_model("smollm2-135m")
        tok = AutoTokenizer.from_pretrained(str(ckpt.path))
        tokens = list(corpus_tokens(lambda text: tok(text, add_special_tokens=False).input_ids, key=str(ckpt.path)))
        runner = load_runner(ckpt, num_blocks=64, block_size=16, dtype=torch.float32)
        out["links"] = links_section(args, runner)
        synth = PromptSynth(tokens, 512)
        out["compression"] = compression_section(ckpt, [synth.chunk(7 + i) for i in range(4)])
        out["engine"] = engine_section(args, ckpt, tokens)
    if not args.skip_mooncake:
        out["mooncake"] = mooncake_section(args)
    out["load_average_after"] = load()
    print(f"\nload average after: {out['load_average_after']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
