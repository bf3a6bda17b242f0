"""Eviction policies for retained blocks (ref count 0, still indexed, recoverable by recompute).

A policy only orders the retained set; the pool decides *when* to evict (only when a block is needed
and the free list is empty) and guarantees that only retained blocks are ever offered to a policy.
Operations are O(1) (LRU) or O(1) amortised plus O(log n) per expiring priority (priority policy), so
releasing or evicting never scans the pool.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable
from itertools import islice
from typing import Any, Protocol

from ..errors import ConfigError, LedgerError
from . import native
from .registry import Registry

DEFAULT_PRIORITY = 35  # the level of a block nobody gave a priority (TensorRT-LLM uses 35 of 0..100)
MAX_PRIORITY = 100


class EvictionPolicy(Protocol):
    """Orders retained blocks. ``add`` is called when a block becomes retained (its last reference went
    away), ``remove`` when it leaves the retained set for any reason other than eviction (a new request
    hit it), ``pop_victims`` when the pool needs blocks back. ``set_priority`` lets a request say how
    valuable a block is when it becomes retained; policies that do not use it ignore it. ``clear``
    forgets everything (the pool calls it when the prefix cache is reset, after evicting every block)."""

    name: str

    def add(self, block: int) -> None: ...
    def add_many(self, blocks: list[int]) -> None: ...
    def remove(self, block: int) -> None: ...
    def pop_victims(self, n: int) -> list[int]: ...
    def set_priority(self, block: int, priority: int, expires_at: float | None) -> None: ...
    def __len__(self) -> int: ...
    def __contains__(self, block: int) -> bool: ...
    def blocks(self) -> list[int]: ...
    def clear(self) -> None: ...


class LRUPolicy:
    """Least recently released first.

    The ledger releases a finished sequence's blocks tail first, so within one request the deepest
    (least shareable) blocks become eligible before its shared head -- a prefix's head is needed by
    every deeper block, so losing it first would strand the rest of the chain.

    The order lives in the native core's ``BlockOrder`` (flat arrays, no object per block) when it is
    available, else in an ``OrderedDict``; a key that is not a block id moves it to the ``OrderedDict``
    for good, so the two never differ in what they do.
    """

    name = "lru"
    __slots__ = ("_order",)

    def __init__(self) -> None:
        fast = native.MODULE
        self._order: OrderedDict[int, None] | Any = fast.BlockOrder() if fast is not None else OrderedDict()

    def _dict(self) -> OrderedDict[int, None]:
        """The order as an ``OrderedDict`` (moved there from the native order, which holds block ids only)."""
        order = self._order
        if type(order) is not OrderedDict:
            order = self._order = OrderedDict.fromkeys(order.to_list())
        return order

    @property
    def native_order(self) -> Any:
        """The native ``BlockOrder`` holding the order, or None (an ``OrderedDict`` holds it)."""
        order = self._order
        return None if type(order) is OrderedDict else order

    def add(self, block: int) -> None:
        order = self._order
        if type(order) is OrderedDict or not order.add(block):
            self._dict()[block] = None

    def add_many(self, blocks: list[int]) -> None:
        order = self._order
        if type(order) is OrderedDict or not order.add_many(blocks):
            self._dict().update(dict.fromkeys(blocks))

    def remove(self, block: int) -> None:
        order = self._order
        if type(order) is OrderedDict:
            del order[block]
        else:
            order.remove(block)

    def pop_victims(self, n: int) -> list[int]:
        order = self._order
        if n > len(order):  # more than there is: refuse before taking any (as PriorityPolicy does)
            raise LedgerError("fewer retained blocks than requested victims")
        if type(order) is not OrderedDict:
            return order.pop_front(n)
        victims = list(islice(order, n))  # the n oldest, read in one C call, then deleted one by one
        for block in victims:
            del order[block]
        return victims

    def set_priority(self, block: int, priority: int, expires_at: float | None) -> None:
        return None

    def peek(self, n: int) -> list[int]:
        """The next ``n`` victims, first victim first, without taking them (O(n); O(retained) while the
        native order holds them)."""
        order = self._order
        if type(order) is OrderedDict:
            return list(islice(order, max(n, 0)))
        return order.to_list()[: max(n, 0)]

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block: int) -> bool:
        return block in self._order

    def blocks(self) -> list[int]:
        """Eviction order, first victim first (for reports and tests; O(n))."""
        order = self._order
        return list(order) if type(order) is OrderedDict else order.to_list()

    def clear(self) -> None:
        self._order.clear()


class PriorityPolicy:
    """Retention priorities with expiry, LRU within a priority level.

    A request may mark token ranges with a priority in 0..100 and an optional duration: a system prompt
    worth keeping for a minute gets 90 for 60 s, a one-off document 10. Eviction takes the lowest level
    first, least recently released within it. When a priority expires the block falls back to
    ``DEFAULT_PRIORITY`` (lazily, when the policy next picks victims). The application knows which
    prefixes will come back; recency alone cannot tell a system prompt from a stale answer.

    With the native core loaded, the state lives in its ``PolicyCore`` (one heap ordered by level, then
    the time the block joined that level: the same order as the buckets here); the code here is the
    reference and the fallback. The native core reads the clock only while an expiry is pending.
    """

    name = "priority"
    _native_kind: int | None = 0  # kvledger.core._native's PolicyCore kind (a subclass runs in Python)
    __slots__ = ("_levels", "_level_of", "_want", "_expiry", "_clock", "_count", "_core")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._levels: dict[int, OrderedDict[int, None]] = {}
        self._level_of: dict[int, int] = {}  # retained block -> its level
        self._want: dict[int, tuple[int, float | None]] = {}  # block -> (priority, expires_at) once set
        self._expiry: list[tuple[float, int]] = []  # heap of (expires_at, block) for raised levels
        self._clock = clock
        self._count = 0
        kind = type(self).__dict__.get("_native_kind")
        fast = native.MODULE
        self._core: Any = None if fast is None or kind is None else fast.PolicyCore(kind, LedgerError, clock)

    @property
    def native_core(self) -> Any:
        """The native ``PolicyCore`` holding this policy's state (the pool calls it directly), or None."""
        return self._core

    def level(self, block: int) -> int | None:
        """The level a retained block sits at now (None: not retained)."""
        if self._core is not None:
            return self._core.level(block)
        return self._level_of.get(block)

    def set_priority(self, block: int, priority: int, expires_at: float | None) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= MAX_PRIORITY:
            raise ConfigError(f"priority must be an integer in 0..{MAX_PRIORITY}, got {priority!r}")
        if self._core is not None:
            self._core.set_want(block, priority, expires_at)
            return
        self._want[block] = (priority, expires_at)

    def _level_for(self, block: int) -> int:
        priority, expires_at = self._want.get(block, (DEFAULT_PRIORITY, None))
        if expires_at is not None:
            if expires_at <= self._clock():
                return DEFAULT_PRIORITY
            heapq.heappush(self._expiry, (expires_at, block))
        return priority

    def add(self, block: int) -> None:
        if self._core is not None:
            self._core.add(block)
            return
        if block in self._level_of:  # twice would count it twice (and corrupt the count)
            raise LedgerError(f"block {block} is retained already")
        level = self._level_for(block)
        bucket = self._levels.get(level)
        if bucket is None:
            bucket = self._levels[level] = OrderedDict()
        bucket[block] = None
        self._level_of[block] = level
        self._count += 1

    def add_many(self, blocks: list[int]) -> None:
        if self._core is not None:
            self._core.add_many(blocks)
            return
        for block in blocks:
            self.add(block)

    def remove(self, block: int) -> None:
        if self._core is not None:
            self._core.remove(block)
            return
        level = self._level_of.pop(block)
        del self._levels[level][block]
        self._count -= 1

    def _expire(self) -> None:
        now = self._clock()
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, block = heapq.heappop(heap)
            level = self._level_of.get(block)
            if level is None or level == DEFAULT_PRIORITY:
                continue  # evicted or re-used since; stale heap entry
            want = self._want.get(block)
            if want is None or want[1] is None or want[1] > now:
                continue  # re-prioritised since (permanently, or with a later expiry)
            del self._levels[level][block]
            self._levels.setdefault(DEFAULT_PRIORITY, OrderedDict())[block] = None
            self._level_of[block] = DEFAULT_PRIORITY

    def pop_victims(self, n: int) -> list[int]:
        if self._core is not None:
            return self._core.pop_victims(n)
        self._expire()
        out: list[int] = []
        for level in sorted(self._levels):  # at most 101 levels
            bucket = self._levels[level]
            while bucket and len(out) < n:
                block = bucket.popitem(last=False)[0]
                del self._level_of[block]
                out.append(block)
            if len(out) == n:
                break
        self._count -= len(out)
        if len(out) < n:
            raise LedgerError("fewer retained blocks than requested victims")
        return out

    def peek(self, n: int) -> list[int]:
        """The next ``n`` victims, first victim first, without taking them."""
        if self._core is not None:
            return self._core.peek(n)
        self._expire()
        out: list[int] = []
        for level in sorted(self._levels):
            for block in self._levels[level]:
                if len(out) >= n:
                    return out
                out.append(block)
        return out

    def forget(self, block: int) -> None:
        """The block lost its identity (freed or evicted): its priority belongs to the old content."""
        if self._core is not None:
            self._core.forget(block)
            return
        self._want.pop(block, None)

    def __len__(self) -> int:
        return self._count if self._core is None else len(self._core)

    def __contains__(self, block: int) -> bool:
        return block in self._level_of if self._core is None else block in self._core

    def blocks(self) -> list[int]:
        if self._core is not None:
            return self._core.blocks()
        self._expire()
        return [b for level in sorted(self._levels) for b in self._levels[level]]


    def clear(self) -> None:
        if self._core is not None:
            self._core.clear()
        self._levels.clear()
        self._level_of.clear()
        self._want.clear()
        self._expiry.clear()
        self._count = 0

    def is_empty(self) -> bool:
        """Nothing retained and nothing remembered (no priority, no pending expiry)."""
        if self._core is not None:
            return not len(self._core) and not self._core.state()["wants"]
        return not (self._count or self._level_of or self._want or self._expiry
                    or any(self._levels.values()))


PolicyFactory = Callable[[Callable[[], float]], EvictionPolicy]

# The one list of eviction policies: name -> factory(clock). CLI choices, the engine, the simulator and
# KVLedger(policy="name") all read it; adding a policy here makes it selectable everywhere.
EVICTION_POLICIES: Registry[PolicyFactory] = Registry("eviction policy")
EVICTION_POLICIES.register(LRUPolicy.name, lambda clock: LRUPolicy(), "least recently used first")
EVICTION_POLICIES.register(PriorityPolicy.name, PriorityPolicy, "lowest priority first, LRU among equals")
DEFAULT_POLICY = LRUPolicy.name


def policy_names() -> tuple[str, ...]:
    """Names of the registered eviction policies, default first (for CLI choices and help text)."""
    return (DEFAULT_POLICY, *sorted(n for n in EVICTION_POLICIES if n != DEFAULT_POLICY))


def make_policy(name: str, clock: Callable[[], float] = time.monotonic) -> EvictionPolicy:
    """A fresh policy by registered name (see :data:`EVICTION_POLICIES`)."""
    factory = EVICTION_POLICIES.get(name) if isinstance(name, str) else None
    if factory is None:
        raise ConfigError(f"unknown eviction policy {name!r}; choose one of {', '.join(policy_names())}")
    return factory(clock)


_POLICY_METHODS = ("add", "add_many", "remove", "pop_victims", "set_priority", "blocks", "__len__",
                   "__contains__")


def as_policy(policy: EvictionPolicy | str | None, clock: Callable[[], float] = time.monotonic) -> EvictionPolicy:
    """What :class:`~kvledger.core.ledger.KVLedger` accepts as ``policy``: None (the default), a
    registered name, or an empty object with the :class:`EvictionPolicy` methods."""
    if policy is None:
        return make_policy(DEFAULT_POLICY, clock)
    if isinstance(policy, str):
        return make_policy(policy, clock)
    missing = [m for m in _POLICY_METHODS if not callable(getattr(policy, m, None))]
    if missing:
        raise ConfigError(f"policy must be an eviction policy or one of {', '.join(policy_names())}; "
                          f"{type(policy).__name__} lacks {', '.join(missing)}")
    if len(policy):
        raise ConfigError("an eviction policy can serve one pool, from empty; this one already holds blocks")
    return policy


from . import eviction_tree  # noqa: E402,F401  (registers lfu, gdsf, arc, s3fifo, sglang-priority)
