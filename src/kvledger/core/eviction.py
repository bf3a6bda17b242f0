"""Eviction policies for retained blocks (ref count 0, still indexed, recoverable by recompute).

A policy only orders the retained set; the pool decides *when* to evict (only when a block is needed and
the free list is empty) and guarantees that only retained blocks are ever offered to a policy.
Every operation is O(1) (amortised) so that releasing or evicting never scans the pool.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class EvictionPolicy(Protocol):
    """Orders retained blocks. ``add`` is called when a block becomes retained (its last reference went
    away), ``remove`` when it leaves the retained set for any reason other than eviction (a new request
    hit it), ``pop_victim`` when the pool needs a block back."""

    def add(self, block: int) -> None: ...
    def add_many(self, blocks: list[int]) -> None: ...
    def remove(self, block: int) -> None: ...
    def pop_victim(self) -> int: ...
    def pop_victims(self, n: int) -> list[int]: ...
    def __len__(self) -> int: ...
    def __contains__(self, block: int) -> bool: ...
    def blocks(self) -> list[int]: ...


class LRUPolicy:
    """Least recently released first.

    The ledger releases a finished sequence's blocks tail first, so within one request the deepest
    (least shareable) blocks become eligible before its shared head -- the same refinement vLLM uses.
    """

    name = "lru"
    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def add(self, block: int) -> None:
        self._order[block] = None

    def add_many(self, blocks: list[int]) -> None:
        self._order.update(dict.fromkeys(blocks))

    def remove(self, block: int) -> None:
        del self._order[block]

    def pop_victim(self) -> int:
        return self._order.popitem(last=False)[0]

    def pop_victims(self, n: int) -> list[int]:
        pop = self._order.popitem
        return [pop(last=False)[0] for _ in range(n)]

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block: int) -> bool:
        return block in self._order

    def blocks(self) -> list[int]:
        """Eviction order, first victim first (for reports and tests; O(n))."""
        return list(self._order)
