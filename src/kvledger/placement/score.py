"""The routing score: one cost function, in blocks, for the live router and the fleet simulator.

A router ranks replicas for a request by what sending it there would cost, in KV blocks::

    uncached = prompt blocks - matched          (matched: leading prompt blocks the router believes the
                                                 replica holds; below min_match_tokens it counts as 0)
    decode   = committed decode blocks           (the replica's promised blocks, plus the output blocks
                                                 of this router's own requests it has not seen counted)
    queue    = prefill backlog in blocks          (prompt blocks waiting to be computed there, plus this
                                                 router's own requests in flight to it)
    cost     = uncached + decode_weight * decode + queue_weight * queue

The **minimum-match gate** keeps a prefix every request shares (a system prompt) from counting as
affinity: a match shorter than ``min_match_tokens`` is no match, so those requests go to the least loaded
replica instead of all to the first one that cached the system prompt. Ties are broken at random.

A replica whose view says the request does not fit (``charge > available``) is ranked after every
replica that fits, never dropped: the view is advice and may be stale in either direction. The charge is
an upper bound on what the admission takes from ``free + evictable - promised`` under full reservation:
every block of the request at its reserved length, counting prefix hits too (a hit on a retained block
takes it out of the evictable pool; the router cannot tell which hits are retained).

Everything a router knows about a replica is a :class:`ReplicaLoad` -- tenant-free aggregates only, so
routing statistics never reveal a tenant's traffic -- stamped with the replica's own time and sequence
number, so the router knows its age and which of its own requests it already counts.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..core import checks
from ..core.promises import declared_blocks
from ..errors import ConfigError

# The fleet simulator's arms: "A" the router decides on its view and the replica commits whatever it is
# sent; "B" the replica's ledger decides and the router retries elsewhere. Routings: the cost function
# below, or round-robin (the baseline).
ARMS = ("A", "B")
ROUTINGS = ("score", "round-robin")
LOAD_FIELDS = ("pool", "free", "evictable", "promised", "booked", "waiting", "running", "backlog", "seq")


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value > 2**62:
        raise ConfigError(f"{what} must be a non-negative integer, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What a replica tells routers about itself: aggregates over every tenant, nothing per tenant.

    ``free``, ``evictable`` and ``promised`` are its ledger's; ``booked`` the blocks its admission door
    has accepted for requests its scheduler has not admitted yet; ``waiting`` and ``running`` requests;
    ``backlog`` prompt blocks still to be computed; ``seq`` the replica's decision counter when this was
    measured (monotonic per replica); ``stamp`` its clock then (seconds)."""

    pool: int
    free: int
    evictable: int
    promised: int
    booked: int = 0
    waiting: int = 0
    running: int = 0
    backlog: int = 0
    seq: int = 0
    stamp: float = 0.0

    @property
    def available(self) -> int:
        """Blocks a new admission could still claim: ``free + evictable - promised - booked``."""
        return self.free + self.evictable - self.promised - self.booked

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in LOAD_FIELDS}
        out["stamp"] = self.stamp
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplicaLoad:
        """Parse a published load (it crossed a process boundary): every field checked."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"a replica load must be a mapping, got {type(data).__name__}")
        values = {k: _count(data.get(k, 0), f"load.{k}") for k in LOAD_FIELDS}
        return cls(**values, stamp=checks.finite(data.get("stamp", 0.0), "load.stamp"))


@dataclass(frozen=True, slots=True)
class ScoreConfig:
    """The cost function's knobs (see the module docstring)."""

    min_match_tokens: int = 1024
    decode_weight: float = 1.0
    queue_weight: float = 0.1

    def __post_init__(self) -> None:
        _count(self.min_match_tokens, "min_match_tokens")
        for name in ("decode_weight", "queue_weight"):
            checks.finite(getattr(self, name), name, 0, 1e6)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a router needs to know about a request: its tenant, its prompt's block digests (computed as the
    replicas' ledgers compute them: the tenant's context is in every digest) and its block figures."""

    request_id: str
    trust_group: str
    digests: tuple[bytes, ...]  # full prompt blocks, chained from the tenant's context root
    prompt_blocks: int  # ceil(prompt / block_size): blocks a replica computes with no hit at all
    decode_blocks: int  # blocks of the reserved output beyond the prompt's
    charge: int  # upper bound on the capacity its admission takes (see module docstring)


def request_blocks(prompt_len: int, max_new_tokens: int, block_size: int, n: int = 1) -> tuple[int, int, int]:
    """``(prompt_blocks, decode_blocks, charge)`` of a request under full reservation, as the ledger
    counts them: every branch reserves its own output allowance plus a copy of a partial prompt tail."""
    for value, what in ((prompt_len, "prompt length"), (max_new_tokens, "max_new_tokens"), (block_size, "block size"),
                        (n, "n")):
        if _count(value, what) < 1:
            raise ConfigError(f"{what} must be at least 1")
    prompt_blocks = -(-prompt_len // block_size)
    charge = declared_blocks(prompt_len, max_new_tokens, block_size, n)
    return prompt_blocks, charge - prompt_blocks, charge


def make_route_request(request_id: str, trust_group: str, digests: Sequence[bytes], prompt_len: int,
                       max_new_tokens: int, block_size: int, n: int = 1) -> RouteRequest:
    prompt_blocks, decode, charge = request_blocks(prompt_len, max_new_tokens, block_size, n)
    return RouteRequest(request_id, trust_group, tuple(digests), prompt_blocks, decode, charge)


@dataclass(frozen=True, slots=True)
class RouteChoice:
    """One replica in a ranking: its cost, whether the router's view says the request fits there, the
    prefix blocks it is believed to hold, and how old the view of it is (None: never heard of it)."""

    replica: str
    cost: float
    fits: bool
    matched: int
    age_s: float | None


def replica_cost(request: RouteRequest, matched: int, decode: int, backlog: int, block_size: int,
                 config: ScoreConfig) -> float:
    """The cost in blocks of sending ``request`` to a replica (see the module docstring)."""
    effective = matched if matched * block_size >= config.min_match_tokens else 0
    uncached = request.prompt_blocks - min(effective, request.prompt_blocks)
    return uncached + config.decode_weight * decode + config.queue_weight * backlog


def rank(choices: Iterable[RouteChoice], rng: random.Random) -> list[RouteChoice]:
    """Replicas that fit first, then the rest; cheapest first within each; ties broken at random."""
    keyed = [(not c.fits, c.cost, rng.random(), c) for c in choices]
    keyed.sort(key=lambda k: k[:3])
    return [k[3] for k in keyed]


__all__ = ["ARMS", "LOAD_FIELDS", "ROUTINGS", "RouteChoice", "ReplicaLoad", "RouteRequest", "ScoreConfig",
           "make_route_request", "rank", "replica_cost", "request_blocks"]
