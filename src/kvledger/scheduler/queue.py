"""The waiting queue: admission units in priority order, first come first served among equals.

A unit is the list of branches admitted together (a fresh request, or a preempted family). Units of a
larger ``GenRequest.priority`` are admitted first; within one priority, in arrival order, except that a
preempted unit goes back to the front of its priority (it was admitted before everything still waiting
there). O(1) per operation while one priority is in use (the common case), O(log levels) otherwise.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from .plan import Branch

Unit = list[Branch]


class WaitingQueue:
    __slots__ = ("_levels", "_keys", "_len")

    def __init__(self) -> None:
        self._levels: dict[int, deque[Unit]] = {}
        self._keys: list[int] = []  # -priority of every non-empty level, ascending (highest priority first)
        self._len = 0

    def _level(self, unit: Unit) -> deque[Unit]:
        key = -unit[0].request.priority
        level = self._levels.get(key)
        if level is None:
            level = self._levels[key] = deque()
            bisect.insort(self._keys, key)
        return level

    def append(self, unit: Unit) -> None:
        """A new arrival: behind every unit of its priority."""
        self._level(unit).append(unit)
        self._len += 1

    def appendleft(self, unit: Unit) -> None:
        """A preempted unit: at the front of its priority."""
        self._level(unit).appendleft(unit)
        self._len += 1

    def _drop_if_empty(self, key: int) -> None:
        if not self._levels[key]:
            del self._levels[key]
            self._keys.remove(key)

    def head(self) -> Unit:
        if not self._len:
            raise IndexError("the waiting queue is empty")
        return self._levels[self._keys[0]][0]

    def popleft(self) -> Unit:
        key = self._keys[0] if self._keys else None
        if key is None:
            raise IndexError("the waiting queue is empty")
        unit = self._levels[key].popleft()
        self._len -= 1
        self._drop_if_empty(key)
        return unit

    def remove(self, unit: Unit) -> None:
        key = -unit[0].request.priority
        level = self._levels.get(key)
        if level is None:
            raise ValueError("unit is not waiting")
        level.remove(unit)
        self._len -= 1
        self._drop_if_empty(key)

    def __getitem__(self, i: int) -> Unit:
        if i == 0:
            return self.head()
        for j, unit in enumerate(self):
            if j == i:
                return unit
        raise IndexError(i)

    def __iter__(self) -> Iterator[Unit]:
        """In admission order."""
        for key in list(self._keys):
            yield from list(self._levels[key])

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0


__all__ = ["Unit", "WaitingQueue"]
