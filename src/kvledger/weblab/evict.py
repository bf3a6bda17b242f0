"""Eviction vs preemption, step by step, on ledger operations.

A small pool (12 blocks of 4 tokens) goes through one scripted story: a finished request leaves its prompt
as retained cache; new requests take free blocks first and then *evict* that idle cache (nothing running
loses anything, and the cache is recoverable by recomputing it); running requests grow under an
incremental reservation until one cannot, and a running request is *preempted* (`KVLedger.preempt`): it
stops, and must replay its tokens (or have swapped them out) to continue.

Every state shown is read from the `KVLedger` after a real call (`admit`, `append_token`, `release`,
`preempt`). The scheduler's own step loop is not driven here: its preemption decision is made by hand
(the newest request is the victim, as the scheduler's default ``latest`` victim policy chooses), and the
recovery costs come from the scheduler's cost model (`RecoveryCosts`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from ..core.identity import request_context
from ..core.ledger import KVLedger, Request
from ..errors import InvariantError, OutOfBlocksError
from ..scheduler.recovery import RecoveryCosts
from .poolmap import Admitted, pool_map

BLOCKS, BLOCK_SIZE = 12, 4
_TINT = {"A": 0, "B": 1, "C": 2, "D": 3}  # one colour per request, whoever holds its blocks
_CTX = request_context("group-0", "lab")


class EvictInput(BaseModel):
    """The story is fixed; the body is an empty JSON object (room for options later)."""

    model_config = ConfigDict(extra="forbid")


def _prompt(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


class _Story:
    def __init__(self) -> None:
        self.ledger = KVLedger(BLOCKS, BLOCK_SIZE)
        self.reserved: dict[str, int] = {}
        self.cache_of: dict[int, str] = {}  # retained block -> whose tokens it caches
        self.steps: list[dict[str, Any]] = []
        self.costs = RecoveryCosts(block_bytes=2 * 2**20)

    def admit(self, rid: str, prompt: list[int], max_new: int, reserve: int) -> str:
        d = self.ledger.admit(Request(rid, prompt, max_new, _CTX, reserve_new_tokens=reserve))
        if not d.admitted:
            raise InvariantError(f"the eviction story expected {rid} to be admitted: {d.reason}")
        self.reserved[rid] = reserve
        return d.reason

    def grow(self, rid: str, token: int) -> None:
        self.ledger.append_token(rid, token)

    def snapshot(self, title: str, what: str, events: list[str], marked: set[int] | None = None,
                 cost: str | None = None) -> None:
        ledger = self.ledger
        ledger.check()
        for b in list(self.cache_of):
            if b not in set(ledger.pool.retained.blocks()):
                del self.cache_of[b]
        m = pool_map(Admitted(ledger, self.reserved))
        cells = []
        for c in m["cells"]:
            owner, who = c["owner"], c["owner"].split(" ")[0]
            label = {"private": who, "promised": who.lower(), "shared": "S", "free": "\u00b7"}.get(c["state"], "")
            if c["state"] == "retained":
                who = self.cache_of.get(c["block"], "?")
                owner = f"cache of {who}'s tokens"
                label = f"R{who}"
            if marked and c["block"] in marked:
                label += "!"
            cells.append({"block": c["block"], "state": c["state"], "label": label, "tint": _TINT.get(who),
                          "title": f"block {c['block']}: {c['state']}, {owner}"
                                   + (" (changed in this step)" if marked and c["block"] in marked else "")})
        counts = ", ".join(f"{v} {k}" for k, v in m["counts"].items() if v)
        self.steps.append({"title": title, "what": what, "events": events, "cells": cells, "cost": cost,
                           "usage": m["usage"], "counts": m["counts"],
                           "map_text": f"{BLOCKS} blocks: {counts}"})

    def retained_now(self) -> set[int]:
        return set(self.ledger.pool.retained.blocks())


def evict_view(_inp: EvictInput | None = None) -> dict[str, Any]:
    s = _Story()
    ledger = s.ledger
    bs = BLOCK_SIZE

    # 1. A ran and finished: its written full blocks stay indexed as retained cache.
    a_prompt = _prompt(1_000, 16)
    s.admit("A", a_prompt, 4, 4)
    ledger.mark_computed("A", 16)
    for t in range(4):
        s.grow("A", 9_000 + t)
    a_blocks = list(ledger.sequence("A").table.blocks)
    ledger.release("A")
    for b in s.retained_now():
        s.cache_of[b] = "A"
    s.snapshot("A finished; its prompt stays cached",
               "Eviction only ever takes blocks like these: idle, written, indexed cache that no request holds.",
               [f"A held blocks {a_blocks}; on release its {len(s.retained_now())} full written blocks became "
                f"retained (evictable) cache, and its tail block, not yet written, went back to the free list"],
               marked=set(a_blocks))

    # 2. B and C arrive under an incremental reservation: the prompt plus the next token.
    reason_b = s.admit("B", _prompt(2_000, 12), 12, 1)
    reason_c = s.admit("C", _prompt(3_000, 12), 12, 1)
    ledger.mark_computed("B", 12)
    ledger.mark_computed("C", 12)
    free_before = ledger.usage().free
    s.snapshot("B and C arrive (incremental reservation)",
               "New blocks come from the free list first; the cache is untouched while free blocks remain.",
               [f"B admitted: {reason_b}", f"C admitted: {reason_c}",
                f"{free_before} blocks stay free; A's cache is still whole"],
               marked=set(ledger.sequence("B").table.blocks) | set(ledger.sequence("C").table.blocks))

    # 3. D arrives: the free list cannot cover it, so admission's allocation evicts A's cache.
    cached = s.retained_now()
    reason_d = s.admit("D", _prompt(4_000, 12), 12, 1)
    ledger.mark_computed("D", 12)
    evicted = sorted(cached - s.retained_now())
    s.snapshot("D arrives: eviction",
               "Eviction: idle cache is reused for a new request. No running request loses anything; the cost is "
               "a later cache miss, repaid by recomputing those tokens if A's prompt comes back.",
               [f"D admitted: {reason_d}",
                f"the free list ran out, so the allocator evicted {len(evicted)} of A's cached blocks "
                f"(deepest first: {evicted}) straight to D"],
               marked=set(evicted),
               cost=f"Recovery of an eviction: recompute {len(evicted) * bs} tokens if A's prompt returns "
                    f"(about {s.costs.recompute_s(len(evicted) * bs) * 1e3:.3f} ms with the scheduler's default "
                    f"cost model), and nothing if it never does.")

    # 4. Each running request writes its first output token: its promised block materialises.
    before = {rid: len(ledger.sequence(rid).table.blocks) for rid in ("B", "C", "D")}
    cached = s.retained_now()
    for i, rid in enumerate(("B", "C", "D")):
        s.grow(rid, 5_000 + i)
    grown = {rid: ledger.sequence(rid).table.blocks[-1] for rid in ("B", "C", "D")
             if len(ledger.sequence(rid).table.blocks) > before[rid]}
    evicted = sorted(cached - s.retained_now())
    s.snapshot("B, C and D start generating",
               "Their promised blocks become real blocks, again from free blocks first, then from cache.",
               [f"{rid} wrote its first output token into new block {b} (from its promise)" for rid, b in grown.items()]
               + ([f"{len(evicted)} more cached blocks evicted: {evicted}"] if evicted else []),
               marked=set(grown.values()) | set(evicted))

    # 5. B grows past its reservation: nothing free, nothing evictable, nothing promised to it.
    failed_at = None
    for t in range(bs):
        try:
            s.grow("B", 6_000 + t)
        except OutOfBlocksError as exc:
            failed_at = str(exc)
            break
    if failed_at is None:
        raise InvariantError("the eviction story expected B's growth to fail")
    u = ledger.usage()
    s.snapshot("B needs one more block: none is left",
               "Growth past a reservation takes only unpromised capacity. With no free or evictable block left, "
               "eviction cannot help: memory must come from a running request.",
               [f"B has {ledger.sequence('B').num_tokens} tokens and needs a new block: {failed_at}",
                f"{u.free} free, {u.evictable} evictable, {u.promised} promised: the scheduler must preempt"])

    # 6. Preempt the newest running request (D): its memory goes back to the pool.
    d_blocks = list(ledger.sequence("D").table.blocks)
    cached = s.retained_now()
    replay = ledger.preempt("D")
    for b in s.retained_now() - cached:
        s.cache_of[b] = "D"
    kept = sorted(s.retained_now() - cached)
    recompute = s.costs.recompute_s(len(replay))
    swap = s.costs.swap_s(len(d_blocks))
    s.snapshot("Preempt D (the newest request)",
               "Preemption: a running request stops and gives its blocks back. It is recoverable only by replaying "
               "its tokens (recompute) or by copying its blocks to host memory and back (swap).",
               [f"KVLedger.preempt('D') returned its {len(replay)} tokens: the state a recompute must replay",
                f"its {len(kept)} full written blocks {kept} stay as retained cache (a replay may hit them); "
                f"the rest went to the free list"],
               marked=set(d_blocks),
               cost=f"Recovery of a preemption: recompute {len(replay)} tokens (about {recompute * 1e3:.3f} ms) or "
                    f"swap {len(d_blocks)} blocks out and back (about {swap * 1e3:.3f} ms), with the scheduler's "
                    f"default cost model; D makes no progress until then.")

    # 7. B grows again; D comes back and finds part of its own prefix still cached.
    s.grow("B", 7_000)
    b_new = ledger.sequence("B").table.blocks[-1]
    back = ledger.can_admit(Request("D", replay, 12 - (len(replay) - 12), _CTX, reserve_new_tokens=1))
    s.snapshot("B grows; D waits to come back",
               "The freed block lets B continue. D re-enters admission with its replay: its own cached blocks "
               "are prefix hits, so only the rest must be recomputed.",
               [f"B took block {b_new} for its next token",
                f"D asking again now: {back.outcome.value} -- {back.reason}; {back.blocks_hit} of its "
                f"{-(-len(replay) // bs)} blocks would be cache hits"],
               marked={b_new})
    intro = [
        "Eviction and preemption both free blocks, but they take them from different owners. Eviction takes "
        "retained cache that no request holds: nothing running is affected, and the evicted state is "
        "recoverable by recomputing it if it is ever needed again. Preemption takes blocks from a running "
        "request: it stops, and its state must be replayed (recompute) or restored from a host copy (swap).",
        f"The pool has {BLOCKS} blocks of {bs} tokens. Requests reserve their prompt and the next token "
        "(incremental), so growth can run out. Each cell names its owner: B is a block B holds, b a block "
        "promised to B, RA a retained block caching A's tokens, \u00b7 a free block; a ! marks blocks that "
        "changed in that step.",
    ]
    return {"intro": intro, "steps": s.steps, "engine": "ledger operations (KVLedger.admit, append_token, "
            "release, preempt); the victim is chosen by hand, as the scheduler's default 'latest' policy would"}
