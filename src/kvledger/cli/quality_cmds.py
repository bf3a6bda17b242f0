"""`kvledger quality`: measure a quantised KV format against the uncompressed KV of the same model.

Prints a table (one row per text kind and context), writes a JSON report and a plot, judges the report
against the format's contract and records it when it passes the full protocol. The top level stays light:
torch and the runtime are imported inside the command.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from ..core.sizing.kv_formats import quantized_formats
from ..errors import ConfigError
from .common import prepare_torch
from .engine_options import DtypeName, engine_option
from .options import Int, epilog, model_option, threads_option

MAX_CONTEXT = 8192


def _contexts(text: str) -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--contexts takes token counts like 256,2048; got {text!r}") from None
    if not values or len(values) > 4 or any(not 16 <= v <= MAX_CONTEXT for v in values):
        raise ConfigError(f"--contexts takes up to 4 token counts in [16, {MAX_CONTEXT}]; got {text!r}")
    return values


def _kinds(text: str) -> list[str]:
    from ..runtime.measure.quality_texts import KINDS

    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if not kinds or bad or len(set(kinds)) != len(kinds):
        raise ConfigError(f"--kinds takes distinct names from {', '.join(KINDS)}; got {text!r}")
    return kinds


def _table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"{report['model']}: {report['kv_format']} against {report['baseline']} KV")
    for col in ("text", "context", "ppl base", "ppl", "ppl change", "KL mean", "KL max", "attn err (worst layer)",
                f"greedy match /{report['protocol']['new_tokens']}", "first divergence"):
        t.add_column(col, justify="left" if col == "text" else "right")
    for c in report["cases"]:
        first = "-" if c["first_divergence"] is None else str(c["first_divergence"])
        t.add_row(c["kind"], f"{c['context']:,}", f"{c['ppl_base']:.3f}", f"{c['ppl']:.3f}",
                  f"{100 * c['ppl_rel_change']:.3f}%", f"{c['kl_mean']:.2e}", f"{c['kl_max']:.2e}",
                  f"{c['attn_rel_err']:.4f}", str(c["greedy_matching"]), first)
    return t


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _held_out_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    held = report["held_out"]
    s, n = held["summary"], held["new_tokens"]
    t = Table(title=f"held out: {held['prompts']} prompts ({held['origin']}), bf16 KV in brackets")
    for col in ("prompt", "tokens", "ppl change", "KL mean", "attn err", f"greedy match /{n}",
                f"free-running common prefix /{n}"):
        t.add_column(col, justify="right")
    for c in held["cases"]:
        b = c["bf16"]
        t.add_row(str(c["prompt"]), f"{c['tokens']:,}",
                  f"{100 * c['ppl_change']:+.3f}% ({100 * b['ppl_change']:+.3f}%)",
                  f"{c['kl_mean']:.2e} ({b['kl_mean']:.2e})", f"{c['attn_rel_err']:.4f}",
                  f"{c['greedy_matching']} ({round(b['greedy_agreement'] * n)})",
                  f"{c['common_prefix']} ({b['common_prefix']})")
    t.add_row("pooled", "", f"{100 * s['ppl_change_pooled']:+.3f}% ({100 * s['ppl_change_pooled_bf16']:+.3f}%)",
              f"{s['kl_mean_pooled']:.2e} ({s['kl_mean_pooled_bf16']:.2e}) = {_ratio(s['kl_vs_bf16'])}", "",
              f"{100 * s['greedy_agreement_mean']:.1f}% ({100 * s['greedy_agreement_mean_bf16']:.1f}%)",
              f"{s['common_prefix_mean']:.1f} ({s['common_prefix_mean_bf16']:.1f}) = "
              f"{_ratio(s['common_prefix_vs_bf16'])}")
    return t


@click.command("quality", epilog=epilog(
    "kvledger quality --model smollm2-135m --kv-cache-dtype int8",
    "kvledger quality --kv-cache-dtype fp8 --contexts 64 --new-tokens 16 --json   # a quick look (not recorded)",
    "kvledger quality --kv-cache-dtype int8-token --held-out my_prompts.json --out reports/int8-token",
))
@model_option()
@engine_option("kv_dtype", required=True, type=DtypeName(lambda: list(quantized_formats())),
              help="The quantised KV format to measure (the baseline is the compute dtype, unquantised).")
@engine_option("block_size",
              help="Tokens per KV block (int4 quantises keys per channel over a block).")
@click.option("--contexts", default="256,2048", show_default=True,
              help="Context lengths in tokens, comma-separated (the full protocol needs <= 512 and >= 2048).")
@click.option("--new-tokens", type=Int(1, 1024), default=128, show_default=True,
              help="Greedy tokens generated after each context (the full protocol needs 128).")
@click.option("--kinds", default="prose,code,chat", show_default=True,
              help="Text kinds: prose (bundled corpus), code (Python's stdlib), chat (Debian FAQs as a chat).")
@click.option("--held-out", "held_out", default=None, metavar="FILE",
              help="A JSON list of held-out prompts (texts, or lists of token ids) the format was not tuned on "
                   "[4 bundled peer chat prompts].")
@click.option("--no-held-out", is_flag=True,
              help="Score the texts only, not the held-out prompts (a quick look: never recorded).")
@click.option("--contract", "contract_path", default=None,
              help="A contract JSON file of thresholds [the one shipped for the format].")
@engine_option("attention_backend",
              help="Attention implementation for both runs (auto, torch, native).")
@click.option("--out", default=None, help="Folder for the JSON report and the plot [the kvledger cache's reports].")
@click.option("--no-record", is_flag=True, help="Do not record a passing report.")
@threads_option()
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
def quality_cmd(model: str, kv_dtype: str, block_size: int, contexts: str, new_tokens: int, kinds: str,
                held_out: str | None, no_held_out: bool, contract_path: str | None, attention_backend: str,
                out: str | None, no_record: bool, threads: int | None, as_json: bool) -> None:
    """Measure a quantised KV format against the uncompressed KV of the same model on prose, code and chat:
    perplexity and its change, next-token KL, per-layer attention error, greedy agreement. A report that
    meets the format's contract on the full protocol and on held-out prompts (each prompt a case, bf16's
    figures beside the format's, free-running common prefix) is recorded; the engine serves a quantised
    format only with such a record (or --allow-untested-kv). Exits 1 when the report
    fails its contract, naming the clause."""

    ctx = _contexts(contexts)
    kind_list = _kinds(kinds)
    if held_out is not None and no_held_out:
        raise ConfigError("--held-out FILE and --no-held-out exclude each other")
    from ..runtime.measure.quality_texts import load_held_out

    held = None if no_held_out else load_held_out(held_out)
    prepare_torch(threads)
    from rich.console import Console

    from ..runtime.attention import attention_backends
    from ..runtime.engine import resolve_model
    from ..runtime.measure.quality import QualityRun, judge, plot_report
    from ..runtime.measure.quality_records import load_contract, record_blocker, save_record
    from ..runtime.weights import cache_root
    from .common import console, emit_json

    if attention_backend not in attention_backends():
        raise ConfigError(f"unknown attention backend {attention_backend!r} (known: {', '.join(attention_backends())})")
    contract = load_contract(kv_dtype, contract_path)
    ckpt = resolve_model(model)
    err = Console(stderr=True)
    run = QualityRun(ckpt, model, block_size=block_size, backend=attention_backend)
    with err.status("measuring") as status:
        report = run.measure(kv_dtype, kinds=kind_list, contexts=ctx, new_tokens=new_tokens,
                             progress=lambda what: status.update(f"measuring {kv_dtype}: {what}"))
        report["held_out"] = None
        if held is not None:
            report["held_out"] = run.measure_held_out(
                kv_dtype, held[0], held[1], new_tokens=new_tokens,
                progress=lambda what: status.update(f"measuring {kv_dtype}: {what}"))
    report = judge(report, contract)
    folder = Path(out) if out else cache_root() / "quality" / "reports" / f"{kv_dtype}-{time.strftime('%Y%m%d-%H%M%S')}"
    folder.mkdir(parents=True, exist_ok=True)
    report["record"] = None
    blocker = record_blocker(report)
    if blocker is None and not no_record:
        report["record"] = str(save_record(report))
    (folder / "quality.json").write_text(json.dumps(report, indent=1) + "\n")
    plot_report(report, folder / "quality.png")
    report["report"] = str(folder / "quality.json")
    if as_json:
        emit_json(report)
        _exit_unless_passed(report, contract.source)
        return
    con = console()
    con.print(_table(report))
    if report["held_out"]:
        con.print(_held_out_table(report))
    for v in report["verdict"]:
        mark = "[green]ok[/green]" if v["ok"] else "[red]FAILS[/red]"
        con.print(f"{mark} {v['threshold']} ({v['set']}): {v['value']:.4g}")
    for t in report["texts"]:
        con.print(f"[dim]{t['kind']}: {t['origin']} (sha256 {t['sha256']}, {t['tokens']:,} tokens)[/dim]")
    verdict = "passes" if report["passed"] else "does not pass"
    con.print(f"{report['kv_format']} {verdict} its contract ({contract.source}); bytes per token "
              f"{report['bytes_per_token']:,} vs {report['baseline_bytes_per_token']:,}")
    if not report["passed"]:
        con.print(report["verdict_line"], markup=False)
    if report["record"]:
        con.print(f"recorded: {report['record']} (the engine now serves {kv_dtype} for these weights)")
    elif report["passed"] and blocker is not None:
        con.print(f"not recorded: {blocker}")
    con.print(f"report: {folder / 'quality.json'}; plot: {folder / 'quality.png'}")
    _exit_unless_passed(report, contract.source)


def _exit_unless_passed(report: dict[str, Any], source: str) -> None:
    """A failed contract is a failed check: one line on stderr and exit 1 (2 stays for bad input), so a
    script or CI step running `kvledger quality` stops."""
    if report["passed"]:
        return
    failing = "; ".join(f"{v['clause']} ({v['threshold']}, {v['set']})" for v in report["verdict"] if not v["ok"])
    click.echo(f"kvledger: {report['kv_format']} fails its contract ({source}): {failing}", err=True)
    raise click.exceptions.Exit(1)


__all__ = ["quality_cmd"]
