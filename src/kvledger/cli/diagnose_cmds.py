"""`kvledger diagnose`: where did the memory go -- run a workload on the engine under the memory sampler.

The top level stays light (click only): torch and the runtime are imported inside the command.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from ..errors import ConfigError
from .common import prepare_torch
from .engine_options import MAX_RUNTIME_BLOCKS, engine_option
from .options import Float, Int, epilog, model_option, threads_option

# The names the runtime's injection registry (kvledger.runtime.measure.diagnostics.INJECTIONS) knows; listed here
# so that help stays torch-free. tests/diagnostics checks the two agree.
INJECTION_NAMES = ("retained-tensor", "pool-leak", "external-alloc", "peak", "cache-growth")


def _trace_workload(path: str, limit: int, scale: float, max_new_cap: int | None, step_seconds: float,
                    vocab: int, context: int) -> Any:
    """A trace slice as a step-clocked workload: arrival seconds / ``step_seconds`` -> arrival steps,
    lengths x ``scale`` (clipped to the model's context), Mooncake block ids -> shared token prefixes."""
    from ..runtime.measure.corpus import block_keys
    from ..runtime.measure.diagnostics.workload import workload_from_lengths
    from ..workloads import MOONCAKE_BLOCK_TOKENS, Poisson, load_trace, trace_has_arrivals

    timed = trace_has_arrivals(path)
    requests = (load_trace(path) if timed else load_trace(path, arrivals=Poisson(1.0)))[:limit]
    if not requests:
        raise ConfigError(f"{path} holds no requests")
    first = requests[0].arrival_s
    rows = []
    for r in requests:
        out = max(1, round(r.output_len * scale))
        if max_new_cap is not None:
            out = max(1, min(out, max_new_cap))
        plen = max(1, round(r.prompt_len * scale))
        plen = max(1, min(plen, context - out - 1))
        keys = block_keys(r.prompt_tokens, MOONCAKE_BLOCK_TOKENS)
        rows.append((int((r.arrival_s - first) / step_seconds), plen, out, r.trust_group, keys))
    return workload_from_lengths(Path(path).name, rows, vocab=vocab)


@click.command("diagnose", epilog=epilog(
    "kvledger diagnose                                   # a clean run: nothing should be named",
    "kvledger diagnose --inject pool-leak,peak --json    # inject two pathologies; findings as JSON",
    "kvledger diagnose --trace azure_conv.csv --limit 24 --out diag/",
))
@model_option()
@engine_option("dtype", help="Weights and KV dtype of the engine: fp32, bf16, fp16 (or vLLM's names).")
@click.option("--requests", type=Int(1, 10_000), default=12, show_default=True,
              help="Requests of the built-in workload (waves of 4 every 12 steps, varied lengths, two tenants).")
@click.option("--max-prompt", type=Int(1, 32_768), default=320, show_default=True,
              help="Longest prompt of the built-in workload (prompts are 16..N tokens).")
@click.option("--max-new", type=Int(1, 32_768), default=40, show_default=True,
              help="Longest output of the built-in workload (outputs are 8..N tokens).")
@click.option("--trace", "trace_path", default=None, help="Replay a trace slice instead (Mooncake JSONL, Azure CSV).")
@click.option("--limit", type=Int(1, 10_000), default=12, show_default=True, help="With --trace: the first N requests.")
@click.option("--scale", type=Float(0.0, 1.0, lo_open=True), default=1 / 64, show_default=True,
              help="With --trace: multiply lengths.")
@click.option("--max-new-cap", type=Int(1, 32_768), default=64, show_default=True,
              help="With --trace: cap output lengths.")
@click.option("--step-seconds", type=Float(0.0, 3600.0, lo_open=True), default=0.05, show_default=True,
              help="With --trace: trace seconds per engine step (arrivals are counted in steps).")
@click.option("--pool-blocks", "--num-gpu-blocks-override", "pool_blocks", type=Int(1, MAX_RUNTIME_BLOCKS), default=160,
              show_default=True, help="KV pool size in blocks.")
@engine_option("block_size")
@click.option("--every", type=Int(1, 1_000_000), default=1, show_default=True,
              help="Sample the four ledgers every N steps.")
@click.option("--no-peaks", is_flag=True, help="Do not measure per-step transient peaks.")
@click.option("--sites", is_flag=True, help="Record where large tensors are created (slower).")
@click.option("--inject", default="", metavar="LIST",
              help=f"Inject pathologies on purpose, comma-separated: {', '.join(INJECTION_NAMES)}.")
@click.option("--inject-bytes", default="64MiB", show_default=True, help="Size of each injected pathology.")
@click.option("--inject-at", type=Int(0, 1_000_000), default=2, show_default=True,
              help="First step an injection may act at (each acts at a decode step; the next one 2 steps later).")
@click.option("--min-bytes", default="16MiB", show_default=True,
              help="Smallest jump between two samples (cache, external) or step excess (peak) to report.")
@click.option("--out", "out_dir", default="kvledger-diagnosis", show_default=True,
              help="Folder for diagnosis.json and timeline.png.")
@threads_option()
@click.option("--fail-on-findings", is_flag=True, help="Exit with code 1 when anything is found.")
@click.option("--json", "as_json", is_flag=True, help="Print the diagnosis document (findings, ledgers, series).")
def diagnose_cmd(model: str, dtype: str, requests: int, max_prompt: int, max_new: int, trace_path: str | None,
                 limit: int, scale: float, max_new_cap: int, step_seconds: float, pool_blocks: int, block_size: int,
                 every: int,
                 no_peaks: bool, sites: bool, inject: str, inject_bytes: str, inject_at: int, min_bytes: str,
                 out_dir: str,
                 threads: int | None, fail_on_findings: bool, as_json: bool) -> None:
    """Where did the memory go: run a workload on the engine, sample the tensor, allocator, pool and
    device ledgers at step boundaries, and name what differs -- retained tensors, cached reservation,
    logical pool leaks, external allocations, transient peaks."""
    from ..units import parse_bytes

    if not 1 <= requests <= 10_000:
        raise ConfigError(f"--requests must be in 1..10000, got {requests}")
    if not 16 <= max_prompt <= 100_000 or not 1 <= max_new <= 100_000:
        raise ConfigError(f"--max-prompt must be in 16..100000 and --max-new in 1..100000, got {max_prompt}, "
                          f"{max_new}")
    if not 1 <= limit <= 10_000:
        raise ConfigError(f"--limit must be in 1..10000, got {limit}")
    if not 0 < scale <= 1:
        raise ConfigError(f"--scale must be in (0, 1], got {scale}")
    if max_new_cap < 1 or step_seconds <= 0:
        raise ConfigError("--max-new-cap must be >= 1 and --step-seconds > 0")
    if pool_blocks < 1 or every < 1 or inject_at < 0:
        raise ConfigError("--pool-blocks and --every must be >= 1, --inject-at >= 0")
    nbytes = parse_bytes(inject_bytes, unit_required=True)
    threshold = parse_bytes(min_bytes, unit_required=True)
    names = [n.strip() for n in inject.split(",") if n.strip()]
    unknown = [n for n in names if n not in INJECTION_NAMES]
    if unknown:
        raise ConfigError(f"unknown injection {', '.join(unknown)} (known: {', '.join(INJECTION_NAMES)})")
    if trace_path is not None and not Path(trace_path).is_file():
        raise ConfigError(f"no trace file at {trace_path}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out_dir} exists and is not a folder")
    prepare_torch(threads)
    from rich.console import Console

    from ..runtime.engine import Engine, model_context, resolve_model
    from ..runtime.measure.diagnostics.reconcile import Thresholds
    from ..runtime.measure.diagnostics.report import attribution_table, findings_table, timeline_png
    from ..runtime.measure.diagnostics.run import run_diagnosis
    from ..runtime.measure.diagnostics.workload import default_workload

    ckpt = resolve_model(model)
    engine = Engine.from_model(ckpt, num_blocks=pool_blocks, block_size=block_size, dtype=dtype,
                               model_name=model)
    vocab = engine.runner.config.vocab_size
    if trace_path is not None:
        workload = _trace_workload(trace_path, limit, scale, max_new_cap, step_seconds, vocab,
                                   model_context(ckpt) or 2048)
    else:
        if max_prompt + max_new > (model_context(ckpt) or 2048):
            raise ConfigError(f"--max-prompt + --max-new must fit the model's context "
                              f"({model_context(ckpt) or 2048} tokens)")
        workload = default_workload(requests, vocab=vocab, max_prompt=max_prompt, max_new=max_new)
    err = Console(stderr=True)
    total = len(workload.items)

    with err.status("diagnosing") as status:
        def on_step(steps: int) -> None:
            status.update(f"step {steps}: {engine.stats.completed}/{total} requests finished")

        result = run_diagnosis(workload, engine=engine, model=model, dtype=dtype, every=every, peaks=not no_peaks,
                               sites=sites, inject=names, inject_bytes=nbytes, inject_at=inject_at, on_step=on_step,
                               thresholds=Thresholds(min_bytes=threshold, peak_min_bytes=threshold))
    out.mkdir(parents=True, exist_ok=True)
    doc = result.document
    (out / "diagnosis.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    png = timeline_png(result.diagnosis, out / "timeline.png",
                       f"{model} {dtype}, {workload.name}: where the memory is, step by step")
    if as_json:
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    else:
        console = Console()
        w = doc["workload"]
        console.print(f"{model} ({dtype}) on {doc['device']['name']}: {w['requests']} requests, {w['steps']} steps "
                      f"in {w['wall_s']} s; workload sha256 {w['sha256'][:16]}...")
        console.print(attribution_table(result.diagnosis))
        console.print(findings_table(result.diagnosis))
        for inj in doc["injected"]:
            console.print(f"injected {inj['name']} at step {inj['step']}: {inj['bytes']} bytes "
                          f"(expect {inj['expected_kind']})")
        for note in doc["notes"]:
            console.print(f"[dim]note:[/dim] {note}")
        console.print(f"wrote {out / 'diagnosis.json'} and {png}")
    if fail_on_findings and doc["findings"]:
        raise click.exceptions.Exit(1)
