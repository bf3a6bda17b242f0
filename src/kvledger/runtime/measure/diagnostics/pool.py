"""The pool ledger in bytes: the KV ledger's blocks by state, per tier and per trust group, and the
blocks nobody live owns.

States (``core/pool.py``): free, active, retained; within active, blocks held by live sequences, by pins,
and *deferred* ones (released, still leased). Promises are a separate ledger (claims on free or evictable
capacity, no block id). Bytes are blocks x ``block_bytes``; a block shared by several sequences counts once.

A *logical leak* is capacity held for nobody: a ledger sequence the scheduler does not run (it holds
blocks and promises until someone releases it, and ``KVLedger.check()`` cannot know it is unwanted), or a
lease outstanding at a step boundary that no step in flight owns (its deferred blocks never come back).
This module lists the candidates at one sample; the reconciler follows them over samples (age) before it
names a leak.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ....core.ledger import KVLedger


@dataclass(frozen=True, slots=True)
class Orphan:
    """Capacity held for no live owner at one sample."""

    kind: str  # "sequence" (in the ledger, unknown to the scheduler) or "lease" (no step in flight owns it)
    ident: str  # the sequence id, or "lease <id>"
    owner: str  # the request/family of a sequence, the lease's owner name
    trust_group: str
    blocks: tuple[int, ...]  # blocks only orphans hold (shared with a live sequence: not counted)
    promised: int = 0  # promised blocks the orphan still holds

    def as_dict(self, block_bytes: int) -> dict[str, Any]:
        return {"kind": self.kind, "id": self.ident, "owner": self.owner, "trust_group": self.trust_group,
                "blocks": len(self.blocks), "bytes": len(self.blocks) * block_bytes, "promised_blocks": self.promised}


@dataclass(slots=True)
class PoolSample:
    """The block pool at one step boundary (counts in blocks; :meth:`as_dict` adds bytes)."""

    block_bytes: int
    total: int
    free: int
    active: int
    retained: int
    promised: int
    pinned: int
    deferred: int
    live: int  # active blocks held by sequences the scheduler runs (or every sequence, without a scheduler)
    sequences: int
    by_group: dict[str, dict[str, int]] = field(default_factory=dict)  # group -> state -> blocks
    host: dict[str, int] | None = None  # host tier: total, used, free (blocks) and block_bytes
    orphans: list[Orphan] = field(default_factory=list)
    tail_slack_slots: int = 0  # charged but unused token slots of the blocks sequences hold
    token_slots_used: int = 0
    block_size: int = 1

    def bytes(self, state: str) -> int:
        return int(getattr(self, state)) * self.block_bytes

    @property
    def orphan_blocks(self) -> int:
        return len({b for o in self.orphans for b in o.blocks})

    def as_dict(self) -> dict[str, Any]:
        bb = self.block_bytes
        states = ("free", "active", "retained", "promised", "pinned", "deferred", "live")
        out: dict[str, Any] = {"block_bytes": bb, "total_blocks": self.total, "total_bytes": self.total * bb}
        for s in states:
            out[f"{s}_blocks"] = getattr(self, s)
            out[f"{s}_bytes"] = getattr(self, s) * bb
        out["sequences"] = self.sequences
        out["token_state_bytes"] = self.token_slots_used * bb // self.block_size
        out["tail_slack_bytes"] = self.tail_slack_slots * bb // self.block_size
        out["by_trust_group"] = {g: {f"{k}_bytes": v * bb for k, v in d.items()} for g, d in self.by_group.items()}
        if self.host is not None:
            hb = self.host.get("block_bytes", bb)
            out["host"] = {"total_bytes": self.host["total"] * hb, "used_bytes": self.host["used"] * hb,
                           "free_bytes": self.host["free"] * hb}
        out["orphans"] = [o.as_dict(bb) for o in self.orphans]
        return out


def live_sequences(scheduler: Any) -> set[str]:
    """Sequence ids the scheduler runs now (every running branch of every running request)."""
    return {br.seq_id for branches in scheduler.running.values() for br in branches}


def pool_sample(ledger: KVLedger, block_bytes: int, *, scheduler: Any = None, host_pool: Any = None,
                host_block_bytes: int | None = None) -> PoolSample:
    """Read the ledger at a step boundary, from the thread that steps the engine (nothing else changes
    the ledger then). With ``scheduler``, sequences it does not run and leases no step in flight owns are
    reported as :class:`Orphan` candidates."""
    pool = ledger.pool
    u = ledger.usage()
    seq_ids = ledger.sequences()
    live_ids = live_sequences(scheduler) if scheduler is not None else set(seq_ids)
    by_group: dict[str, dict[str, int]] = {}
    held_live: set[int] = set()
    orphan_seqs: list[tuple[str, Any]] = []
    group_blocks: dict[str, set[int]] = {}
    bs = ledger.block_size
    fill: dict[int, int] = {}
    for sid in seq_ids:
        seq = ledger.sequence(sid)
        group = seq.context.trust_group
        blocks = seq.table.blocks
        group_blocks.setdefault(group, set()).update(blocks)
        g = by_group.setdefault(group, {"active": 0, "retained": 0, "promised": 0})
        g["promised"] += seq.promised
        n = len(seq.tokens)
        for i, b in enumerate(blocks):
            used = min(bs, n - i * bs)
            if used > fill.get(b, 0):
                fill[b] = used
        if sid in live_ids:
            held_live.update(blocks)
        else:
            orphan_seqs.append((sid, seq))
    for group, blocks in group_blocks.items():
        by_group[group]["active"] = len(blocks)
    for b in pool.retained.blocks():
        group = pool.group[b] or "(unknown)"
        by_group.setdefault(group, {"active": 0, "retained": 0, "promised": 0})["retained"] += 1
    orphans: list[Orphan] = []
    for sid, seq in orphan_seqs:
        only = tuple(b for b in seq.table.blocks if b not in held_live)
        orphans.append(Orphan("sequence", sid, seq.family, seq.context.trust_group, only, seq.promised))
    if scheduler is not None:
        plan = scheduler.in_flight
        in_flight = {plan.lease} if plan is not None and plan.lease is not None else set()
        deferred = tuple(b for b in range(pool.num_blocks) if pool.ref[b] == 0 and pool.leased[b])
        stale = [(lid, owner) for lid, owner in ledger.leases().items() if lid not in in_flight]
        for i, (lid, owner) in enumerate(stale):
            # Deferred blocks are attributed to the first stale lease (which one holds each is the
            # ledger's private record); the others name themselves with no blocks.
            orphans.append(Orphan("lease", f"lease {lid}", owner or "(no owner)", "-",
                                  deferred if i == 0 else ()))
    host = None
    if host_pool is not None:
        host = {"total": host_pool.num_blocks, "used": host_pool.num_used, "free": host_pool.num_free,
                "block_bytes": host_block_bytes or block_bytes}
    used_slots = sum(fill.values())
    return PoolSample(block_bytes, u.total, u.free, u.active, u.retained, u.promised, u.pinned, u.deferred,
                      len(held_live), len(seq_ids), by_group, host, orphans,
                      tail_slack_slots=len(fill) * bs - used_slots, token_slots_used=used_slots, block_size=bs)


__all__ = ["Orphan", "PoolSample", "live_sequences", "pool_sample"]
