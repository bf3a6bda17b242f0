"""Small step-by-step views on the real ledger: forks with a copy-on-write tail, and tail slack against
contiguous holes. Each runs real core operations and returns snapshots of what the ledger holds.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..core.ledger import KVLedger, Request
from ..core.sizing.contiguous import FirstFit
from ..errors import ConfigError

_PROMPT_BASE = 1_000
_BRANCH_BASE = 100_000


def _int(lo: int, hi: int) -> Any:
    return Annotated[int, Field(strict=True, ge=lo, le=hi)]


def _blocks(ledger: KVLedger, rid: str) -> list[dict[str, Any]]:
    seq = ledger.sequence(rid)
    bs, n = ledger.block_size, seq.num_tokens
    return [{"block": b, "ref": ledger.pool.ref[b], "used": min(bs, n - i * bs)}
            for i, b in enumerate(seq.table.blocks)]


def _snapshot(ledger: KVLedger, title: str, events: list[str]) -> dict[str, Any]:
    usage = ledger.usage()
    seqs = []
    for rid in ledger.sequences():
        seq = ledger.sequence(rid)
        seqs.append({"id": rid, "tokens": seq.num_tokens, "generated": seq.num_generated,
                     "blocks": _blocks(ledger, rid), "promised": seq.promised})
    copy_promises = usage.promised - sum(s["promised"] for s in seqs)
    ledger.check()
    return {"title": title, "events": events, "sequences": seqs, "usage": usage.as_dict(),
            "copy_promises": copy_promises}


# ---- forks and copy-on-write -------------------------------------------------------------------------------
class ForkInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: _int(1, 512) = 40  # type: ignore[valid-type]
    block_size: _int(1, 64) = 16  # type: ignore[valid-type]
    branches: _int(2, 8) = 3  # type: ignore[valid-type]
    tokens: _int(1, 64) = 10  # type: ignore[valid-type]
    max_new: _int(1, 256) | None = None  # type: ignore[valid-type]  # default: exactly `tokens`
    pool_blocks: _int(1, 512) = 64  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _fits(self) -> ForkInput:
        if self.max_new is None:
            self.max_new = self.tokens
        if self.tokens > self.max_new:
            raise ValueError(f"tokens ({self.tokens}) cannot exceed the output allowance max_new ({self.max_new})")
        return self


def fork_view(inp: ForkInput) -> dict[str, Any]:
    """Admit one request as ``branches`` parallel samples, let every branch generate ``tokens`` tokens one
    round at a time, then release the last branch (a pruned sample). A snapshot after every round."""
    ledger = KVLedger(inp.pool_blocks, inp.block_size)
    prompt = list(range(_PROMPT_BASE, _PROMPT_BASE + inp.prompt))
    decision = ledger.admit(Request("r", prompt, inp.max_new or inp.tokens, branches=inp.branches))
    steps: list[dict[str, Any]] = []
    if not decision.admitted:
        return {"decision": {"outcome": decision.outcome.value, "reason": decision.reason}, "steps": steps}
    bs = inp.block_size
    tail = inp.prompt % bs
    ids = ledger.sequences()
    first = [f"admitted as {inp.branches} branches: {decision.reason}"]
    if tail:
        first.append(f"the prompt's last block holds {tail} of {bs} tokens and is shared by all {inp.branches} "
                     f"branches; {inp.branches - 1} copy-on-write copies are promised for it")
    else:
        first.append("the prompt ends on a block boundary: every prompt block is full, immutable and shared; "
                     "no copy is needed")
    steps.append(_snapshot(ledger, "Admitted: every branch holds the same prompt blocks", first))
    for t in range(inp.tokens):
        events = []
        for i, rid in enumerate(ids):
            before = len(ledger.sequence(rid).table.blocks)
            copies = ledger.append_token(rid, _BRANCH_BASE + i * 1_000 + t)
            for op in copies:
                events.append(f"{rid} writes into the shared tail: block {op.src} is copied to block {op.dst} "
                              f"({op.slots} slots) first")
            if not copies and len(ledger.sequence(rid).table.blocks) > before:
                events.append(f"{rid} starts a new private block {ledger.sequence(rid).table.blocks[-1]} "
                              f"(from its promise)")
        if t == 0 and tail and not events:
            events.append("every branch writes in place")
        steps.append(_snapshot(ledger, f"Round {t + 1}: each branch generates one token",
                               events or ["every branch appends inside its own tail block"]))
    pruned = ids[-1]
    held = [b["block"] for b in _blocks(ledger, pruned)]
    ledger.release(pruned)
    pool = ledger.pool
    freed = [b for b in held if pool.ref[b] == 0 and b in pool.free_blocks()]
    retained = [b for b in held if pool.ref[b] == 0 and b not in freed]
    kept = [b for b in held if pool.ref[b] > 0]
    steps.append(_snapshot(ledger, f"Release the pruned branch {pruned}", [
        f"{pruned} gives back {len(held)} block references: {len(kept)} blocks stay (other branches hold them), "
        f"{len(retained)} written full blocks stay cached (retained), {len(freed)} go to the free list",
        f"its {ledger.usage().as_dict()['promised']} remaining promises in the pool belong to the other branches"]))
    return {"decision": {"outcome": decision.outcome.value, "reason": decision.reason}, "steps": steps}


# ---- tail slack against contiguous holes -------------------------------------------------------------------
class FragmentInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    capacity_tokens: _int(1, 4096) = 160  # type: ignore[valid-type]
    block_size: _int(1, 256) = 16  # type: ignore[valid-type]
    lengths: Annotated[list[_int(1, 4096)], Field(min_length=1, max_length=16)] = [40, 30, 40]  # type: ignore[valid-type]
    finish: Annotated[list[_int(0, 15)], Field(max_length=16)] = [1]  # type: ignore[valid-type]
    new_length: _int(1, 4096) = 60  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _indices(self) -> FragmentInput:
        bad = [i for i in self.finish if i >= len(self.lengths)]
        if bad:
            raise ValueError(f"finish names request {bad[0]}, but there are only {len(self.lengths)} requests "
                             f"(0..{len(self.lengths) - 1})")
        return self


def _name(i: int) -> str:
    return chr(ord("A") + i)


def fragment_view(inp: FragmentInput) -> dict[str, Any]:
    """The same requests in one contiguous address space (first fit, each exactly its length) and in the
    paged ledger (whole blocks); some finish; then one more request arrives."""
    if inp.capacity_tokens < inp.block_size:
        raise ConfigError(f"capacity {inp.capacity_tokens} tokens holds no block of {inp.block_size}")
    finishing = sorted(set(inp.finish))
    new = len(inp.lengths)
    # Contiguous: first fit over [0, capacity).
    alloc = FirstFit(inp.capacity_tokens)
    ranges: dict[int, tuple[int, int]] = {}
    notes = []
    for i, n in enumerate(inp.lengths):
        start = alloc.allocate(n)
        if start is None:
            notes.append(f"{_name(i)} ({n} tokens) does not fit: largest hole {alloc.largest_hole()}")
        else:
            ranges[i] = (start, n)
    for i in finishing:
        if i in ranges:
            alloc.free(*ranges.pop(i))
    free_total, largest = alloc.free_total, alloc.largest_hole()
    start = alloc.allocate(inp.new_length)
    if start is not None:
        ranges[new] = (start, inp.new_length)
        c_outcome, c_reason = "admitted", f"placed at slot {start} (first fit)"
    elif free_total >= inp.new_length:
        c_outcome = "hole_failure"
        c_reason = (f"{free_total} slots are free in all, but the largest contiguous hole is {largest}: "
                    f"a contiguous-hole failure")
    else:
        c_outcome, c_reason = "not_now", f"only {free_total} slots are free"
    segments = [{"start": s, "size": size, "owner": _name(i)} for i, (s, size) in ranges.items()]
    segments += [{"start": s, "size": size, "owner": None} for s, size in alloc.holes]
    segments.sort(key=lambda seg: seg["start"])
    # Paged: the real ledger, each request holding exactly its length (no output to promise).
    num_blocks = inp.capacity_tokens // inp.block_size
    ledger = KVLedger(num_blocks, inp.block_size, prefix_caching=False)
    base = 0
    paged_notes = []

    def admit(i: int, n: int) -> Any:
        nonlocal base
        d = ledger.admit(Request(_name(i), range(base, base + n), 0))
        base += n
        return d

    for i, n in enumerate(inp.lengths):
        d = admit(i, n)
        if not d.admitted:
            paged_notes.append(f"{_name(i)} ({n} tokens) {d.outcome.value}: {d.reason}")
    for i in finishing:
        if _name(i) in ledger:
            ledger.release(_name(i))
    d = admit(new, inp.new_length)
    owners = {}
    slack = {}
    for rid in ledger.sequences():
        seq = ledger.sequence(rid)
        for b in seq.table.blocks:
            owners[b] = rid
        slack[rid] = seq.table.tail_slack(seq.num_tokens)
    cells = [{"block": b, "owner": owners.get(b), "slack": slack[owners[b]] if owners.get(b) and
              b == ledger.sequence(owners[b]).table.blocks[-1] else 0} for b in range(num_blocks)]
    ledger.check()
    tu = ledger.token_usage()
    return {
        "names": [_name(i) for i in range(len(inp.lengths) + 1)],
        "finished": [_name(i) for i in finishing],
        "new": {"name": _name(new), "length": inp.new_length},
        "contiguous": {"capacity": inp.capacity_tokens, "segments": segments, "free_total": free_total,
                       "largest_hole": largest, "outcome": c_outcome, "reason": c_reason, "notes": notes},
        "paged": {"blocks": num_blocks, "block_size": inp.block_size, "cells": cells,
                  "unused_capacity": inp.capacity_tokens - num_blocks * inp.block_size,
                  "tail_slack": slack, "tail_slack_total": tu["tail_slack_slots"],
                  "outcome": d.outcome.value, "reason": d.reason, "notes": paged_notes,
                  "usage": ledger.usage().as_dict()},
    }
