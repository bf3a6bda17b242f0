"""`kvledger generate` and `kvledger serve-trace`: the real runtime's faces.

The top level stays light (click only): torch, transformers and the runtime are imported inside the
commands, so `kvledger plan` never pays for them.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from ..engine_config import MAX_POOL_BYTES
from ..errors import ConfigError
from ..workloads import trace_format_choices
from .common import prepare_torch
from .engine_options import MAX_RUNTIME_BLOCKS, cpu_engine_refusals, engine_option, engine_options
from .options import SEED, Float, Int, Size, epilog, model_option, threads_option


def _load_tokenizer(ckpt: Any) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError("text prompts need the transformers package (for the model's tokenizer)") from None
    try:
        return AutoTokenizer.from_pretrained(str(ckpt.path))
    except Exception as exc:  # noqa: BLE001 -- any tokenizer failure is one clear line
        raise ConfigError(f"no usable tokenizer in {ckpt.path}: {str(exc).splitlines()[0][:200]}") from None


def _scheduler_config(policy: str, on_growth_failure: str, recovery: str, **extra: Any) -> Any:
    from ..scheduler import SchedulerConfig

    return SchedulerConfig(policy=policy, on_growth_failure=on_growth_failure, recovery=recovery, **extra)


def _pool_args(pool_blocks: int | None, pool: int | None, default_blocks: int) -> dict[str, Any]:
    if pool_blocks is not None and pool is not None:
        raise ConfigError("give --pool-blocks or --pool, not both")
    if pool is not None:
        if pool > MAX_POOL_BYTES:
            raise ConfigError(f"--pool {pool:,} B is more than the runtime allocates ({MAX_POOL_BYTES // 2**30} GiB)")
        return {"pool_bytes": pool}
    blocks = default_blocks if pool_blocks is None else pool_blocks
    if not 1 <= blocks <= MAX_RUNTIME_BLOCKS:
        raise ConfigError(f"the pool needs 1 to {MAX_RUNTIME_BLOCKS:,} blocks, got {blocks:,}")
    return {"num_blocks": blocks}


def _memory_lines(summary: dict[str, Any]) -> list[str]:
    from ..units import format_bytes

    u, life = summary["usage"], summary["lifetimes"]
    per_token = summary["peak_kv_bytes_per_live_token"]
    return [
        f"KV pool: {summary['pool_blocks']} blocks x {summary['block_size']} tokens = "
        f"{format_bytes(summary['pool_bytes'])} ({format_bytes(summary['kv_bytes_per_token'])} per token)",
        f"ledger: {u['active']} active, {u['retained']} retained (prefix cache), {u['free']} free, "
        f"{u['promised']} promised; peak {summary['engine']['peak_blocks_in_use']} blocks in use"
        + (f" = {format_bytes(int(per_token))} per live token" if per_token else ""),
        f"prefix cache hit rate {summary['prefix_hit_rate']:.1%}; preemptions {summary['preemptions']}; "
        f"forks {life['forks']}, copy-on-write copies {life['copies']}, evictions {life['evictions']}",
    ]


def _tier_lines(summary: dict[str, Any]) -> list[str]:
    """The tiers below the pool and their transfers, when the engine has any."""
    from ..units import format_bytes

    transfers, eng = summary.get("transfers"), summary["engine"]
    if not transfers:
        return []
    tiers = summary.get("tiers") or {}
    flow = tiers.get("flow", {})
    out = [f"tiers: host {summary['host_blocks']} + disk {summary['disk_blocks']} blocks; "
           f"demoted {flow.get('demoted', 0)}, promoted {flow.get('promoted', 0)}, dropped {flow.get('dropped', 0)}; "
           f"transfers {eng['transfer_s'] * 1e3:.1f} ms, hidden {eng['transfer_hidden_s'] * 1e3:.1f} ms, "
           f"exposed {eng['transfer_exposed_s'] * 1e3:.1f} ms"]
    for name, link in sorted(transfers.get("links", {}).items()):
        if link["blocks"]:
            rate = link["bytes"] / link["seconds"] / 1e9 if link["seconds"] > 0 else 0.0
            out.append(f"  {name}: {link['blocks']} blocks, {format_bytes(link['bytes'])}, {rate:.2f} GB/s")
    return out


# ---- generate --------------------------------------------------------------------------------------
@click.command("generate", epilog=epilog(
    "kvledger generate 'The capital of France is' --max-new 16",
    "kvledger generate 'Write a haiku about memory' --chat --n 3 --temperature 0.8 --seed 1",
    "kvledger generate 'Once upon a time' --beam-width 4 --max-new 24 --json",
))
@click.argument("prompt")
@model_option()
@click.option("--max-new", "--max-tokens", "max_new", type=Int(1, 100_000), default=64, show_default=True,
              help="Most tokens to generate (--max-tokens: vLLM's and OpenAI's name).")
@click.option("--temperature", type=Float(0.0, 100.0), default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=Float(0.0, 1.0, lo_open=True), default=1.0, show_default=True,
              help="Nucleus sampling: keep the smallest set of tokens with this much probability.")
@click.option("--top-k", type=Int(0, 10**7), default=0, show_default=True, help="0 = no top-k cut.")
@click.option("--seed", type=SEED, default=None, help="Sampling seed (default: random, printed).")
@click.option("--n", "n", type=Int(1, 256), default=1, show_default=True,
              help="Parallel samples (share the prompt's KV).")
@click.option("--beam-width", type=Int(1, 256), default=1, show_default=True, help="Beam search width (1 = off).")
@click.option("--chat", is_flag=True, help="Apply the model's chat template (instruct models).")
@click.option("--pool-blocks", "--num-gpu-blocks-override", "pool_blocks", type=Int(1, MAX_RUNTIME_BLOCKS),
              default=None, help="KV pool size in blocks [enough for the request].")
@click.option("--pool", type=Size(), default=None, help="KV pool size in bytes, e.g. 64MiB (instead of --pool-blocks).")
@engine_option("block_size")
@threads_option()
@engine_options("attention_backend", "dtype", "kv_dtype", "allow_untested_kv")
@cpu_engine_refusals()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def generate_cmd(prompt: str, model: str, max_new: int, temperature: float, top_p: float, top_k: int,
                 seed: int | None, n: int, beam_width: int, chat: bool, pool_blocks: int | None, pool: int | None,
                 block_size: int, threads: int | None, attention_backend: str, dtype: str, kv_dtype: str | None,
                 allow_untested_kv: bool, as_json: bool) -> None:
    """Generate text for PROMPT with the real runtime and print a memory summary."""
    prepare_torch(threads)
    from ..runtime.engine import Engine, refuse_untested_kv_early, resolve_model
    from ..runtime.sampling import SamplingParams

    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, n=n,
                            beam_width=beam_width)
    refuse_untested_kv_early(model, kv_dtype, allow_untested_kv)
    ckpt = resolve_model(model)
    # The config is checked (and the weights loaded) before the tokenizer: an unsupported model fails
    # with the runner's reason, not a tokenizer's.
    from ..runtime.engine import load_runner

    load_runner(ckpt, num_blocks=1, block_size=block_size)
    tok = _load_tokenizer(ckpt)
    if chat:
        if not getattr(tok, "chat_template", None):
            raise ConfigError(f"{model} has no chat template; drop --chat")
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=False)
        ids = tok(text, add_special_tokens=False).input_ids
    else:
        ids = tok(prompt).input_ids
    if not ids:
        raise ConfigError("the prompt is empty after tokenisation")
    branches = beam_width if beam_width > 1 else n
    need = branches * (-(-(len(ids) + max_new) // block_size) + 1)
    engine = Engine.from_model(ckpt, block_size=block_size, backend=attention_backend, dtype=dtype, kv_dtype=kv_dtype,
                               allow_untested_kv=allow_untested_kv, residual_slots=branches, model_name=model,
                               **_pool_args(pool_blocks, pool, max(need, 16)))
    stop = {t for t in (tok.eos_token_id,) if t is not None}
    if chat:
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != tok.unk_token_id:
            stop.add(im_end)
    stream = not as_json and branches == 1 and beam_width == 1 and sys.stdout.isatty()
    printed = [""]

    def on_token(event: Any) -> None:
        if event.token is None:
            return
        text = tok.decode(list(handle_tokens) + [event.token], skip_special_tokens=True)
        handle_tokens.append(event.token)
        click.echo(text[len(printed[0]):], nl=False)
        printed[0] = text

    handle_tokens: list[int] = []
    start = time.perf_counter()
    handle = engine.submit(ids, max_new, params, stop_token_ids=sorted(stop), on_token=on_token if stream else None)
    result = handle.result()
    seconds = time.perf_counter() - start
    engine.check()
    texts = [tok.decode(o, skip_special_tokens=True) for o in result.outputs]
    summary = engine.summary()
    if as_json:
        data = {
            "model": model, "prompt_tokens": len(ids), "chat": chat, "seed": result.seed,
            "outputs": [{"text": t, "tokens": o, "finish_reason": r}
                        for t, o, r in zip(texts, result.outputs, result.finish_reasons, strict=True)],
            "scores": result.scores, "seconds": round(seconds, 3),
            "tokens_per_s": round(result.num_generated / seconds, 2) if seconds > 0 else None,
            "memory": summary,
        }
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return
    if stream:
        click.echo()
    else:
        for i, (text, reason) in enumerate(zip(texts, result.finish_reasons, strict=True)):
            label = ("beam" if beam_width > 1 else "sample") + f" {i}" if len(texts) > 1 else ""
            if label:
                score = f", score {result.scores[i]:.3f}" if result.scores else ""
                click.echo(f"--- {label} ({reason}{score})")
            click.echo(text)
    click.echo(f"[{result.num_generated} tokens in {seconds:.2f} s; finish: {', '.join(result.finish_reasons)}"
               + (f"; seed {result.seed}" if result.seed is not None else "") + "]", err=stream)
    for line in _memory_lines(summary):
        click.echo(line)


# ---- serve-trace -----------------------------------------------------------------------------------
@click.command("serve-trace", epilog=epilog(
    "kvledger serve-trace --trace examples/mooncake.jsonl --limit 16",
    "kvledger serve-trace --trace examples/mooncake.jsonl --limit 32 --burst --pool-blocks 96 --out reports/real",
    "kvledger simulate --trace examples/mooncake.jsonl --limit 32 --scale 0.015625 --model smollm2-135m --gpu "
    "cpu-local --pool-blocks 96 --policy incremental --out reports/sim   # after kvledger calibrate",
))
@click.option("--trace", "trace_path", required=True, help="A trace file (Mooncake JSONL, Azure CSV, a length table "
              "or kvledger's JSONL/CSV schema).")
@click.option("--trace-format", type=click.Choice(trace_format_choices()), default="auto", show_default=True,
              help="Trace format; auto recognises it from the suffix and the first line.")
@click.option("--rate", type=Float(0.0, 1e6, lo_open=True), default=1.0, show_default=True,
              help="Arrivals per second for traces without arrival times (length tables).")
@click.option("--limit", type=Int(1, 10_000), default=16, show_default=True, help="Replay the first N requests.")
@model_option()
@engine_options("policy", "on_growth_failure", "recovery", "eviction")
@click.option("--pool-blocks", "--num-gpu-blocks-override", "pool_blocks", type=Int(1, MAX_RUNTIME_BLOCKS),
              default=None, help="KV pool size in blocks [128].")
@click.option("--pool", type=Size(), default=None, help="KV pool size in bytes, e.g. 64MiB (instead of --pool-blocks).")
@engine_options("host_blocks", "disk_blocks", "disk_dir", "tier_compression", "enable_prefix_caching",
                "max_num_seqs", "max_num_batched_tokens")
@click.option("--offload-prefixes", is_flag=True,
              help="Demote evicted prefix blocks to the tiers instead of forgetting them; promote them on a hit.")
@engine_option("block_size")
@click.option("--scale", type=Float(0.0, 1.0, lo_open=True), default=1 / 64, show_default=True,
              help="Multiply the trace's lengths (fits a small model's context and a CPU). Prompts scale by whole "
                   "KV blocks per 512-token trace block, so the effective prompt scale is printed (1/64 with "
                   "16-token blocks becomes 16/512 = 1/32).")
@click.option("--max-new-cap", type=Int(1, 100_000), default=None, help="Cap each request's (scaled) output length.")
@click.option("--speedup", type=Float(0.0, 1e6, lo_open=True), default=1.0, show_default=True,
              help="Replay arrivals this many times faster than the trace.")
@click.option("--burst", is_flag=True, help="Submit every request at once (ignore arrival times).")
@threads_option()
@click.option("--out", default=None, help="Write a report folder (the layout `simulate --out` writes).")
@engine_options("attention_backend", "dtype", "kv_dtype", "allow_untested_kv")
@cpu_engine_refusals()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def serve_trace_cmd(trace_path: str, trace_format: str, rate: float, limit: int, model: str, policy: str,
                    on_growth_failure: str, recovery: str, eviction: str, pool_blocks: int | None, pool: int | None,
                    host_blocks: int, disk_blocks: int, disk_dir: str | None, tier_compression: str,
                    enable_prefix_caching: bool, max_num_seqs: int, max_num_batched_tokens: int,
                    offload_prefixes: bool, block_size: int, scale: float, max_new_cap: int | None, speedup: float,
                    burst: bool, threads: int | None, out: str | None, attention_backend: str, dtype: str,
                    kv_dtype: str | None, allow_untested_kv: bool, as_json: bool) -> None:
    """Replay a slice of a real trace through the engine: lengths and prefix sharing from the trace,
    prompt tokens from the bundled corpus. A request that can never fit the pool is refused ("never") and
    the replay goes on."""
    from ..workloads import MOONCAKE_BLOCK_TOKENS, Poisson, load_trace, scale_lengths

    if (recovery == "swap" or offload_prefixes) and not (host_blocks or disk_blocks):
        raise ConfigError(("--recovery swap" if recovery == "swap" else "--offload-prefixes")
                          + " needs a tier below the pool: give --host-blocks N or --disk-blocks N")
    requests = load_trace(trace_path, format=trace_format, arrivals=Poisson(rate))[:limit]
    if not requests:
        raise ConfigError(f"{trace_path} holds no requests")
    # Each trace block becomes a whole number of KV blocks, so a shared trace prefix stays a run of whole
    # shared blocks (simulate --scale applies the same transform).
    requests = scale_lengths(requests, scale, block_size=block_size)
    chunk = max(1, round(MOONCAKE_BLOCK_TOKENS * scale / block_size)) * block_size
    prepare_torch(threads)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..errors import KVLedgerError
    from ..runtime.engine import Engine, model_context, refuse_untested_kv_early, resolve_model
    from ..runtime.measure.corpus import PromptSynth, block_keys, corpus_tokens
    from ..runtime.sampling import SamplingParams
    from ..sim.report import run_summary, write_run_report

    refuse_untested_kv_early(model, kv_dtype, allow_untested_kv)
    ckpt = resolve_model(model)
    engine = Engine.from_model(ckpt, block_size=block_size, host_blocks=host_blocks, disk_blocks=disk_blocks,
                               disk_dir=disk_dir, tier_compression=tier_compression, eviction=eviction,
                               prefix_caching=enable_prefix_caching, backend=attention_backend, dtype=dtype,
                               kv_dtype=kv_dtype, allow_untested_kv=allow_untested_kv, model_name=model,
                               scheduler_config=_scheduler_config(policy, on_growth_failure, recovery,
                                                                  offload_prefixes=offload_prefixes,
                                                                  max_running=max_num_seqs,
                                                                  token_budget=max_num_batched_tokens),
                               **_pool_args(pool_blocks, pool, 128))
    tok = _load_tokenizer(ckpt)
    tokens = corpus_tokens(lambda text: tok(text, add_special_tokens=False).input_ids, key=str(ckpt.path))
    synth = PromptSynth(tokens, chunk)
    context = model_context(ckpt) or 2048
    jobs: list[tuple[float, str, list[int], int, str]] = []
    rows: dict[str, dict[str, Any]] = {}
    clipped = refused = 0
    for r in requests:
        out_len = max(1, r.output_len)
        if max_new_cap is not None:
            out_len = max(1, min(out_len, max_new_cap))
        length = r.prompt_len
        if length + out_len > context:
            length, clipped = max(1, context - out_len), clipped + 1
        prompt = synth.prompt(block_keys(r.prompt_tokens, chunk), length)
        arrival = 0.0 if burst else r.arrival_s / speedup
        row = {"request_id": r.request_id, "trust_group": r.trust_group, "arrival_s": arrival, "prompt_len": length,
               "output_len": out_len, "n": 1, "admitted_s": None, "first_token_s": None, "finish_s": None,
               "generated": 0, "preemptions": 0, "hit_tokens": 0, "finish_reason": "", "ttft_s": None,
               "tpot_s": None, "e2e_s": None}
        rows[r.request_id] = row
        try:
            engine.check_request(prompt, out_len, trust_group=r.trust_group, request_id=r.request_id)
        except KVLedgerError as exc:  # larger than the whole pool (or the model's context): never runnable
            row["finish_reason"] = f"never: {exc}"
            refused += 1
            continue
        jobs.append((arrival, r.request_id, prompt, out_len, r.trust_group))
    greedy = SamplingParams()
    err = Console(stderr=True)
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err, transient=as_json) as progress:
        task = progress.add_task("serving", total=len(jobs))
        t0 = time.perf_counter()
        handles = []
        pending = list(jobs)
        while pending or engine.has_work():
            now = time.perf_counter() - t0
            while pending and pending[0][0] <= now:
                arrival, rid, prompt, out_len, group = pending.pop(0)
                handles.append(engine.submit(prompt, out_len, greedy, request_id=rid, trust_group=group,
                                             arrival_s=t0 + arrival))
            if engine.has_work():
                engine.step()
            elif pending:
                time.sleep(min(0.05, max(0.0, pending[0][0] - now)))
            progress.update(task, completed=sum(h.done() for h in handles))
        wall = time.perf_counter() - t0
        results = [h.result() for h in handles]
    engine.check()
    for res in results:
        row = rows[res.request_id]
        per_branch = res.num_generated // max(1, len(res.outputs))
        first = None if res.first_token_s is None else res.first_token_s - t0
        row.update(first_token_s=first, finish_s=res.finish_s - t0, generated=res.num_generated,
                   preemptions=res.preemptions, hit_tokens=res.cached_prompt_tokens,
                   finish_reason=",".join(sorted(set(res.finish_reasons))))
        row["ttft_s"] = None if first is None else first - row["arrival_s"]
        row["e2e_s"] = row["finish_s"] - row["arrival_s"]
        row["tpot_s"] = (row["finish_s"] - first) / (per_branch - 1) if first is not None and per_branch > 1 else None
    table = list(rows.values())
    summary = engine.summary()
    data = run_summary(table, wall_s=wall, extra={
        "source": "runtime", "device": str(engine.runner.store.device), "trace": trace_path, "model": model,
        "policy": policy, "recovery": recovery,
        "kv_format": engine.spec.kv_format_id,
        "scale": scale, "prompt_scale": chunk / MOONCAKE_BLOCK_TOKENS, "clipped_prompts": clipped,
        "refused_never": refused, "title": f"{model} replaying {Path(trace_path).name} ({len(table)} requests, "
        f"prompts x {chunk / MOONCAKE_BLOCK_TOKENS:g}, outputs x {scale:g})", "memory": summary})
    folder = Path(out) if out else None
    if folder is not None:
        write_run_report(data, table, folder)
    if as_json:
        sys.stdout.write(json.dumps({**data, "report": str(folder) if folder else None}, indent=2, default=str) + "\n")
        return

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.1f}"

    click.echo(f"{len(table)} requests from {trace_path} (prompts x {chunk / MOONCAKE_BLOCK_TOKENS:g}: each 512-token "
               f"trace block is {chunk} tokens, whole KV blocks; outputs x {scale:g}"
               + (f", {clipped} prompts clipped to the context" if clipped else "") + f") in {wall:.2f} s")
    if refused:
        click.echo(f"{refused} request(s) refused 'never' (larger than the whole pool); the replay went on")
    click.echo(f"throughput {data['throughput_tok_s']:.2f} generated tokens/s; {data['prompt_tokens']} prompt tokens, "
               f"{data['prefix_hit_tokens']} of them from the prefix cache; {data['output_tokens']} generated")
    for name, pct in (("TTFT", data["ttft_s"]), ("TPOT", data["tpot_s"])):
        click.echo(f"{name} ms: p50 {ms(pct['p50'])}  p90 {ms(pct['p90'])}  p99 {ms(pct['p99'])}  "
                   f"mean {ms(pct['mean'])}")
    click.echo("finish: " + ", ".join(f"{k} {v}" for k, v in data["finish_reasons"].items()))
    for line in _memory_lines(summary):
        click.echo(line)
    for line in _tier_lines(summary):
        click.echo(line)
    if folder is not None:
        click.echo(f"report: {folder}")
