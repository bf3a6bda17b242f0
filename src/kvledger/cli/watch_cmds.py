"""`kvledger watch`: a live, read-only mirror of a running vLLM's prefix cache, explained the seed's way.

pyzmq and msgspec (the `watch` extra) are imported when the command runs, never at the CLI's import.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from ..errors import ConfigError
from .engine_options import engine_option
from .options import Float, Int, catalogue_gpu_name, epilog

MAX_PROMPT_IDS_BYTES = 64 << 20


def _prompt_ids(path: str) -> list[int]:
    """A token-id file: a JSON list of integers, or integers separated by whitespace or commas."""
    p = Path(path)
    if p.stat().st_size > MAX_PROMPT_IDS_BYTES:
        raise ConfigError(f"{path} is larger than {MAX_PROMPT_IDS_BYTES >> 20} MiB")
    text = p.read_text(encoding="utf-8").strip()
    try:
        ids = json.loads(text) if text.startswith("[") else [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ConfigError(f"{path}: token ids must be a JSON list of integers, or integers separated by "
                          "spaces") from None
    if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise ConfigError(f"{path}: token ids must be non-negative integers")
    return ids


def _tokenize(prompt: str, tokenizer: str | None) -> list[int]:
    if tokenizer is None:
        raise ConfigError("--prompt needs --tokenizer (the served model's tokenizer folder), or give --prompt-ids")
    from ..server.text import TextCodec

    # vLLM's completions endpoint tokenizes with the tokenizer's special tokens (add_special_tokens=True)
    return list(TextCodec.from_pretrained(tokenizer).tok(prompt)["input_ids"])


def _planner(model: str, tp: int, block_size: int, gpu: str | None = None, utilization: float | None = None,
             kv_dtype: str | None = None) -> Any:
    """Our planner's terms for the served model (its KV in ``kv_dtype``, else the checkpoint's dtype); with ``gpu``,
    the pool `kvledger plan --engine vllm` sizes there (at vLLM's --gpu-memory-utilization, read from its metrics,
    else vLLM's default 0.9)."""
    from ..integrations.vllm_watch import PlannerTerms
    from .plan_cmds import resolve_spec

    spec, cfg = resolve_spec(model, None, None, None, kv_dtype, tp, block_size)
    terms = PlannerTerms(model, spec.bytes_per_token, spec.block_bytes)
    if gpu is not None:
        from ..core.sizing.inventory import build_inventory

        inv = build_inventory(spec, cfg, gpu=gpu, utilization=utilization or 0.9, engine="vllm", model_name=model)
        terms.gpu, terms.pool_blocks = gpu, inv.pool_blocks
    return terms


@click.command("watch", epilog=epilog(
    "kvledger watch --events tcp://127.0.0.1:5557 --metrics http://127.0.0.1:8000/metrics --model llama-3.1-8b",
    "kvledger watch --events tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558 --json --once",
    "kvledger watch --events tcp://127.0.0.1:5557 --prompt-ids prompt.json --json --once",
))
@click.option("--events", "events", required=True,
              help="vLLM's KV event publisher (its --kv-events-config endpoint, e.g. tcp://127.0.0.1:5557).")
@click.option("--replay", "replay", default=None,
              help="vLLM's replay socket (its replay_endpoint): missed batches are asked for there.")
@click.option("--topic", default="", help="The publisher's topic (its --kv-events-config topic) [all].")
@click.option("--metrics", "metrics_url", default=None,
              help="vLLM's Prometheus endpoint (http://HOST:PORT/metrics): pool size, usage, hit counters.")
@click.option("--model", default=None, help="Bundled model vLLM serves: adds our planner's bytes per token and block.")
@click.option("--gpu", default=None, callback=catalogue_gpu_name,
              help="Catalogue GPU vLLM runs on (with --model): adds the pool our planner predicts there.")
@engine_option("tensor_parallel_size",
               help="vLLM's tensor parallel size (the planner's figures are per rank, as vLLM's blocks are).")
@engine_option("block_size", help="vLLM's block size, used until its metrics or a stored full block tell it.")
@engine_option("kv_dtype", help="The KV dtype vLLM stores, for the planner's bytes: its --kv-cache-dtype, or its "
               "--dtype when the cache follows the model (vLLM's metrics say only 'auto') [the checkpoint's dtype].")
@click.option("--prompt", default=None, help="A prompt to predict the prefix-cache hit of (needs --tokenizer).")
@click.option("--tokenizer", default=None, help="The served model's tokenizer folder (for --prompt).")
@click.option("--prompt-ids", "prompt_ids", default=None,
              help="A file of the prompt's token ids (JSON list or whitespace-separated), instead of --prompt.")
@click.option("--cache-salt", default=None, help="The request's cache_salt (vLLM hashes it into the first block).")
@click.option("--hash-algo", type=click.Choice(["sha256", "sha256_cbor"]), default=None,
              help="vLLM's --prefix-caching-hash-algo [read from the metrics, else sha256].")
@click.option("--hash-seed", default=None, help="The PYTHONHASHSEED vLLM runs with, if any (it seeds the hashes).")
@click.option("--bytes-hashes", is_flag=True,
              help="vLLM runs with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (events carry 32-byte hashes).")
@click.option("--interval", type=Float(0.05, 3600.0), default=1.0, show_default=True,
              help="Seconds between snapshots (and between metric scrapes).")
@click.option("--snapshots", type=Int(1, 10**9), default=None,
              help="Stop after this many snapshots [run until interrupted].")
@click.option("--once", is_flag=True, help="Listen one interval, print one snapshot and stop (--snapshots 1).")
@click.option("--max-blocks", type=Int(1, 1 << 24), default=None,
              help="Blocks the mirror tracks at most (oldest stored forgotten first) [262,144].")
@click.option("--top", type=Int(0, 100), default=5, show_default=True, help="Shared prefixes shown.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per snapshot instead of the view.")
def watch_cmd(events: str, replay: str | None, topic: str, metrics_url: str | None, model: str | None,
              gpu: str | None, tensor_parallel_size: int, block_size: int, kv_dtype: str | None, prompt: str | None,
              tokenizer: str | None,
              prompt_ids: str | None, cache_salt: str | None, hash_algo: str | None, hash_seed: str | None,
              bytes_hashes: bool, interval: float, snapshots: int | None, once: bool, max_blocks: int | None, top: int,
              as_json: bool) -> None:
    """Mirror a running vLLM's prefix cache from its KV events (read-only) and explain its memory."""
    from ..integrations.vllm_events import DEFAULT_MAX_BLOCKS, VLLM_VERSION, VllmBlockHasher, VllmCacheMirror
    from ..integrations.vllm_watch import (
        EventSubscriber,
        RestartWatch,
        check_endpoint,
        check_metrics_url,
        explain,
        scrape_metrics,
    )

    check_endpoint(events)
    if replay is not None:
        check_endpoint(replay, "--replay")
    if metrics_url is not None:
        check_metrics_url(metrics_url)
    if prompt is not None and prompt_ids is not None:
        raise ConfigError("give --prompt or --prompt-ids, not both")
    tokens = _prompt_ids(prompt_ids) if prompt_ids is not None else (
        _tokenize(prompt, tokenizer) if prompt is not None else None)
    if gpu is not None and model is None:
        raise ConfigError("--gpu needs --model (the model vLLM serves)")
    planners: dict[Any, Any] = {}  # the planner's terms per block size (vLLM's, once the metrics or events tell it)
    mirror = VllmCacheMirror(max_blocks or DEFAULT_MAX_BLOCKS)
    sub = EventSubscriber(events, mirror, replay_endpoint=replay, topic=topic)
    restarts = RestartWatch()
    limit = 1 if once else snapshots
    live = None
    if not as_json and sys.stdout.isatty():
        from rich.live import Live

        live = Live(auto_refresh=False)
        live.start()
    shown = 0
    try:
        while limit is None or shown < limit:
            sub.poll(interval)
            metrics = scrape_metrics(metrics_url, timeout_s=min(2.0, max(0.2, interval))) if metrics_url else None
            if metrics is not None:
                restarts.observe(mirror, metrics)
            bs = (metrics.block_size if metrics is not None else None) or mirror.block_size or block_size
            util = metrics.gpu_memory_utilization if metrics is not None else None
            if model is not None and (bs, util) not in planners:
                planners[bs, util] = _planner(model, tensor_parallel_size, bs, gpu, util, kv_dtype)
            heard = sub.stats.last_message_s
            data = {"vllm_schema": VLLM_VERSION, "events": events, "at": time.time(),
                    "last_event_age_s": None if heard is None else round(time.monotonic() - heard, 3),
                    **explain(mirror, metrics, planners.get((bs, util)), top=top)}
            if tokens is not None:
                data["would_hit"] = _would_hit(mirror, tokens, metrics, block_size, cache_salt, hash_algo, hash_seed,
                                               bytes_hashes, VllmBlockHasher)
            shown += 1
            if as_json:
                sys.stdout.write(json.dumps(data) + "\n")
                sys.stdout.flush()
            elif live is not None:
                live.update(_view(data), refresh=True)
            else:
                from rich.console import Console

                Console().print(_view(data))
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()
        sub.close()


def _would_hit(mirror: Any, tokens: list[int], metrics: Any, block_size: int, cache_salt: str | None,
               hash_algo: str | None, hash_seed: str | None, bytes_hashes: bool, hasher_cls: Any) -> dict[str, Any]:
    bs = (metrics.block_size if metrics is not None else None) or mirror.block_size or block_size
    algo = hash_algo or (metrics.hash_algo if metrics is not None else None) or "sha256"
    hasher = None
    note = None
    try:
        hasher = hasher_cls(algo, hash_seed, not bytes_hashes)
    except ConfigError as exc:
        note = f"{exc}; matched by token-id chain only"
    hit = mirror.would_hit(tokens, hasher=hasher, cache_salt=cache_salt, block_size=bs)
    out = {**hit.to_dict(), "hash_algo": algo if hasher is not None else None}
    if hasher is not None and hit.by_hash != hit.by_chain:
        note = ("vLLM's hashes and the token-id chain disagree: check --hash-algo, --hash-seed, --bytes-hashes "
                "and --cache-salt against the server's settings")
    if mirror.sync.stale:
        note = (note + "; " if note else "") + "the mirror is stale: the prediction may be off"
    if note:
        out["note"] = note
    return out


def _view(data: dict[str, Any]) -> Any:
    """The terminal view of one snapshot."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    snap, pool, states = data["mirror"], data["pool"], data["states"]
    sync = snap["sync"]
    if sync["state"] == "waiting":
        head = Text(f"no events yet, waiting on {data['events']}", style="yellow")
    elif sync["state"] == "stale":
        head = Text(f"STALE: {sync['why']} (resyncs on a replay, a cache reset or a vLLM restart)", style="bold red")
    else:
        age = data.get("last_event_age_s")
        head = Text(f"live: batch {sync['next_seq'] - 1}" + ("" if age is None else f", {age:.0f} s ago")
                    + f", {sync['restarts']} restart(s) seen", style="green")
    parts: list[Any] = [head]
    m = data.get("metrics")
    if m is not None and m.get("error"):
        parts.append(Text(m["error"], style="yellow"))
    from ..units import format_bytes

    t = Table(title="KV pool: vLLM's figures, then our planner's", show_header=False)
    for key in ("num_gpu_blocks", "usable_blocks", "block_size", "kv_tokens", "gpu_memory_utilization", "cache_dtype"):
        if pool.get(key) is not None:
            t.add_row(key.replace("_", " "), f"{pool[key]:,}" if isinstance(pool[key], int) else str(pool[key]))
    for key, value in (pool.get("planner") or {}).items():
        shown = format_bytes(value) if "bytes" in key else f"{value:+.1%}" if key.endswith("_vs_vllm") else (
            f"{value:,}" if isinstance(value, int) else str(value))
        t.add_row(f"planner: {key.replace('_', ' ')}", shown)
    if t.row_count:
        parts.append(t)
    s = Table(title="Blocks by state (events + metrics)", show_header=False)
    s.add_row("cached (prefix cache, GPU)", f"{states['cached']:,}")
    if "active" in states:
        s.add_row("active (held by running requests)", f"{states['active']:,}")
        s.add_row("retained (cached, held by none)", _span(states["retained_min"], states["retained_max"]))
        s.add_row("free (neither)", _span(states["free_min"], states["free_max"]))
    else:
        s.add_row("active / retained / free", "need --metrics")
    for medium, n in snap["blocks"].items():
        if medium != "GPU":
            s.add_row(f"cached on {medium}", f"{n:,}")
    parts.append(s)
    if data.get("shared_prefixes"):
        sessions = any(row["session"] for row in data["shared_prefixes"])  # vLLM names the storing session
        p = Table("prefix tokens", "continuations", "cached sequences", "hash", *(("stored by",) if sessions else ()),
                  title="Largest shared prefixes")
        for row in data["shared_prefixes"]:
            p.add_row(str(row["prefix_tokens"]), str(row["continuations"]), str(row["sequences"]), str(row["hash"]),
                      *((row["session"] or "-",) if sessions else ()))
        parts.append(p)
    if "prefix_cache_hit_rate" in data:
        parts.append(Text(f"prefix cache hit rate (vLLM's counters): {data['prefix_cache_hit_rate']:.1%}"))
    w = data.get("would_hit")
    if w is not None:
        parts.append(Text(f"this prompt would hit {w['would_hit_blocks']} of {w['full_blocks']} full blocks "
                          f"({w['cached_tokens']:,} cached tokens of {w['prompt_tokens']:,})"
                          + (f" -- {w['note']}" if w.get("note") else "")))
    return Group(*parts)


def _span(lo: int, hi: int) -> str:
    return f"{lo:,}" if lo == hi else f"{lo:,} .. {hi:,}"
