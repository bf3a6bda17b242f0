"""`kvledger plan`: KV geometry, the memory an engine leaves for the KV cache, and capacity answers.

Geometry alone prints the geometry; with a GPU (`--gpu`, or `--device-memory` as the driver reports it)
the engine's accounting (`--engine vllm` by default, or `kvledger`) sizes the pool; with `--pool` the
pool is given. `--prompt/--max-new` add the request answers, `--matrix` the GPU x TP table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ..core.sizing.engines import ENGINES
from .engine_options import FLAGS, engine_option
from .options import MAX_COUNT, TOKENS, Int, Size, bundled_model_name, catalogue_gpu_name, epilog, flag_name

if TYPE_CHECKING:
    from ..core.sizing.capacity import FitHint


def _step_names(knob: str, dest: str) -> list[str]:
    """The flag names of engine knob ``knob`` (vLLM's and ours) with the plan's own parameter name."""
    return [n for n in FLAGS[knob][0] if n.startswith("-")] + [dest]


def geometry_options(fn: Any) -> Any:
    """The KV geometry flags shared by every command that needs a model."""
    opts = [
        click.option("--model", default=None, callback=bundled_model_name,
                     help="Bundled model name (see `kvledger models`) or its Hugging Face id "
                     "(meta-llama/Llama-3.1-8B), or a path to a Hugging Face config.json or its folder."),
        click.option("--layers", type=Int(1, 10_000), default=None, help="Decoder layers (instead of --model)."),
        click.option("--kv-heads", type=Int(1, 100_000), default=None, help="Total KV heads (instead of --model)."),
        click.option("--head-dim", type=Int(1, 100_000), default=None, help="Head dimension (instead of --model)."),
        engine_option("kv_dtype", help="KV cache format: vLLM's values (auto, fp8 = fp8_e4m3 unscaled, fp8_e5m2) or "
                      "kvledger's (fp8-scaled, int8, int8-token and int4 count their scales; see docs/kv_formats.md) "
                      "[auto: the model's dtype]."),
        engine_option("tensor_parallel_size"),
        engine_option("block_size"),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def sizing_options(*, pool: str = "KV pool size directly, e.g. 512MiB (no engine accounting).",
                   gpu: str = "Catalogue GPU (see `kvledger gpus`); its driver-reported memory is used.",
                   device_memory: str = "Device memory as the driver reports it, e.g. 79.18GiB (instead of --gpu).",
                   engine: str = "Whose memory accounting: vLLM's start-up profile or kvledger's runtime.",
                   utilization: str = "Fraction of device memory the engine may use (vLLM's "
                                      "gpu_memory_utilization).") -> Any:
    """The flags that size a KV pool (``plan``, ``admit``): a size given directly, or a device (a catalogue GPU
    or its memory) under an engine's memory accounting. One name, type and default each; a command words
    the help for what it does with them."""
    opts = [
        click.option("--pool", type=Size(), default=None, help=pool),
        click.option("--gpu", default=None, callback=catalogue_gpu_name, help=gpu),
        click.option("--device-memory", type=Size(), default=None, help=device_memory),
        click.option("--engine", type=click.Choice(ENGINES), default="vllm", show_default=True, help=engine),
        engine_option("gpu_memory_utilization", help=utilization),
    ]

    def apply(fn: Any) -> Any:
        for opt in reversed(opts):
            fn = opt(fn)
        return fn

    return apply


def resolve_spec(model: str | None, layers: int | None, kv_heads: int | None, head_dim: int | None,
                 kv_dtype: str | None, tp: int, block_size: int) -> tuple[Any, dict[str, Any] | None]:
    from ..core.sizing.geometry import KVSpec
    from ..core.sizing.models import load_model_config
    from ..errors import ConfigError

    explicit = (layers, kv_heads, head_dim)
    if model is not None:
        if any(v is not None for v in explicit):
            raise ConfigError("give either --model or --layers/--kv-heads/--head-dim, not both")
        cfg = load_model_config(model)
        return KVSpec.from_hf_config(cfg, kv_dtype=kv_dtype, tp=tp, block_size=block_size, name=model), cfg
    if any(v is None for v in explicit):
        raise ConfigError("give --model NAME, or all of --layers, --kv-heads and --head-dim")
    spec = KVSpec(layers, kv_heads, head_dim, kv_dtype=kv_dtype or "bf16", block_size=block_size, tp=tp)  # type: ignore[arg-type]
    return spec, None


def kv_table(spec: Any) -> Any:
    from rich.table import Table

    from ..units import format_bytes

    t = Table(title="KV geometry (per rank)", show_header=False)
    t.add_row("layers / KV heads / head dim", f"{spec.layers} / {spec.kv_heads} / {spec.head_dim}")
    t.add_row("attention", spec.attention + (f" (window {spec.sliding_window} on {spec.sliding_layers} layers)"
                                             if spec.sliding_window else ""))
    t.add_row("KV format", spec.kv_format_id if spec.kv_format_id == spec.kv_dtype
              else f"{spec.kv_dtype} ({spec.kv_format_id})")
    t.add_row("tensor parallel", f"tp={spec.tp}: {spec.kv_heads_per_rank} KV head(s) per rank, "
              f"replication x{spec.kv_replication}")
    bpt = spec.bytes_per_token
    t.add_row("KV bytes per token", f"{bpt:,} ({format_bytes(int(bpt))})" if isinstance(bpt, int)
              else f"{bpt:,.2f} (block bytes / block size)")
    t.add_row("block", f"{spec.block_size} tokens = {format_bytes(spec.block_bytes)}"
              + ("" if spec.format.plain else f" ({spec.block_bytes:,} B, metadata included)"))
    if not spec.format.plain:
        from ..core.sizing.inventory import kv_layout

        parts = ", ".join(f"{p['kv'].upper()} {p['part']} {'x'.join(map(str, p['shape']))} {p['element']}"
                          for p in kv_layout(spec))
        t.add_row("layout per layer and block", f"{parts} = {spec.layer_block_bytes:,} B")
    if spec.residual_page_bytes:
        t.add_row("residual page", f"{format_bytes(spec.residual_page_bytes)} per running sequence "
                  f"({spec.block_size} tokens unquantised, {spec.residual_dtype})")
    return t


def _gib(n: int | None) -> str:
    from ..units import format_gib

    return "-" if n is None else format_gib(n)


def _explain(con: Any, inv: Any) -> None:
    """Each term's formula and source, as plain lines (long formulas wrap badly inside a table)."""
    con.print("How each term is computed:")
    for term in inv.terms:
        where = "" if term.in_budget else " (outside the budget)"
        con.print(f"  {term.label}{where}: {_gib(term.bytes)} = {term.formula}")
        con.print(f"    [dim]source: {term.source}[/dim]")


def _memory_table(inv: Any, gpu: Any, explain: bool) -> Any:
    from rich.table import Table

    from ..core.sizing.engines import VLLM_VERSION
    from ..units import format_bytes

    engine = f"vllm ({VLLM_VERSION})" if inv.engine == "vllm" else "kvledger (our runtime)"
    t = Table(title=f"Memory inventory (per rank), engine {engine}", show_header=False)
    if inv.device_bytes is not None:
        if gpu is not None:
            smi = "" if gpu.nvidia_smi_total_mib is None else f", nvidia-smi {gpu.nvidia_smi_total_mib:,} MiB"
            basis = "from the datasheet (none driver-reported is published)" if gpu.memory_from_datasheet else \
                "as the driver reports it"
            t.add_row("device", f"{_gib(inv.device_bytes)} {basis} ({gpu.name}; datasheet "
                      f"{gpu.datasheet_memory}{smi})")
        else:
            t.add_row("device", f"{_gib(inv.device_bytes)} (--device-memory)")
        t.add_row("budget", f"{_gib(inv.budget_bytes)} (utilization {inv.utilization:g})")
        for term in inv.terms:
            if term.in_budget:
                t.add_row(f"  - {term.label}", _gib(term.bytes))
        t.add_row("  = KV cache", f"{_gib(inv.kv_budget_bytes)} ({inv.kv_budget_bytes:,} B)")
        outside = [term for term in inv.terms if not term.in_budget]
        if outside:
            t.add_row("outside the budget", "; ".join(f"{term.label.split(' (')[0]} {_gib(term.bytes)}"
                                                      for term in outside)
                      + f"; headroom {_gib(inv.headroom_bytes)}")
    elif inv.weights_bytes_per_rank:
        t.add_row("weights on this rank", _gib(inv.weights_bytes_per_rank))
    if inv.parameters:
        t.add_row("parameters", f"{inv.parameters:,} ({inv.parameters / 1e9:.2f} B); weights {inv.weight_format}")
    if inv.max_batched_tokens is not None and inv.device_bytes is not None:
        t.add_row("step shape", f"{inv.max_batched_tokens:,} tokens, {inv.max_seqs:,} sequences per step")
    if inv.workspace_source and inv.engine == "kvledger":
        t.add_row("workspace source", inv.workspace_source)
    t.add_row("KV pool", f"{inv.pool_blocks:,} blocks of {format_bytes(inv.block_bytes)} = {_gib(inv.pool_bytes)} "
              f"= {inv.capacity_tokens:,} tokens")
    if inv.residual_slots:
        t.add_row("residual pages", f"{inv.residual_slots:,} running sequences x "
                  f"{format_bytes(inv.spec.residual_page_bytes)} = {format_bytes(inv.residual_bytes)} "
                  "(--max-num-seqs sets the count)")
    for term in inv.terms:
        if term.key == "first_rows":  # kvtc: a store's constant bytes, charged to the pool it is sized in
            t.add_row(term.label, f"{format_bytes(term.bytes)} ({term.formula})")
    return t


def _matrix(cfg: dict[str, Any], model: str, prompt: int | None, max_new: int | None, concurrency: int | None,
            gpus: str | None, tps: str, prices: str | None, engine: str, utilization: float, kv_dtype: str | None,
            weight_dtype: str | None, block_size: int, as_json: bool) -> None:
    from rich.table import Table

    from ..core.sizing.capacity import capacity_matrix, parse_prices
    from ..errors import ConfigError
    from .common import console, emit_json

    if prompt is None or max_new is None or concurrency is None:
        raise ConfigError("--matrix needs --prompt, --max-new and --concurrency")
    try:
        degrees = sorted({int(x) for x in tps.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--tps takes integers like 1,2,4,8; got {tps!r}") from None
    if not degrees or any(not 1 <= d <= 1024 for d in degrees) or len(degrees) > 16:
        raise ConfigError(f"--tps takes up to 16 degrees in [1, 1024]; got {tps!r}")
    from ..core.sizing.gpus import resolve_gpu_name

    names = [resolve_gpu_name(g) for g in gpus.split(",") if g.strip()] if gpus else None
    price_map = parse_prices(prices)
    rows = capacity_matrix(cfg, prompt=prompt, max_new=max_new, concurrency=concurrency, model_name=model,
                           engine=engine, utilization=utilization, kv_dtype=kv_dtype, weight_dtype=weight_dtype,
                           block_size=block_size, gpus=names, tps=degrees, prices=price_map)
    if as_json:
        emit_json({"model": model, "prompt": prompt, "max_new": max_new, "concurrency": concurrency,
                   "engine": engine, "cost_unit": "price x GPUs" if price_map else "GPU-GiB (GPUs x memory)",
                   "rows": [r.to_dict() for r in rows]})
        return
    unit = "cost (price x GPUs)" if price_map else "GPU-GiB"
    t = Table(title=f"{model}: {prompt:,} + {max_new:,} tokens per request, {concurrency:,} at once ({engine})")
    for col in ("gpu", "tp", "fits", "blocks/rank", "blocks/request", "requests/instance", "instances", "GPUs",
                unit, ""):
        t.add_column(col, justify="left" if col in ("gpu", "") else "right")
    for r in rows:
        mark = ("[bold green]<- tied cheapest[/bold green]" if r.tie else "[bold green]<- cheapest[/bold green]"
                if r.cheapest else ("" if r.fits else f"[dim]{r.note}[/dim]"))
        t.add_row(r.gpu, str(r.tp), "yes" if r.fits else "no", f"{r.pool_blocks:,}" if r.pool_blocks else "-",
                  f"{r.blocks_per_request:,}" if r.blocks_per_request else "-",
                  f"{r.per_instance:,}" if r.fits else "-", f"{r.instances:,}" if r.fits else "-",
                  f"{r.gpus_total:,}" if r.fits else "-", "-" if r.cost is None else f"{r.cost:,.1f}", mark)
    con = console()
    con.print(t)
    from ..core.sizing.gpus import GPUS

    guessed = [g for g in dict.fromkeys(r.gpu for r in rows) if GPUS[g].memory_from_datasheet]
    if guessed:
        con.print(f"[yellow]note:[/yellow] {', '.join(guessed)}: memory is the datasheet figure, not "
                  "driver-reported (none is published); their rows are 1-8% optimistic")
    if not any(r.fits for r in rows):
        raise ConfigError("no GPU x TP combination in the matrix serves this request shape")


def _hints(hints: list[FitHint]) -> str:
    """``; try A, or B`` with each option under plan's own first flag name (vLLM's where vLLM has the knob)."""
    if not hints:
        return ""
    return "; try " + ", or ".join(h.text(lambda option: flag_name(plan_cmd, option)) for h in hints)


@click.command("plan", epilog=epilog(
    "kvledger plan --model llama-3.1-8b --device-memory 79.18GiB           # vLLM's KV cache on an H100",
    "kvledger plan --model llama-3.1-70b --gpu h100-80gb --tensor-parallel-size 4 --prompt 2048 --max-new 512",
    "kvledger plan --model mixtral-8x7b --matrix --prompt 4096 --max-new 1024 --concurrency 64",
))
@geometry_options
@sizing_options()
@click.option("--reserve", type=Size(allow_zero=True), default=None,
              help="Extra memory to keep back [1GiB for kvledger, 0 for vllm].")
@click.option("--weight-dtype", default=None,
              help="Weight format: bf16, fp16, fp8, int8, int4 (AWQ), gptq-int4, fp4 (NVFP4), mxfp4 "
                   "[the checkpoint's quantization_config, else its dtype].")
@click.option("--params", default=None, help="Parameter count for hand-given geometry, e.g. 8.03B.")
@click.option("--weights", type=Size(), default=None, help="Weight bytes per rank for hand-given geometry.")
@click.option("--workspace", type=Size(allow_zero=True), default=None,
              help="Activation workspace per rank, overriding the engine's estimate.")
@click.option("--vocab", type=Int(1, 10**7), default=None,
              help="Vocabulary size for hand-given geometry's sampler estimate [128256].")
# The step sizes take the engine knobs' names but default to the chosen engine's own (vLLM's per GPU class).
@click.option(*_step_names("max_num_batched_tokens", "max_batched_tokens"), type=Int(1, MAX_COUNT * 16), default=None,
              help="Tokens per step [vLLM's default for the GPU class; 8192 for kvledger].")
@click.option(*_step_names("max_num_seqs", "max_seqs"), type=Int(1, MAX_COUNT), default=None,
              help="Sequences per step [vLLM's default for the GPU class; 256 for kvledger].")
@click.option("--peaks", "peaks_file", default=None,
              help="A JSON file of peaks measured on our runtime (schema: kvledger/data/measured_peaks.json).")
@click.option("--prompt", type=TOKENS, default=None, help="Prompt tokens of one request.")
@click.option("--max-new", type=TOKENS, default=None, help="Declared output allowance of one request.")
@engine_option("max_model_len", help="Tokens per request for vLLM's 'maximum concurrency' (vLLM's max_model_len) "
              "[max_position_embeddings].")
@click.option("--matrix", is_flag=True, help="Table of GPU x TP combinations for --prompt/--max-new at --concurrency.")
@click.option("--concurrency", type=Int(1, 10**7), default=None, help="Matrix mode: requests served at once.")
@click.option("--gpus", default=None, help="Matrix mode: GPUs to consider, comma-separated [the whole catalogue].")
@click.option("--tps", default="1,2,4,8", show_default=True, help="Matrix mode: TP degrees to consider.")
@click.option("--prices", default=None,
              help="Matrix mode: price per GPU-hour, e.g. h100-80gb=2.5,l4=0.8 [cost = GPUs x memory].")
@click.option("--explain", is_flag=True, help="Show each memory term's formula and source.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def plan_cmd(model: str | None, layers: int | None, kv_heads: int | None, head_dim: int | None,
             kv_dtype: str | None, tensor_parallel_size: int, block_size: int, pool: int | None, gpu: str | None,
             device_memory: int | None, engine: str, gpu_memory_utilization: float, reserve: int | None,
             weight_dtype: str | None, params: str | None, weights: int | None, workspace: int | None,
             vocab: int | None, max_batched_tokens: int | None, max_seqs: int | None, peaks_file: str | None,
             prompt: int | None, max_new: int | None, max_model_len: int | None, matrix: bool, concurrency: int | None,
             gpus: str | None, tps: str, prices: str | None, explain: bool, as_json: bool) -> None:
    """KV geometry, the memory an engine leaves for the KV cache on one rank, and the requests that fit."""
    from ..core.sizing.capacity import fit_hints
    from ..core.sizing.engines import load_measured_peaks
    from ..core.sizing.geometry import config_int, text_config
    from ..core.sizing.inventory import DoesNotFit, build_inventory, get_gpu
    from ..core.sizing.models import list_models, model_source
    from ..core.sizing.params import parse_param_count
    from ..errors import ConfigError
    from .common import console, emit_json

    if (prompt is None) != (max_new is None):
        raise ConfigError("give both --prompt and --max-new for a request shape")
    spec, cfg = resolve_spec(model, layers, kv_heads, head_dim, kv_dtype, tensor_parallel_size, block_size)
    utilization = gpu_memory_utilization
    if matrix:
        if cfg is None:
            raise ConfigError("--matrix needs --model (every GPU x TP combination is planned from the config)")
        _matrix(cfg, str(model), prompt, max_new, concurrency, gpus, tps, prices, engine, utilization, kv_dtype,
                weight_dtype, block_size, as_json)
        return
    if sum(x is not None for x in (pool, gpu, device_memory)) > 1:
        raise ConfigError("give one of --pool, --gpu and --device-memory")
    gpu_obj = get_gpu(gpu) if gpu is not None else None
    from ..core.sizing.inventory import kv_layout

    base: dict[str, Any] = {"model": model, "block_size": spec.block_size, "kv_dtype": spec.kv_dtype, "tp": spec.tp,
                            "attention": spec.attention, "kv_bytes_per_token": spec.bytes_per_token,
                            "block_bytes": spec.block_bytes, "kv_heads_per_rank": spec.kv_heads_per_rank,
                            "kv_replication": spec.kv_replication, "kv_format": spec.kv_format_id,
                            "kv_format_parts": kv_layout(spec), "residual_page_bytes": spec.residual_page_bytes}
    if pool is None and gpu is None and device_memory is None:
        # Geometry alone: nothing to size, so say what the geometry is.
        if as_json:
            emit_json({**base, "pool_blocks": None})
            return
        con = console()
        con.print(kv_table(spec))
        con.print("[dim]give --gpu NAME, --device-memory SIZE or --pool SIZE to size the KV pool[/dim]")
        return
    kwargs: dict[str, Any] = dict(
        pool_bytes=pool, gpu=gpu, device_bytes=device_memory, utilization=utilization, weight_dtype=weight_dtype,
        runtime_reserve_bytes=reserve, engine=engine, model_name=model, max_batched_tokens=max_batched_tokens,
        max_seqs=max_seqs, params=parse_param_count(params) if params is not None else None,
        weights_bytes=weights, workspace_bytes=workspace, vocab=vocab,
        peaks=load_measured_peaks(peaks_file) if peaks_file else None,
    )
    state = _state(cfg, spec)
    try:
        inv = build_inventory(spec, cfg, **kwargs)
    except DoesNotFit as exc:
        raise ConfigError(f"{exc}" + _hints(fit_hints(spec, cfg, kwargs, prompt=prompt, max_new=max_new))) from None
    data: dict[str, Any] = {**base, **inv.to_dict()}
    if gpu_obj is not None and gpu_obj.memory_note:
        data["device_memory_note"] = gpu_obj.memory_note  # a datasheet figure, said wherever the plan is read
    ctx_len = max_model_len
    hybrid = None
    if ctx_len is None and cfg is not None:
        ctx_len = config_int(text_config(cfg), "max_position_embeddings", default=None)
    if ctx_len is not None:
        data["context"] = ctx_len
        data["max_concurrency_for_context"] = round(inv.max_concurrency(ctx_len), 2)
        hybrid = _hybrid(spec, inv, ctx_len, state)
        if hybrid is not None:
            data["hybrid"] = hybrid.to_dict()
    if prompt is not None and max_new is not None:
        data["prompt"], data["max_new"] = prompt, max_new
        data["blocks_per_request"] = inv.blocks_per_request(prompt, max_new)
        data["max_concurrent_requests"] = inv.max_concurrent_requests(prompt, max_new)
        if spec.sliding_window:
            data["kv_bytes_per_request_windowed"] = spec.kv_bytes_for_sequence(prompt + max_new)
        if data["max_concurrent_requests"] == 0:
            raise ConfigError(
                f"a request of {prompt:,} + {max_new:,} tokens needs {data['blocks_per_request']:,} blocks but the "
                f"pool holds {inv.pool_blocks:,} ({inv.largest_context:,} tokens): it can never be admitted"
                + _hints(fit_hints(spec, cfg, kwargs, prompt=prompt, max_new=max_new)))
    if as_json:
        emit_json(data)
        return
    con = console()
    con.print(kv_table(spec))
    con.print(_memory_table(inv, gpu_obj, explain))
    if explain and inv.terms:
        _explain(con, inv)
    lines = [f"KV capacity: {inv.capacity_tokens:,} tokens; the largest context that fits is "
             f"{inv.largest_context:,} tokens"]
    if ctx_len is not None:
        lines.append(f"maximum concurrency for {ctx_len:,} tokens per request: {inv.max_concurrency(ctx_len):.2f}x")
        if inv.engine == "vllm" and inv.largest_context < ctx_len and (hybrid is None or hybrid.max_concurrency < 1):
            lines.append(f"[yellow]note:[/yellow] vLLM refuses to start when the KV cache cannot hold one request of "
                         f"max_model_len ({ctx_len:,} tokens); give vLLM "
                         f"{flag_name(plan_cmd, 'max_model_len')} {inv.largest_context} or less")
    if "hybrid" in data:
        lines.extend(_hybrid_lines(hybrid))
    if "blocks_per_request" in data:
        lines.append(f"a request of {prompt:,} + {max_new:,} tokens takes {data['blocks_per_request']:,} blocks "
                     f"(the tail block is charged whole): {data['max_concurrent_requests']:,} fit at once "
                     "without prefix sharing")
    if gpu_obj is not None and gpu_obj.memory_note:
        lines.append(f"[yellow]note:[/yellow] {gpu_obj.memory_note}")
    for line in lines:
        con.print(line)
    if model in list_models():
        con.print(f"[dim]config source: {model_source(model)}[/dim]")
    if not explain and inv.device_bytes is not None:
        con.print("[dim]--explain shows each term's formula and source[/dim]")


def _state(cfg: Any, spec: Any) -> Any:
    """The model's Mamba / linear-attention state layers (None without a config or without such layers)."""
    from ..core.sizing.geometry import state_geometry

    return state_geometry(cfg, spec.tp) if cfg is not None else None


def _hybrid(spec: Any, inv: Any, ctx_len: int, state: Any = None) -> Any:
    """The hybrid pool (one block table per KV cache group, sliding groups bounded by their window, state groups
    one fixed block) the same KV budget makes, for a model with sliding or state layers; None for a uniform
    model."""
    from ..core.sizing.hybrid import hybrid_plan, is_hybrid

    if not is_hybrid(spec, state):
        return None
    in_flight = inv.max_batched_tokens or 8192
    return hybrid_plan(spec, inv.kv_budget_bytes - inv.residual_bytes, ctx_len, in_flight, state)


def _hybrid_lines(plan: Any) -> list[str]:
    from ..units import format_bytes

    kinds = "; ".join(
        f"{kind}: {row['layers']} layers in {row['groups']} group(s), {row['blocks_per_request']:,} blocks = "
        f"{format_bytes(row['kv_bytes_per_request'])}" for kind, row in plan.by_kind().items())
    pad = f", {plan.padding_layers} padding layer(s)" if plan.padding_layers else ""
    held = f"sliding groups hold their window beside {plan.in_flight_tokens:,} in-flight tokens"
    if "state" in plan.by_kind():
        held = (f"state groups hold one block per request whatever its length; attention blocks of "
                f"{plan.block_size:,} tokens, raised so a page holds one layer's state")
    return [
        f"hybrid pool (a block table per KV cache group of {plan.group_size} layers{pad}; {held}): "
        f"{plan.pool_blocks:,} blocks of {format_bytes(plan.block_bytes)}",
        f"  a request of {plan.tokens:,} tokens holds {format_bytes(plan.kv_bytes_per_request)} ({kinds}) "
        f"against {format_bytes(plan.uniform_bytes_per_request)} in the uniform pool",
        f"  maximum concurrency for {plan.tokens:,} tokens per request: {plan.max_concurrency:.2f}x hybrid vs "
        f"{plan.uniform_max_concurrency:.2f}x uniform ({plan.max_concurrency / plan.uniform_max_concurrency:.2f}x)",
    ]


__all__ = ["geometry_options", "kv_table", "plan_cmd", "resolve_spec"]
