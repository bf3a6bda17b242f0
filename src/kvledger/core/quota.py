"""Per-trust-group ledgers and quotas: what each group holds and may still take, and its cap.

Every block a sequence or pin references belongs to exactly one trust group: prefix sharing is salted
by the group (identical tokens in two groups are two digests), and forks and families stay in their
request's group. So the pool's referenced blocks and its promises split into one ledger per group:

    active   distinct blocks the group's sequences and pins reference
    promised blocks promised to its sequences (reserved output allowance) and to copy-on-write copies
             of the partial tails its branches share
    growth   blocks its sequences may still take past their reservations, up to their declared maximum
             length (``max(reserved blocks, ceil(max length / block_size))`` per sequence): what
             incremental and predicted admission leave unpromised
    charged  = active + promised + growth

Conservation law (:func:`check_group_ledgers`, run by ``KVLedger.check``): no block is referenced by two
groups; ``sum(active) == pool active - deferred`` (every referenced block, once); ``sum(promised) ==
ledger promised``; ``growth >= 0``.

A sequence's charge is fixed for its life: a promised block that materialises moves from ``promised``
to ``active``, a block gained by growth past the reservation from ``growth`` to ``active``. So a
group's charge changes only when a sequence is admitted, forked or released, and admission is where a
quota is enforced (:class:`QuotaBook`, ``KVLedger.set_quota``): an admission whose addition would take the
group's charge past its cap is ``not_now`` (``never`` when the request's declared maximum alone exceeds the cap),
decided under the ledger's lock with the rest of the decision. Because growth is charged up front, a
capped group's active + promised blocks never exceed its cap, whatever the admission policy, and no
other group's request is ever preempted to keep it there. Forks after admission (``fork``, beam
search's reshuffles) are the request's own branches: they are charged, not refused.

Computing a group's ledger walks the ledger's sequences and the group's blocks: O(sequences + the
group's blocks), done only for admissions of capped groups and for the operator's view (its cap bounds
a capped group's blocks).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError, InvariantError
from . import checks
from .pool import BlockPool
from .promises import PromiseBook
from .types import Decision, Outcome, SequenceState, show

if TYPE_CHECKING:
    from .lifetimes import PinBook
    from .observe import Counters
    from .windows import GroupTables

MAX_QUOTA = 2**40  # bound on a trust group's cap (blocks)


@dataclass(frozen=True, slots=True)
class GroupUsage:
    """One trust group's ledger (see the module docstring)."""

    active: int
    promised: int
    growth: int
    cap: int | None = None  # its quota; None: none

    @property
    def charged(self) -> int:
        return self.active + self.promised + self.growth

    @property
    def headroom(self) -> int | None:
        """Blocks an admission may still add under the cap (None without one; negative past it)."""
        return None if self.cap is None else self.cap - self.charged

    def as_dict(self) -> dict[str, int | None]:
        return {"active": self.active, "promised": self.promised, "growth": self.growth,
                "charged": self.charged, "cap": self.cap}


def max_blocks(seq: SequenceState, block_size: int) -> int:
    """The most blocks ``seq`` may hold: its reservation, or its declared maximum length if longer."""
    return max(seq.reserved_blocks, -(-seq.limit // block_size))


def group_ledgers(seqs: Iterable[SequenceState], pins: Iterable[list[int]], cow_promises: Mapping[int, int],
                  block_group: list[str | None], block_size: int, only: str | None = None,
                  strict: bool = False) -> dict[str, GroupUsage]:
    """Every group's ledger (or only group ``only``'s). ``strict`` raises :class:`InvariantError` when a
    block is referenced by two groups (the audit); otherwise the first group seen keeps it."""
    owner: dict[int, str] = {}
    acc: dict[str, list[int]] = {}

    def hold(block: int, group: str, row: list[int], what: str) -> None:
        held = owner.get(block)
        if held is None:
            owner[block] = group
            row[0] += 1
        elif held != group and strict:
            raise InvariantError(f"{what} {block} is referenced by trust groups {held!r} and {group!r}")

    for seq in seqs:
        group = seq.context.trust_group
        if only is not None and group != only:
            continue
        row = acc.get(group)
        if row is None:
            row = acc[group] = [0, 0, 0]
        blocks = seq.table.blocks
        for b in blocks:
            hold(b, group, row, "block")
        row[1] += seq.promised
        row[2] += max(0, max_blocks(seq, block_size) - len(blocks) - seq.promised)
    for blocks in pins:
        for b in blocks:
            pinned_group = block_group[b]  # a pinned block is a canonical index entry: it has its group
            if pinned_group is None:
                if strict:
                    raise InvariantError(f"pinned block {b} has no trust group")
                continue
            if only is not None and pinned_group != only:
                continue
            row = acc.get(pinned_group)
            if row is None:
                row = acc[pinned_group] = [0, 0, 0]
            hold(b, pinned_group, row, "pinned block")
    for tail, count in cow_promises.items():
        tail_group = owner.get(tail)
        if tail_group is None:
            if strict:
                raise InvariantError(f"copy-on-write promises for block {tail}, which no sequence holds")
            continue
        acc[tail_group][1] += count
    return {g: GroupUsage(a, p, grow) for g, (a, p, grow) in acc.items()}


def check_group_ledgers(ledgers: Mapping[str, GroupUsage], referenced: int, promised: int) -> None:
    """The per-group conservation law against the pool's referenced blocks and the ledger's promises."""
    active = sum(u.active for u in ledgers.values())
    if active != referenced:
        raise InvariantError(f"group ledgers hold {active} active blocks but the pool has {referenced} referenced")
    group_promised = sum(u.promised for u in ledgers.values())
    if group_promised != promised:
        raise InvariantError(f"group ledgers hold {group_promised} promised blocks, the ledger {promised}")
    for group, u in ledgers.items():
        if u.growth < 0 or u.active < 0 or u.promised < 0:
            raise InvariantError(f"trust group {group!r} has a negative ledger entry: {u.as_dict()}")


class QuotaBook:
    """Every trust group's cap, and the group ledgers read against it. Owns the caps; reads the
    ledger's sequences, pins, promises and pool (it has no lock: the ledger calls it under its own)."""

    __slots__ = ("_block_size", "_pins", "_pool", "_promises", "_seqs", "caps", "kv_groups")

    def __init__(self, pool: BlockPool, promises: PromiseBook, seqs: Mapping[str, SequenceState], pins: PinBook,
                 block_size: int) -> None:
        self._pool = pool
        self._promises = promises
        self._seqs = seqs
        self._pins = pins
        self._block_size = block_size
        self.caps: dict[str, int] = {}  # trust group -> cap on its charged blocks
        self.kv_groups: GroupTables | None = None  # a hybrid pool's KV cache groups after the first

    def cap(self, group: str) -> int | None:
        """``group``'s cap, None for none (O(1); no dict lookup while no group has one)."""
        return self.caps.get(group) if self.caps else None

    def set(self, trust_group: str, max_blocks: int | None) -> None:
        if type(trust_group) is not str or not trust_group:
            raise ConfigError(f"a quota names a trust group (a non-empty string), got {show(trust_group)}")
        if max_blocks is not None:
            max_blocks = checks.count(max_blocks, f"quota of trust group {trust_group!r}", minimum=1)
            if max_blocks > MAX_QUOTA:
                raise ConfigError(f"quota of trust group {trust_group!r} must be at most {MAX_QUOTA}, "
                                  f"got {show(max_blocks)}")
        if max_blocks is None:
            self.caps.pop(trust_group, None)
        else:
            self.caps[trust_group] = max_blocks

    def over(self, rid: str, group: str, cap: int, adds: int, total: int, hit: int, pending: int, new_now: int,
             promise: int, branches: int) -> Decision | None:
        """The not-now decision when admitting ``adds`` more blocks to ``group``'s charge would pass its
        cap, else None. The reason speaks of the group's own figures only."""
        usage = self.usage_of(group)
        if usage.charged + adds <= cap:
            return None
        reason = (f"needs {adds} blocks of its trust group's quota of {cap} blocks, of which {usage.charged} are "
                  f"held or committed to its running requests now")
        detail = (f"{reason} (active {usage.active} + promised {usage.promised} + growth {usage.growth})")
        return Decision(rid, Outcome.NOT_NOW, reason, total, hit, pending, new_now, promise, branches, detail,
                        over_quota=True)

    def _ledgers(self, only: str | None = None, strict: bool = False) -> dict[str, GroupUsage]:
        out = group_ledgers(self._seqs.values(), self._pins.held(), self._promises.copies, self._pool.group,
                            self._block_size, only=only, strict=strict)
        if self.kv_groups is not None:  # a hybrid pool: the other KV cache groups' blocks are their sequence's
            for sid, gs in self.kv_groups.seqs.items():
                g = self._seqs[sid].context.trust_group
                if only is None or g == only:
                    u = out.get(g) or GroupUsage(0, 0, 0)
                    out[g] = GroupUsage(u.active + sum(gs.held), u.promised + sum(gs.promised), u.growth)
        return out

    def usage_of(self, group: str) -> GroupUsage:
        u = self._ledgers(only=group).get(group)
        cap = self.caps.get(group)
        return GroupUsage(0, 0, 0, cap) if u is None else GroupUsage(u.active, u.promised, u.growth, cap)

    def usage(self) -> dict[str, GroupUsage]:
        """Every group holding blocks or with a cap, with its cap, by name."""
        out = {g: GroupUsage(u.active, u.promised, u.growth, self.caps.get(g)) for g, u in self._ledgers().items()}
        for g, cap in self.caps.items():
            out.setdefault(g, GroupUsage(0, 0, 0, cap))
        return dict(sorted(out.items()))

    def report(self, counters: Counters) -> dict[str, dict[str, int | None]]:
        """Each group's ledger with its prefix-cache figures of first admissions and its quota refusals."""
        usage = self.usage()
        names = sorted(set(usage) | set(counters.groups) | set(counters.quota_refusals))
        out: dict[str, dict[str, int | None]] = {}
        for g in names:
            u = usage.get(g) or GroupUsage(0, 0, 0, self.caps.get(g))
            q = counters.groups.get(g)
            out[g] = {**u.as_dict(), "query_tokens": q.query_tokens if q else 0,
                      "hit_tokens": q.hit_tokens if q else 0, "quota_refusals": counters.quota_refusals.get(g, 0)}
        return out

    def check(self) -> None:
        """The group ledgers' conservation law (:func:`check_group_ledgers`)."""
        pool = self._pool
        check_group_ledgers(self._ledgers(strict=True), pool.num_active - pool.deferred, self._promises.total)


__all__ = ["MAX_QUOTA", "GroupUsage", "QuotaBook", "check_group_ledgers", "group_ledgers", "max_blocks"]
