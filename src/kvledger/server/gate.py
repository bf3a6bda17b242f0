"""Admission at the HTTP boundary: a bounded queue, per-tenant request limits and block caps.

The engine's ledger decides what runs and when ("not now" keeps a request queued); the gate only keeps
the queue bounded and a tenant inside its share, before anything reaches the engine:

* **queue full** -- requests that wait (held at the gate, or submitted but not yet running) are bounded
  by the server's ``max_queue``; a tenant's ``max_requests`` bounds its requests in flight or waiting.
  Past either, the request gets 429.
* **tenant cap** -- a tenant's ``max_blocks`` bounds the blocks its in-flight requests may claim. At the
  boundary the only sound bound is a request's worst case, ``n x ceil((prompt + max_tokens) / block)``
  (a shared prefix counted once per request): the sum over in-flight requests never exceeds the cap, so
  the tenant can never hold or be promised more. A request larger than the cap on its own can never run
  (400); one that does not fit now waits here, first come first served within its tenant.

Conservation (checked by :meth:`AdmissionGate.check`): per tenant, ``reserved`` is the sum of its live
engine requests' blocks and never exceeds ``max_blocks``; ``in_flight`` is the number of live engine
requests; ``waiting_at_gate`` the number of held tickets. Everything runs on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import InvariantError
from .tenants import Tenant


class QueueFull(Exception):
    """Too many requests are waiting: answer 429."""


class NeverFits(Exception):
    """The request can never run for this tenant: answer 400 with the reason."""


@dataclass(slots=True)
class Ticket:
    """One HTTP request's share: one entry per engine request (a prompt of a batch)."""

    tenant: str
    blocks: list[int]
    seq: int
    live: list[bool] = field(default_factory=list)  # engine request i still holds its share
    admitted: bool = False  # past the gate (its share counted)


@dataclass(slots=True)
class _TenantBook:
    reserved: int = 0  # blocks of its live engine requests
    in_flight: int = 0  # its live engine requests
    queue: deque[Ticket] = field(default_factory=deque)  # held by its block cap, in arrival order
    live: dict[int, Ticket] = field(default_factory=dict)  # tickets with a live engine request
    cap: int | None = None
    cond: asyncio.Condition | None = None


class AdmissionGate:
    def __init__(self, max_queue: int, running: Callable[[], int]) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be an integer >= 1, got {max_queue!r}")
        self.max_queue = max_queue
        self._running = running
        self.in_flight = 0
        self.waiting_at_gate = 0
        self._books: dict[str, _TenantBook] = {}
        self._seq = itertools.count()

    def _book(self, tenant: str) -> _TenantBook:
        book = self._books.get(tenant)
        if book is None:
            book = self._books[tenant] = _TenantBook()
        return book

    def waiting(self) -> int:
        """Requests that wait: held at the gate, or submitted and not yet running."""
        return self.waiting_at_gate + max(0, self.in_flight - self._running())

    def reserved(self, tenant: str) -> int:
        book = self._books.get(tenant)
        return book.reserved if book else 0

    def tenant_in_flight(self, tenant: str) -> int:
        book = self._books.get(tenant)
        return book.in_flight if book else 0

    def tenants(self) -> list[str]:
        return list(self._books)

    def enter(self, tenant: Tenant, blocks_each: list[int]) -> Ticket:
        """A ticket for a request's engine requests (all or none): live at once when the tenant's cap
        allows, else held (await :meth:`admitted`). Raises :class:`NeverFits` or :class:`QueueFull`."""
        cap = tenant.max_blocks
        total, count = sum(blocks_each), len(blocks_each)
        if cap is not None and total > cap:
            raise NeverFits(f"this request may need {total} KV blocks (n x ceil((prompt + max_tokens) / "
                            f"block size)) but your tenant's cap is {cap} blocks: lower max_tokens or n")
        book = self._book(tenant.name)
        book.cap = cap
        if self.waiting() + count > self.max_queue:
            raise QueueFull("too many requests are waiting; retry later")
        if tenant.max_requests is not None and book.in_flight + len(book.queue) + count > tenant.max_requests:
            raise QueueFull(f"your tenant already has {tenant.max_requests} requests in flight or waiting; "
                            "retry later")
        ticket = Ticket(tenant.name, list(blocks_each), next(self._seq))
        if cap is not None and (book.queue or book.reserved + total > cap):
            book.queue.append(ticket)
            self.waiting_at_gate += 1
        else:
            self._go(book, ticket)
        return ticket

    async def admitted(self, ticket: Ticket) -> None:
        """Wait until a held ticket goes live. A caller cancelled while it waits leaves nothing behind."""
        if ticket.admitted:
            return
        book = self._books[ticket.tenant]
        if book.cond is None:
            book.cond = asyncio.Condition()
        try:
            async with book.cond:
                await book.cond.wait_for(lambda: book.queue[0] is ticket
                                         and book.reserved + sum(ticket.blocks) <= (book.cap or 0))
        except BaseException:
            self.abandon(ticket)
            raise
        book.queue.popleft()
        self.waiting_at_gate -= 1
        self._go(book, ticket)
        if book.queue:
            self._notify(book)

    def abandon(self, ticket: Ticket) -> None:
        """A held ticket's request went away before it ran."""
        book = self._books[ticket.tenant]
        if not ticket.admitted and ticket in book.queue:
            book.queue.remove(ticket)
            self.waiting_at_gate -= 1
            if book.queue:
                self._notify(book)

    def _go(self, book: _TenantBook, ticket: Ticket) -> None:
        book.reserved += sum(ticket.blocks)
        book.in_flight += len(ticket.blocks)
        self.in_flight += len(ticket.blocks)
        ticket.live = [True] * len(ticket.blocks)
        ticket.admitted = True
        book.live[ticket.seq] = ticket

    def release(self, ticket: Ticket, index: int) -> None:
        """Engine request ``index`` of the ticket is over (finished, or cancelled and confirmed by the
        engine): give its share back. Idempotent."""
        if index >= len(ticket.live) or not ticket.live[index]:
            return
        ticket.live[index] = False
        book = self._books[ticket.tenant]
        book.reserved -= ticket.blocks[index]
        book.in_flight -= 1
        self.in_flight -= 1
        if not any(ticket.live):
            book.live.pop(ticket.seq, None)
        if book.queue:
            self._notify(book)

    def _notify(self, book: _TenantBook) -> None:
        cond = book.cond
        if cond is None:
            return

        async def wake() -> None:
            async with cond:
                cond.notify_all()

        asyncio.get_running_loop().create_task(wake())

    def check(self) -> None:
        """The gate's conservation laws (see the module docstring)."""
        for name, book in self._books.items():
            live = [(t.blocks[i]) for t in book.live.values() for i, on in enumerate(t.live) if on]
            if book.reserved != sum(live) or book.in_flight != len(live):
                raise InvariantError(f"gate: tenant {name!r} reserves {book.reserved} blocks for {book.in_flight} "
                                     f"requests but its live tickets hold {sum(live)} for {len(live)}")
            if book.cap is not None and book.reserved > book.cap:
                raise InvariantError(f"gate: tenant {name!r} reserves {book.reserved} blocks over its cap {book.cap}")
        if self.in_flight != sum(b.in_flight for b in self._books.values()):
            raise InvariantError("gate: in-flight requests disagree with the tenants' books")
        if self.waiting_at_gate != sum(len(b.queue) for b in self._books.values()):
            raise InvariantError("gate: waiting requests disagree with the tenants' queues")


__all__ = ["AdmissionGate", "NeverFits", "QueueFull", "Ticket"]
