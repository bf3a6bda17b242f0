"""A replica's admission door: where a routed request is accepted or told "not now", locally.

A router's advice reaches a replica as a request. The door decides, under its own lock, against the pool
as it is *now* and every request it has already accepted that its scheduler has not admitted yet (the
**book**), with the ledger's own figures (:meth:`KVLedger.can_admit`)::

    worst   = new blocks + promised blocks + prefix hits      # the most its admission can take: a hit on
                                                               # a retained block leaves the evictable
                                                               # pool, and a hit evicted before admission
                                                               # becomes a new block
    accept  iff  the ledger would admit it now  and  worst <= free + evictable - promised - booked
    booked += worst

A refused request never held a block: the answer is a cheap, normal "not now" with a fresh
:class:`~kvledger.placement.score.ReplicaLoad`, and the router tries elsewhere. "never" (larger than the whole
pool) is final. The scheduler then admits accepted requests in order through ``KVLedger.admit`` -- the one
place memory is committed -- and :meth:`AdmissionDoor.admitted` takes them off the book.

**Conservation law** (checked by :meth:`AdmissionDoor.check`): ``promised + booked <= free + evictable``
-- everything the replica has promised or accepted fits what it has. Since an admission takes at most
its booked ``worst`` (under full reservation running requests grow only into their promises), every
booked request is admissible when its turn comes. With ``enforce=False`` the door accepts whatever
arrives (the "router decides" arm of the fleet simulator); the law can then break, and every acceptance
that breaks it is counted as an **overcommitted admission** with its overshoot in blocks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..core import checks
from ..core.ledger import KVLedger
from ..core.tiers import TierLedger
from ..core.types import Outcome, Request
from ..errors import ConfigError, InvariantError
from .score import ReplicaLoad

ACCEPTED, NOT_NOW, NEVER = "accepted", "not_now", "never"


class CacheEventTap:
    """A ledger event sink (``KVLedger(events=tap)``) keeping the last ``maxlen`` (or up to twice that)
    cache events as ``(kind, digest)``, numbered from 0, for routers to catch up on. Digests only: no
    trust group, no block id. O(1) per event; :meth:`since` is a slice.

    With :meth:`attach_tiers` the tap publishes what the replica holds *anywhere*: a digest is "stored"
    when it is first held on the device or in a tier below it, and "removed" / "evicted" once it is held
    in neither -- a prefix block demoted to host memory is still a hit there (promoted instead of
    recomputed), so routers keep counting it as the replica's. The device and tier digest sets this needs
    are kept only then."""

    KINDS = frozenset({"stored", "removed", "evicted", "cleared"})

    def __init__(self, maxlen: int = 65536) -> None:
        self.maxlen = checks.positive(maxlen, "maxlen")
        self._events: list[tuple[str, bytes]] = []
        self._base = 0  # the number of the first event kept
        self._lock = threading.Lock()
        self._device: set[bytes] | None = None  # with tiers: digests indexed on the device
        self._below: set[bytes] = set()  # with tiers: digests indexed in a tier below it

    def attach_tiers(self, tiers: TierLedger) -> None:
        """Publish the entries of ``tiers`` (a :class:`~kvledger.core.tiers.TierLedger`) too; call before
        the ledger or the tiers hold anything, so both digest sets start complete."""
        if not isinstance(tiers, TierLedger):
            raise ConfigError(f"attach_tiers needs a TierLedger, got {type(tiers).__name__}")
        if tiers.index or self.seq:
            raise ConfigError("attach the tiers to the event tap before anything is cached")
        with self._lock:
            self._device = set()
        tiers.on_event = self._tier_event

    @property
    def seq(self) -> int:
        """Events emitted so far (the number the next one gets)."""
        return self._base + len(self._events)

    def emit(self, kind: str, block: int, digest: bytes | None, group: str | None,
             source_block: int | None = None) -> None:
        if kind not in self.KINDS or digest is None:
            return
        with self._lock:
            device = self._device
            if device is not None:
                if kind == "stored":
                    device.add(digest)
                else:
                    device.discard(digest)
                if digest in self._below:
                    return  # held below the device all along: routers' belief is unchanged
            self._append(kind, digest)

    def _tier_event(self, kind: str, digest: bytes) -> None:
        with self._lock:
            if kind == "stored":
                self._below.add(digest)
            else:
                self._below.discard(digest)
            if self._device is not None and digest in self._device:
                return  # still (or already) on the device
            self._append(kind, digest)

    def _append(self, kind: str, digest: bytes) -> None:
        self._events.append((kind, digest))
        if len(self._events) > 2 * self.maxlen:
            drop = len(self._events) - self.maxlen
            del self._events[:drop]
            self._base += drop

    def since(self, seq: int, upto: int | None = None, limit: int | None = None
              ) -> tuple[list[tuple[str, bytes]], int, bool]:
        """Events numbered ``seq`` up to ``upto`` (default: all), at most ``limit``: ``(events, next seq,
        complete)``; ``complete`` is False when some were already dropped (the reader must resync)."""
        with self._lock:
            base = self._base
            complete = seq >= base
            start = max(seq, base) - base
            end = len(self._events) if upto is None else max(start, min(upto - base, len(self._events)))
            if limit is not None:
                end = min(end, start + limit)
            return self._events[start:end], base + end, complete


@dataclass(frozen=True, slots=True)
class DoorAnswer:
    """The door's answer to one routed request."""

    request_id: str
    outcome: str  # accepted | not_now | never
    reason: str  # the tenant-safe reason (the request's own blocks only)
    booked: int  # blocks booked for it (0 unless accepted)
    overshoot: int  # blocks promised + booked beyond free + evictable after this answer (0 when sound)
    seq: int  # the replica's decision counter for this answer
    load: ReplicaLoad

    @property
    def accepted(self) -> bool:
        return self.outcome == ACCEPTED


@dataclass(slots=True)
class _Booking:
    blocks: int
    prefill: int  # uncached prompt blocks still to compute


class AdmissionDoor:
    """See the module docstring. ``clock`` stamps published loads (seconds)."""

    def __init__(self, ledger: KVLedger, *, enforce: bool = True, clock: Callable[[], float] | None = None) -> None:
        if not isinstance(ledger, KVLedger):
            raise ConfigError("the admission door needs the replica's KVLedger")
        self.ledger = ledger
        self.enforce = bool(enforce)
        self.clock = clock or (lambda: 0.0)
        self._lock = threading.Lock()
        self._book: dict[str, _Booking] = {}
        self.booked = 0
        self.booked_prefill = 0
        self.seq = 0
        self.accepted = 0
        self.refused = 0
        self.never = 0
        self.overcommits = 0
        self.max_overshoot = 0

    # ---- deciding ---------------------------------------------------------------------------------
    def decide(self, request: Request, *, running: int = 0, waiting: int = 0, backlog: int = 0) -> DoorAnswer:
        """Accept or refuse ``request`` (a full-reservation ledger request); O(prompt blocks)."""
        ledger = self.ledger
        with self._lock:
            # Read the book before the ledger: a request the scheduler admits meanwhile is then counted
            # twice (conservative), never not at all.
            booked = self.booked
            decision = ledger.can_admit(request)
            rid = request.request_id
            if decision.outcome is Outcome.NEVER:
                self.never += 1
                return self._answer(rid, NEVER, decision.reason, 0, running, waiting, backlog)
            worst = decision.blocks_charged + decision.blocks_hit
            if self.enforce and (not decision.admitted or worst > ledger.usage().available - booked):
                self.refused += 1
                reason = decision.reason if not decision.admitted else (
                    f"needs up to {worst} blocks ({decision.blocks_hit} shared); the replica cannot promise them now")
                return self._answer(rid, NOT_NOW, reason, 0, running, waiting, backlog)
            if rid in self._book:
                raise ConfigError(f"request {rid!r} is already booked at this replica")
            prefill = -(-len(request.prompt) // ledger.block_size) - decision.blocks_hit
            self._book[rid] = _Booking(worst, prefill)
            self.booked += worst
            self.booked_prefill += prefill
            self.accepted += 1
            return self._answer(rid, ACCEPTED, decision.reason, worst, running, waiting, backlog)

    def _answer(self, rid: str, outcome: str, reason: str, booked: int, running: int, waiting: int,
                backlog: int) -> DoorAnswer:
        self.seq += 1
        load = self._load(running, waiting, backlog)
        overshoot = max(0, -load.available)
        if outcome == ACCEPTED and overshoot:
            self.overcommits += 1
            self.max_overshoot = max(self.max_overshoot, overshoot)
        return DoorAnswer(rid, outcome, reason, booked, overshoot, self.seq, load)

    # ---- what happens next ------------------------------------------------------------------------
    def admitted(self, request_id: str) -> None:
        """The scheduler admitted a booked request (its blocks are the ledger's now)."""
        with self._lock:
            self._unbook(request_id)

    def finished(self, request_id: str) -> int:
        """A request ended (normally, cancelled, or refused by the scheduler before admission). Returns
        the replica's decision counter, for routers to know which loads count it."""
        with self._lock:
            self._unbook(request_id)
            self.seq += 1
            return self.seq

    def _unbook(self, request_id: str) -> None:
        b = self._book.pop(request_id, None)
        if b is not None:
            self.booked -= b.blocks
            self.booked_prefill -= b.prefill

    def is_booked(self, request_id: str) -> bool:
        return request_id in self._book

    # ---- what routers see -------------------------------------------------------------------------
    def load(self, *, running: int = 0, waiting: int = 0, backlog: int = 0) -> ReplicaLoad:
        with self._lock:
            return self._load(running, waiting, backlog)

    def _load(self, running: int, waiting: int, backlog: int) -> ReplicaLoad:
        u = self.ledger.usage()
        return ReplicaLoad(u.total, u.free, u.evictable, u.promised, self.booked, waiting, running,
                           backlog + self.booked_prefill, self.seq, float(self.clock()))

    def committed(self) -> tuple[int, int]:
        """``(promised + booked, free + evictable)``: what the replica owes and what it has."""
        with self._lock:
            u = self.ledger.usage()
            return u.promised + self.booked, u.free + u.evictable

    def check(self) -> None:
        """The door's conservation law (and the book's own arithmetic)."""
        with self._lock:
            if self.booked != sum(b.blocks for b in self._book.values()):
                raise InvariantError("the door's booked total disagrees with its book")
            u = self.ledger.usage()
            if u.promised + self.booked > u.free + u.evictable:
                raise InvariantError(f"overcommitted: {u.promised} promised + {self.booked} booked > {u.free} free + "
                                     f"{u.evictable} evictable")

    def counters(self) -> dict[str, int]:
        return {"accepted": self.accepted, "refused": self.refused, "never": self.never,
                "overcommits": self.overcommits, "max_overshoot": self.max_overshoot, "booked": self.booked}


__all__ = ["ACCEPTED", "NEVER", "NOT_NOW", "AdmissionDoor", "CacheEventTap", "DoorAnswer"]
