"""The workload request (`SimRequest`) and its compact prompt (`Prompt`): what every trace reader and
generator returns, and what the simulator, the fleet simulator and the load client consume."""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, pairwise
from typing import Any

from ..core import checks
from ..errors import ConfigError

TOKEN_ID_LIMIT = 2**32  # token ids are hashed as little-endian uint32 by the ledger
DEFAULT_TRUST_GROUP = "default"  # CacheContext's default trust group


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(value: Any, what: str, minimum: int) -> int:
    if not _is_int(value) or value < minimum:
        raise ConfigError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


# ---- prompts ---------------------------------------------------------------------------------


class Prompt(Sequence[int]):
    """An immutable token-id sequence stored as runs of consecutive ids.

    `Prompt([(100, 3), (7, 2)])` is the tokens `[100, 101, 102, 7, 8]`. Adjacent runs that continue
    each other are merged, so equal token sequences have equal `runs`. Indexing and `len` are
    O(log runs) and O(1); iteration and `tolist()` build the ids on the fly (C-speed ranges).
    Compares equal to another `Prompt` or a `list` with the same tokens.
    """

    __slots__ = ("_runs", "_ends")

    def __init__(self, runs: Iterable[tuple[int, int]] = ()) -> None:
        merged: list[list[int]] = []
        for run in runs:
            start, length = run
            if not _is_int(start) or not _is_int(length) or start < 0 or length < 0:
                raise ConfigError(f"prompt run must be (start >= 0, length >= 0) integers, got {run!r}")
            if start + length > TOKEN_ID_LIMIT:
                raise ConfigError(f"prompt run {run!r} goes past the largest token id {TOKEN_ID_LIMIT - 1}")
            if length == 0:
                continue
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1][1] += length
            else:
                merged.append([start, length])
        self._set(merged)

    def _set(self, runs: list[list[int]]) -> None:
        if len(runs) == 1:
            start, length = runs[0]
            self._runs: tuple[tuple[int, int], ...] = ((start, length),)
            self._ends: tuple[int, ...] = (length,)
            return
        self._runs = tuple((s, n) for s, n in runs)
        ends, total = [], 0
        for _, n in self._runs:
            total += n
            ends.append(total)
        self._ends = tuple(ends)

    # -- construction --

    @classmethod
    def from_tokens(cls, tokens: Iterable[int]) -> Prompt:
        """Compress explicit token ids (each an integer in [0, 2**32)) into runs."""
        if isinstance(tokens, Prompt):
            return tokens
        runs: list[tuple[int, int]] = []
        start = prev = -2
        for tok in tokens:
            if not _is_int(tok) or not 0 <= tok < TOKEN_ID_LIMIT:
                raise ConfigError(f"token ids must be integers in [0, 2**32), got {tok!r}")
            if tok != prev + 1:
                if prev >= 0:
                    runs.append((start, prev - start + 1))
                start = tok
            prev = tok
        if prev >= 0:
            runs.append((start, prev - start + 1))
        return cls(runs)

    @classmethod
    def from_blocks(cls, block_ids: Sequence[int], block_tokens: int, length: int,
                    token_base: int = 0) -> Prompt:
        """Expand block ids into `length` tokens: id `h` is tokens `token_base + h*block_tokens + j`
        for `j` in `range(block_tokens)`; the last block is truncated so the total is `length`.

        Needs `len(block_ids) == ceil(length / block_tokens)`. Distinct ids give disjoint tokens, so
        two prompts share a token prefix exactly as far as their block ids agree.
        """
        if len(block_ids) != -(-length // block_tokens):
            raise ConfigError(f"{len(block_ids)} block ids cannot hold {length} tokens in blocks of "
                              f"{block_tokens} (need {-(-length // block_tokens)})")
        if not block_ids:
            return cls()
        # type() rather than isinstance: JSON true/false must not pass as block 1/0.
        if not all(type(h) is int for h in block_ids) or min(block_ids) < 0:
            bad = next(h for h in block_ids if type(h) is not int or h < 0)
            raise ConfigError(f"block ids must be non-negative integers, got {bad!r}")
        if token_base + (max(block_ids) + 1) * block_tokens > TOKEN_ID_LIMIT:
            raise ConfigError(f"block id {max(block_ids)} maps past the largest token id "
                              f"{TOKEN_ID_LIMIT - 1}; lower token_base")
        # Split where ids stop counting up by one; each stretch of consecutive ids is one run.
        cuts = [i for i, (a, b) in enumerate(pairwise(block_ids), 1) if b != a + 1]
        runs = []
        lo = 0
        for hi in (*cuts, len(block_ids)):
            runs.append([token_base + block_ids[lo] * block_tokens, (hi - lo) * block_tokens])
            lo = hi
        runs[-1][1] -= len(block_ids) * block_tokens - length  # the last block is partial
        return cls._canonical(runs)

    @classmethod
    def _canonical(cls, runs: list[list[int]]) -> Prompt:
        """Build from runs already known to be valid, non-empty and merged (no checks)."""
        self = cls.__new__(cls)
        self._set(runs)
        return self

    # -- the Sequence protocol --

    @property
    def runs(self) -> tuple[tuple[int, int], ...]:
        """The canonical (start, length) runs."""
        return self._runs

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __iter__(self) -> Iterator[int]:
        return chain.from_iterable(range(s, s + n) for s, n in self._runs)

    def __reversed__(self) -> Iterator[int]:
        return chain.from_iterable(range(s + n - 1, s - 1, -1) for s, n in reversed(self._runs))

    def __getitem__(self, index):  # type: ignore[override]
        size = len(self)
        if isinstance(index, slice):
            start, stop, step = index.indices(size)
            if step != 1:
                return self.tolist()[index]
            return self._slice(start, max(start, stop))
        if not _is_int(index):
            raise TypeError(f"Prompt indices must be integers or slices, not {type(index).__name__}")
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError("Prompt index out of range")
        k = bisect_right(self._ends, index)
        before = self._ends[k - 1] if k else 0
        return self._runs[k][0] + index - before

    def __contains__(self, value: object) -> bool:
        return any(s <= value < s + n for s, n in self._runs) if _is_int(value) else False

    def _slice(self, start: int, stop: int) -> Prompt:
        out: list[tuple[int, int]] = []
        begin = 0
        for (s, _n), end in zip(self._runs, self._ends, strict=True):
            lo, hi = max(start, begin), min(stop, end)
            if lo < hi:
                out.append((s + lo - begin, hi - lo))
            begin = end
            if begin >= stop:
                break
        return Prompt(out)

    def tolist(self) -> list[int]:
        """The token ids as a new list (O(len))."""
        if len(self._runs) == 1:
            s, n = self._runs[0]
            return list(range(s, s + n))
        return list(iter(self))

    def common_prefix_len(self, other: Sequence[int]) -> int:
        """How many leading tokens this prompt shares with `other` (without materialising either)."""
        if not isinstance(other, Prompt):
            other = Prompt.from_tokens(other)
        a, b = self._runs, other._runs
        i = j = 0
        off_a = off_b = 0  # offsets into the current run of each
        shared = 0
        while i < len(a) and j < len(b):
            tok_a, tok_b = a[i][0] + off_a, b[j][0] + off_b
            if tok_a != tok_b:
                break
            step = min(a[i][1] - off_a, b[j][1] - off_b)  # both runs count up together
            shared += step
            off_a += step
            off_b += step
            if off_a == a[i][1]:
                i, off_a = i + 1, 0
            if off_b == b[j][1]:
                j, off_b = j + 1, 0
        return shared

    def __add__(self, other: object) -> Prompt:
        if not isinstance(other, Prompt):
            return NotImplemented
        return Prompt(self._runs + other._runs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Prompt):
            return self._runs == other._runs
        if isinstance(other, list):
            return len(other) == len(self) and self.tolist() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._runs)

    def __repr__(self) -> str:
        shown = ", ".join(f"({s}, {n})" for s, n in self._runs[:4])
        more = ", ..." if len(self._runs) > 4 else ""
        return f"Prompt(len={len(self)}, runs=[{shown}{more}])"


# ---- requests --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a simulated workload.

    `prompt_tokens` may be given as any sequence of token ids; it is stored as a `Prompt`
    (compact runs). Use `prompt_len` for the length and `prompt_tokens.tolist()` for a list.
    `n` is the number of parallel samples; `priority`: larger is more important by convention of
    the scheduler that reads it (the workload only carries it).
    """

    request_id: str
    arrival_s: float
    prompt_tokens: Prompt
    output_len: int
    trust_group: str = DEFAULT_TRUST_GROUP
    n: int = 1
    priority: int = 0

    def __post_init__(self) -> None:
        # Loaders build tens of thousands of these: exact-type fast paths first, full checks after.
        if type(self.prompt_tokens) is not Prompt:
            object.__setattr__(self, "prompt_tokens", Prompt.from_tokens(self.prompt_tokens))
        if not self.prompt_tokens._ends:
            raise ConfigError(f"request {self.request_id!r} has an empty prompt")
        arrival = self.arrival_s
        if type(arrival) is not float or not 0.0 <= arrival < math.inf:
            object.__setattr__(self, "arrival_s", checks.finite(arrival, f"request {self.request_id!r}: arrival_s", 0))
        if type(self.output_len) is not int or self.output_len < 0:
            _check_int(self.output_len, f"request {self.request_id!r}: output_len", 0)
        if type(self.n) is not int or self.n < 1:
            _check_int(self.n, f"request {self.request_id!r}: n", 1)
        if type(self.priority) is not int and not _is_int(self.priority):
            raise ConfigError(f"request {self.request_id!r}: priority must be an integer, "
                              f"got {self.priority!r}")
        if type(self.trust_group) is not str or not self.trust_group:
            if not isinstance(self.trust_group, str) or not self.trust_group:
                raise ConfigError(f"request {self.request_id!r}: trust_group must be a non-empty string")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_tokens)


def _by_arrival(requests: Iterable[SimRequest]) -> list[SimRequest]:
    return sorted(requests, key=lambda r: r.arrival_s)  # stable: ties keep file order


__all__ = ["DEFAULT_TRUST_GROUP", "TOKEN_ID_LIMIT", "Prompt", "SimRequest"]
