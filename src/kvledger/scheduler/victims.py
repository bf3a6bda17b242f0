"""Victim policies: which running request gives its memory back when another one cannot grow.

A policy is a key function over one candidate (all branches of a request count as one); the victim is
the candidate with the smallest ``(key, -admission order)``, so every tie goes to the request admitted
last (it has had the least service). Policies are registered in :data:`VICTIM_POLICIES`.

``min_waste`` is InferCept's "memory x time wasted": ``held x replay`` where *held* is the distinct
blocks the request's branches hold and *replay* the tokens a recompute would run again -- per branch,
all of its tokens minus its leading full written blocks that other requests also hold (they stay cached
whatever happens to this request).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..core.registry import Registry
from .plan import Branch

if TYPE_CHECKING:
    from ..core.ledger import KVLedger

# (ledger, the candidate's live branches) -> key; the smallest key is the victim
VictimKey = Callable[["KVLedger", Sequence[Branch]], float]


def held_blocks(ledger: KVLedger, branches: Sequence[Branch]) -> int:
    """Distinct device blocks the branches hold."""
    if len(branches) == 1:  # a block appears once in a table
        return len(ledger.sequence(branches[0].seq_id).table.blocks)
    return len({b for br in branches for b in ledger.sequence(br.seq_id).table.blocks})


def replay_tokens(ledger: KVLedger, branches: Sequence[Branch]) -> int:
    """Tokens a recompute must run again: all of them, minus leading full written blocks other
    requests still hold (they stay in the prefix index whatever happens to this request)."""
    mine = len(branches)  # references this family itself holds on a shared block
    ref = ledger.pool.ref
    total = 0
    for br in branches:
        seq = ledger.sequence(br.seq_id)
        blocks, written = seq.table.blocks, seq.written_blocks
        kept = 0
        while kept < written and ref[blocks[kept]] > mine:
            kept += 1
        total += len(br.tokens) - kept * ledger.block_size
    return total


def waste(ledger: KVLedger, branches: Sequence[Branch]) -> int:
    """``min_waste``'s key, ``held_blocks x replay_tokens``; a lone branch in one pass over its table head."""
    if len(branches) != 1:
        return held_blocks(ledger, branches) * replay_tokens(ledger, branches)
    br = branches[0]
    seq = ledger.sequence(br.seq_id)
    blocks, written, ref = seq.table.blocks, seq.written_blocks, ledger.pool.ref
    kept = 0
    while kept < written and ref[blocks[kept]] > 1:
        kept += 1
    return len(blocks) * (len(br.tokens) - kept * ledger.block_size)


VICTIM_POLICIES: Registry[VictimKey] = Registry("victim policy")
VICTIM_POLICIES.register("latest", lambda ledger, branches: 0,
                         "the request admitted last")
VICTIM_POLICIES.register("priority", lambda ledger, branches: branches[0].request.priority,
                         "the lowest GenRequest.priority; the latest admitted among equals")
VICTIM_POLICIES.register("least_computed", lambda ledger, branches: sum(br.computed for br in branches),
                         "the fewest computed tokens over its branches")
VICTIM_POLICIES.register("min_waste", waste,
                         "the smallest held blocks x tokens a recompute replays (InferCept's waste)")


def pick_victim(policy: str, ledger: KVLedger, running: dict[str, list[Branch]]) -> str | None:
    """The request ``policy`` preempts among ``running`` (request id -> live branches, in admission
    order, as the scheduler keeps it)."""
    if not running:
        return None
    if policy == "latest":
        # Every key ties, so the latest admitted is the victim. The scheduler keeps ``running`` in
        # admission order (a re-admitted request is inserted again; Scheduler.check() verifies it).
        return next(reversed(running))
    key = VICTIM_POLICIES[policy]
    # The smallest (key, -admission order): in admission order, the last of the smallest keys.
    victim, best = None, None
    for rid, branches in running.items():
        k = key(ledger, branches)
        if best is None or k <= best:
            victim, best = rid, k
    return victim


class VictimQueue:
    """The victims of one growth pass, picked one after another without scoring every candidate again.

    While running requests only grow -- their branches append tokens and take blocks, their shared
    blocks lose holders as others are preempted -- no policy's key goes down: ``min_waste``'s held
    blocks and replay tokens only rise, priorities and computed tokens stay. So the keys are scored
    once into a heap, and a pick re-scores only the candidate at its top: if its key has not risen it is
    the smallest (every other key is at least what the heap holds), else it goes back with its new key.
    The result is exactly :func:`pick_victim`'s. Valid while no request joins ``running`` (within
    ``Scheduler._grow``)."""

    __slots__ = ("_heap", "_key", "_ledger", "_running")

    def __init__(self, policy: str, ledger: KVLedger, running: dict[str, list[Branch]]) -> None:
        key = self._key = VICTIM_POLICIES[policy]
        self._ledger, self._running = ledger, running
        self._heap = [(key(ledger, brs), -brs[0].admitted_order, rid) for rid, brs in running.items()]
        heapq.heapify(self._heap)

    def pick(self) -> str | None:
        heap, running, key, ledger = self._heap, self._running, self._key, self._ledger
        while heap:
            stored, order, rid = heap[0]
            branches = running.get(rid)
            if not branches:
                heapq.heappop(heap)  # preempted or finished since
                continue
            now = key(ledger, branches)
            if now <= stored:
                return rid
            heapq.heapreplace(heap, (now, order, rid))
        return None


__all__ = ["VICTIM_POLICIES", "VictimKey", "VictimQueue", "held_blocks", "pick_victim", "replay_tokens", "waste"]
