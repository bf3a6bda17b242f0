"""`kvledger` command line: `plan` (geometry and memory inventory) and `admit` (the admission lab).

People get rich tables; machines get `--json`. Every error kvledger raises on purpose becomes one
line on stderr and exit code 2 -- never a traceback.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from ..core.geometry import KVSpec
from ..core.inventory import GPUS, build_inventory
from ..core.models import list_models, load_model_config, model_source
from ..errors import ConfigError, KVLedgerError
from ..lab import LabSpec, run_lab
from ..scheduler import ADMISSION_POLICIES
from ..units import format_bytes, parse_bytes


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="kvledger")
def app() -> None:
    """Plan, admit and account for KV-cache memory across concurrent LLM requests."""


def geometry_options(fn: Any) -> Any:
    """The KV geometry flags shared by every command that needs a model."""
    opts = [
        click.option("--model", default=None, help="Bundled model name or path to a config.json (or its folder)."),
        click.option("--layers", type=int, default=None, help="Decoder layers (instead of --model)."),
        click.option("--kv-heads", type=int, default=None, help="Total KV heads (instead of --model)."),
        click.option("--head-dim", type=int, default=None, help="Head dimension (instead of --model)."),
        click.option("--kv-dtype", default=None, help="KV dtype: bf16, fp16, fp32, fp8, int8 [model's dtype]."),
        click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel degree."),
        click.option("--block-size", type=int, default=16, show_default=True, help="Tokens per KV block."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")


def resolve_spec(model: str | None, layers: int | None, kv_heads: int | None, head_dim: int | None,
                 kv_dtype: str | None, tp: int, block_size: int) -> tuple[KVSpec, dict[str, Any] | None]:
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


def _reserve_bytes(text: str) -> int:
    """A reserve may be zero, in any spelling (0, 0B, 0GiB)."""
    stripped = text.strip().rstrip("bBiIkKmMgGtT").strip()
    try:
        if float(stripped) == 0:
            return 0
    except ValueError:
        pass
    return parse_bytes(text)


def _emit_json(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def _kv_table(spec: KVSpec) -> Table:
    t = Table(title="KV geometry (per rank)", show_header=False)
    t.add_row("layers / KV heads / head dim", f"{spec.layers} / {spec.kv_heads} / {spec.head_dim}")
    t.add_row("attention", spec.attention + (f" (window {spec.sliding_window} on {spec.sliding_layers} layers)"
                                             if spec.sliding_window else ""))
    t.add_row("KV dtype", spec.kv_dtype)
    t.add_row("tensor parallel", f"tp={spec.tp}: {spec.kv_heads_per_rank} KV head(s) per rank, "
              f"replication x{spec.kv_replication}")
    t.add_row("KV bytes per token", f"{spec.bytes_per_token:,} ({format_bytes(spec.bytes_per_token)})")
    t.add_row("block", f"{spec.block_size} tokens = {format_bytes(spec.block_bytes)}")
    return t


# ---- plan ------------------------------------------------------------------------------------------
@app.command()
@geometry_options
@click.option("--pool", default=None, help="KV pool size directly, e.g. 512MiB.")
@click.option("--gpu", default=None, help=f"Named GPU: {', '.join(GPUS)}.")
@click.option("--device-memory", default=None, help="Device memory, e.g. 80GiB (instead of --gpu).")
@click.option("--utilization", type=float, default=0.9, show_default=True,
              help="Fraction of device memory to plan with.")
@click.option("--reserve", default="1GiB", show_default=True, help="Runtime reserve (CUDA context, libraries).")
@click.option("--weight-dtype", default=None, help="Weight dtype [model's dtype].")
@click.option("--prompt", type=int, default=None, help="Prompt tokens of one request.")
@click.option("--max-new", type=int, default=None, help="Declared output allowance of one request.")
@json_option
def plan(model: str | None, layers: int | None, kv_heads: int | None, head_dim: int | None,
         kv_dtype: str | None, tp: int, block_size: int, pool: str | None, gpu: str | None,
         device_memory: str | None, utilization: float, reserve: str, weight_dtype: str | None,
         prompt: int | None, max_new: int | None, as_json: bool) -> None:
    """KV geometry and the memory inventory of one rank; with --prompt/--max-new, requests that fit."""
    spec, cfg = resolve_spec(model, layers, kv_heads, head_dim, kv_dtype, tp, block_size)
    if pool is None and gpu is None and device_memory is None:
        raise ConfigError("give --pool BYTES, or --gpu NAME / --device-memory BYTES to size the KV pool")
    inv = build_inventory(
        spec, cfg, pool_bytes=parse_bytes(pool) if pool is not None else None, gpu=gpu,
        device_bytes=parse_bytes(device_memory) if device_memory is not None else None,
        utilization=utilization, runtime_reserve_bytes=_reserve_bytes(reserve),
        weight_dtype=weight_dtype,
    )
    data: dict[str, Any] = {"model": model, **inv.to_dict(), "block_size": spec.block_size,
                            "kv_dtype": spec.kv_dtype, "tp": spec.tp, "attention": spec.attention}
    if (prompt is None) != (max_new is None):
        raise ConfigError("give both --prompt and --max-new for a request shape")
    if prompt is not None and max_new is not None:
        data["prompt"], data["max_new"] = prompt, max_new
        data["blocks_per_request"] = inv.blocks_per_request(prompt, max_new)
        data["max_concurrent_requests"] = inv.max_concurrent_requests(prompt, max_new)
        if spec.sliding_window:
            data["kv_bytes_per_request_windowed"] = spec.kv_bytes_for_sequence(prompt + max_new)
    if as_json:
        _emit_json(data)
        return
    con = Console()
    con.print(_kv_table(spec))
    t = Table(title="Memory inventory (per rank)", show_header=False)
    if inv.device_bytes:
        t.add_row("device", format_bytes(inv.device_bytes))
        t.add_row("budget", f"{format_bytes(inv.budget_bytes)} (utilization {utilization:g})")
    if cfg is not None:
        t.add_row("parameters", f"{inv.parameters:,} ({inv.parameters / 1e9:.2f} B)")
        t.add_row("weights on this rank", format_bytes(inv.weights_bytes_per_rank))
        t.add_row("activation/workspace peak", format_bytes(inv.workspace_bytes))
        t.add_row("runtime reserve", format_bytes(inv.reserve_bytes))
    t.add_row("KV pool", f"{format_bytes(inv.pool_bytes)} = {inv.pool_blocks:,} blocks")
    if "blocks_per_request" in data:
        t.add_row("blocks per request", f"{data['blocks_per_request']} (ceil(({prompt} + {max_new}) / "
                  f"{spec.block_size}); the tail block is charged whole)")
        t.add_row("max concurrent requests", f"{data['max_concurrent_requests']} (no prefix sharing)")
    con.print(t)
    if model in list_models():
        con.print(f"[dim]config source: {model_source(model)}[/dim]")


# ---- admit -----------------------------------------------------------------------------------------
@app.command()
@geometry_options
@click.option("--pool", required=True, help="KV pool size, e.g. 512MiB.")
@click.option("--requests", type=int, default=8, show_default=True, help="Requests arriving together.")
@click.option("--prompt", type=int, default=2048, show_default=True, help="Prompt tokens per request.")
@click.option("--shared-prefix", type=int, default=0, show_default=True,
              help="Leading prompt tokens common to the requests of one trust group.")
@click.option("--max-new", type=int, default=257, show_default=True, help="Declared output allowance.")
@click.option("--groups", type=int, default=1, show_default=True, help="Trust groups the requests are spread over.")
@click.option("--prefix-cache/--no-prefix-cache", default=True, show_default=True,
              help="Share identical prefixes within a trust group.")
@click.option("--policy", type=click.Choice(ADMISSION_POLICIES.names()), default="full",
              show_default=True, help="Admission policy: what is reserved at admission.")
@click.option("--branches", type=int, default=1, show_default=True,
              help="Parallel samples per request (n-way sampling); each extra branch reserves its own output.")
@json_option
def admit(model: str | None, layers: int | None, kv_heads: int | None, head_dim: int | None,
          kv_dtype: str | None, tp: int, block_size: int, pool: str, requests: int, prompt: int,
          shared_prefix: int, max_new: int, groups: int, prefix_cache: bool, policy: str, branches: int,
          as_json: bool) -> None:
    """Admit N requests into one pool with full output reservation, through the real ledger."""
    spec, _ = resolve_spec(model, layers, kv_heads, head_dim, kv_dtype, tp, block_size)
    pool_bytes = parse_bytes(pool)
    result = run_lab(LabSpec(spec.pool_blocks(pool_bytes), spec.block_size, requests, prompt, shared_prefix,
                             max_new, groups, prefix_cache, model or "explicit", branches, policy))
    data = {"kv_bytes_per_token": spec.bytes_per_token, "block_bytes": spec.block_bytes,
            "pool_bytes": pool_bytes, **result}
    if as_json:
        _emit_json(data)
        return
    con = Console()
    con.print(_kv_table(spec))
    t = Table(title=f"Admission ({policy}): {requests} requests, {groups} trust group(s), "
                    f"pool {data['pool_blocks']} blocks")
    for col in ("request", "group", "outcome", "shared", "new", "promised"):
        t.add_column(col, justify="left" if col in ("request", "group", "outcome") else "right")
    reasons: dict[str, str] = {}
    for d in data["decisions"]:
        style = {"admitted": "green", "not_now": "yellow", "never": "red"}[d["outcome"]]
        t.add_row(d["request"], d["group"], f"[{style}]{d['outcome']}[/{style}]", str(d["blocks_shared"]),
                  str(d["blocks_new"]), str(d["blocks_promised"]))
        reasons.setdefault(d["outcome"], f"{d['request']}: {d['reason']}")
    con.print(t)
    for outcome, reason in reasons.items():
        con.print(f"[bold]{outcome}[/bold] e.g. {reason}")
    u = data["usage"]
    if branches > 1:
        con.print(f"each request samples {branches} branches: the extra {branches - 1} need "
                  f"{data['branch_blocks_per_request']} more blocks per request (own output allowance + one "
                  f"copy-on-write copy of the prompt's partial tail each)")
    con.print(
        f"blocks per request {data['blocks_per_request']} = {data['shared_prefix_blocks']} shared-prefix + "
        f"{data['private_blocks_per_request']} private; all {requests} together need "
        f"{data['blocks_needed_all']} (sharing as groups allow), {data['blocks_needed_unshared']} unshared.\n"
        f"admitted {data['admitted']} using {data['admitted_blocks']} blocks "
        f"({u['active']} live + {u['promised']} promised); {data['free_blocks_after']} left to promise.\n"
        f"pool by state: {u['free']} free, {u['active']} active, {u['retained']} retained (evictable "
        f"{u['evictable']}), {u['promised']} promised; token slots used "
        f"{data['token_usage']['token_slots_used']} of {data['token_usage']['token_slots_held']} held.")
    g = data["growth"]
    if g is not None:
        con.print(
            f"growth under '{policy}': {g['started_at_once']} started at once, peak {g['peak_running_requests']} "
            f"running, {g['preemptions']} preemption(s), all done after {g['steps']} steps "
            f"(finish: {', '.join(g['finish_reasons'])}).")


# ---- catalogues ------------------------------------------------------------------------------------
@app.command("models")
@json_option
def models_cmd(as_json: bool) -> None:
    """Bundled model configs and where they come from."""
    rows = {name: model_source(name) for name in list_models()}
    if as_json:
        _emit_json(rows)
        return
    t = Table("model", "source")
    for name, src in rows.items():
        t.add_row(name, src)
    Console().print(t)


@app.command("gpus")
@json_option
def gpus_cmd(as_json: bool) -> None:
    """Named GPUs and their datasheet figures."""
    rows = {g.name: {"memory_bytes": g.memory_bytes, "hbm_bandwidth_Bps": g.hbm_bandwidth_Bps,
                     "bf16_dense_flops": g.bf16_dense_flops, "host_link_Bps": g.host_link_Bps,
                     "source": g.source} for g in GPUS.values()}
    if as_json:
        _emit_json(rows)
        return
    t = Table("gpu", "memory", "HBM B/s", "bf16 FLOP/s", "host link B/s")
    for name, g in rows.items():
        t.add_row(name, format_bytes(g["memory_bytes"]), f"{g['hbm_bandwidth_Bps']:.3g}",
                  f"{g['bf16_dense_flops']:.3g}", f"{g['host_link_Bps']:.3g}")
    Console().print(t)


# Commands whose heavy imports (torch, matplotlib) happen only when they run; each module keeps its
# top level light so that `kvledger plan` stays fast.
from .diagnose_cmds import diagnose_cmd  # noqa: E402
from .runtime_cmds import generate_cmd, serve_trace_cmd  # noqa: E402
from .sim_cmds import calibrate_cmd, simulate_cmd  # noqa: E402

for _cmd in (generate_cmd, serve_trace_cmd, simulate_cmd, calibrate_cmd, diagnose_cmd):
    app.add_command(_cmd)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app and turn every expected failure into one line and exit code 2."""
    try:
        rc = app.main(args=argv, prog_name="kvledger", standalone_mode=False)
    except KVLedgerError as exc:
        print(f"kvledger: error: {exc}", file=sys.stderr)
        return 2
    except click.exceptions.Abort:
        print("kvledger: aborted", file=sys.stderr)
        return 130
    except click.exceptions.ClickException as exc:  # bad flags, missing values, wrong types
        print(f"kvledger: error: {exc.format_message()}", file=sys.stderr)
        return exc.exit_code if exc.exit_code else 2
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except BrokenPipeError:  # `kvledger ... | head`
        return 0
    return rc if isinstance(rc, int) else 0


def run() -> None:
    """Console-script wrapper: exit with main()'s code."""
    sys.exit(main())


if __name__ == "__main__":
    run()
