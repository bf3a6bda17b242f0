"""`kvledger serve` (the OpenAI-compatible server) and `kvledger bench serve` (its load client).

The top level imports only click: FastAPI, uvicorn, torch and the runtime load inside the commands.
Scheduler options are validated by `SchedulerConfig` itself (its error lists the allowed values), so
no choice list is repeated here.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

from ..errors import ConfigError
from .common import prepare_torch
from .engine_options import MAX_RUNTIME_BLOCKS, cpu_engine_refusals, engine_option, engine_options
from .options import MAX_COUNT, Float, Int, Size, epilog, model_option, threads_option


def _need(*modules: str) -> None:
    """One clear line when the server's optional dependencies are missing."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"this command needs {', '.join(missing)}: pip install 'kvledger[serve]'")


@click.command("serve", epilog=epilog(
    "kvledger serve --model smollm2-135m --port 8000             # single tenant, announced at startup",
    "kvledger serve --tenants tenants.toml --pool-blocks 2048    # API keys -> trust groups",
    "kvledger serve --policy full --max-queue 64 --port 0        # any free port; the URL is printed",
))
@model_option()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=Int(0, 65535), default=8000, show_default=True, help="Port (0: any free port, printed).")
@click.option("--pool-blocks", "--num-gpu-blocks-override", "pool_blocks", type=Int(1, MAX_RUNTIME_BLOCKS),
              default=None, help="KV pool size in blocks [1024].")
@click.option("--pool", type=Size(), default=None,
              help="KV pool size in bytes, e.g. 512MiB (instead of --pool-blocks).")
@engine_options("block_size", "kv_dtype", "allow_untested_kv", "dtype", "policy", "on_growth_failure", "recovery",
                "host_blocks", "max_num_seqs", "max_num_batched_tokens", server=True)
@engine_option("max_model_len", help="Prompt + output tokens of one sequence [the model's context, cut to the pool].")
@engine_option("enable_prefix_caching")
@cpu_engine_refusals()
@click.option("--max-queue", type=Int(1, MAX_COUNT), default=256, show_default=True,
              help="Requests that may wait before new ones get 429.")
@click.option("--max-request-body-bytes", default=None,
              help="Largest request body, e.g. 4MiB (413 past it) [64 bytes per token of the model length "
                   "+ 1 MiB].")
@click.option("--tenants", "tenants_path", default=None,
              help="TOML file mapping API keys to tenants (trust groups); without it, single-tenant mode.")
@click.option("--api-key", default=None, help="Single-tenant mode with one required key (instead of --tenants).")
@click.option("--served-model-name", default=None, help="Model id clients use [--model].")
@click.option("--drain-timeout", type=Float(0.0, 86_400.0), default=30.0, show_default=True,
              help="On SIGTERM, seconds running requests get to finish before they are cancelled.")
@threads_option()
@click.option("--engine-process/--no-engine-process", default=False, show_default=True,
              help="Run the engine in a process of its own, fed over ZeroMQ one message per step, as vLLM's "
                   "engine core runs (vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=0 is --no-engine-process: the "
                   "engine in a thread of the server's process). Not faster on 2 busy cores (docs/server.md).")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug", "trace"]),
              default="warning", show_default=True, help="uvicorn's log level (info adds an access log).")
def serve_cmd(model: str, host: str, port: int, pool_blocks: int | None, pool: int | None, block_size: int,
              kv_dtype: str | None, allow_untested_kv: bool, dtype: str, policy: str, on_growth_failure: str,
              recovery: str,
              host_blocks: int, max_num_seqs: int | None, max_num_batched_tokens: int | None,
              max_model_len: int | None, enable_prefix_caching: bool, max_queue: int,
              max_request_body_bytes: str | None,
              tenants_path: str | None, api_key: str | None, served_model_name: str | None, drain_timeout: float,
              threads: int | None, engine_process: bool, log_level: str) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (completions, chat, streaming, /metrics)."""
    _need("fastapi", "uvicorn", "prometheus_client", *(("zmq", "msgspec") if engine_process else ()))
    from ..scheduler import SchedulerConfig
    from ..server.tenants import Tenants
    from ..units import format_bytes, parse_bytes

    if tenants_path is not None and api_key is not None:
        raise ConfigError("give --tenants or --api-key, not both")
    if max_queue < 1:
        raise ConfigError(f"--max-queue must be >= 1, got {max_queue}")
    if drain_timeout < 0:
        raise ConfigError(f"--drain-timeout must be >= 0, got {drain_timeout}")
    if max_model_len is not None and max_model_len < 2:
        raise ConfigError(f"--max-model-len must be >= 2, got {max_model_len}")
    if pool_blocks is not None and pool is not None:
        raise ConfigError("give --pool-blocks or --pool, not both")
    body_limit = None
    if max_request_body_bytes is not None:
        try:
            body_limit = parse_bytes(max_request_body_bytes, unit_required=True)
        except ConfigError as exc:
            raise ConfigError(f"--max-request-body-bytes: {exc}") from None
    tenants = Tenants.from_file(tenants_path) if tenants_path else Tenants.single_tenant(api_key)
    sched: dict[str, Any] = {"policy": policy, "on_growth_failure": on_growth_failure, "recovery": recovery}
    if max_num_seqs is not None:
        sched["max_running"] = max_num_seqs
    if max_num_batched_tokens is not None:
        sched["token_budget"] = max_num_batched_tokens
    scheduler_config = SchedulerConfig(**sched)
    if recovery == "swap" and host_blocks == 0:
        raise ConfigError("--recovery swap needs a host tier: give --host-blocks N")
    from ..server.launch import bind

    sock = bind(host, port)  # fail on a taken port before loading anything
    backend: Any = None
    try:
        from ..engine_config import EngineConfig
        from ..server.app import ServerSettings, create_app
        from ..server.text import TextCodec

        config = EngineConfig(model=model, dtype=dtype, kv_dtype=kv_dtype, num_blocks=pool_blocks, pool_bytes=pool,
                              block_size=block_size, host_blocks=host_blocks, scheduler=scheduler_config,
                              allow_untested_kv=allow_untested_kv, prefix_caching=enable_prefix_caching)
        if engine_process:
            prepare_torch(1)  # this process only parses, tokenizes and streams; the engine's threads are there
            from ..server.engine_proc import ProcessBackend

            backend = ProcessBackend(config, threads)
            info = backend.info
            checkpoint, kv_name, pool_bytes = info.checkpoint_path, info.kv_dtype, info.store_nbytes
        else:
            prepare_torch(threads)
            from ..runtime.engine import Engine
            from ..server.backend import EngineBackend

            engine = Engine.from_config(config)
            backend = EngineBackend(engine)
            checkpoint, kv_name, pool_bytes = str(engine.checkpoint.path), engine.spec.kv_dtype, \
                engine.runner.store.nbytes
        codec = TextCodec.from_pretrained(checkpoint)
        say = _say
        context = backend.max_context or 2**31
        capacity = backend.pool_blocks * backend.block_size
        length = min(context, capacity) if max_model_len is None else max_model_len
        if max_model_len is not None and max_model_len > context:
            raise ConfigError(f"--max-model-len {max_model_len} exceeds the model's context of {context} tokens")
        if max_model_len is not None and max_model_len > capacity:
            raise ConfigError(f"--max-model-len {max_model_len} exceeds the KV pool ({backend.pool_blocks} blocks "
                              f"x {backend.block_size} = {capacity} tokens): give a larger --pool-blocks")
        settings = ServerSettings(served_model_name or model, length, max_queue,
                                  max_request_body_bytes=body_limit)
        app = create_app(backend, codec, tenants, settings)
        where = f"; engine in process {backend.info.pid}" if engine_process else ""
        say(f"kvledger serve: model {model} ({settings.served_model_name}); KV pool {backend.pool_blocks} blocks x "
            f"{backend.block_size} tokens = {format_bytes(pool_bytes)} {kv_name}; "
            f"policy {scheduler_config.policy}, on growth failure {scheduler_config.on_growth_failure}, "
            f"recovery {scheduler_config.recovery}" + ("" if enable_prefix_caching else "; prefix caching off")
            + where)
        note = " (cut to what the KV pool holds)" if max_model_len is None and capacity < context else ""
        say(f"kvledger serve: max model length {length} tokens{note}; up to {max_queue} requests wait, then 429; "
            f"request bodies up to {format_bytes(settings.body_limit)}, then 413")
        say(f"kvledger serve: {tenants.describe()}")
        backend.start()
    except BaseException:
        sock.close()
        if backend is not None and engine_process:
            backend.stop()
        raise
    from ..server.launch import serve

    bound = sock.getsockname()
    say(f"kvledger serve: listening on http://{_url_host(bound[0])}:{bound[1]}  (SIGTERM or Ctrl-C drains and "
        "stops)")
    report = serve(app, sock, drain_timeout=drain_timeout, log_level=log_level, echo=say)
    if not report.get("clean"):
        raise ConfigError("the ledger was not clean at exit (see the report above)")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# ---- bench -----------------------------------------------------------------------------------------
# `bench serve` is the group's one command: the group shows its examples.
BENCH_SERVE_EXAMPLES = epilog(
    "kvledger bench serve --url http://127.0.0.1:8000 --workload synthetic --rate 2 --duration 30",
    "kvledger bench serve --url http://127.0.0.1:8000 --trace azure_conv.csv --rate 1 --concurrency 16",
)


@click.group("bench", epilog=BENCH_SERVE_EXAMPLES)
def bench_group() -> None:
    """Load and measure running servers."""


@bench_group.command("serve", epilog=BENCH_SERVE_EXAMPLES)
@click.option("--url", default="http://127.0.0.1:8000", show_default=True,
              help="Base URL of an OpenAI-compatible server (loopback only).")
@click.option("--trace", "trace_path", default=None,
              help="Lengths (and arrival times) from a trace: Azure CSV, ShareGPT/arXiv lengths CSV, Mooncake JSONL.")
@click.option("--workload", type=click.Choice(["synthetic"]), default=None, help="A synthetic workload instead.")
@click.option("--rate", type=float, default=None,
              help="Poisson arrivals per second (default for a timed trace: its own arrival times).")
@click.option("--duration", type=float, default=30.0, show_default=True,
              help="Seconds during which requests are sent (in-flight ones then get --timeout to finish).")
@click.option("--num-requests", type=int, default=None, help="Send at most this many requests.")
@click.option("--concurrency", type=int, default=16, show_default=True, help="Most requests in flight at once.")
@click.option("--scale", type=float, default=1.0, show_default=True,
              help="Multiply the trace's prompt and output lengths.")
@click.option("--max-prompt", type=int, default=1024, show_default=True, help="Cut prompts to this many tokens.")
@click.option("--max-tokens", type=int, default=256, show_default=True, help="Cut outputs to this many tokens.")
@click.option("--prompt-len", type=int, default=128, show_default=True, help="Synthetic: prompt tokens.")
@click.option("--output-len", type=int, default=64, show_default=True, help="Synthetic: output tokens.")
@click.option("--shared-prefix", type=int, default=0, show_default=True,
              help="Synthetic: tokens of a system prompt every request starts with.")
@click.option("--model", default=None, help="Model id to request [the server's first /v1/models entry].")
@click.option("--api-key", default=None, help="Bearer key [$OPENAI_API_KEY].")
@click.option("--timeout", type=float, default=120.0, show_default=True, help="Seconds one request may take.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--vocab", type=int, default=32000, show_default=True,
              help="Prompts are token ids below this (every tokenizer of interest has more).")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON report.")
def bench_serve_cmd(url: str, trace_path: str | None, workload: str | None, rate: float | None, duration: float,
                    num_requests: int | None, concurrency: int, scale: float, max_prompt: int, max_tokens: int,
                    prompt_len: int, output_len: int, shared_prefix: int, model: str | None, api_key: str | None,
                    timeout: float, seed: int, vocab: int, as_json: bool) -> None:
    """Drive an OpenAI-compatible server with open-loop arrivals and report throughput, TTFT, TPOT,
    end-to-end latency percentiles and errors (a table, then one JSON line)."""
    _need("httpx")
    from .. import loadgen

    if (trace_path is None) == (workload is None):
        raise ConfigError("give --trace FILE or --workload synthetic")
    spec = loadgen.LoadSpec(url=url, rate=rate, duration_s=duration, num_requests=num_requests,
                            concurrency=concurrency, timeout_s=timeout, model=model,
                            api_key=api_key if api_key is not None else os.environ.get("OPENAI_API_KEY"),
                            seed=seed)
    items = (loadgen.trace_workload(trace_path, spec, scale=scale, max_prompt=max_prompt, max_tokens=max_tokens,
                                    vocab=vocab) if trace_path is not None
             else loadgen.synthetic_workload(spec, prompt_len=prompt_len, output_len=output_len,
                                             shared_prefix=shared_prefix, vocab=vocab))
    report = loadgen.run(spec, items, progress=not as_json)
    if not as_json:
        loadgen.print_table(report)
    sys.stdout.write(json.dumps(report, sort_keys=True) + "\n")


__all__ = ["bench_group", "serve_cmd"]
