"""A first-fit allocator over a linear address space: contiguous ranges in ``[0, capacity)``, holes merged
when freed. What a contiguous KV reservation (one range per request for its whole life) does to memory --
the fragmentation that paging removes -- is measured over it by the simulator's study, the runtime's
fragmentation diagnostics and the web lab's view; all three use this one allocator.
"""

from __future__ import annotations

import bisect

from ...errors import ConfigError


class FirstFit:
    """Contiguous ranges in ``[0, capacity)``: first fit on allocation, holes merged on free."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ConfigError(f"capacity must be >= 1 slot, got {capacity}")
        self.capacity = capacity
        self._starts: list[int] = [0]  # holes, sorted by start
        self._sizes: list[int] = [capacity]
        self.free_total = capacity

    @property
    def holes(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._sizes, strict=True))

    def largest_hole(self) -> int:
        return max(self._sizes, default=0)

    def allocate(self, size: int) -> int | None:
        """Start address of a new range of ``size`` slots, or None if no hole is large enough."""
        for i, hole in enumerate(self._sizes):
            if hole >= size:
                start = self._starts[i]
                if hole == size:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += size
                    self._sizes[i] -= size
                self.free_total -= size
                return start
        return None

    def free(self, start: int, size: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] < start + size or \
                i > 0 and self._starts[i - 1] + self._sizes[i - 1] > start:
            raise ConfigError(f"range [{start}, {start + size}) overlaps a free hole (double free?)")
        self._starts.insert(i, start)
        self._sizes.insert(i, size)
        self.free_total += size
        if i + 1 < len(self._starts) and start + size == self._starts[i + 1]:  # merge right
            self._sizes[i] += self._sizes.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == start:  # merge left
            self._sizes[i - 1] += self._sizes.pop(i)
            self._starts.pop(i)


__all__ = ["FirstFit"]
