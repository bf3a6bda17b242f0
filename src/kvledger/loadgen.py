"""`kvledger bench serve`: an open-loop load client for any OpenAI-compatible server (ours, `vllm serve`).

Requests arrive on their own schedule (a trace's arrival times, or Poisson at ``rate``), whether or not
earlier ones have finished; at most ``concurrency`` are in flight (a request that arrives when all slots
are busy waits for one, and that wait is reported apart). Sending stops after ``duration`` seconds or
``num_requests`` requests; requests still running then get ``timeout`` seconds, so a run is bounded in
count and in time. Only loopback URLs are accepted.

Each request is a streaming ``/v1/completions`` call with token-id prompts (so both servers see exactly
the same tokens, and the lengths are the trace's), ``temperature=0`` and ``ignore_eos`` (vLLM's
extension, which ours implements too) so every request produces exactly its ``max_tokens``. Measured
client-side: TTFT (send -> first token chunk), ITL (between chunks), TPOT ((e2e - TTFT) / (tokens - 1)),
end-to-end latency, throughput, and errors by kind. Percentiles interpolate linearly between order
statistics (numpy's default, as vLLM's serving benchmark reports them).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import os
import random
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from .errors import ConfigError
from .scheduler.metrics import distribution, percentile  # the one definition (scheduler, simulator, engine)

_MASK64 = (1 << 64) - 1
_FIRST_ID = 1000  # prompt ids start here: clear of the special tokens most vocabularies put first


@dataclass(frozen=True, slots=True)
class LoadSpec:
    url: str
    rate: float | None = None
    duration_s: float = 30.0
    num_requests: int | None = None
    concurrency: int = 16
    timeout_s: float = 120.0
    model: str | None = None
    api_key: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate is not None and not (math.isfinite(self.rate) and self.rate > 0):
            raise ConfigError(f"--rate must be > 0, got {self.rate}")
        if not (math.isfinite(self.duration_s) and 0 < self.duration_s <= 86400):
            raise ConfigError(f"--duration must be in (0, 86400] seconds, got {self.duration_s}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ConfigError(f"--num-requests must be >= 1, got {self.num_requests}")
        if not 1 <= self.concurrency <= 4096:
            raise ConfigError(f"--concurrency must be in [1, 4096], got {self.concurrency}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"--timeout must be > 0, got {self.timeout_s}")


@dataclass(frozen=True, slots=True)
class Item:
    """One request to send: when (seconds after the start), what, and how many tokens to ask for."""

    arrival_s: float
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class RequestOutcome:
    ok: bool
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    slot_wait_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


# ---- workloads --------------------------------------------------------------------------------------
def _mix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def to_vocab(ids: list[int], vocab: int, salt: int = 0) -> list[int]:
    """Map synthetic token identifiers into ``[_FIRST_ID, vocab)``, one id at a time: equal prefixes stay
    equal (so a trace's prefix sharing survives), distinct ids rarely collide. A different ``salt`` (the
    run's seed) gives different tokens, so two runs never hit each other's cached prompts."""
    span = vocab - _FIRST_ID
    key = _mix(salt & _MASK64)
    return [_FIRST_ID + _mix(t ^ key) % span for t in ids]


def _check_vocab(vocab: int) -> None:
    if vocab <= _FIRST_ID + 1:
        raise ConfigError(f"--vocab must be > {_FIRST_ID + 1}, got {vocab}")


def _poisson(rate: float, count: int, seed: int) -> list[float]:
    rng = random.Random(f"kvledger.loadgen/{seed}")
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def _cap(spec: LoadSpec, available: int) -> int:
    """How many requests a run may need: enough to cover ``duration`` at ``rate`` (with margin)."""
    n = available if spec.num_requests is None else min(available, spec.num_requests)
    if spec.rate is not None:
        n = min(n, int(spec.rate * spec.duration_s * 2) + 16)
    return n


def trace_workload(path: str, spec: LoadSpec, *, scale: float = 1.0, max_prompt: int = 1024,
                   max_tokens: int = 256, vocab: int = 32000) -> list[Item]:
    """Lengths from a trace (``scale``d, then cut to ``max_prompt`` / ``max_tokens``); arrivals from the
    trace itself, or Poisson at ``spec.rate`` (needed for length tables, which have no times)."""
    from .workloads import Poisson, load_trace, trace_has_arrivals

    _check_vocab(vocab)
    if not (math.isfinite(scale) and 0 < scale <= 1):
        raise ConfigError(f"--scale must be in (0, 1], got {scale}")
    if max_prompt < 1 or max_tokens < 1:
        raise ConfigError("--max-prompt and --max-tokens must be >= 1")
    timed = trace_has_arrivals(path)
    if not timed and spec.rate is None:
        raise ConfigError(f"{path} has no arrival times: give --rate")
    requests = load_trace(path) if timed else load_trace(path, arrivals=Poisson(spec.rate or 1.0), seed=spec.seed)
    if not requests:
        raise ConfigError(f"{path} holds no requests")
    n = _cap(spec, len(requests))
    requests = requests[:n]
    if spec.rate is not None:
        times = _poisson(spec.rate, n, spec.seed)
    else:
        start = requests[0].arrival_s
        times = [r.arrival_s - start for r in requests]
    items = []
    for r, t in zip(requests, times, strict=True):
        plen = min(max_prompt, max(1, round(r.prompt_len * scale)))
        out = min(max_tokens, max(1, round(r.output_len * scale)))
        items.append(Item(t, to_vocab(list(r.prompt_tokens[:plen]), vocab, spec.seed), out))
    return [i for i in items if i.arrival_s < spec.duration_s] or items[:1]


def synthetic_workload(spec: LoadSpec, *, prompt_len: int = 128, output_len: int = 64, shared_prefix: int = 0,
                       vocab: int = 32000) -> list[Item]:
    """Fixed lengths, Poisson arrivals; ``shared_prefix`` tokens of one system prompt open every prompt."""
    _check_vocab(vocab)
    if prompt_len < 1 or output_len < 1 or shared_prefix < 0:
        raise ConfigError("--prompt-len and --output-len must be >= 1, --shared-prefix >= 0")
    if spec.rate is None:
        raise ConfigError("the synthetic workload needs --rate")
    n = _cap(spec, 10**9)
    times = _poisson(spec.rate, n, spec.seed)
    system = list(range(shared_prefix))
    items, next_id = [], shared_prefix
    for t in times:
        if t >= spec.duration_s:
            break
        own = list(range(next_id, next_id + prompt_len))
        next_id += prompt_len
        items.append(Item(t, to_vocab(system + own, vocab, spec.seed), output_len))
    return items or [Item(0.0, to_vocab(system + list(range(next_id, next_id + prompt_len)), vocab, spec.seed),
                            output_len)]


# ---- the client -------------------------------------------------------------------------------------
def check_loopback(url: str) -> str:
    """The base URL, if its host is a loopback address (names are resolved); else ConfigError."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--url must look like http://127.0.0.1:8000, got {url!r}")
    host = parts.hostname
    try:
        addresses = {ipaddress.ip_address(host)}
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, parts.port or 80, proto=socket.IPPROTO_TCP)
        except OSError:
            raise ConfigError(f"cannot resolve {host!r}") from None
        addresses = {ipaddress.ip_address(info[4][0]) for info in infos}
    if not addresses or not all(a.is_loopback for a in addresses):
        raise ConfigError(f"--url must be a loopback address (127.0.0.0/8, ::1, localhost); {host!r} is not")
    return url.rstrip("/").removesuffix("/v1")


async def _one(client: Any, base: str, model: str, item: Item, slots: asyncio.Semaphore, headers: dict[str, str],
               timeout_s: float) -> RequestOutcome:
    arrived = time.perf_counter()
    async with slots:
        sent = time.perf_counter()
        outcome = RequestOutcome(False, slot_wait_s=sent - arrived, prompt_tokens=len(item.prompt))
        body = {"model": model, "prompt": item.prompt, "max_tokens": item.max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        last = None
        chunks = 0
        try:
            async with asyncio.timeout(timeout_s):
                async with client.stream("POST", f"{base}/v1/completions", json=body, headers=headers) as resp:
                    if resp.status_code != 200:
                        await resp.aread()
                        outcome.error = f"http_{resp.status_code}"
                        return outcome
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        msg = json.loads(data)
                        if "error" in msg:
                            outcome.error = "stream_error"
                            return outcome
                        now = time.perf_counter()
                        if msg.get("choices"):
                            chunks += 1
                            if outcome.ttft_s is None:
                                outcome.ttft_s = now - sent
                            elif last is not None:
                                outcome.itl_s.append(now - last)
                            last = now
                        usage = msg.get("usage")
                        if usage:
                            outcome.output_tokens = int(usage.get("completion_tokens") or 0)
                            outcome.prompt_tokens = int(usage.get("prompt_tokens") or outcome.prompt_tokens)
                            details = usage.get("prompt_tokens_details") or {}
                            outcome.cached_tokens = int(details.get("cached_tokens") or 0)
        except TimeoutError:
            outcome.error = "timeout"
            return outcome
        except Exception as exc:  # noqa: BLE001 -- any transport failure is counted, by kind
            outcome.error = type(exc).__name__
            return outcome
        outcome.e2e_s = time.perf_counter() - sent
        if not outcome.output_tokens:
            outcome.output_tokens = max(0, chunks - 1)  # no usage: content chunks minus the closing one
        outcome.ok = True
        return outcome


async def _drive(spec: LoadSpec, items: list[Item], progress: Any) -> tuple[list[RequestOutcome], float, str]:
    import httpx

    base = check_loopback(spec.url)
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    limits = httpx.Limits(max_connections=spec.concurrency + 4, max_keepalive_connections=spec.concurrency + 4)
    # trust_env=False: never route loopback traffic through a proxy from the environment.
    async with httpx.AsyncClient(timeout=httpx.Timeout(spec.timeout_s), limits=limits, trust_env=False) as client:
        model = spec.model
        if model is None:
            try:
                resp = await client.get(f"{base}/v1/models", headers=headers)
            except httpx.HTTPError as exc:
                raise ConfigError(f"cannot reach {base}: {exc}") from None
            if resp.status_code != 200:
                raise ConfigError(f"{base}/v1/models answered {resp.status_code}: {resp.text[:200]}")
            model = resp.json()["data"][0]["id"]
        slots = asyncio.Semaphore(spec.concurrency)
        tasks: list[asyncio.Task[RequestOutcome]] = []
        start = time.perf_counter()
        for item in items:
            if spec.num_requests is not None and len(tasks) >= spec.num_requests:
                break
            delay = item.arrival_s - (time.perf_counter() - start)
            if item.arrival_s >= spec.duration_s:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(_one(client, base, model, item, slots, headers, spec.timeout_s))
            if progress is not None:
                task.add_done_callback(lambda _: progress())
            tasks.append(task)
        # Bounded: whatever is still waiting for a slot or running gets one more timeout, then stops.
        done, pending = await asyncio.wait(tasks, timeout=spec.timeout_s) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        wall = time.perf_counter() - start
        outcomes = [t.result() if t in done and not t.cancelled() else RequestOutcome(False, "timeout") for t in tasks]
        return outcomes, wall, model


def _dist(values: list[float]) -> dict[str, float | None]:
    return {**distribution(values), "count": len(values)}  # the one definition, plus the sample size


def summarize(spec: LoadSpec, outcomes: list[RequestOutcome], wall_s: float, model: str) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            errors[o.error or "unknown"] = errors.get(o.error or "unknown", 0) + 1
    out_tokens = sum(o.output_tokens for o in ok)
    in_tokens = sum(o.prompt_tokens for o in ok)
    return {
        "url": spec.url, "model": model, "rate": spec.rate, "duration_s": spec.duration_s,
        "concurrency": spec.concurrency, "requests": len(outcomes), "completed": len(ok),
        "errors": dict(sorted(errors.items())), "wall_s": round(wall_s, 3),
        "request_throughput": len(ok) / wall_s if wall_s > 0 else None,
        "output_throughput_tok_s": out_tokens / wall_s if wall_s > 0 else None,
        "total_token_throughput_tok_s": (in_tokens + out_tokens) / wall_s if wall_s > 0 else None,
        "prompt_tokens": in_tokens, "output_tokens": out_tokens,
        "cached_tokens": sum(o.cached_tokens for o in ok),
        "ttft_s": _dist([o.ttft_s for o in ok if o.ttft_s is not None]),
        "tpot_s": _dist([o.tpot_s for o in ok if o.tpot_s is not None]),
        "itl_s": _dist([x for o in ok for x in o.itl_s]),
        "e2e_s": _dist([o.e2e_s for o in ok if o.e2e_s is not None]),
        "slot_wait_s": _dist([o.slot_wait_s for o in ok]),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def run(spec: LoadSpec, items: list[Item], progress: bool = False) -> dict[str, Any]:
    """Send ``items`` as ``spec`` says and return the report (see :func:`summarize`)."""
    check_loopback(spec.url)
    if not items:
        raise ConfigError("the workload is empty")
    total = len(items) if spec.num_requests is None else min(len(items), spec.num_requests)
    if not progress:
        outcomes, wall, model = asyncio.run(_drive(spec, items, None))
        return summarize(spec, outcomes, wall, model)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("requests", total=total)
        outcomes, wall, model = asyncio.run(_drive(spec, items, lambda: bar.advance(task)))
    return summarize(spec, outcomes, wall, model)


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:,.1f}"

    console = Console()
    rate = "trace times" if report["rate"] is None else f"{report['rate']:g}/s"
    errors = ", ".join(f"{k} {v}" for k, v in report["errors"].items()) or "none"
    console.print(f"{report['completed']} of {report['requests']} requests completed in {report['wall_s']:.1f} s "
                  f"against {report['url']} ({report['model']}); arrivals {rate}, concurrency "
                  f"{report['concurrency']}; errors: {errors}")
    thr = report["output_throughput_tok_s"]
    console.print(f"throughput: {report['request_throughput'] or 0:.2f} req/s, {thr or 0:,.1f} output tok/s; "
                  f"{report['prompt_tokens']:,} prompt tokens ({report['cached_tokens']:,} cached), "
                  f"{report['output_tokens']:,} output tokens; load average {report['load_average']}")
    table = Table("ms", "mean", "p50", "p90", "p99", "count")
    for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("end-to-end", "e2e_s"),
                      ("slot wait", "slot_wait_s")):
        d = report[key]
        table.add_row(name, ms(d["mean"]), ms(d["p50"]), ms(d["p90"]), ms(d["p99"]), str(d["count"]))
    console.print(table)


__all__ = ["Item", "LoadSpec", "check_loopback", "percentile", "print_table", "run", "summarize",
           "synthetic_workload", "to_vocab", "trace_workload"]
