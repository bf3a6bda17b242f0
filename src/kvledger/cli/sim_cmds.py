"""`kvledger simulate` and `kvledger compare`: the simulator's faces.

The top level imports only click: the simulator, rich and matplotlib are imported inside the commands, so
`kvledger plan` stays fast. Workload-level sweeps (`--sweep rate=...`, `--sweep speedup=...`) transform the
requests here (`kvledger.workloads.transform_workload`); the other sweep keys are simulator settings.
The module runs just past 600 lines because `simulate` has some forty options (workload, deployment, policy,
sweep, SLO, fleet), each declared once here or in `engine_options`, and its one function turns them into a
`SimConfig`; splitting the options from their use would only move the list.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from ..core.sizing.engines import ENGINES
from ..errors import ConfigError
from ..placement.score import ARMS, ROUTINGS
from ..scheduler import ADMISSION_POLICIES, VICTIM_POLICIES
from ..workloads import trace_format_choices
from .calibrate_cmds import calibrate_cmd, measure_runtime  # noqa: F401 -- re-exported for the app
from .common import emit_json as _emit_json
from .engine_options import engine_option, engine_options
from .options import MAX_COUNT, SEED, Float, Int, Size, bundled_model_name, device_profile_name, epilog

DEFAULT_FRAG_CAPACITY = 131072  # token slots of KV memory in the fragmentation study
MAX_POOL_BLOCKS = 2**22  # the largest pool a simulation allocates (its per-block state is Python lists)
MAX_SIM_REQUESTS = 10**6
MAX_SWEEP_RUNS = 64


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:,.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _load_requests(trace: str, *, start_s: float | None, duration_s: float | None, limit: int | None,
                   speedup: float | None, rate: float, arrival_cv: float, seed: int, block_tokens: int,
                   shuffle: bool = False, trace_format: str = "auto") -> list[Any]:
    from ..workloads import Gamma, Poisson, load_trace, scale_time, slice_requests
    from ..workloads import trace_format as format_of

    path = Path(trace)
    fmt = format_of(path, trace_format)
    kwargs: dict[str, Any] = {"block_tokens": block_tokens}
    if fmt.needs_arrivals:
        kwargs.update(arrivals=Poisson(rate) if arrival_cv == 1 else Gamma(rate, arrival_cv), seed=seed,
                      shuffle=shuffle)
    requests = load_trace(path, format=fmt.name, **kwargs)
    if len(requests) > MAX_SIM_REQUESTS:
        requests = requests[:MAX_SIM_REQUESTS]
    end = None if duration_s is None else (start_s or 0.0) + duration_s
    if start_s is not None or end is not None or limit is not None:
        requests = slice_requests(requests, start_s=start_s, end_s=end, first_n=limit)
    if speedup is not None and speedup != 1:
        requests = scale_time(requests, speedup)
    if not requests:
        raise ConfigError(f"no requests left in {path} after slicing (start {start_s}, duration {duration_s}, "
                          f"limit {limit})")
    return requests


def _synthetic(count: int, input_len: int, output_len: int, prefix_len: int, prefixes: int, length_cv: float,
               rate: float, arrival_cv: float, seed: int) -> list[Any]:
    from ..workloads import Gamma, LogNormal, Poisson, synthetic

    def dist(mean: int) -> Any:
        return mean if length_cv == 0 or mean == 0 else LogNormal(mean, length_cv, low=1, high=10 * mean)

    if count * (input_len + prefix_len) > 2**31:
        raise ConfigError("the synthetic workload would need more than 2**31 distinct prompt tokens; use fewer or "
                          "shorter requests")
    return synthetic(count, arrivals=Poisson(rate) if arrival_cv == 1 else Gamma(rate, arrival_cv),
                     prompt_len=dist(input_len), output_len=dist(output_len),
                     system_prompts=prefixes if prefix_len else 0, system_prompt_len=prefix_len,
                     shared_fraction=1.0 if prefix_len else 0.0, seed=seed)


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

    return update, progress, task


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
    sat = s.get("saturation") or {}
    load = ""
    if sat.get("offered_req_s") is not None:
        load = f"; offered {sat['offered_req_s']:,.2f} req/s, served {sat['served_req_s'] or 0:,.2f} req/s"
    t.add_row("throughput", f"{s['throughput_tok_s']:,.1f} output tok/s, {s['throughput_req_s']:,.2f} req/s, "
              f"{s['total_tok_s']:,.1f} tok/s incl. prompts{load}")
    if sat.get("saturated"):
        t.add_row("[bold red]saturated[/bold red]", sat["reason"])
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

    from ..sim.report import PAPER_FIG2

    t = Table(title="Where KV memory goes (steps with a non-empty queue; cf. PagedAttention Fig. 2)")
    for col in ("allocator", "token states", "reservation", "internal frag.", "external frag. & free",
                "hole refusals (requests)", "preemptions", "mean running", "steps", "paper: token states"):
        t.add_column(col, justify="left" if col == "allocator" else "right")
    for r in results:
        f = r.fractions
        paper = PAPER_FIG2.get(r.mode) if r.allocator == "contiguous" or r.block_size == 16 else None
        paper_s = "-" if paper is None else f"{100 * paper['token_states']:.1f}%"
        holes = f"{r.hole_failures:,} ({r.hole_failure_requests})" if r.allocator == "contiguous" else "-"
        t.add_row(r.label, _pct(f["token_states"]), _pct(f["reservation"]), _pct(f["internal"]),
                  _pct(f["external"]), holes, str(r.preemptions) if r.allocator == "paged" else "-",
                  f"{r.mean_running:.1f}", f"{r.steps:,}", paper_s)
    return t


def _curve_table(rows: list[dict[str, Any]], keys: list[str]):
    from rich.table import Table

    t = Table(title="Sweep: throughput and latency (ms)")
    for k in keys:
        t.add_column(k)
    for col in ("offered req/s", "served req/s", "out tok/s", "TTFT p50", "TTFT p90", "TTFT p99", "TPOT p50",
                "TPOT p90", "TPOT p99", "preempt.", "hit rate", "completed", "saturated"):
        t.add_column(col, justify="right")

    def rate(v: float | None) -> str:
        return "-" if v is None else f"{v:,.2f}"

    for row in rows:
        t.add_row(*(str(row[k]) for k in keys), rate(row["offered_req_s"]), rate(row["served_req_s"]),
                  f"{row['throughput_tok_s']:,.1f}", _ms(row["ttft_p50_s"]), _ms(row["ttft_p90_s"]),
                  _ms(row["ttft_p99_s"]), _ms(row["tpot_p50_s"]), _ms(row["tpot_p90_s"]), _ms(row["tpot_p99_s"]),
                  str(row["preemptions"]), _pct(row["prefix_hit_rate"]), f"{row['completed']}/{row['requests']}",
                  "[bold red]yes[/bold red]" if row["saturated"] else "no")
    return t


def _console():
    """stdout console; piped or captured output gets a wide page so that tables stay one row per run."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=200)


def _default_out(kind: str) -> Path:
    return Path("reports") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def _split_sweep(specs: tuple[str, ...]) -> tuple[list[tuple[str, list[float]]], list[str]]:
    """Workload sweep keys (rate, speedup) with their values, and the remaining simulator sweep specs."""
    from ..workloads import WORKLOAD_TRANSFORMS

    workload: list[tuple[str, list[float]]] = []
    rest = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        name = key.strip().replace("-", "_")
        if name not in WORKLOAD_TRANSFORMS:
            rest.append(spec)
            continue
        if not sep or not values.strip():
            raise ConfigError(f"--sweep takes key=v1,v2,...; got {spec!r}")
        if any(k == name for k, _ in workload):
            raise ConfigError(f"sweep key {name!r} given twice")
        parsed = []
        for v in values.split(","):
            if not v.strip():
                continue
            try:
                x = float(v) if len(v) < 32 else float("nan")
            except ValueError:
                raise ConfigError(f"--sweep {name} takes positive numbers, got {v.strip()!r}") from None
            if not (0 < x <= 1e6):
                raise ConfigError(f"--sweep {name} takes numbers in (0, 1e6], got {v.strip()[:32]!r}")
            parsed.append(int(x) if x.is_integer() else x)
        workload.append((name, parsed))
    if len(workload) > 1:
        raise ConfigError("sweep one workload key at a time (rate or speedup)")
    return workload, rest


def _simulate(config: Any, requests: list[Any], progress: Any = None) -> Any:
    from ..sim.simulator import Simulator, build_deployment

    dep = build_deployment(config)
    if dep.pool_blocks > MAX_POOL_BLOCKS:
        raise ConfigError(f"the pool would have {dep.pool_blocks:,} blocks, more than a simulation allocates "
                          f"({MAX_POOL_BLOCKS:,}); use a larger --block-size or less device memory")
    if dep.host_blocks > MAX_POOL_BLOCKS:
        raise ConfigError(f"the host pool would have {dep.host_blocks:,} blocks (at most {MAX_POOL_BLOCKS:,})")
    return Simulator(config, dep).run(requests, progress=progress)


# ---- simulate --------------------------------------------------------------------------------------


@click.command("simulate", epilog=epilog(
    "kvledger simulate --workload synthetic --input-len 1024 --output-len 256 --prefix-len 512 --rate 4 "
    "--sweep rate=0.5,1,2,4 --slo-ttft 500 --slo-tpot 50",
    "kvledger simulate --trace examples/azure_conv.csv --duration-s 300 --sweep speedup=1,2,4",
    "kvledger simulate --trace examples/mooncake.jsonl --block-size 512 --pool-blocks 200 --replicas 4 --routers 2 "
    "--staleness 10 --arm B",
))
@click.option("--trace", default=None, help="Trace file: Mooncake .jsonl, Azure CSV, a length table, or kvledger's "
              "JSONL/CSV schema (see --trace-format).")
@click.option("--trace-format", type=click.Choice(trace_format_choices()), default="auto", show_default=True,
              help="Trace format; auto recognises it from the suffix and the first line.")
@click.option("--workload", type=click.Choice(["trace", "synthetic"]), default=None,
              help="Where requests come from [trace with --trace, else synthetic needs saying].")
@click.option("--requests", type=Int(1, MAX_SIM_REQUESTS), default=200, show_default=True,
              help="Synthetic workload: number of requests.")
@click.option("--input-len", type=Int(1, 10**7), default=1024, show_default=True,
              help="Synthetic workload: prompt tokens after the shared prefix (mean with --length-cv).")
@click.option("--output-len", type=Int(1, 10**7), default=256, show_default=True,
              help="Synthetic workload: output tokens (mean with --length-cv).")
@click.option("--prefix-len", type=Int(0, 2**22), default=0, show_default=True,
              help="Synthetic workload: tokens of a shared system prompt at the start of every prompt.")
@click.option("--prefixes", type=Int(1, 4096), default=1, show_default=True,
              help="Synthetic workload: distinct shared prefixes, chosen uniformly per request.")
@click.option("--length-cv", type=Float(0.0, 10.0), default=0.0, show_default=True,
              help="Synthetic workload: coefficient of variation of the lengths (0 = fixed, else log-normal).")
@click.option("--model", default="llama-3.1-8b", show_default=True, callback=bundled_model_name,
              help="Bundled model name (or its Hugging Face id) or config.json path.")
@click.option("--gpu", default="h100-80gb", show_default=True, callback=device_profile_name,
              help="Device profile: a catalogue GPU (see `kvledger gpus`) or cpu-local (after `kvledger calibrate`).")
@click.option("--profile", "profile_path", default=None,
              help="With --gpu cpu-local: the profile file `kvledger calibrate --out F` wrote [the cache's].")
@engine_option("tensor_parallel_size")
@click.option("--policy", type=click.Choice(ADMISSION_POLICIES.names()), default="full",
              show_default=True, help="Admission policy (what is reserved at admission).")
@engine_option("block_size")
@engine_option("enable_prefix_caching")
@engine_option("eviction")
@click.option("--isolate-groups", is_flag=True, help="Every request its own trust group (no sharing across "
              "requests); without it the trace's groups are used.")
@click.option("--trust-groups", default=None, help="trace | request | N (spread requests over N tenants).")
@click.option("--host-pool", type=Size(allow_zero=True), default="0", show_default=True,
              help="Host tier for swapped KV, e.g. 64GiB (per replica with --replicas).")
@click.option("--offload-prefixes", is_flag=True,
              help="Demote evicted prefix blocks to the host tier and promote them on a hit (needs --host-pool).")
@engine_option("gpu_memory_utilization", help="Fraction of device memory the pool sizing may use.")
@click.option("--engine", type=click.Choice(ENGINES), default="vllm", show_default=True,
              help="Whose memory accounting sizes the pool from the device, as `kvledger plan --engine` (vllm: "
                   "also vLLM's step shape for the GPU unless --max-num-seqs/--max-num-batched-tokens are given).")
@click.option("--pool-blocks", type=Int(1, MAX_POOL_BLOCKS), default=None,
              help="KV pool size in blocks (overrides the inventory).")
@click.option("--device-memory", type=Size(), default=None,
              help="Device memory per rank when --gpu has none (cpu-local), as the driver reports it.")
@engine_options("max_num_seqs", "max_num_batched_tokens")
@click.option("--prefill-chunk", type=Int(1, 10**7), default=2048, show_default=True,
              help="Most prompt tokens of one request per step.")
@click.option("--victim", type=click.Choice(VICTIM_POLICIES.names()),
              default="latest", show_default=True, help="Which running request is preempted first.")
@engine_option("recovery", help="How a preempted request comes back (swap needs --host-pool).")
@engine_option("kv_dtype", help="KV cache format [auto: the model's dtype].")
@click.option("--weight-dtype", default=None, help="Weight format [the checkpoint's].")
@engine_option("max_model_len", help="Clamp prompts/outputs [max_position_embeddings].")
@click.option("--declared-max-new", type=Int(1, 10**8), default=None,
              help="Requests declare this output allowance and stop (stop token) at their trace length; "
              "default: the trace length is the allowance (full reservation then knows it exactly).")
@click.option("--start-s", type=Float(0.0, 1e10), default=None, help="Keep requests arriving from this time (s).")
@click.option("--duration-s", type=Float(0.0, 1e10, lo_open=True), default=None, help="... for this long (s).")
@click.option("--limit", type=Int(1, MAX_SIM_REQUESTS), default=None, help="Keep the first N requests.")
@click.option("--speedup", type=Float(0.0, 1e6, lo_open=True), default=None,
              help="Replay arrivals X times faster.")
@click.option("--rate", type=Float(0.0, 1e6, lo_open=True), default=1.0, show_default=True,
              help="Arrivals per second for the synthetic workload and length tables.")
@click.option("--arrival-cv", type=Float(0.01, 100.0), default=1.0, show_default=True,
              help="Gamma arrivals' coefficient of variation (1 = Poisson).")
@click.option("--block-tokens", type=Int(1, 2**16), default=512, show_default=True,
              help="Tokens per Mooncake hash id.")
@click.option("--scale", type=Float(0.0, 1.0, lo_open=True), default=1.0, show_default=True,
              help="Multiply the trace's lengths as serve-trace --scale does (a trace block of shared prefix "
                   "becomes a whole number of KV blocks), to simulate the same replay.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of every random choice.")
@click.option("--out", default=None, help="Report folder [reports/sim-<time>]; serve-trace writes the same layout.")
@click.option("--no-report", is_flag=True, help="Print only; write no report folder.")
@click.option("--sweep", multiple=True,
              help="key=v1,v2,... (repeatable: a grid): rate or speedup (the workload), or any simulator setting "
                   "(policy, block_size, max_running, ...).")
@click.option("--slo-ttft", type=Float(0.0, 1e9, lo_open=True), default=None,
              help="Sweep: TTFT target in milliseconds.")
@click.option("--slo-tpot", type=Float(0.0, 1e9, lo_open=True), default=None,
              help="Sweep: TPOT target in milliseconds.")
@click.option("--slo-percentile", type=click.Choice(["50", "90", "99"]), default="90", show_default=True,
              help="Sweep: the percentile the SLO targets apply to (a run meets the SLO only if it also serves "
                   ">= 95% of the offered rate).")
@click.option("--kv-groups", is_flag=True,
              help="Charge a sliding-window or Mamba / linear-attention model by KV cache group, as vLLM's hybrid "
                   "allocator (the same KV bytes in blocks of one group's page; one block per state group a request).")
@click.option("--prefix-bound", is_flag=True, help="Also print (and plot) the hit rate an unbounded cache allows.")
@click.option("--fragmentation", is_flag=True, help="Run the fragmentation study on the trace's lengths instead "
              "of a simulation.")
@click.option("--capacity-tokens", type=Int(1, 10**8), default=DEFAULT_FRAG_CAPACITY, show_default=True,
              help="Fragmentation study: KV memory in token slots.")
@click.option("--frag-max-len", type=Int(1, 10**7), default=8192, show_default=True,
              help="Fragmentation study: the maximum sequence length (Orca Max reservation).")
@click.option("--frag-block-sizes", default="8,16,32,64,128", show_default=True,
              help="Fragmentation study: paged block sizes to compare, comma-separated.")
@click.option("--replicas", type=Int(1, 64), default=None,
              help="Simulate a fleet of N replicas (each --pool-blocks) behind --routers routers.")
@click.option("--routers", type=Int(1, 64), default=1, show_default=True, help="Fleet: routers deciding at once.")
@click.option("--staleness", type=Float(0.0, 3600.0), default=1.0, show_default=True,
              help="Fleet: seconds between the load snapshots each router gets (0: fresh at every decision).")
@click.option("--arm", type=click.Choice(ARMS), default="B", show_default=True,
              help="Fleet: B the replica's ledger decides and the router retries; A the router decides.")
@click.option("--routing", type=click.Choice(ROUTINGS), default=ROUTINGS[0], show_default=True,
              help="Fleet: the router's cost function, or round-robin.")
@click.option("--transit-ms", type=Float(0.0, 10_000.0), default=1.0, show_default=True,
              help="Fleet: one-way message time between a router and a replica.")
@click.option("--retries", type=Int(0, 1000), default=None, help="Fleet: retries after a refusal [replicas - 1].")
@click.option("--min-match", type=Int(0, 10**8), default=1024, show_default=True,
              help="Fleet: prefix tokens below which a match is not affinity.")
@click.option("--queue-weight", type=Float(0.0, 1e6), default=0.1, show_default=True,
              help="Fleet: weight of a replica's prefill backlog in the routing cost.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def simulate_cmd(trace: str | None, trace_format: str, workload: str | None, requests: int, input_len: int,
                 output_len: int, prefix_len: int, prefixes: int, length_cv: float, model: str, gpu: str,
                 profile_path: str | None, tensor_parallel_size: int, policy: str, block_size: int,
                 enable_prefix_caching: bool, eviction: str,
                 isolate_groups: bool, trust_groups: str | None,
                 host_pool: int, offload_prefixes: bool, gpu_memory_utilization: float, engine: str,
                 pool_blocks: int | None,
                 device_memory: int | None, max_num_seqs: int, max_num_batched_tokens: int, prefill_chunk: int,
                 victim: str,
                 recovery: str,
                 kv_dtype: str | None, weight_dtype: str | None, max_model_len: int | None,
                 declared_max_new: int | None, start_s: float | None, duration_s: float | None, limit: int | None,
                 speedup: float | None, rate: float, arrival_cv: float, block_tokens: int, scale: float,
                 seed: int, out: str | None, no_report: bool, sweep: tuple[str, ...], slo_ttft: float | None,
                 slo_tpot: float | None, slo_percentile: str, kv_groups: bool, prefix_bound: bool, fragmentation: bool,
                 capacity_tokens: int, frag_max_len: int, frag_block_sizes: str, replicas: int | None, routers: int,
                 staleness: float, arm: str, routing: str, transit_ms: float, retries: int | None, min_match: int,
                 queue_weight: float, as_json: bool) -> None:
    """Simulate a workload through the real scheduler and ledger, timed by the cost model; sweep load and
    settings into a throughput-latency curve."""
    from ..sim.simulator import SimConfig, parse_sweep, prefix_hit_bound, sweep_configs

    workload = workload or ("trace" if trace is not None else None)
    if workload is None:
        raise ConfigError("give --trace PATH, or --workload synthetic (with --input-len, --output-len, --rate)")
    if workload == "trace" and trace is None:
        raise ConfigError("give --trace PATH (Mooncake .jsonl, Azure CSV, a length table or kvledger's schema)")
    if workload == "synthetic" and trace is not None:
        raise ConfigError("--workload synthetic takes no --trace")
    if fragmentation:
        if trace is None:
            raise ConfigError("--fragmentation needs --trace")
        _fragmentation(trace, trace_format, capacity_tokens, frag_max_len, frag_block_sizes, limit or 1000, rate,
                       seed, out, no_report, as_json)
        return
    workload_grid, rest = _split_sweep(sweep)
    grid = parse_sweep(rest)  # bad keys fail before any work
    if isolate_groups and trust_groups not in (None, "request"):
        raise ConfigError("--isolate-groups and --trust-groups disagree; give one")
    if trust_groups not in (None, "trace", "request") and not (
            trust_groups.isdigit() and len(trust_groups) <= 6 and 1 <= int(trust_groups) <= 100_000):
        raise ConfigError(f"--trust-groups takes trace, request or a count in [1, 100,000]; got {trust_groups[:24]!r}")
    groups = "request" if isolate_groups else (trust_groups or "trace")
    max_num_seqs, max_num_batched_tokens = _step_shape(engine, gpu, device_memory, pool_blocks, max_num_seqs,
                                                       max_num_batched_tokens)
    if offload_prefixes and not host_pool:
        raise ConfigError("--offload-prefixes needs a host tier to demote to: give --host-pool, e.g. 64GiB")
    profile = None
    if profile_path is not None:
        from ..sim.cost_model import CPU_LOCAL, load_cpu_profile

        if gpu.strip().lower() != CPU_LOCAL:
            raise ConfigError(f"--profile reads a calibrated {CPU_LOCAL} profile: give --gpu {CPU_LOCAL} with it "
                              f"(got --gpu {gpu[:40]})")
        profile = load_cpu_profile(profile_path)
    base = SimConfig(model=model, gpu=gpu, profile=profile, tp=tensor_parallel_size, policy=policy,
                     block_size=block_size,
                     prefix_cache=enable_prefix_caching, kv_groups=kv_groups, eviction=eviction, trust_groups=groups,
                     host_pool_bytes=host_pool, offload_prefixes=offload_prefixes,
                     utilization=gpu_memory_utilization, pool_blocks=pool_blocks, device_memory=device_memory,
                     engine=engine,
                     max_running=max_num_seqs, token_budget=max_num_batched_tokens, prefill_chunk=prefill_chunk,
                     victim=victim, recovery=recovery, kv_dtype=kv_dtype, weight_dtype=weight_dtype,
                     max_model_len=max_model_len, declared_max_new=declared_max_new, seed=seed)
    if trace is not None:
        reqs = _load_requests(trace, start_s=start_s, duration_s=duration_s, limit=limit, speedup=speedup, rate=rate,
                              arrival_cv=arrival_cv, seed=seed, block_tokens=block_tokens, trace_format=trace_format)
        label = Path(trace).name
        if scale != 1:
            from ..workloads import scale_lengths

            reqs = scale_lengths(reqs, scale, block_size=block_size, trace_block=block_tokens)
            label += f" (lengths x {scale:g})"
    else:
        reqs = _synthetic(requests, input_len, output_len, prefix_len, prefixes, length_cv, rate, arrival_cv, seed)
        if speedup is not None and speedup != 1:
            from ..workloads import scale_time

            reqs = scale_time(reqs, speedup)
        label = f"a synthetic workload ({input_len} + {output_len} tokens, prefix {prefix_len}, {rate:g} req/s)"
    console = _console()
    if replicas is not None:
        from .fleet_cmds import run_fleet

        run_fleet(base, reqs, replicas=replicas, routers=routers, staleness=staleness, arm=arm, routing=routing,
                  transit_ms=transit_ms, retries=retries, min_match=min_match, queue_weight=queue_weight,
                  label=label, as_json=as_json, emit_json=_emit_json, console=console,
                  sweep=bool(sweep), folder=None if no_report else Path(out) if out else _default_out("fleet"),
                  progress_bar=_progress_bar)
        return
    bound = prefix_hit_bound(reqs, block_size, isolate=groups) if prefix_bound else None
    combos = sweep_configs(base, grid)
    wl_key, wl_values = workload_grid[0] if workload_grid else (None, [None])
    n_runs = len(combos) * len(wl_values)
    if n_runs > MAX_SWEEP_RUNS:
        raise ConfigError(f"the sweep has {n_runs} runs; at most {MAX_SWEEP_RUNS} at once")
    folder = None if no_report else Path(out) if out else _default_out("sweep" if n_runs > 1 or grid or workload_grid
                                                                       else "sim")
    if not (grid or workload_grid):
        update, bar, _task = _progress_bar("simulate")
        with bar:
            result = _simulate(base, reqs, progress=update)
        from ..sim.report import saturation

        summary = result.summary()
        summary["saturation"] = saturation([r.to_row() for r in result.requests])
        if folder is not None:
            from ..sim.report import write_report

            write_report(result, folder, prefix_bound=bound)
        if as_json:
            _emit_json({**summary, "prefix_bound": bound, "report": str(folder) if folder else None})
            return
        console.print(_summary_table(summary, f"Simulation of {label} ({len(reqs):,} requests)"))
        for note in summary["notes"]:
            console.print(f"[dim]note: {note}[/dim]")
    else:
        from ..sim.report import SLO_MIN_SERVED_RATIO, best_under_slo, comparison_row, meets_latency, write_sweep
        from ..workloads import transform_workload

        runs = []
        rows = []
        _update, bar, task = _progress_bar("sweep")
        with bar:
            bar.update(task, total=n_runs)
            for wl_value in wl_values:
                run_reqs = reqs if wl_key is None else transform_workload(reqs, wl_key, wl_value)
                for values, config in combos:
                    merged = ({wl_key: wl_value} if wl_key else {}) | values
                    result = _simulate(config, run_reqs)
                    runs.append((merged, result))
                    rows.append(comparison_row(merged, result))
                    bar.advance(task)
        keys = list(runs[0][0])
        pct = int(slo_percentile)
        slo = None
        short_of_offered: list[dict[str, Any]] = []  # latency targets met, throughput not
        if slo_ttft is not None or slo_tpot is not None:
            targets = {"ttft_s": None if slo_ttft is None else slo_ttft / 1e3,
                       "tpot_s": None if slo_tpot is None else slo_tpot / 1e3}
            numeric_key = keys[0] if len(keys) == 1 and isinstance(rows[0][keys[0]], int | float) else None
            best = best_under_slo(rows, numeric_key, **targets, pct=pct) if numeric_key else None
            slo = {**targets, "percentile": pct, "min_served_ratio": SLO_MIN_SERVED_RATIO, "key": numeric_key,
                   "best": None if best is None else best[numeric_key]}
            short_of_offered = [r for r in rows if not r["keeps_up"] and meets_latency(r, **targets, pct=pct)]
        if folder is not None:
            write_sweep(runs, folder, slo=slo, rows=rows)
        if as_json:
            _emit_json({"runs": rows, "slo": slo, "prefix_bound": bound, "report": str(folder) if folder else None})
            return
        console.print(_curve_table(rows, keys))
        saturated = [", ".join(f"{k}={r[k]}" for k in keys) for r in rows if r["saturated"]]
        if saturated:
            console.print(f"[bold red]saturated[/bold red] (served below offered and queueing delay growing): "
                          f"{'; '.join(saturated)}")
        if slo is not None:
            target = " and ".join(x for x in (f"TTFT <= {slo_ttft:g} ms" if slo_ttft else "",
                                              f"TPOT <= {slo_tpot:g} ms" if slo_tpot else "") if x)
            rule = f"p{pct} {target}, served >= {SLO_MIN_SERVED_RATIO:.0%} of the offered rate"
            if slo["key"] is None:
                console.print("SLO: sweep one numeric key (e.g. rate) to find the highest value meeting it")
            elif slo["best"] is None:
                console.print(f"SLO ({rule}): no swept {slo['key']} meets it")
            else:
                console.print(f"SLO ({rule}): the highest {slo['key']} that meets it is {slo['best']}")
            for r in short_of_offered:
                console.print(f"{', '.join(f'{k}={r[k]}' for k in keys)} meets the latency targets but served "
                              f"{r['served_req_s']:,.2f} of {r['offered_req_s']:,.2f} req/s offered, below "
                              f"{SLO_MIN_SERVED_RATIO:.0%}", markup=False, highlight=False)
            if short_of_offered:
                console.print("[dim](served runs from the first arrival to the last finish, the drain after the "
                              "last arrival included: more requests measure a sustainable rate more closely)[/dim]")
    if bound is not None:
        console.print(f"prefix-hit bound with an unbounded cache ({bound['block_size']}-token blocks): "
                      f"{_pct(bound['bound'])} of {bound['prompt_tokens']:,} prompt tokens")
    if folder is not None:
        console.print(f"report: {folder}")


def _step_shape(engine: str, gpu: str, device_memory: int | None, pool_blocks: int | None,
                max_num_seqs: int | None, max_num_batched_tokens: int | None) -> tuple[int, int]:
    """The step shape the simulated engine runs with and is sized for: when vllm sizes the pool from the
    device, what the user did not give is vLLM's default for it (as `plan` assumes, so both size the same
    pool); else the flags'."""
    ctx = click.get_current_context(silent=True)
    given = {name: ctx is not None and ctx.get_parameter_source(name) not in
             (click.core.ParameterSource.DEFAULT, None) for name in ("max_num_seqs", "max_num_batched_tokens")}
    if engine == "vllm" and pool_blocks is None and not all(given.values()):
        from ..core.sizing.engines import vllm_batch_defaults
        from ..core.sizing.inventory import GPUS, get_gpu

        key = gpu.strip().lower()
        gpu_obj = get_gpu(key) if key in GPUS and device_memory is None else None
        defaults = vllm_batch_defaults(gpu_obj.memory_bytes if gpu_obj else device_memory,
                                       gpu_obj.name if gpu_obj else "")
        if not given["max_num_seqs"]:
            max_num_seqs = defaults.max_num_seqs
        if not given["max_num_batched_tokens"]:
            max_num_batched_tokens = defaults.max_num_batched_tokens
    if max_num_seqs is None or max_num_batched_tokens is None:  # kvledger's scheduler defaults
        max_num_seqs = 256 if max_num_seqs is None else max_num_seqs
        max_num_batched_tokens = 8192 if max_num_batched_tokens is None else max_num_batched_tokens
    return max_num_seqs, max_num_batched_tokens


def _fragmentation(trace: str, trace_format: str, capacity: int, max_len: int, block_sizes: str, limit: int,
                   rate: float, seed: int, out: str | None, no_report: bool, as_json: bool) -> None:
    from ..sim.fragmentation import fragmentation_study
    from ..sim.report import PAPER_FIG2_SOURCE

    sizes: list[int] = []
    for x in block_sizes.split(","):
        text = x.strip()
        if not text:
            continue
        if not text.isdigit() or len(text) > 6 or not 1 <= int(text) <= 4096:
            raise ConfigError(f"--frag-block-sizes takes block sizes in [1, 4096] like 8,16,32; got {text[:24]!r}")
        sizes.append(int(text))
    if not sizes or len(sizes) > 16:
        raise ConfigError(f"--frag-block-sizes takes 1 to 16 block sizes; got {block_sizes[:40]!r}")
    requests = _load_requests(trace, start_s=None, duration_s=None, limit=None, speedup=None, rate=rate,
                              arrival_cv=1.0, seed=seed, block_tokens=512, shuffle=True, trace_format=trace_format)
    requests = requests[:limit]
    lengths = [(r.prompt_len, max(r.output_len, 1)) for r in requests]
    dropped = sum(1 for p, o in lengths if p + o > max_len)
    lengths = [(p, o) for p, o in lengths if p + o <= max_len]
    if not lengths:
        raise ConfigError(f"no request of {trace} fits --frag-max-len {max_len}")
    if max_len > capacity:
        raise ConfigError(f"--frag-max-len {max_len} exceeds --capacity-tokens {capacity}: no contiguous "
                          "reservation would fit")
    results = fragmentation_study(lengths, capacity, max_len=max_len, block_sizes=sizes)
    folder = None if no_report else Path(out) if out else _default_out("fragmentation")
    if folder is not None:
        from ..sim.report import write_fragmentation

        write_fragmentation(results, folder)
    if as_json:
        _emit_json({"requests": len(lengths), "dropped_longer_than_max_len": dropped, "capacity_tokens": capacity,
                    "max_len": max_len, "results": [r.to_dict() for r in results], "paper_source": PAPER_FIG2_SOURCE,
                    "report": str(folder) if folder else None})
        return
    console = _console()
    console.print(_frag_table(results))
    console.print(f"{len(lengths):,} requests of {Path(trace).name} (shuffled, seed {seed}), all queued at t=0; "
                  f"{capacity:,} token slots; contiguous reservations capped at {max_len:,} tokens"
                  + (f"; {dropped} longer request(s) left out" if dropped else "") + ".")
    console.print(f"[dim]paper figures: {PAPER_FIG2_SOURCE} (OPT-13B on ShareGPT in the paper; a different model "
                  "and workload here)[/dim]")
    if folder is not None:
        console.print(f"report: {folder}")


# ---- compare ---------------------------------------------------------------------------------------


@click.command("compare", epilog=epilog(
    "kvledger compare reports/sim-run reports/real-run",
    "kvledger serve-trace --trace examples/mooncake.jsonl --out r/real && kvledger simulate --trace "
    "examples/mooncake.jsonl --limit 16 --scale 0.015625 --model smollm2-135m --gpu cpu-local --profile r/cpu.json "
    "--pool-blocks 128 --policy incremental --out r/sim && kvledger compare r/sim r/real",
))
@click.argument("first")
@click.argument("second")
@click.option("--force", is_flag=True, help="Compare a GPU run with a CPU run anyway (refused without it).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def compare_cmd(first: str, second: str, force: bool, as_json: bool) -> None:
    """Headline metrics of two report folders (`simulate` and `serve-trace` write the same layout) side by side.

    Runs on different device classes (GPU vs CPU) are refused: their ratios measure the device. Runs that
    differ in model, policy or pool get a warning naming each difference."""
    from ..sim.report import compare_reports, device_class, setup_differences

    rows = compare_reports(first, second)
    differences = setup_differences(first, second)
    for what, a, b in differences:
        if what == "device" and device_class(a) != device_class(b) and not force:
            raise ConfigError(f"{first} ran on a {device_class(a)} ({a}) and {second} on a {device_class(b)} ({b}): "
                              "their ratios would measure the device; simulate the CPU run with --gpu cpu-local "
                              "--profile F (after kvledger calibrate --out F), or pass --force")
    if differences:
        click.echo(click.style("warning: the two runs differ in " + "; ".join(
            f"{what} ({a} vs {b})" for what, a, b in differences) + ": the ratios compare setups, not the "
            "simulator's accuracy", fg="yellow", bold=True), err=True)
    if as_json:
        _emit_json({"first": first, "second": second,
                    "differences": [{"what": w, "first": a, "second": b} for w, a, b in differences],
                    "metrics": [{"metric": m, "first": a, "second": b} for m, a, b in rows]})
        return
    from rich.table import Table

    t = Table(title="Report comparison")
    for col in ("metric", first, second, "second / first"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    def show(metric: str, v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v * 1e3:,.1f} ms" if metric.startswith(("ttft", "tpot", "e2e")) else f"{v:,.3f}"
        return str(v)

    for metric, a, b in rows:
        ratio = f"{b / a:.2f}" if isinstance(a, int | float) and isinstance(b, int | float) and a and \
            not isinstance(a, bool) else "-"
        t.add_row(metric, show(metric, a), show(metric, b), ratio)
    _console().print(t)


__all__ = ["DEFAULT_FRAG_CAPACITY", "MAX_COUNT", "calibrate_cmd", "compare_cmd", "simulate_cmd"]
