"""Fragmentation measured, not simulated: one variable-length workload, three ways to hold its KV.

Every way holds real tensors with the model's exact per-token KV bytes, writes every token's KV when the
token exists, and allocates (and frees) each step's activation workspace through the framework's allocator,
so KV allocations interleave with transients as they do in an engine. The model's forward pass itself is not
run: what it computes does not change what is allocated. The allocator and the process are read after every
step (glibc ``mallinfo2`` / CUDA ``memory_stats``, the resident set).

* ``paged`` -- one preallocated pool tensor addressed by a real :class:`~kvledger.core.ledger.KVLedger`
  (full reservation: blocks for the prompt and the whole output allowance promised at admission);
* ``grow`` -- per request, per layer, K and V tensors that grow by one token per step through
  ``torch.cat``, as Hugging Face's dynamic cache does: exact sizes, allocator churn;
* ``max`` -- per request one contiguous tensor sized for its declared maximum (prompt + output allowance),
  placed first-fit in a fixed arena of the pool's size (a device has no virtual memory to grow into).

A request's admission step writes its prompt and its first sampled token (a prefill samples one); every later step
adds one token; it finishes with ``output`` tokens. The same admission rule holds everywhere: a request is
admitted, in arrival order, when its declared maximum fits the capacity (``paged``: whole blocks; ``grow``: the
byte budget; ``max``: a contiguous hole). Requests stop before their allowance (``output < max_new``), as real
ones do. The seed's three forms of unusable capacity come out as separate rows: **tail slack** (the charged,
unwritten slots of each sequence's last block), **contiguous-hole failures** (a request refused although the
arena's total free bytes would hold it) and **allocator fragmentation** (bytes the framework's allocator holds
but has not handed out).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ....core import KVLedger, KVSpec, Request
from ....core.identity import request_context
from ....core.sizing.contiguous import FirstFit
from ....errors import ConfigError
from .providers import Providers

WAYS = ("paged", "grow", "max")


@dataclass(frozen=True, slots=True)
class FragRequest:
    rid: str
    prompt: int
    max_new: int  # the declared output allowance (what the seed's policy reserves)
    output: int  # tokens it really generates (<= max_new)


def variable_workload(n: int = 40, *, seed: int = 0, max_prompt: int = 512, max_new: int = 256) -> list[FragRequest]:
    """``n`` requests: prompts log-uniform in [16, max_prompt], allowances uniform in [16, max_new], and
    outputs that stop somewhere in the allowance (uniform)."""
    if n < 1 or max_prompt < 16 or max_new < 16:
        raise ConfigError("a fragmentation workload needs n >= 1, max_prompt >= 16 and max_new >= 16")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = int(round(16 * (max_prompt / 16) ** rng.random()))
        allowance = rng.randint(16, max_new)
        out.append(FragRequest(f"f{i}", prompt, allowance, rng.randint(1, allowance)))
    return out


@dataclass(slots=True)
class WayResult:
    """One way's measurements (bytes averaged over the steps that had requests, unless *_max or *_end)."""

    way: str
    steps: int = 0
    finished: int = 0
    peak_running: int = 0
    token_state_bytes: float = 0.0  # KV of tokens that exist
    held_bytes: float = 0.0  # what the way holds for KV (blocks in use, tensors, arena ranges)
    tail_slack_bytes: float = 0.0  # paged: charged, unwritten slots of last blocks
    reserved_unused_bytes: float = 0.0  # max: ranges reserved for tokens that do not exist (yet or ever)
    promised_bytes: float = 0.0  # paged: capacity promised, not materialised (no memory)
    hole_failures: int = 0  # max: admissions refused although the free total would hold them
    hole_failure_free_bytes: float = 0.0  # ... and the arena's free bytes at those moments (mean)
    arena_free_bytes: float = 0.0  # max: the arena's free bytes (holes)
    allocator_cache_max: int = 0  # framework allocator: reserved - allocated above the start, largest
    allocator_cache_end: int = 0
    allocator_reserved_max: int = 0  # framework allocator: reserved above the start, largest
    process_bytes_max: int = 0  # resident set (or device used) above the start, largest
    process_bytes_end: int = 0
    wall_s: float = 0.0
    series: list[dict[str, int]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 1) if isinstance(v, float) else v) for k in self.__slots__  # type: ignore[attr-defined]
                if k != "series" for v in [getattr(self, k)]}


@dataclass(slots=True)
class _Live:
    req: FragRequest
    tokens: int
    kv: Any = None  # grow: [layers][2] tensors; max: (offset, view)


def _workspace_bytes(cfg: dict[str, Any], tokens: int, seqs: int, act_bytes: int) -> int:
    """The step's activations as the runtime lays them out: (4 I + H) per token (gate and up, their
    product, the MLP output) in the compute dtype, plus fp32 logits per sequence."""
    from ....core.sizing.geometry import text_config

    c = text_config(cfg)
    return tokens * (4 * int(c["intermediate_size"]) + int(c["hidden_size"])) * act_bytes \
        + seqs * int(c["vocab_size"]) * 4


def run_way(way: str, requests: Sequence[FragRequest], spec: KVSpec, capacity_bytes: int, *,
            hf_config: dict[str, Any], device: str = "cpu", providers: Providers | None = None,
            max_steps: int = 100_000) -> WayResult:
    """Run the workload one way and measure it (see the module docstring)."""
    if way not in WAYS:
        raise ConfigError(f"way must be one of {', '.join(WAYS)}, got {way!r}")
    from ...kv_store import KVStore, torch_dtype

    dev = torch.device(device)
    providers = providers or Providers.for_device(dev)
    dtype = torch_dtype(spec.kv_dtype)
    act_bytes = torch.empty((), dtype=dtype).element_size()
    bpt = spec.bytes_per_token
    layers, heads, dim = spec.layers, spec.kv_heads_per_rank, spec.head_dim
    res = WayResult(way)
    queue = deque(requests)
    running: dict[str, _Live] = {}
    a0, d0 = providers.allocator.read(), providers.device.read()
    t0 = time.perf_counter()
    sums: dict[str, float] = {k: 0.0 for k in ("tok", "held", "slack", "unused", "promised", "arena")}
    hole_free: list[int] = []
    budget_used = 0
    store = ledger = arena = fit = None
    if way == "paged":
        blocks = capacity_bytes // spec.block_bytes
        store = KVStore(spec, blocks, dev)
        ledger = KVLedger(blocks, spec.block_size)
        flat = store.kv.view(layers, 2, blocks * spec.block_size, heads, dim)
    elif way == "max":
        arena = torch.zeros(capacity_bytes, dtype=torch.uint8, device=dev)
        fit = FirstFit(capacity_bytes)
    token_value = torch.ones(layers, 2, heads, dim, dtype=dtype, device=dev)
    ctx = request_context("frag", "frag")
    next_token = 100
    while (queue or running) and res.steps < max_steps:
        # ---- admission, in arrival order, stopping at the first refusal ------------------------------
        admitted: list[_Live] = []
        while queue:
            r = queue[0]
            need = r.prompt + r.max_new
            if way == "paged":
                assert ledger is not None
                toks = list(range(next_token, next_token + r.prompt))
                if not ledger.admit(Request(r.rid, toks, r.max_new, ctx)).admitted:
                    break
                next_token += r.prompt
                ledger.append_token(r.rid, next_token)  # the prefill step samples the first token
                next_token += 1
                live = _Live(r, r.prompt + 1)
            elif way == "grow":
                if budget_used + need * bpt > capacity_bytes:
                    break
                budget_used += need * bpt
                live = _Live(r, r.prompt + 1, [[torch.ones(heads, r.prompt + 1, dim, dtype=dtype, device=dev)
                                            for _ in range(2)] for _ in range(layers)])
            else:
                assert fit is not None and arena is not None
                size = need * bpt
                start = fit.allocate(size)
                if start is None:
                    if fit.free_total >= size:
                        res.hole_failures += 1
                        hole_free.append(fit.free_total)
                    break
                view = arena[start:start + size].view(need, bpt)
                view[: r.prompt + 1] = 1
                live = _Live(r, r.prompt + 1, (start, view))
            queue.popleft()
            running[r.rid] = live
            admitted.append(live)
        if not running:
            break
        res.peak_running = max(res.peak_running, len(running))
        # ---- the step: workspace transient, one token for every request admitted before ----------------
        decoding = [lv for lv in running.values() if lv not in admitted]
        tokens = sum(lv.req.prompt for lv in admitted) + len(decoding)
        workspace = torch.empty(_workspace_bytes(hf_config, tokens, len(running), act_bytes) // act_bytes,
                                dtype=dtype, device=dev)
        workspace.fill_(0)
        if way == "paged":
            assert ledger is not None and store is not None
            slots = []
            for lv in admitted:
                slots.extend(ledger.sequence(lv.req.rid).table.slot_mapping(0, lv.req.prompt + 1))
            for lv in decoding:
                ledger.append_token(lv.req.rid, next_token)
                next_token += 1
                lv.tokens += 1
                slots.extend(ledger.sequence(lv.req.rid).table.slot_mapping(lv.tokens - 1, lv.tokens))
            if slots:
                flat[:, :, torch.tensor(slots, device=dev)] = token_value[:, :, None]
        for lv in decoding if way != "paged" else ():
            if way == "grow":
                for layer in lv.kv:
                    for j in (0, 1):
                        layer[j] = torch.cat([layer[j], token_value[0, j][:, None, :]], dim=1)
            else:
                lv.kv[1][lv.tokens] = 1
            lv.tokens += 1
        del workspace
        res.steps += 1
        # ---- what is held now -------------------------------------------------------------------------
        tok = sum(lv.tokens for lv in running.values()) * bpt
        sums["tok"] += tok
        if way == "paged":
            assert ledger is not None
            u, tu = ledger.usage(), ledger.token_usage()
            sums["held"] += (u.active) * spec.block_bytes
            sums["slack"] += tu["tail_slack_slots"] * bpt
            sums["promised"] += u.promised * spec.block_bytes
        elif way == "grow":
            sums["held"] += sum(t.nbytes for lv in running.values() for layer in lv.kv for t in layer)
        else:
            assert fit is not None
            held = sum((lv.req.prompt + lv.req.max_new) * bpt for lv in running.values())
            sums["held"] += held
            sums["unused"] += held - tok
            sums["arena"] += fit.free_total
        a, d = providers.allocator.read(), providers.device.read()
        cache = (a.reserved - a.allocated) - (a0.reserved - a0.allocated)
        res.allocator_cache_max = max(res.allocator_cache_max, cache)
        res.allocator_reserved_max = max(res.allocator_reserved_max, a.reserved - a0.reserved)
        res.process_bytes_max = max(res.process_bytes_max, d.used - d0.used)
        res.series.append({"step": res.steps, "running": len(running), "token_state_bytes": tok,
                           "allocator_cache": cache, "process_bytes": d.used - d0.used})
        # ---- finished requests give their memory back ---------------------------------------------------
        for rid in [rid for rid, lv in running.items() if lv.tokens >= lv.req.prompt + lv.req.output]:
            lv = running.pop(rid)
            res.finished += 1
            need = lv.req.prompt + lv.req.max_new
            if way == "paged":
                assert ledger is not None
                ledger.release(rid)
            elif way == "grow":
                budget_used -= need * bpt
                lv.kv = None
            else:
                assert fit is not None
                fit.free(lv.kv[0], need * bpt)
                lv.kv = None
    n = max(1, res.steps)
    res.token_state_bytes = sums["tok"] / n
    res.held_bytes = sums["held"] / n
    res.tail_slack_bytes = sums["slack"] / n
    res.reserved_unused_bytes = sums["unused"] / n
    res.promised_bytes = sums["promised"] / n
    res.arena_free_bytes = sums["arena"] / n
    res.hole_failure_free_bytes = sum(hole_free) / len(hole_free) if hole_free else 0.0
    a, d = providers.allocator.read(), providers.device.read()
    res.allocator_cache_end = (a.reserved - a.allocated) - (a0.reserved - a0.allocated)
    res.process_bytes_end = d.used - d0.used
    res.wall_s = time.perf_counter() - t0
    if queue:
        raise ConfigError(f"{way}: {len(queue)} requests never fit the capacity (a request larger than the pool?)")
    return res


def table_rows(results: Sequence[WayResult]) -> list[tuple[str, list[str]]]:
    """The comparison table: one row per measurement, one column per way (formatted)."""
    from ....units import format_bytes

    def b(x: float) -> str:
        return format_bytes(int(x))

    by = {r.way: r for r in results}
    ways = [w for w in WAYS if w in by]

    def row(name: str, fn: Any) -> tuple[str, list[str]]:
        return name, [fn(by[w]) for w in ways]

    return [
        row("steps to finish the workload", lambda r: str(r.steps)),
        row("peak requests running", lambda r: str(r.peak_running)),
        row("token-state bytes (mean)", lambda r: b(r.token_state_bytes)),
        row("bytes held for KV (mean)", lambda r: b(r.held_bytes)),
        row("token states / held", lambda r: f"{r.token_state_bytes / r.held_bytes:.1%}" if r.held_bytes else "-"),
        row("(1) tail slack: last-block slots unwritten (mean)",
            lambda r: b(r.tail_slack_bytes) if r.way == "paged" else "0 B (exact sizes)" if r.way == "grow" else "-"),
        row("reserved for tokens not there (mean)",
            lambda r: b(r.reserved_unused_bytes) if r.way == "max" else "-"),
        row("promised capacity, no memory (mean)", lambda r: b(r.promised_bytes) if r.way == "paged" else "-"),
        row("(2) contiguous-hole failures", lambda r: str(r.hole_failures) if r.way == "max"
            else "0 (any free block fits)" if r.way == "paged" else "n/a (the allocator grows instead)"),
        row("    arena free at those failures (mean)",
            lambda r: b(r.hole_failure_free_bytes) if r.way == "max" else "-"),
        row("(3) allocator fragmentation: reserved - allocated, largest", lambda r: b(r.allocator_cache_max)),
        row("    ... at the end", lambda r: b(r.allocator_cache_end)),
        row("allocator reserved above start, largest", lambda r: b(r.allocator_reserved_max)),
        row("process / device bytes above start, largest", lambda r: b(r.process_bytes_max)),
        row("    ... at the end", lambda r: b(r.process_bytes_end)),
    ]


__all__ = ["WAYS", "FirstFit", "FragRequest", "WayResult", "run_way", "table_rows", "variable_workload"]
