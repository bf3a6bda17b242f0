"""Admission at the HTTP boundary: a bounded queue and per-tenant request limits.

The engine's ledger decides what runs and when. "Not now" keeps a request queued in the engine -- for
lack of pool memory, or because its tenant is at its block cap (the ledger's per-trust-group quota,
``Engine.set_quota``, decided atomically with admission; the engine's scheduler lets other tenants'
requests past a tenant held by its own cap). "Never" -- larger than the pool, than the model's length
or than the tenant's cap on its own -- is refused before anything is queued (400). The gate only keeps
the queue bounded, before anything reaches the engine:

* **queue full** -- requests that wait (submitted to the engine, not yet running) are bounded by the
  server's ``max_queue``; a tenant's ``max_requests`` bounds its requests in flight. Past either, the
  request gets 429.

Conservation (checked by :meth:`AdmissionGate.check`): per tenant, ``in_flight`` is the number of its
live engine requests (tickets' entries not yet released), and the server's ``in_flight`` is their sum.
Everything runs on the event loop's thread.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import InvariantError
from .tenants import Tenant


class QueueFull(Exception):
    """Too many requests are waiting: answer 429."""


class NeverFits(Exception):
    """A request of more engine requests than the queue or the tenant's limit can ever hold: a retry
    never helps, so answer 400 (not 429)."""


@dataclass(slots=True)
class Ticket:
    """One HTTP request's share: one entry per engine request (a prompt of a batch)."""

    tenant: str
    count: int
    seq: int
    live: list[bool] = field(default_factory=list)  # engine request i has not been released yet


@dataclass(slots=True)
class _TenantBook:
    in_flight: int = 0  # its live engine requests
    live: dict[int, Ticket] = field(default_factory=dict)  # tickets with a live engine request


class AdmissionGate:
    def __init__(self, max_queue: int, running: Callable[[], int]) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be an integer >= 1, got {max_queue!r}")
        self.max_queue = max_queue
        self._running = running
        self.in_flight = 0
        self._books: dict[str, _TenantBook] = {}
        self._seq = itertools.count()

    def _book(self, tenant: str) -> _TenantBook:
        book = self._books.get(tenant)
        if book is None:
            book = self._books[tenant] = _TenantBook()
        return book

    def waiting(self) -> int:
        """Requests that wait: submitted to the engine and not yet running."""
        return max(0, self.in_flight - self._running())

    def tenant_in_flight(self, tenant: str) -> int:
        book = self._books.get(tenant)
        return book.in_flight if book else 0

    def tenants(self) -> list[str]:
        return list(self._books)

    def enter(self, tenant: Tenant, count: int) -> Ticket:
        """A ticket for a request's ``count`` engine requests (all or none), live at once. Raises
        :class:`QueueFull` when the server's queue or the tenant's request limit is full now, and
        :class:`NeverFits` when ``count`` alone exceeds either (nothing changes then)."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"a ticket is for at least one engine request, got {count!r}")
        if count > self.max_queue:
            raise NeverFits(f"{count} prompts are more than this server's queue of {self.max_queue} can hold")
        if tenant.max_requests is not None and count > tenant.max_requests:
            raise NeverFits(f"{count} prompts are more than your tenant's limit of {tenant.max_requests} "
                            "requests in flight at once")
        book = self._book(tenant.name)
        if self.waiting() + count > self.max_queue:
            raise QueueFull("too many requests are waiting; retry later")
        if tenant.max_requests is not None and book.in_flight + count > tenant.max_requests:
            raise QueueFull(f"your tenant already has {tenant.max_requests} requests in flight or waiting; "
                            "retry later")
        ticket = Ticket(tenant.name, count, next(self._seq), [True] * count)
        book.in_flight += count
        self.in_flight += count
        book.live[ticket.seq] = ticket
        return ticket

    def release(self, ticket: Ticket, index: int) -> None:
        """Engine request ``index`` of the ticket is over (finished, cancelled and confirmed by the engine,
        or never submitted): give its share back. Idempotent."""
        if index >= len(ticket.live) or not ticket.live[index]:
            return
        ticket.live[index] = False
        book = self._books[ticket.tenant]
        book.in_flight -= 1
        self.in_flight -= 1
        if not any(ticket.live):
            book.live.pop(ticket.seq, None)

    def check(self) -> None:
        """The gate's conservation laws (see the module docstring)."""
        for name, book in self._books.items():
            live = sum(on for t in book.live.values() for on in t.live)
            if book.in_flight != live:
                raise InvariantError(f"gate: tenant {name!r} counts {book.in_flight} requests in flight but its "
                                     f"live tickets hold {live}")
        if self.in_flight != sum(b.in_flight for b in self._books.values()):
            raise InvariantError("gate: in-flight requests disagree with the tenants' books")


__all__ = ["AdmissionGate", "NeverFits", "QueueFull", "Ticket"]
