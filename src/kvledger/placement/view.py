"""A router's view of the replicas: their last published loads (with their age), its own requests in
flight, and a prefix index of which replica holds which block digest.

Prefix knowledge comes first from the router's own decisions (a request it sent is about to be cached
there) and then from the replicas' cache events (``stored``, ``removed``, ``evicted``), keyed by the very
digests the replicas' ledgers compute (:mod:`kvledger.core.identity`): the tenant's context is in every
digest, so a prefix of one tenant can never match another's, and router and ledger agree bit for bit.

Loads are stale by construction. The view corrects what it can -- its own requests the last load does not
count yet are added to it, its own finished ones taken off -- and stamps every replica with the age of
its load. It cannot see what other routers sent: that is why it only ranks, and the replica decides.

Nothing here blocks or talks to anyone: feeding the view (loads, events, replies) and ranking with it are
plain method calls, O(prompt blocks + replicas) per decision. Every public method holds the view's own
lock (uncontended in the simulator): in a live ingress, Ray runs the router on its own event loop thread
while the ingress code feeds the same view from the user-code thread.
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import wraps
from typing import Any, TypeVar

from ..core import checks
from ..errors import ConfigError
from .score import ReplicaLoad, RouteChoice, RouteRequest, ScoreConfig, rank, replica_cost

_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(method: _F) -> _F:
    @wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


STORED, REMOVED, EVICTED, CLEARED = "stored", "removed", "evicted", "cleared"
FORGET_EVENTS = frozenset({REMOVED, EVICTED, CLEARED})


class PrefixIndex:
    """digest -> the replicas believed to hold it (a bitmask), bounded: beyond ``max_digests`` the
    digests learned longest ago are forgotten first."""

    def __init__(self, max_digests: int = 1_000_000) -> None:
        self.max_digests = checks.positive(max_digests, "max_digests")
        self._holders: OrderedDict[bytes, int] = OrderedDict()
        self._bit: dict[str, int] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0

    def __len__(self) -> int:
        return len(self._holders)

    def bit(self, replica: str) -> int:
        b = self._bit.get(replica)
        if b is None:
            index = self._free_bits.pop() if self._free_bits else self._next_bit
            if index == self._next_bit:
                self._next_bit += 1
            b = self._bit[replica] = 1 << index
        return b

    def add(self, replica: str, digests: Iterable[bytes]) -> list[bytes]:
        """Mark ``digests`` as held by ``replica``; returns those it was not known to hold before."""
        b = self.bit(replica)
        holders = self._holders
        new: list[bytes] = []
        for d in digests:
            mask = holders.get(d, 0)
            if not mask & b:
                new.append(d)
                holders[d] = mask | b
            holders.move_to_end(d)
        while len(holders) > self.max_digests:
            holders.popitem(last=False)
        return new

    def remove(self, replica: str, digests: Iterable[bytes]) -> None:
        b = self._bit.get(replica)
        if b is None:
            return
        holders = self._holders
        for d in digests:
            mask = holders.get(d)
            if mask is not None and mask & b:
                mask &= ~b
                if mask:
                    holders[d] = mask
                else:
                    del holders[d]

    def drop(self, replica: str) -> None:
        """Forget a replica entirely (it died or left): O(index)."""
        b = self._bit.pop(replica, None)
        if b is None:
            return
        holders = self._holders
        for d in [d for d, m in holders.items() if m & b]:
            mask = holders[d] & ~b
            if mask:
                holders[d] = mask
            else:
                del holders[d]
        self._free_bits.append(b.bit_length() - 1)

    def held_by(self, replica: str) -> int:
        """How many digests ``replica`` is believed to hold (O(index))."""
        b = self._bit.get(replica, 0)
        return sum(1 for m in self._holders.values() if m & b) if b else 0

    def matches(self, digests: Sequence[bytes], replicas: Sequence[str]) -> dict[str, int]:
        """Leading digests of ``digests`` each replica is believed to hold (O(len(digests)))."""
        bits = {r: self._bit.get(r, 0) for r in replicas}
        alive = 0
        for b in bits.values():
            alive |= b
        out = dict.fromkeys(replicas, 0)
        if not alive:
            return out
        holders = self._holders
        depth = 0
        for d in digests:
            mask = holders.get(d, 0) & alive
            if mask != alive:
                for r, b in bits.items():
                    if alive & b and not mask & b:
                        out[r] = depth
                alive = mask
                if not alive:
                    return out
            depth += 1
        for r, b in bits.items():
            if alive & b:
                out[r] = depth
        return out


@dataclass(slots=True)
class _Sent:
    """One of this router's requests at one replica, until the replica's published load counts it."""

    charge: int
    decode: int
    prefill: int
    accept_seq: int | None = None  # the replica's decision counter when it accepted (None: not heard yet)
    finish_seq: int | None = None
    new_digests: list[bytes] = field(default_factory=list)  # prefix knowledge this decision added


@dataclass(slots=True)
class ReplicaState:
    load: ReplicaLoad | None = None
    received_s: float = 0.0  # when this router got the load (its own clock)
    sent: dict[str, _Sent] = field(default_factory=dict)
    delta_available: int = 0  # own requests: blocks to add to the load's available (negative: in flight)
    delta_decode: int = 0
    delta_prefill: int = 0
    events_seq: int = 0  # the replica's cache-event counter this router has consumed up to


@dataclass(frozen=True, slots=True)
class Placement:
    """Optional replicas dedicated to a tenant: its requests go only there, and nobody else's do."""

    dedicated: tuple[tuple[str, frozenset[str]], ...] = ()

    @classmethod
    def of(cls, dedicated: dict[str, Iterable[str]] | None = None) -> Placement:
        pairs = tuple(sorted((t, frozenset(rs)) for t, rs in (dedicated or {}).items()))
        seen: set[str] = set()
        for tenant, replicas in pairs:
            if not replicas:
                raise ConfigError(f"tenant {tenant!r} has an empty set of dedicated replicas")
            if replicas & seen:
                raise ConfigError("a replica can be dedicated to one tenant only")
            seen |= replicas
        return cls(pairs)

    def allowed(self, trust_group: str, replicas: Iterable[str]) -> list[str]:
        mine = next((rs for t, rs in self.dedicated if t == trust_group), None)
        if mine is not None:
            return [r for r in replicas if r in mine]
        taken: frozenset[str] = frozenset().union(*(rs for _, rs in self.dedicated)) if self.dedicated else frozenset()
        return [r for r in replicas if r not in taken]


class RouterView:
    """See the module docstring. ``clock`` is the router's time (seconds, same epoch as the replicas'
    load stamps: wall time in a live fleet, the virtual clock in the simulator)."""

    def __init__(self, block_size: int, config: ScoreConfig | None = None, *, seed: int | None = None,
                 placement: Placement | None = None, max_digests: int = 1_000_000) -> None:
        self.block_size = checks.positive(block_size, "block_size")
        self.config = config or ScoreConfig()
        self.rng = random.Random(seed)
        self.placement = placement or Placement()
        self.index = PrefixIndex(max_digests)
        self.replicas: dict[str, ReplicaState] = {}
        self._where: dict[str, str] = {}  # request id -> the replica it was last sent to
        self._lock = threading.RLock()

    # ---- membership ---------------------------------------------------------------------------------
    @_locked
    def set_replicas(self, replicas: Iterable[str]) -> None:
        """The replicas that exist now: new ones are added in the order given, gone ones forgotten (with
        their prefixes). The view's order breaks ranking ties and drives round-robin, so it follows the
        caller's order, never a set's (whose order changes with the process's string-hash salt)."""
        now = dict.fromkeys(replicas)
        for r in list(self.replicas):
            if r not in now:
                self.drop(r)
        for r in now:
            self.replicas.setdefault(r, ReplicaState())

    @_locked
    def drop(self, replica: str) -> None:
        state = self.replicas.pop(replica, None)
        if state is not None:
            for rid in state.sent:
                self._where.pop(rid, None)
        self.index.drop(replica)

    # ---- what the router learns --------------------------------------------------------------------
    @_locked
    def update_load(self, replica: str, load: ReplicaLoad, now: float) -> bool:
        """A published load (a periodic snapshot, or one carried by a reply). An older one than the view
        already has is ignored. Returns whether it was taken."""
        state = self.replicas.get(replica)
        if state is None:
            return False
        if state.load is not None and load.seq < state.load.seq:
            return False
        state.load = load
        state.received_s = now
        self._recount(state)
        return True

    @_locked
    def apply_events(self, replica: str, events: Iterable[tuple[str, bytes]], upto: int | None = None) -> None:
        """Cache events of ``replica`` in order: (kind, digest). ``upto``: the replica's event counter
        after them (what this view asks for next)."""
        if replica not in self.replicas:
            return
        index = self.index
        for kind, digest in events:
            if kind == STORED:
                index.add(replica, (digest,))
            elif kind in FORGET_EVENTS:
                index.remove(replica, (digest,))
        if upto is not None:
            self.replicas[replica].events_seq = upto

    @_locked
    def resync(self, replica: str) -> None:
        """The replica's event history has a gap for this view: forget what the view believed it holds
        (its own later decisions and events rebuild it)."""
        self.index.drop(replica)
        if replica in self.replicas:
            self.index.bit(replica)

    # ---- deciding -----------------------------------------------------------------------------------
    def candidates(self, trust_group: str, avoid: Iterable[str] = ()) -> list[str]:
        skip = set(avoid)
        return [r for r in self.placement.allowed(trust_group, self.replicas) if r not in skip]

    @_locked
    def rank(self, request: RouteRequest, now: float, avoid: Iterable[str] = ()) -> list[RouteChoice]:
        """Every allowed replica not in ``avoid``, best first (see :func:`kvledger.placement.score.rank`)."""
        names = self.candidates(request.trust_group, avoid)
        if not names:
            return []
        matched = self.index.matches(request.digests, names) if request.digests else dict.fromkeys(names, 0)
        bs, cfg = self.block_size, self.config
        choices = []
        for r in names:
            st = self.replicas[r]
            load = st.load
            if load is None:
                decode, backlog, avail, age = st.delta_decode, st.delta_prefill, None, None
            else:
                decode = load.promised + st.delta_decode
                backlog = load.backlog + st.delta_prefill
                avail = load.available + st.delta_available
                age = max(0.0, now - load.stamp)
            fits = avail is None or avail >= request.charge
            choices.append(RouteChoice(r, replica_cost(request, matched[r], decode, backlog, bs, cfg), fits,
                                  matched[r], age))
        return rank(choices, self.rng)

    @_locked
    def available(self, replica: str) -> int | None:
        """What the view believes ``replica`` could still admit (None: no load heard yet)."""
        st = self.replicas.get(replica)
        if st is None or st.load is None:
            return None
        return st.load.available + st.delta_available

    @_locked
    def age(self, replica: str, now: float) -> float | None:
        st = self.replicas.get(replica)
        return None if st is None or st.load is None else max(0.0, now - st.load.stamp)

    # ---- this router's own requests ---------------------------------------------------------------
    @_locked
    def routed(self, request: RouteRequest, replica: str, matched: int = 0) -> None:
        """The router sent ``request`` to ``replica``: count it there until the replica's load does, and
        remember that the replica is about to hold its prefix."""
        state = self.replicas.get(replica)
        if state is None:
            return
        prefill = request.prompt_blocks - min(matched, request.prompt_blocks)
        sent = _Sent(request.charge, request.decode_blocks, prefill)
        sent.new_digests = self.index.add(replica, request.digests)
        previous = self._where.get(request.request_id)
        if previous is not None and previous != replica:
            self._forget(request.request_id, previous)
        state.sent[request.request_id] = sent
        self._where[request.request_id] = replica
        self._recount(state)

    @_locked
    def accepted(self, request_id: str, replica: str, seq: int, load: ReplicaLoad | None, now: float) -> None:
        """The replica admitted the request with its decision ``seq``."""
        self._settled(request_id, replica, seq, load, now, finished=False)

    @_locked
    def refused(self, request_id: str, replica: str, load: ReplicaLoad | None, now: float) -> None:
        """The replica said "not now": its prefix is not coming there after all."""
        state = self.replicas.get(replica)
        if state is None:
            return
        sent = state.sent.pop(request_id, None)
        if sent is not None and sent.new_digests:
            self.index.remove(replica, sent.new_digests)
        if self._where.get(request_id) == replica:
            del self._where[request_id]
        self._take_reply_load(state, replica, load, now)

    @_locked
    def finished(self, request_id: str, replica: str, seq: int, load: ReplicaLoad | None, now: float) -> None:
        """The request finished there with the replica's decision ``seq`` (admitted then too, if not heard yet)."""
        self._settled(request_id, replica, seq, load, now, finished=True)

    def _settled(self, request_id: str, replica: str, seq: int, load: ReplicaLoad | None, now: float, *,
                 finished: bool) -> None:
        state = self.replicas.get(replica)
        if state is None:
            return
        sent = state.sent.get(request_id)
        if sent is not None:
            if finished:
                sent.finish_seq = seq
            if not finished or sent.accept_seq is None:
                sent.accept_seq = seq
        if finished and self._where.get(request_id) == replica:
            del self._where[request_id]
        self._take_reply_load(state, replica, load, now)

    def _take_reply_load(self, state: ReplicaState, replica: str, load: ReplicaLoad | None, now: float) -> None:
        """A reply's fresh load if it carries one the view takes; else the router's own requests recounted
        against the load it has."""
        if load is None or not self.update_load(replica, load, now):
            self._recount(state)

    def _forget(self, request_id: str, replica: str) -> None:
        state = self.replicas.get(replica)
        if state is not None and state.sent.pop(request_id, None) is not None:
            self._recount(state)

    def _recount(self, state: ReplicaState) -> None:
        """Own requests against the current load: in flight and not counted yet (-charge), counted
        (nothing), finished while the load still counts them (+charge), finished and gone (dropped)."""
        seq = state.load.seq if state.load is not None else -1
        avail = decode = prefill = 0
        done = []
        for rid, s in state.sent.items():
            if s.finish_seq is not None:
                if seq >= s.finish_seq:
                    done.append(rid)
                elif s.accept_seq is not None and seq >= s.accept_seq:
                    avail += s.charge
            elif s.accept_seq is None or seq < s.accept_seq:
                avail -= s.charge
                decode += s.decode
                prefill += s.prefill
        for rid in done:
            del state.sent[rid]
        state.delta_available, state.delta_decode, state.delta_prefill = avail, decode, prefill

    @_locked
    def in_flight(self) -> int:
        return sum(len(s.sent) for s in self.replicas.values())

    @_locked
    def event_positions(self) -> dict[str, int]:
        """Each replica's cache-event counter this view has consumed up to."""
        return {r: st.events_seq for r, st in self.replicas.items()}

    @_locked
    def known(self) -> dict[str, int]:
        """Digests the view believes each replica holds (O(index): for operators and tests)."""
        return {r: self.index.held_by(r) for r in self.replicas}


_VIEWS: dict[str, RouterView] = {}
_VIEWS_LOCK = threading.Lock()


def shared_view(key: str, *, block_size: int, score: ScoreConfig | None = None,
                dedicated: dict[str, list[str]] | None = None, seed: int | None = None) -> RouterView:
    """The view of fleet ``key`` in this process, created on first use: the live router (which Ray builds
    itself) and the ingress code of one process meet here. The simulator gives every router its own."""
    with _VIEWS_LOCK:
        view = _VIEWS.get(key)
        if view is None:
            view = _VIEWS[key] = RouterView(block_size, score, seed=seed, placement=Placement.of(dedicated))
        elif view.block_size != block_size:
            raise ConfigError(f"fleet {key!r} already has a view with block size {view.block_size}")
        return view


__all__ = ["CLEARED", "EVICTED", "FORGET_EVENTS", "REMOVED", "STORED", "Placement", "PrefixIndex", "ReplicaState",
           "RouterView", "shared_view"]
