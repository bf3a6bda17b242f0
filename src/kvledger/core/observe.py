"""Cache events and statistics.

Events are what a router or a log consumes: a block was stored in the prefix index, removed (its
pending fill was abandoned), evicted, cleared, or copied (copy-on-write). Each event names the trust
group that owns the block; :meth:`EventLog.view` gives one tenant only its own events, so no tenant
ever sees another group's digests. The operator's view (:meth:`EventLog.all`) sees everything.

Statistics never carry digests at all; per-group counters are likewise only shown per group
(``KVLedger.tenant_stats``), and pool-wide figures only to the operator (``KVLedger.stats``).
Prefix-cache queries of re-admissions after preemption are counted apart from first admissions, so a
preempted request that finds its own blocks again does not inflate the hit rate users see.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class CacheEvent:
    seq: int  # monotonically increasing event number
    kind: str  # stored | removed | evicted | cleared | copied
    block: int
    digest: str | None  # hex; None for anonymous blocks (copies of partial tails)
    trust_group: str | None
    source_block: int | None = None  # for "copied"


class EventLog:
    """A bounded in-memory log of cache events (oldest dropped first) plus optional subscribers."""

    def __init__(self, maxlen: int = 100_000) -> None:
        self._events: deque[CacheEvent] = deque(maxlen=maxlen)
        self._subscribers: list = []
        self._seq = itertools.count()

    def subscribe(self, callback) -> None:  # callback(CacheEvent)
        self._subscribers.append(callback)

    def emit(self, kind: str, block: int, digest: bytes | None, group: str | None,
             source_block: int | None = None) -> None:
        event = CacheEvent(next(self._seq), kind, block, digest.hex() if digest is not None else None, group,
                           source_block)
        self._events.append(event)
        for callback in self._subscribers:
            callback(event)

    def all(self) -> list[CacheEvent]:
        """Operator view: every event."""
        return list(self._events)

    def view(self, trust_group: str) -> list[CacheEvent]:
        """Tenant view: only the events of blocks owned by ``trust_group``."""
        return [e for e in self._events if e.trust_group == trust_group]

    def __len__(self) -> int:
        return len(self._events)


@dataclass(slots=True)
class GroupCounters:
    queries: int = 0  # admissions that looked up the prefix index
    query_blocks: int = 0
    hit_blocks: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0


@dataclass(slots=True)
class Counters:
    """Monotonic counters kept by the ledger (O(1) updates)."""

    admitted: int = 0  # first admissions (a request with n branches counts once)
    readmitted: int = 0  # admissions of requests brought back after preemption
    rejected_not_now: int = 0
    rejected_never: int = 0
    finished: int = 0
    cancelled: int = 0
    forks: int = 0
    copies: int = 0
    preemptions: int = 0  # sequences preempted (a family of n branches preempted together counts n)
    cleared: int = 0
    cache_resets: int = 0
    read_skipped: int = 0  # admissions that wrote the cache without reading it (read_prefix_cache=False)
    promoted_blocks: int = 0  # prefix blocks brought back from a lower tier (core/offload.py)
    groups: dict[str, GroupCounters] = field(default_factory=dict)  # first admissions
    quota_refusals: dict[str, int] = field(default_factory=dict)  # trust group -> admissions its quota refused
    readmission_groups: dict[str, GroupCounters] = field(default_factory=dict)  # re-admissions
    window: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=1000))

    def record_query(self, group: str, blocks: int, hits: int, tokens: int, hit_tokens: int,
                     readmission: bool = False) -> None:
        table = self.readmission_groups if readmission else self.groups
        g = table.get(group)
        if g is None:
            g = table[group] = GroupCounters()
        g.queries += 1
        g.query_blocks += blocks
        g.hit_blocks += hits
        g.query_tokens += tokens
        g.hit_tokens += hit_tokens
        if not readmission:
            self.window.append((tokens, hit_tokens))

    def record_quota_refusal(self, group: str) -> None:
        """An admission of ``group`` refused by its quota (also counted under not_now / never)."""
        self.quota_refusals[group] = self.quota_refusals.get(group, 0) + 1

    def totals(self, readmission: bool = False) -> GroupCounters:
        t = GroupCounters()
        for g in (self.readmission_groups if readmission else self.groups).values():
            t.queries += g.queries
            t.query_blocks += g.query_blocks
            t.hit_blocks += g.hit_blocks
            t.query_tokens += g.query_tokens
            t.hit_tokens += g.hit_tokens
        return t

    def window_hit_rate(self) -> float:
        tokens = sum(t for t, _ in self.window)
        return sum(h for _, h in self.window) / tokens if tokens else 0.0


def prefix_figures(q: GroupCounters | None) -> dict[str, Any]:
    """One group's (or the totals') prefix-cache figures as reported by the ledger's statistics."""
    return {
        "queries": q.queries if q else 0,
        "query_blocks": q.query_blocks if q else 0,
        "hit_blocks": q.hit_blocks if q else 0,
        "query_tokens": q.query_tokens if q else 0,
        "hit_tokens": q.hit_tokens if q else 0,
        "hit_rate": (q.hit_tokens / q.query_tokens) if q and q.query_tokens else 0.0,
    }
