"""The block map: one cell per physical block of the lab's pool, read from a real ledger.

The lab (`kvledger.lab.run_lab`) reports numbers; `replay` repeats its admissions into a fresh `KVLedger`
(the lab's requests, in arrival order, each reserving what the lab's decision reserved) and reads every
block's state and owners back. It checks that its decisions and pool usage equal the lab's, so the
picture and the numbers cannot drift apart.

A promise is a claim on capacity, not a block: the map shows promises on the free blocks the free list
hands out next (in that order), which is where they would materialise if nothing else allocated first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.ledger import KVLedger, Request
from ..errors import InvariantError
from ..lab import LabSpec, lab_requests

MAX_DRAWN_BLOCKS = 4096  # larger pools get counts, not cells

# Cell states, in legend order; the letter is the cell's visible text label.
STATES = {
    "shared": ("S", "shared prefix (held by more than one request)"),
    "private": ("P", "private live block (one request)"),
    "promised": ("p", "promised: a claim on a free block for output not written yet"),
    "retained": ("R", "retained: idle cached block, evictable"),
    "free": ("\u00b7", "free"),
}


@dataclass(slots=True)
class Admitted:
    ledger: KVLedger
    reserved: dict[str, int]  # request id (and branch ids) -> output tokens reserved at admission


def replay(spec: LabSpec, lab: dict[str, Any]) -> Admitted:
    """Admit, in arrival order, the requests the lab admitted, each reserving what the lab's decision
    reserved (its ``blocks_total``), into a fresh pool; then check the pool matches the lab's usage.

    Requests the lab refused are skipped: a refused admission changes nothing, so the pool ends exactly as
    the lab's did, whatever the policy (its reservation rule and watermark are the scheduler's business)."""
    ledger = KVLedger(spec.pool_blocks, spec.block_size, prefix_caching=spec.prefix_caching)
    decided = {d["request"]: d for d in lab["decisions"]}
    reserved: dict[str, int] = {}
    for r in lab_requests(spec):
        d = decided[r.request_id]
        if d["outcome"] != "admitted":
            continue
        reserve = min(r.max_new_tokens, d["blocks_total"] * spec.block_size - len(r.prompt))
        mine = ledger.admit(Request(r.request_id, r.prompt, r.max_new_tokens, r.context,
                                    reserve_new_tokens=reserve, branches=r.branches))
        got = (mine.outcome.value, mine.blocks_hit, mine.blocks_new, mine.blocks_promised)
        if got != ("admitted", d["blocks_shared"], d["blocks_new"], d["blocks_promised"]):
            raise InvariantError(f"the block map's ledger disagrees with the lab's decision for {r.request_id}")
        for rid in ledger.sequences():
            reserved.setdefault(rid, reserve)
    ledger.check()
    if ledger.usage().as_dict() != lab["usage"]:
        raise InvariantError("the block map's ledger disagrees with the lab's pool usage")
    return Admitted(ledger, reserved)


def admitted_in_full(spec: LabSpec) -> int:
    """How many of the lab's requests the ledger admits reserving their whole output allowance (the
    ledger's default, the seed's policy): admission only, no growth run."""
    ledger = KVLedger(spec.pool_blocks, spec.block_size, prefix_caching=spec.prefix_caching)
    return sum(ledger.admit(r).admitted for r in lab_requests(spec))


def _owner_text(holders: list[str], groups: dict[str, str]) -> str:
    if len(holders) == 1:
        return f"{holders[0]} ({groups[holders[0]]})"
    owning = sorted({groups[h] for h in holders})
    return f"{len(holders)} requests of {', '.join(owning)}"


def pool_map(admitted: Admitted) -> dict[str, Any]:
    """Every block of the pool with its state, owners and tail slack, plus the legend with counts."""
    ledger = admitted.ledger
    pool, bs = ledger.pool, ledger.block_size
    n = pool.num_blocks
    holders: list[list[str]] = [[] for _ in range(n)]
    group_of: dict[str, str] = {}
    slack_at: dict[int, tuple[str, int, bool]] = {}  # block -> (request, unused slots, live now)
    for rid in ledger.sequences():
        seq = ledger.sequence(rid)
        group_of[rid] = seq.context.trust_group
        for b in seq.table.blocks:
            holders[b].append(rid)
        live_slack = seq.table.tail_slack(seq.num_tokens)
        if live_slack and not seq.promised:
            slack_at[seq.table.blocks[-1]] = (rid, live_slack, True)
    retained = set(pool.retained.blocks())
    free_next = pool.free_blocks()[::-1]  # the order the free list hands blocks out
    promise_owner: dict[int, str] = {}
    cursor = 0
    for rid in ledger.sequences():
        seq = ledger.sequence(rid)
        mine = free_next[cursor: cursor + seq.promised]
        cursor += len(mine)
        for b in mine:
            promise_owner[b] = rid
        if mine:
            reserved = seq.num_prompt + admitted.reserved[rid]
            final_slack = -(-reserved // bs) * bs - reserved
            if final_slack:
                slack_at[mine[-1]] = (rid, final_slack, False)
    copy_promises = ledger.usage().promised - sum(ledger.sequence(r).promised for r in ledger.sequences())
    for b in free_next[cursor: cursor + copy_promises]:
        promise_owner[b] = ""  # a copy-on-write copy of a shared partial tail, owned by whichever branch writes
    families: dict[str, int] = {}
    groups: dict[str, int] = {}
    request_tint: dict[str, int] = {}
    for rid in ledger.sequences():  # admission order; branches take their request's colour
        family = ledger.sequence(rid).family
        request_tint[rid] = families.setdefault(family, len(families))
        groups.setdefault(group_of[rid], len(groups))
    cells = []
    counts = dict.fromkeys(STATES, 0)
    for b in range(n):
        tint = None  # which owner's colour: the request (private, promised) or the trust group (shared)
        if holders[b]:
            state = "shared" if len(holders[b]) > 1 else "private"
            owner = _owner_text(holders[b], group_of)
            group = group_of[holders[b][0]]
            tint = groups[group] if state == "shared" else request_tint[holders[b][0]]
        elif b in promise_owner:
            state = "promised"
            rid = promise_owner[b]
            owner = f"{rid} ({group_of[rid]})" if rid else "a branch's copy-on-write tail copy"
            group = group_of[rid] if rid else None
            tint = request_tint[rid] if rid else None
        elif b in retained:
            state, owner, group = "retained", "cache", pool.group[b]
        else:
            state, owner, group = "free", "nobody", None
        counts[state] += 1
        cell: dict[str, Any] = {"block": b, "state": state, "label": STATES[state][0], "owner": owner,
                                "group": group, "tint": tint}
        if b in slack_at:
            rid, slots, live = slack_at[b]
            cell["slack"] = slots
            cell["slack_note"] = (f"tail slack: {slots} of {bs} slots unused now" if live else
                                  f"tail slack: at its full reservation {rid}'s last block leaves {slots} of "
                                  f"{bs} slots unused")
        cells.append(cell)
    if counts["shared"] + counts["private"] != pool.num_active:  # leased-only blocks never occur here
        raise InvariantError("block map: active blocks without a holder")
    usage = ledger.usage()
    return {
        "pool_blocks": n,
        "block_size": bs,
        "drawn": n <= MAX_DRAWN_BLOCKS,
        "cells": cells if n <= MAX_DRAWN_BLOCKS else [],
        "counts": counts,
        "legend": [{"state": s, "label": letter, "text": text, "count": counts[s]}
                   for s, (letter, text) in STATES.items()],
        "usage": usage.as_dict(),
        "token_usage": ledger.token_usage(),
        "promise_note": "Promises hold no block id: they are shown on the free blocks handed out next.",
    }
