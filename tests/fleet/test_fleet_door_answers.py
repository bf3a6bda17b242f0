"""The admission door's whole answers and the cache-event tap's windows, as a router reads them.

A router takes every field of a :class:`~kvledger.placement.door.DoorAnswer` at face value: the outcome and
its reason (shown to the client), the blocks booked for the request, the overshoot, the decision counter
and the fresh :class:`~kvledger.placement.score.ReplicaLoad` (its ``waiting``/``running``/``backlog`` feed
the router's queue cost). So each outcome -- accepted, "not now", "never" -- is pinned here as one whole
known answer, not field by field. The tap's ``since(seq, upto, limit)`` is the catch-up a router (and
the fleet simulator) does after the tap dropped its oldest events: the window must be numbered from the
events' own numbers, not from the tap's first kept one."""

from __future__ import annotations

import pytest

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger
from kvledger.core.types import Request
from kvledger.errors import ConfigError
from kvledger.placement.door import ACCEPTED, NEVER, NOT_NOW, AdmissionDoor, CacheEventTap, DoorAnswer
from kvledger.placement.score import ReplicaLoad

BS = 4
CTX = CacheContext(trust_group="acme", model="m")


def request(rid: str, prompt_blocks: int, max_new: int, base: int = 0) -> Request:
    return Request(rid, list(range(base, base + prompt_blocks * BS)), max_new, CTX)


def test_each_outcome_is_one_whole_answer_with_the_callers_queue_figures() -> None:
    """On an 8-block pool: a 3-block request is accepted and booked; a 6-block one is then "not now"
    (8 - 3 booked < 6) with nothing booked for it; a 12-block one is "never". Every answer carries the
    replica's load *with the queue figures the caller passed* (waiting, running, backlog plus the booked
    prefill), the decision counter, and the clock's stamp."""
    ledger = KVLedger(8, BS)
    door = AdmissionDoor(ledger, clock=lambda: 7.5)

    def load(booked: int, waiting: int, running: int, backlog: int, seq: int) -> ReplicaLoad:
        return ReplicaLoad(pool=8, free=8, evictable=0, promised=0, booked=booked, waiting=waiting, running=running,
                           backlog=backlog, seq=seq, stamp=7.5)

    accepted = door.decide(request("a", 2, 4), running=2, waiting=3, backlog=5)
    assert accepted == DoorAnswer("a", ACCEPTED, "0 shared + 2 new + 1 promised = 3 blocks", 3, 0, 1,
                                  load(booked=3, waiting=3, running=2, backlog=5 + 2, seq=1))
    assert accepted.accepted

    not_now = door.decide(request("b", 2, 16, base=100), running=2, waiting=4, backlog=1)
    assert not_now == DoorAnswer("b", NOT_NOW, "needs up to 6 blocks (0 shared); the replica cannot promise them now",
                                 0, 0, 2, load(booked=3, waiting=4, running=2, backlog=1 + 2, seq=2))
    assert not not_now.accepted

    never = door.decide(request("c", 2, 40, base=200), running=2, waiting=6, backlog=0)
    assert never == DoorAnswer("c", NEVER, "needs 12 blocks (8 + 40 tokens) but the whole pool has 8", 0, 0, 3,
                               load(booked=3, waiting=6, running=2, backlog=0 + 2, seq=3))

    assert door.counters() == {"accepted": 1, "refused": 1, "never": 1, "overcommits": 0, "max_overshoot": 0,
                               "booked": 3}
    # What the answers' loads say is what the door's own load says now (the published load).
    assert door.load(running=2, waiting=6) == load(booked=3, waiting=6, running=2, backlog=2, seq=3)


def test_a_book_of_hits_a_full_pool_refusals_and_releases_as_a_router_reads_it() -> None:
    """A 10-block pool with a 2-block prefix retained. In order: a request that hits it (booked 2 shared +
    1 new + 1 output, 1 prompt block left to compute); the same id again (refused: already booked); one
    that takes exactly what is left (accepted: the book may fill the pool); two that no longer fit ("not
    now") and two that never will; then the scheduler admits the first and the second ends. Every answer,
    the counters and the published loads are known answers."""
    ledger = KVLedger(10, BS)
    ledger.admit(request("p", 2, 4))
    ledger.mark_computed("p", 2 * BS)
    ledger.release("p")  # its two prompt blocks stay retained (evictable)
    door = AdmissionDoor(ledger)

    def load(booked: int, backlog: int, seq: int) -> ReplicaLoad:
        return ReplicaLoad(pool=10, free=8, evictable=2, promised=0, booked=booked, backlog=backlog, seq=seq)

    hit = Request("h", list(range(2 * BS)) + [50] * BS, 4, CTX)
    answers = [door.decide(hit)]
    with pytest.raises(ConfigError, match=r"^request 'h' is already booked at this replica$"):
        door.decide(hit)
    answers += [door.decide(r) for r in (request("edge", 5, 4, base=100), request("more", 1, 1, base=200),
                                         request("more2", 1, 1, base=300), request("big", 3, 40, base=400),
                                         request("big2", 3, 40, base=500))]
    no_room = "needs up to 2 blocks (0 shared); the replica cannot promise them now"
    never = "needs 13 blocks (12 + 40 tokens) but the whole pool has 10"
    assert answers == [
        DoorAnswer("h", ACCEPTED, "2 shared + 1 new + 1 promised = 4 blocks", 4, 0, 1, load(4, 1, 1)),
        DoorAnswer("edge", ACCEPTED, "0 shared + 5 new + 1 promised = 6 blocks", 6, 0, 2, load(10, 6, 2)),
        DoorAnswer("more", NOT_NOW, no_room, 0, 0, 3, load(10, 6, 3)),
        DoorAnswer("more2", NOT_NOW, no_room, 0, 0, 4, load(10, 6, 4)),
        DoorAnswer("big", NEVER, never, 0, 0, 5, load(10, 6, 5)),
        DoorAnswer("big2", NEVER, never, 0, 0, 6, load(10, 6, 6)),
    ]
    # Each load crosses a process boundary to the router as a dict, which is checked field by field there.
    assert [ReplicaLoad.from_dict(a.load.to_dict()) for a in answers] == [a.load for a in answers]
    assert door.counters() == {"accepted": 2, "refused": 2, "never": 2, "overcommits": 0, "max_overshoot": 0,
                               "booked": 10}
    assert door.committed() == (10, 10)  # promised + booked, free + evictable: the book fills the pool
    door.check()
    door.admitted("h")  # the scheduler admitted it: the ledger holds its blocks now, the book no longer does
    assert door.load() == load(6, 5, 6) and not door.is_booked("h") and door.is_booked("edge")
    assert door.finished("edge") == 7  # ended before admission: its booking goes, the counter moves
    assert door.load() == load(0, 0, 7) and door.committed() == (0, 10)
    assert door.finished("h") == 8  # the admitted one ends too: nothing left to unbook, the counter moves
    assert door.load() == load(0, 0, 8)
    door.check()


def test_a_ledger_refusal_is_not_now_with_the_ledgers_own_reason() -> None:
    """The tenant's quota (4 blocks, 2 committed to a running request) refuses a 3-block request for now:
    the door answers "not now" with the ledger's reason, books nothing, and counts one refusal."""
    ledger = KVLedger(10, BS)
    ledger.set_quota("acme", 4)
    ledger.admit(request("q1", 1, 4, base=900))
    door = AdmissionDoor(ledger)
    assert door.decide(request("q2", 2, 4, base=950)) == DoorAnswer(
        "q2", NOT_NOW, "needs 3 blocks of its trust group's quota of 4 blocks, of which 2 are held or committed to "
        "its running requests now", 0, 0, 1, ReplicaLoad(pool=10, free=9, evictable=0, promised=1, seq=1))
    assert door.counters()["refused"] == 1 and door.booked == 0


def test_a_door_that_does_not_enforce_books_anyway_and_reports_the_overshoot() -> None:
    """enforce=False (the "router decides" arm): three requests of 3, 6 and 2 blocks on an 8-block pool are
    all accepted and booked; the second overshoots the pool by one block and the third by three, and the
    door counts two overcommitted admissions with the worst overshoot."""
    door = AdmissionDoor(KVLedger(8, BS), enforce=False)
    answers = [door.decide(r) for r in (request("a", 2, 4), request("b", 2, 16, base=100),
                                        request("c", 1, 4, base=200))]

    def load(booked: int, backlog: int, seq: int) -> ReplicaLoad:
        return ReplicaLoad(pool=8, free=8, evictable=0, promised=0, booked=booked, backlog=backlog, seq=seq)

    assert answers == [
        DoorAnswer("a", ACCEPTED, "0 shared + 2 new + 1 promised = 3 blocks", 3, 0, 1, load(3, 2, 1)),
        DoorAnswer("b", ACCEPTED, "0 shared + 2 new + 4 promised = 6 blocks", 6, 1, 2, load(9, 4, 2)),
        DoorAnswer("c", ACCEPTED, "0 shared + 1 new + 1 promised = 2 blocks", 2, 3, 3, load(11, 5, 3)),
    ]
    assert door.counters() == {"accepted": 3, "refused": 0, "never": 0, "overcommits": 2, "max_overshoot": 3,
                               "booked": 11}


def test_since_windows_are_numbered_by_the_events_own_numbers_after_a_drop() -> None:
    """Six "stored" events through a tap keeping 2 (up to 4): the first three are dropped, events 3, 4, 5
    are kept. Every window -- with an ``upto``, a ``limit`` or both -- is the kept events with those
    numbers, the next number to ask for, and whether nothing asked for was lost."""
    tap = CacheEventTap(maxlen=2)
    ledger = KVLedger(16, BS, events=tap)
    ledger.admit(request("a", 4, 1))
    ledger.admit(request("b", 2, 1, base=1000))
    kept, nxt, complete = tap.since(3)
    assert (len(kept), nxt, complete, tap.seq) == (3, 6, True, 6)
    assert [kind for kind, _ in kept] == ["stored"] * 3
    e3, e4, e5 = kept
    windows = {
        (0, None, None): ([e3, e4, e5], 6, False),  # 0-2 were dropped: the reader must resync
        (3, 5, None): ([e3, e4], 5, True),
        (4, 5, None): ([e4], 5, True),
        (4, 4, None): ([], 4, True),
        (0, 4, None): ([e3], 4, False),
        (5, 100, None): ([e5], 6, True),
        (6, 3, None): ([], 6, True),  # nothing new: ask again from 6
        (2, None, 1): ([e3], 4, False),
        (3, 6, 2): ([e3, e4], 5, True),
    }
    assert {key: tap.since(*key) for key in windows} == windows


# ---- the fleet's admission door and its scores ---------------------------------------------------
def _request(rid: str, prompt_blocks: int, bs: int = 16) -> Request:
    """A request of ``prompt_blocks`` full prompt blocks and one block of output (full reservation)."""
    return Request(rid, list(range(1000 * len(rid), 1000 * len(rid) + prompt_blocks * bs)), bs,
                   CacheContext(trust_group="acme", model="m"))


def test_the_door_counts_every_refusal_and_every_overcommit_and_reports_the_load_it_was_given() -> None:
    door = AdmissionDoor(KVLedger(8, 16))
    first = door.decide(_request("a", 4), running=2, waiting=5)  # 5 blocks booked of 8
    assert first.accepted and (first.load.waiting, first.load.running) == (5, 2)
    assert first.load.backlog == 4  # its 4 prompt blocks still to compute: nothing else was passed
    assert door.decide(_request("bb", 4)).outcome == NOT_NOW  # 5 more than the 3 left
    assert door.decide(_request("ccc", 4)).outcome == NOT_NOW
    assert door.counters()["refused"] == 2
    # A door that does not enforce (the study's arm A) accepts anyway and counts each overshoot.
    loose = AdmissionDoor(KVLedger(8, 16), enforce=False)
    answers = [loose.decide(_request(rid, 4)) for rid in ("a", "bb", "ccc")]
    assert [(a.accepted, a.overshoot) for a in answers] == [(True, 0), (True, 2), (True, 7)]
    assert loose.counters()["overcommits"] == 2 and loose.counters()["max_overshoot"] == 7
