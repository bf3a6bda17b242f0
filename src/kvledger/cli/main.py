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

from ..errors import ConfigError, KVLedgerError
from ..lab import LabSpec, run_lab
from ..scheduler import ADMISSION_POLICIES
from .engine_options import engine_option
from .options import TOKENS, Int, epilog
from .plan_cmds import geometry_options, kv_table, plan_cmd, resolve_spec, sizing_options

MAX_LAB_REQUESTS = 100_000
MAX_LAB_TOKENS = 50_000_000  # requests x (prompt + max_new) x branches the lab may materialise
MAX_POOL_BLOCKS = 2**22  # the ledger keeps per-block state in Python lists
TABLE_ROWS = 20  # decisions shown before "... N more" (--all shows every one)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
             epilog=epilog("kvledger plan --model llama-3.1-8b --device-memory 79.18GiB",
                           "kvledger admit --model llama-3.1-8b --pool 512MiB --requests 8 --prompt 2048 "
                           "--shared-prefix 2048",
                           "kvledger simulate --workload synthetic --rate 4 --sweep rate=1,2,4,8"))
@click.version_option(package_name="kvledger")
def app() -> None:
    """Plan, admit and account for KV-cache memory across concurrent LLM requests."""


json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")


def _emit_json(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


_kv_table = kv_table  # the name other modules used before plan moved to plan_cmds

app.add_command(plan_cmd)


# ---- admit -----------------------------------------------------------------------------------------
@app.command(epilog=epilog(
    "kvledger admit --layers 32 --kv-heads 8 --head-dim 128 --pool 512MiB --requests 8 --prompt 2048 "
    "--shared-prefix 2048 --max-new 257",
    "kvledger admit --model llama-3.1-8b --gpu l4 --requests 64 --prompt 1024 --max-new 256 --groups 4",
    "kvledger admit --model qwen2.5-7b --gpu h100-80gb --requests-file requests.jsonl",
))
@geometry_options
@sizing_options(pool="KV pool size, e.g. 512MiB (or size it with --gpu).",
                gpu="Catalogue GPU whose KV pool (as `kvledger plan` sizes it) is used.",
                device_memory="Device memory as the driver reports it.",
                engine="Whose memory accounting sizes the pool with --gpu/--device-memory.",
                utilization="Fraction of device memory the engine may use.")
@click.option("--weight-dtype", default=None, help="Weight format for the pool's sizing [the checkpoint's].")
@click.option("--requests", type=Int(1, MAX_LAB_REQUESTS), default=8, show_default=True,
              help="Requests arriving together.")
@click.option("--prompt", type=Int(1, 10**7), default=2048, show_default=True, help="Prompt tokens per request.")
@click.option("--shared-prefix", type=TOKENS, default=0, show_default=True,
              help="Leading prompt tokens common to the requests of one trust group.")
@click.option("--max-new", type=Int(0, 10**7), default=257, show_default=True, help="Declared output allowance.")
@click.option("--groups", type=Int(1, MAX_LAB_REQUESTS), default=1, show_default=True,
              help="Trust groups the requests are spread over.")
@engine_option("enable_prefix_caching")
@click.option("--policy", type=click.Choice(ADMISSION_POLICIES.names()), default="full",
              show_default=True, help="Admission policy: what is reserved at admission.")
@click.option("--branches", type=Int(1, 1024), default=1, show_default=True,
              help="Parallel samples per request (n-way sampling); each extra branch reserves its own output.")
@click.option("--requests-file", default=None,
              help="JSONL or CSV of requests with mixed lengths and groups (fields: prompt, max_new, group, prefix, "
                   "prefix_len, id, branches), admitted in order instead of --requests.")
@click.option("--all", "show_all", is_flag=True, help=f"Show every decision (else the first {TABLE_ROWS} and a count).")
@click.option("--geometry/--no-geometry", default=True, show_default=True,
              help="Print the KV geometry table first (the demo prints it once, with `plan`).")
@json_option
def admit(model: str | None, layers: int | None, kv_heads: int | None, head_dim: int | None,
          kv_dtype: str | None, tensor_parallel_size: int, block_size: int, pool: int | None, gpu: str | None,
          device_memory: int | None, engine: str, gpu_memory_utilization: float, weight_dtype: str | None,
          requests: int, prompt: int, shared_prefix: int, max_new: int, groups: int, enable_prefix_caching: bool,
          policy: str, branches: int,
          requests_file: str | None, show_all: bool, geometry: bool, as_json: bool) -> None:
    """Admit requests into one pool through the real ledger: the seed's lab, or a requests file."""
    spec, cfg = resolve_spec(model, layers, kv_heads, head_dim, kv_dtype, tensor_parallel_size, block_size)
    prefix_cache = enable_prefix_caching
    if sum(x is not None for x in (pool, gpu, device_memory)) != 1:
        raise ConfigError("give one of --pool, --gpu and --device-memory to size the pool")
    if pool is not None:
        pool_blocks, pool_bytes, sized = spec.pool_blocks(pool), pool, None
    else:
        from ..core.sizing.inventory import build_inventory

        inv = build_inventory(spec, cfg, gpu=gpu, device_bytes=device_memory, utilization=gpu_memory_utilization,
                              weight_dtype=weight_dtype, engine=engine, model_name=model)
        pool_blocks, pool_bytes, sized = inv.pool_blocks, inv.pool_bytes, f"kvledger plan ({engine} engine)"
    if pool_blocks > MAX_POOL_BLOCKS:
        raise ConfigError(f"the pool would have {pool_blocks:,} blocks; the lab allocates at most {MAX_POOL_BLOCKS:,} "
                          "(use a larger --block-size or a smaller pool)")
    if requests_file is not None:
        _admit_file(spec, requests_file, pool_blocks, pool_bytes, sized, prefix_cache, model, as_json, policy,
                    show_all, geometry)
        return
    if requests * (prompt + max_new) * branches > MAX_LAB_TOKENS:
        raise ConfigError(f"{requests:,} requests of {prompt + max_new:,} tokens x {branches} branches is more than "
                          f"the lab materialises ({MAX_LAB_TOKENS:,} tokens); use fewer or shorter requests")
    result = run_lab(LabSpec(pool_blocks, spec.block_size, requests, prompt, shared_prefix,
                             max_new, groups, prefix_cache, model or "explicit", branches, policy))
    data = {"kv_bytes_per_token": spec.bytes_per_token, "block_bytes": spec.block_bytes,
            "pool_bytes": pool_bytes, **({"pool_sized_by": sized} if sized else {}), **result}
    hybrid = _hybrid_admit(spec, int(pool_bytes), prompt + max_new, cfg)
    if hybrid is not None:
        data["hybrid"] = hybrid.to_dict()
    con = _admission_console(spec, data, as_json, geometry)
    if con is None:
        return
    if hybrid is not None:
        from .plan_cmds import _hybrid_lines

        con.print("the ledger below charges every layer for every token (a uniform pool); for this model:")
        for line in _hybrid_lines(hybrid):
            con.print(line)
    _print_decisions(con, f"Admission ({policy}): {requests} requests, {groups} trust group(s), "
                          f"pool {data['pool_blocks']} blocks", data["decisions"], lengths=False, show_all=show_all)
    reasons: dict[str, str] = {}
    for d in data["decisions"]:
        reasons.setdefault(d["outcome"], f"{d['request']}: {d['reason']}")
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


def _hybrid_admit(spec: Any, pool_bytes: int, tokens: int, cfg: Any = None) -> Any:
    """The hybrid pool the same bytes make for a model with sliding or state layers (one block table per KV cache
    group; a sliding group holds its window beside one step of the scheduler's default 8,192 tokens, a state
    group one fixed block)."""
    from ..core.sizing.geometry import state_geometry
    from ..core.sizing.hybrid import hybrid_plan, is_hybrid

    state = state_geometry(cfg, spec.tp) if cfg is not None else None
    return hybrid_plan(spec, pool_bytes, tokens, 8192, state) if is_hybrid(spec, state) else None


def _admission_console(spec: Any, data: dict[str, Any], as_json: bool, geometry: bool = True) -> Any:
    """``admit``'s report starts one way for the lab and a requests file: with ``--json`` the whole report is
    printed (and None returned), else a console that has printed the KV geometry (unless not ``geometry``)."""
    if as_json:
        _emit_json(data)
        return None
    con = Console()
    if geometry:
        con.print(_kv_table(spec))
    return con


def _print_decisions(con: Any, title: str, decisions: list[dict[str, Any]], lengths: bool, show_all: bool) -> None:
    """The decisions table, cut to its first TABLE_ROWS rows unless ``show_all``: a 64-row table for 64 alike
    requests buried the summary below it."""
    shown = decisions if show_all else decisions[:TABLE_ROWS]
    con.print(_decisions_table(title, shown, lengths))
    if len(shown) < len(decisions):
        con.print(f"[dim]... {len(decisions) - len(shown):,} more (--all shows every row, --json every "
                  "field)[/dim]")


def _decisions_table(title: str, decisions: list[dict[str, Any]], lengths: bool) -> Any:
    """One row per admission decision, its outcome coloured; ``lengths`` adds the prompt and max_new columns."""
    t = Table(title=title)
    cols = ("request", "group", *(("prompt", "max new") if lengths else ()), "outcome", "shared", "new", "promised")
    for col in cols:
        t.add_column(col, justify="left" if col in ("request", "group", "outcome") else "right")
    for d in decisions:
        style = {"admitted": "green", "not_now": "yellow", "never": "red"}[d["outcome"]]
        sizes = (f"{d['prompt']:,}", f"{d['max_new']:,}") if lengths else ()
        t.add_row(d["request"], d["group"], *sizes, f"[{style}]{d['outcome']}[/{style}]", str(d["blocks_shared"]),
                  str(d["blocks_new"]), str(d["blocks_promised"]))
    return t


def _admit_file(spec: Any, path: str, pool_blocks: int, pool_bytes: int, sized: str | None, prefix_cache: bool,
                model: str | None, as_json: bool, policy: str, show_all: bool, geometry: bool) -> None:
    from .admit_file import admit_requests, load_requests_file

    rows = load_requests_file(path)
    result = admit_requests(rows, pool_blocks, spec.block_size, prefix_caching=prefix_cache, model=model or "file",
                            policy=policy)
    data = {"kv_bytes_per_token": spec.bytes_per_token, "block_bytes": spec.block_bytes, "pool_bytes": pool_bytes,
            "pool_sized_by": sized or "--pool", "requests_file": path, **result}
    con = _admission_console(spec, data, as_json, geometry)
    if con is None:
        return
    _print_decisions(con, f"Admission ({policy}) of {path}: {data['requests']} requests, {data['groups']} trust "
                          f"group(s), pool {pool_blocks:,} blocks", data["decisions"], lengths=True, show_all=show_all)
    u = data["usage"]
    con.print(f"outcomes: {', '.join(f'{k} {v}' for k, v in data['outcomes'].items())}; admitted blocks "
              f"{data['admitted_blocks']:,} ({u['active']:,} live + {u['promised']:,} promised); "
              f"{data['free_blocks_after']:,} left to promise.")
    for d in data["decisions"]:
        if d["outcome"] != "admitted":
            con.print(f"[bold]{d['outcome']}[/bold] e.g. {d['request']}: {d['reason']}")
            break


# ---- catalogues ------------------------------------------------------------------------------------
@app.command("models", epilog=epilog("kvledger models", "kvledger models --json"))
@json_option
def models_cmd(as_json: bool) -> None:
    """Bundled model configs, the Hugging Face ids they come from (--model takes either), parameter counts."""
    from ..core.sizing.models import list_models, load_model_config, model_hf_id, model_source
    from ..core.sizing.params import count_parameters

    rows = {}
    for name in list_models():
        count = count_parameters(load_model_config(name))
        rows[name] = {"hf_id": model_hf_id(name), "source": model_source(name), "parameters": count.total,
                      "active_parameters": count.active}
    if as_json:
        _emit_json(rows)
        return
    t = Table("model", "Hugging Face id", "parameters", "active",
              caption="numbers from each repo's config.json; --model takes the name or the id")
    for name, row in rows.items():
        t.add_row(name, row["hf_id"] or row["source"], f"{row['parameters'] / 1e9:.2f} B",
                  f"{row['active_parameters'] / 1e9:.2f} B")
    Console().print(t)


@app.command("gpus", epilog=epilog("kvledger gpus", "kvledger gpus --json"))
@json_option
def gpus_cmd(as_json: bool) -> None:
    """Catalogue GPUs: memory as the driver reports it beside the datasheet, bandwidth and FLOP/s, sources."""
    from ..core.sizing.gpus import GPUS
    from ..units import format_gib

    rows = {g.name: g.to_dict() for g in GPUS.values()}
    if as_json:
        _emit_json(rows)
        return
    t = Table(title="Catalogue GPUs")
    t.add_column("gpu", no_wrap=True)  # a name is never cut: the other columns wrap instead
    for col in ("driver reports", "data sheet", "nvidia smi", "memory BW", "bf16 dense", "host link"):
        t.add_column(col, justify="right", overflow="fold")
    for name, g in rows.items():
        smi = g["nvidia_smi_total_mib"]
        t.add_row(name, format_gib(g["memory_bytes"]) + (" *" if g["memory_from_datasheet"] else ""),
                  g["datasheet_memory"], "-" if smi is None else f"{smi:,} MiB",
                  _si(g["hbm_bandwidth_Bps"], "B/s"), _si(g["bf16_dense_flops"], "FLOP/s"),
                  _si(g["host_link_Bps"], "B/s"))
    con = Console()
    con.print(t)
    if any(g["memory_from_datasheet"] for g in rows.values()):
        con.print("* the datasheet's capacity: no driver-reported total is published for this GPU, so plans on it "
                  "are 1-8% optimistic")
    for name, g in rows.items():
        origin = (f"memory is the datasheet's ({g['driver_source'].removeprefix('datasheet: ')})"
                  if g["memory_from_datasheet"] else f"driver figure from {g['driver_source']}")
        con.print(f"[dim]{name}: {origin}; datasheet: {g['source']}[/dim]")


def _si(value: float, unit: str) -> str:
    """A rate with a decimal prefix, as datasheets write it: 3.35e12 B/s -> '3.35 TB/s'."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


# Commands whose heavy imports (torch, matplotlib) happen only when they run; each module keeps its
# top level light so that `kvledger plan` stays fast.
from .cache_cmds import cache_cmd  # noqa: E402
from .diagnose_cmds import diagnose_cmd  # noqa: E402
from .fleet_serve_cmds import fleet_group  # noqa: E402
from .lab_cmds import lab_cmd  # noqa: E402
from .quality_cmds import quality_cmd  # noqa: E402
from .runtime_cmds import generate_cmd, serve_trace_cmd  # noqa: E402
from .serve_cmds import bench_group, serve_cmd  # noqa: E402
from .sim_cmds import calibrate_cmd, compare_cmd, simulate_cmd  # noqa: E402
from .watch_cmds import watch_cmd  # noqa: E402

for _cmd in (generate_cmd, serve_trace_cmd, simulate_cmd, calibrate_cmd, compare_cmd, serve_cmd, bench_group,
             diagnose_cmd, quality_cmd, fleet_group, cache_cmd, watch_cmd):
    app.add_command(_cmd)
app.add_command(lab_cmd)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app and turn every expected failure into one line and exit code 2."""
    try:
        rc = app.main(args=argv, prog_name="kvledger", standalone_mode=False)
    except KVLedgerError as exc:
        return _fail(str(exc))
    except click.exceptions.Abort:
        print("kvledger: aborted", file=sys.stderr)
        return 130
    except click.exceptions.NoSuchOption as exc:  # an engine knob this command does not take: say who does
        return _fail(_no_such_option(exc))
    except click.exceptions.ClickException as exc:  # bad flags, missing values, wrong types
        _fail(exc.format_message())
        return exc.exit_code if exc.exit_code else 2
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except BrokenPipeError:  # `kvledger ... | head`
        return 0
    except RecursionError:  # a structure nested past Python's limit in some input
        return _fail("input nested too deeply")
    except MemoryError:
        return _fail("out of memory; use a smaller input or fewer requests")
    except OSError as exc:  # a file or folder the command was told to use
        where = f" {exc.filename}" if getattr(exc, "filename", None) else ""
        return _fail(f"{exc.strerror or exc}{where}")
    return rc if isinstance(rc, int) else 0


def _no_such_option(exc: click.exceptions.NoSuchOption) -> str:
    """Click's message, except for an engine knob's flag (vLLM's or ours) on a command that does not take it:
    then which commands do, instead of a guess at a similar name (`--max-model-len` is not `--model`)."""
    from .engine_options import FLAGS

    flag = exc.option_name
    names = {n for key, (opts, _) in FLAGS.items() for opt in opts if opt.startswith("-") for n in opt.split("/")}
    if flag not in names:
        return exc.format_message()

    def takers(group: click.Group, prefix: str = "") -> list[str]:
        out: list[str] = []
        for name, cmd in sorted(group.commands.items()):
            if isinstance(cmd, click.Group):
                out += takers(cmd, f"{prefix}{name} ")
            elif any(flag in (*p.opts, *p.secondary_opts) for p in cmd.params if not getattr(p, "why", None)):
                out.append(prefix + name)
        return out

    where = exc.ctx.command_path if exc.ctx is not None else "kvledger"
    who = takers(app)
    return (f"{where} takes no {flag}: it is an engine knob, taken by " + ", ".join(who) if who
            else exc.format_message())


def _fail(message: str) -> int:
    """Print `kvledger: error: <message>` as exactly one line on stderr; exit code 2."""
    line = " ".join(str(message).split())  # one line, whatever the message held
    print(f"kvledger: error: {line[:2000]}", file=sys.stderr)
    return 2


def run() -> None:
    """Console-script wrapper: exit with main()'s code."""
    sys.exit(main())


if __name__ == "__main__":
    run()
