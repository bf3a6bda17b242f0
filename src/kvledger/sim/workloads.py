"""Simulator workloads: requests with arrival times, prompts and output lengths.

Sources:
- `load_mooncake`: Mooncake FAST'25 JSONL traces. Each `hash_ids` entry names one 512-token block
  *and its whole prefix*; every id expands to `block_tokens` consecutive synthetic token ids, so two
  requests share exactly the token prefix the trace says they share, and nothing else.
- `load_azure`: Azure LLM inference 2023 CSVs (absolute timestamps, no prefix information).
- `load_lengths`: ShareGPT / arXiv length tables (no arrival times: an arrival process is chosen).
- `synthetic`: a seeded generator with shared system prompts, trust groups and n > 1.

Prompts are stored compactly as runs of consecutive token ids (`Prompt`); `SimRequest.prompt_tokens`
is that `Prompt`, a read-only `Sequence[int]`, and `.tolist()` materialises a real list on demand.
Token ids are synthetic identifiers for prefix matching, not ids in any model's vocabulary.

Every loader returns a list sorted by arrival time (stable, so file order breaks ties).
"""

from __future__ import annotations

import csv
import json
import math
import random
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import date
from functools import lru_cache
from itertools import chain, pairwise
from operator import itemgetter
from pathlib import Path
from typing import Any, Protocol

from ..core.registry import Registry
from ..errors import ConfigError

TOKEN_ID_LIMIT = 2**32  # token ids are hashed as little-endian uint32 by the ledger
DEFAULT_TRUST_GROUP = "default"  # CacheContext's default trust group
MOONCAKE_BLOCK_TOKENS = 512
MAX_LENGTH = 10**8  # the longest prompt or output a trace line may declare
MAX_TIMESTAMP_MS = 10**13  # ~300 years: any real trace's timestamps in milliseconds
MAX_TRACE_BYTES = 2**30  # traces larger than 1 GiB are refused before reading


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
            if isinstance(arrival, bool) or not isinstance(arrival, int | float) \
                    or not math.isfinite(arrival) or arrival < 0:
                raise ConfigError(f"request {self.request_id!r}: arrival_s must be a finite number >= 0, "
                                  f"got {arrival!r}")
            object.__setattr__(self, "arrival_s", float(arrival))
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


# ---- distributions ---------------------------------------------------------------------------


class IntDist(Protocol):
    """A distribution of integers: token lengths, n, priorities."""

    def sample(self, rng: random.Random) -> int: ...


@dataclass(frozen=True, slots=True)
class Fixed:
    value: int

    def __post_init__(self) -> None:
        _check_int(self.value, "Fixed value", 0)

    def sample(self, rng: random.Random) -> int:
        return self.value


@dataclass(frozen=True, slots=True)
class Uniform:
    """Integers uniform on [low, high], both included."""

    low: int
    high: int

    def __post_init__(self) -> None:
        _check_int(self.low, "Uniform low", 0)
        _check_int(self.high, "Uniform high", self.low)

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclass(frozen=True, slots=True)
class LogNormal:
    """Log-normal with the given mean and coefficient of variation (std / mean), rounded to an
    integer and clipped to [low, high] (clipping moves the mean a little for heavy tails)."""

    mean: float
    cv: float
    low: int = 1
    high: int | None = None

    def __post_init__(self) -> None:
        if not self.mean > 0 or not self.cv > 0:
            raise ConfigError(f"LogNormal needs mean > 0 and cv > 0, got mean={self.mean!r} cv={self.cv!r}")
        _check_int(self.low, "LogNormal low", 0)
        if self.high is not None:
            _check_int(self.high, "LogNormal high", max(self.low, 1))

    def sample(self, rng: random.Random) -> int:
        sigma2 = math.log1p(self.cv * self.cv)
        value = round(rng.lognormvariate(math.log(self.mean) - sigma2 / 2, math.sqrt(sigma2)))
        value = max(self.low, value)
        return value if self.high is None else min(self.high, value)


@dataclass(frozen=True, slots=True)
class Choice:
    """One of `values`, with optional relative `weights`."""

    values: tuple[int, ...]
    weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(self.values))
        if not self.values or not all(_is_int(v) for v in self.values):
            raise ConfigError(f"Choice needs at least one integer value, got {self.values!r}")
        if self.weights is not None:
            object.__setattr__(self, "weights", tuple(self.weights))
            if len(self.weights) != len(self.values) or any(not w >= 0 for w in self.weights) \
                    or not sum(self.weights) > 0:
                raise ConfigError("Choice weights must be one non-negative number per value, not all zero")

    def sample(self, rng: random.Random) -> int:
        if self.weights is None:
            return rng.choice(self.values)
        return rng.choices(self.values, weights=self.weights)[0]


def _as_dist(value: IntDist | int, what: str) -> IntDist:
    if _is_int(value):
        return Fixed(value)
    if not hasattr(value, "sample"):
        raise ConfigError(f"{what} must be an integer or a distribution (Fixed, Uniform, LogNormal, Choice)")
    return value


# ---- arrival processes -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Poisson:
    """Poisson arrivals: exponential gaps with mean 1 / rate_per_s."""

    rate_per_s: float

    def __post_init__(self) -> None:
        rate = self.rate_per_s
        if isinstance(rate, bool) or not (isinstance(rate, int | float) and rate > 0 and math.isfinite(rate)):
            raise ConfigError(f"rate_per_s must be a positive number, got {self.rate_per_s!r}")

    def arrival_times(self, count: int, rng: random.Random) -> list[float]:
        """`count` arrival times; the first request arrives at 0."""
        return _cumulative(rng.expovariate(self.rate_per_s) for _ in range(count - 1))


@dataclass(frozen=True, slots=True)
class Gamma:
    """Renewal arrivals with gamma-distributed gaps: mean 1 / rate_per_s, coefficient of variation
    `cv` (cv = 1 is Poisson; cv > 1 burstier; cv < 1 more regular)."""

    rate_per_s: float
    cv: float

    def __post_init__(self) -> None:
        Poisson(self.rate_per_s)  # same check
        if not (isinstance(self.cv, int | float) and self.cv > 0 and math.isfinite(self.cv)):
            raise ConfigError(f"cv must be a positive number, got {self.cv!r}")

    def arrival_times(self, count: int, rng: random.Random) -> list[float]:
        shape = 1.0 / (self.cv * self.cv)
        scale = 1.0 / (self.rate_per_s * shape)
        return _cumulative(rng.gammavariate(shape, scale) for _ in range(count - 1))


ArrivalProcess = Poisson | Gamma


def _cumulative(gaps: Iterable[float]) -> list[float]:
    out, now = [0.0], 0.0
    for gap in gaps:
        now += gap
        out.append(now)
    return out


def _arrivals(arrivals: ArrivalProcess | Sequence[float], count: int, rng: random.Random) -> list[float]:
    if count == 0:
        return []
    if isinstance(arrivals, Poisson | Gamma):
        return arrivals.arrival_times(count, rng)
    if isinstance(arrivals, Sequence) and not isinstance(arrivals, str | bytes):
        if len(arrivals) < count:
            raise ConfigError(f"{len(arrivals)} arrival times given for {count} requests")
        return [float(t) for t in arrivals[:count]]
    raise ConfigError(f"arrivals must be Poisson(...), Gamma(...) or a list of times, got {arrivals!r}")


def _rng(seed: int, stream: str) -> random.Random:
    # One independent stream per aspect, so changing e.g. the n distribution leaves prompts alone.
    return random.Random(f"kvledger.sim/{seed}/{stream}")


# ---- trace loaders -----------------------------------------------------------------------------


def _open_text(path: Path, binary: bool = False):
    try:
        if not path.is_file():
            raise ConfigError(f"no trace file at {path}")
        if path.stat().st_size > MAX_TRACE_BYTES:
            raise ConfigError(f"trace {path} is larger than {MAX_TRACE_BYTES // 2**20} MiB")
        # utf-8-sig: a byte order mark (spreadsheets write one) is not part of the first column's name.
        return path.open("rb") if binary else path.open(encoding="utf-8-sig", newline="")
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc.strerror or exc}") from None


def _not_utf8(path: Path) -> ConfigError:
    """The refusal of a text trace holding a byte that is not UTF-8, naming the line that holds it (a text
    reader decodes ahead of the lines it has returned, so its own line count is not that line)."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    line = 1
    try:
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as exc:  # exc.object: the bytes held back from the last chunk + this one
                    bad = exc.object
                    line += bad[: exc.start].count(b"\n")
                    return ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{bad[exc.start]:02x})")
                line += chunk.count(b"\n")
    except OSError as exc:
        return ConfigError(f"cannot read trace {path}: {exc.strerror or exc}")
    return ConfigError(f"{path}:{line}: not UTF-8 text (a multi-byte character cut at the end)")


def _short(value: Any) -> str:
    """A value for an error message, cut to 40 characters (a 5,000-digit number is not a message)."""
    text = repr(value) if not isinstance(value, int) or isinstance(value, bool) else (
        str(value) if value.bit_length() < 128 else f"a {value.bit_length()}-bit integer")
    return text if len(text) <= 40 else text[:37] + "..."


def _json_line(loads: Any, line: bytes | str, where: str) -> Any:
    """One JSON value of a JSONL line; every way it can be malformed is one ConfigError naming the line."""
    try:
        return loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); truncated line?") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at column "
                          f"{exc.start + 1})") from None
    except RecursionError:
        raise ConfigError(f"{where}: JSON nested too deeply") from None
    except ValueError as exc:  # e.g. an integer longer than Python's 4,300-digit conversion limit
        raise ConfigError(f"{where}: not usable JSON ({str(exc)[:80]})") from None


def _jsonl_objects(path: Path) -> Iterator[tuple[dict, str]]:
    """Each non-blank line of a JSON Lines trace as a JSON object, with its ``file:line`` for messages."""
    loads = json.loads
    with _open_text(path, binary=True) as fh:  # bytes: json.loads decodes, so bad UTF-8 has a line
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            rec = _json_line(loads, line, where)
            if not isinstance(rec, dict):
                raise ConfigError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            yield rec, where


def _head(path: Path, size: int = 65536) -> str:
    """The first bytes of a trace as text, for sniffing its format: binary or non-UTF-8 files are refused."""
    with _open_text(path, binary=True) as fh:
        raw = fh.read(size)
    if b"\x00" in raw:
        raise ConfigError(f"{path} is a binary file, not a trace")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start >= len(raw) - 4:  # a multi-byte character cut by the read
            return raw[: exc.start].decode("utf-8")
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x})") from None


def _prefix(path: Path, id_prefix: str | None) -> str:
    return f"{path.stem}-" if id_prefix is None else id_prefix


def _check_token_space(top: int, path: Path) -> None:
    if top > TOKEN_ID_LIMIT:
        raise ConfigError(f"{path}: synthetic token ids would exceed {TOKEN_ID_LIMIT - 1}; lower token_base")


def load_mooncake(path: str | Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS, *,
                  trust_group: str = DEFAULT_TRUST_GROUP, id_prefix: str | None = None,
                  token_base: int = 0) -> list[SimRequest]:
    """Load a Mooncake JSONL trace (`timestamp` ms, `input_length`, `output_length`, `hash_ids`).

    Hash id `h` becomes tokens `token_base + h*block_tokens ... + block_tokens - 1`, the last block cut
    to `input_length`, so equal hash-id prefixes give identical token prefixes. `arrival_s` is the
    timestamp in seconds (the trace's timestamps already count from its start). Blank lines are
    skipped; anything else malformed is a `ConfigError` naming the file and line.
    """
    path = Path(path)
    _check_int(block_tokens, "block_tokens", 1)
    _check_int(token_base, "token_base", 0)
    prefix = _prefix(path, id_prefix)
    out: list[SimRequest] = []
    for rec, where in _jsonl_objects(path):
        try:
            ts, n_in = rec["timestamp"], rec["input_length"]
            n_out, ids = rec["output_length"], rec["hash_ids"]
        except KeyError as exc:
            raise ConfigError(f"{where}: missing key {exc.args[0]!r}") from None
        if not _is_int(ts) or not 0 <= ts <= MAX_TIMESTAMP_MS:
            raise ConfigError(f"{where}: timestamp must be an integer in [0, {MAX_TIMESTAMP_MS}] (ms), "
                              f"got {_short(ts)}")
        if not _is_int(n_in) or not 1 <= n_in <= MAX_LENGTH:
            raise ConfigError(f"{where}: input_length must be an integer in [1, {MAX_LENGTH:,}], "
                              f"got {_short(n_in)}")
        if not _is_int(n_out) or not 0 <= n_out <= MAX_LENGTH:
            raise ConfigError(f"{where}: output_length must be an integer in [0, {MAX_LENGTH:,}], "
                              f"got {_short(n_out)}")
        if not isinstance(ids, list):
            raise ConfigError(f"{where}: hash_ids must be a list, got {type(ids).__name__}")
        try:
            prompt = Prompt.from_blocks(ids, block_tokens, n_in, token_base)
        except ConfigError as exc:
            raise ConfigError(f"{where}: hash_ids: {exc}") from None
        out.append(SimRequest(f"{prefix}{len(out)}", ts / 1000.0, prompt, n_out, trust_group))
    return _by_arrival(out)


def _csv_rows(path: Path, required: Sequence[str]) -> Iterator[tuple[int, tuple[str, ...]]]:
    """(line number, texts of the `required` columns in that order) for each data row; the header and
    every row's field count are checked."""
    with _open_text(path) as fh:
        reader = csv.reader(fh)
        try:
            header = next(reader, None)
        except UnicodeDecodeError:
            raise _not_utf8(path) from None
        except csv.Error as exc:
            raise ConfigError(f"{path}:1: cannot parse the CSV header ({exc})") from None
        if header is None:
            raise ConfigError(f"{path}: empty file (expected a header {','.join(required)})")
        header = [h.strip() for h in header]
        missing = [c for c in required if c not in header]
        if missing:
            raise ConfigError(f"{path}:1: missing column(s) {', '.join(missing)} "
                              f"in header {','.join(header)}")
        pick = itemgetter(*(header.index(c) for c in required))
        width = len(header)
        while True:
            try:
                row = next(reader)
            except StopIteration:
                return
            except UnicodeDecodeError:
                raise _not_utf8(path) from None
            except csv.Error as exc:
                raise ConfigError(f"{path}:{reader.line_num}: cannot parse CSV ({exc})") from None
            if not row:
                continue  # blank line
            if len(row) != width:
                raise ConfigError(f"{path}:{reader.line_num}: expected {len(header)} fields "
                                  f"({','.join(header)}), got {len(row)}; truncated line?")
            yield reader.line_num, pick(row)


def _int_field(text: str, column: str, where: tuple[Path, int], minimum: int, maximum: int = 10**8) -> int:
    stripped = text.strip()
    if len(stripped) > 20 or not stripped.lstrip("+-").isdigit():
        raise ConfigError(f"{where[0]}:{where[1]}: column {column} must be an integer, got {_short(text)}")
    value = int(stripped)
    if not minimum <= value <= maximum:
        raise ConfigError(f"{where[0]}:{where[1]}: column {column} must be in [{minimum}, {maximum:,}], got {value}")
    return value


@lru_cache(maxsize=256)
def _day_seconds(day: str) -> int:
    return date.fromisoformat(day).toordinal() * 86400


def _parse_timestamp_ns(text: str, where: tuple[Path, int]) -> int:
    """`YYYY-MM-DD HH:MM:SS[.fraction]` (up to 9 fractional digits; Azure writes 7) -> ns since the
    proleptic epoch. No time zone: only differences are used."""
    try:
        day, clock = text.strip().split(" ")
        hh, mm, ss = clock.split(":")
        whole, _, frac = ss.partition(".")
        if len(frac) > 9 or (frac and not frac.isdigit()) or not (whole.isdigit() and hh.isdigit()
                                                                 and mm.isdigit()):
            raise ValueError
        seconds = _day_seconds(day) + int(hh) * 3600 + int(mm) * 60 + int(whole)
        if int(hh) > 23 or int(mm) > 59 or int(whole) > 60:
            raise ValueError
        return seconds * 10**9 + int(frac.ljust(9, "0") or 0)
    except ValueError:
        raise ConfigError(f"{where[0]}:{where[1]}: TIMESTAMP must look like 2023-11-16 18:17:03.9799600, "
                          f"got {text!r}") from None


AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
LENGTH_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")


def load_azure(path: str | Path, *, trust_group: str = DEFAULT_TRUST_GROUP, id_prefix: str | None = None,
               token_base: int = 0) -> list[SimRequest]:
    """Load an Azure LLM inference trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`).

    `arrival_s` counts from the earliest timestamp. The trace has no prefix information, so every
    prompt gets its own fresh token ids (no two requests share a token).
    """
    path = Path(path)
    _check_int(token_base, "token_base", 0)
    prefix = _prefix(path, id_prefix)
    rows = []
    for lineno, (ts, n_in, n_out) in _csv_rows(path, AZURE_COLUMNS):
        where = (path, lineno)
        rows.append((_parse_timestamp_ns(ts, where), _int_field(n_in, "ContextTokens", where, 1),
                     _int_field(n_out, "GeneratedTokens", where, 0)))
    t0 = min((r[0] for r in rows), default=0)
    out, next_id = [], token_base
    for i, (t_ns, n_in, n_out) in enumerate(rows):
        _check_token_space(next_id + n_in, path)
        prompt = Prompt._canonical([[next_id, n_in]])
        out.append(SimRequest(f"{prefix}{i}", (t_ns - t0) / 1e9, prompt, n_out, trust_group))
        next_id += n_in
    return _by_arrival(out)


def load_lengths(path: str | Path, *, arrivals: ArrivalProcess | Sequence[float], seed: int = 0,
                 limit: int | None = None, shuffle: bool = False, trust_group: str = DEFAULT_TRUST_GROUP,
                 id_prefix: str | None = None, token_base: int = 0) -> list[SimRequest]:
    """Load a length table (`num_prefill_tokens,num_decode_tokens,...`: ShareGPT, arXiv) and give
    it arrival times from `arrivals` (a seeded `Poisson` / `Gamma` process, or explicit times).

    `shuffle` permutes the rows (seeded) before `limit` keeps the first rows. Every prompt gets
    fresh token ids: these tables carry no prefix information.
    """
    path = Path(path)
    _check_int(token_base, "token_base", 0)
    if limit is not None:
        _check_int(limit, "limit", 0)
    prefix = _prefix(path, id_prefix)
    rows = []
    for lineno, (n_in, n_out) in _csv_rows(path, LENGTH_COLUMNS):
        where = (path, lineno)
        rows.append((_int_field(n_in, "num_prefill_tokens", where, 1),
                     _int_field(n_out, "num_decode_tokens", where, 0)))
    if shuffle:
        _rng(seed, "shuffle").shuffle(rows)
    if limit is not None:
        rows = rows[:limit]
    times = _arrivals(arrivals, len(rows), _rng(seed, "arrivals"))
    out, next_id = [], token_base
    for i, ((n_in, n_out), t) in enumerate(zip(rows, times, strict=True)):
        _check_token_space(next_id + n_in, path)
        out.append(SimRequest(f"{prefix}{i}", t, Prompt._canonical([[next_id, n_in]]), n_out, trust_group))
        next_id += n_in
    return _by_arrival(out)


# ---- kvledger's own trace schema ----------------------------------------------------------------

KVLEDGER_FIELDS = ("arrival_s", "prompt_len", "output_len", "group", "prefix", "prefix_len", "n", "priority")
KVLEDGER_REQUIRED = KVLEDGER_FIELDS[:3]
_PREFIX_SPAN = 2**22  # token ids reserved per named prefix (the longest shared prefix)


def _kvledger_request(rec: dict[str, Any], where: str, index: int, prefix_ids: dict[str, int], next_id: int,
                      id_prefix: str) -> tuple[SimRequest, int]:
    unknown = sorted(set(rec) - set(KVLEDGER_FIELDS) - {"id"})
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)[:80]} (accepted: "
                          f"{', '.join(KVLEDGER_FIELDS)}, id)")
    missing = [k for k in KVLEDGER_REQUIRED if rec.get(k) in (None, "")]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)} (required: {', '.join(KVLEDGER_REQUIRED)})")

    def num(key: str, lo: int, hi: int, default: int | None = None) -> int:
        value = rec.get(key, default)
        if value in (None, ""):
            value = default
        if isinstance(value, str):
            text = value.strip()
            if len(text) > 20 or not text.lstrip("+-").isdigit():
                raise ConfigError(f"{where}: {key} must be an integer in [{lo}, {hi:,}], got {_short(value)}")
            value = int(text)
        if not _is_int(value) or not lo <= value <= hi:
            raise ConfigError(f"{where}: {key} must be an integer in [{lo}, {hi:,}], got {_short(value)}")
        return value

    raw = rec["arrival_s"]
    try:
        arrival = float(raw) if isinstance(raw, int | float | str) and not isinstance(raw, bool) \
            and len(str(raw)) <= 32 else math.nan
    except ValueError:
        arrival = math.nan
    if not (math.isfinite(arrival) and 0 <= arrival <= 1e10):
        raise ConfigError(f"{where}: arrival_s must be a number of seconds in [0, 1e10], got {_short(raw)}")
    prompt_len = num("prompt_len", 1, MAX_LENGTH)
    output_len = num("output_len", 0, MAX_LENGTH)
    prefix_len = num("prefix_len", 0, _PREFIX_SPAN, 0)
    prefix = rec.get("prefix")
    group = rec.get("group") or DEFAULT_TRUST_GROUP
    for key, value in (("prefix", prefix), ("group", group), ("id", rec.get("id"))):
        if value is not None and (not isinstance(value, str) or len(value) > 128):
            raise ConfigError(f"{where}: {key} must be a string of at most 128 characters")
    if prefix_len and not prefix:
        raise ConfigError(f"{where}: prefix_len without a prefix name")
    if prefix_len > prompt_len:
        raise ConfigError(f"{where}: prefix_len ({prefix_len}) exceeds prompt_len ({prompt_len})")
    runs: list[tuple[int, int]] = []
    if prefix and prefix_len:
        if prefix not in prefix_ids and len(prefix_ids) >= 512:
            raise ConfigError(f"{where}: more than 512 named prefixes")
        runs.append((prefix_ids.setdefault(prefix, len(prefix_ids)) * _PREFIX_SPAN, prefix_len))
    own = prompt_len - prefix_len
    if own:
        _check_token_space(next_id + own, Path(where.split(":")[0]))
        runs.append((next_id, own))
        next_id += own
    rid = rec.get("id") or f"{id_prefix}{index}"
    req = SimRequest(str(rid), arrival, Prompt(runs), output_len, str(group), num("n", 1, 1024, 1),
                     num("priority", -10**6, 10**6, 0))
    return req, next_id


def load_kvledger(path: str | Path, *, id_prefix: str | None = None) -> list[SimRequest]:
    """Load a trace in kvledger's own schema, JSON Lines (`.jsonl`) or CSV with a header.

    Fields (one request per line): `arrival_s` (seconds from the trace start), `prompt_len`, `output_len`
    (required); `group` (trust group), `prefix` and `prefix_len` (the first `prefix_len` prompt tokens are
    shared with every request naming the same prefix), `n` (parallel samples), `priority`, `id`.
    """
    path = Path(path)
    prefix = _prefix(path, id_prefix)
    prefix_ids: dict[str, int] = {}
    next_id = 512 * _PREFIX_SPAN  # private tokens above every named prefix's range
    out: list[SimRequest] = []
    if path.suffix == ".jsonl":
        for rec, where in _jsonl_objects(path):
            req, next_id = _kvledger_request(rec, where, len(out), prefix_ids, next_id, prefix)
            out.append(req)
    else:
        with _open_text(path) as fh:
            reader = csv.DictReader(fh)
            try:
                header = [h.strip() for h in (reader.fieldnames or [])]
                bad = [h for h in header if h not in KVLEDGER_FIELDS and h != "id"]
                if bad or not set(KVLEDGER_REQUIRED) <= set(header):
                    raise ConfigError(f"{path}:1: header {','.join(header)[:80]} is not kvledger's schema "
                                      f"(columns: {', '.join(KVLEDGER_FIELDS)}, id; required: "
                                      f"{', '.join(KVLEDGER_REQUIRED)})")
                for rec in reader:
                    where = f"{path}:{reader.line_num}"
                    if None in rec:
                        raise ConfigError(f"{where}: more fields than the header has")
                    clean = {k.strip(): v for k, v in rec.items() if v not in (None, "")}
                    req, next_id = _kvledger_request(clean, where, len(out), prefix_ids, next_id, prefix)
                    out.append(req)
            except UnicodeDecodeError:
                raise _not_utf8(path) from None
            except csv.Error as exc:
                raise ConfigError(f"{path}:{reader.line_num}: cannot parse CSV ({str(exc)[:80]})") from None
    return _by_arrival(out)


# ---- the trace-format registry -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceFormat:
    """A trace format: how to recognise it from its first line and how to load it.

    `columns` are the CSV header columns (or JSON keys) that identify it; `needs_arrivals` formats carry no
    arrival times, so `load_trace` asks for an arrival process (`arrivals=`).
    """

    name: str
    description: str
    suffix: str  # ".jsonl" or ".csv"
    columns: tuple[str, ...]
    loader: Any
    needs_arrivals: bool = False

    def matches(self, suffix: str, first: str) -> bool:
        if self.suffix == ".jsonl":
            if suffix != ".jsonl":
                return False
            try:
                rec = json.loads(first)
            except (ValueError, RecursionError):
                return False
            return isinstance(rec, dict) and set(self.columns) <= set(rec)
        if suffix == ".jsonl":
            return False
        header = [h.strip() for h in first.split(",")]
        return set(self.columns) <= set(header)


TRACE_FORMATS: Registry[TraceFormat] = Registry("trace format")


def register_trace_format(fmt: TraceFormat, *, replace: bool = False) -> TraceFormat:
    """Add a format to the registry (the CLI's --trace-format choices come from it)."""
    return TRACE_FORMATS.register(fmt.name, fmt, fmt.description, replace=replace)


for _fmt in (
    TraceFormat("mooncake", "Mooncake FAST'25 JSONL: timestamp (ms), input_length, output_length, hash_ids",
                ".jsonl", ("timestamp", "input_length", "output_length", "hash_ids"), load_mooncake),
    TraceFormat("azure", "Azure LLM inference 2023 CSV: TIMESTAMP,ContextTokens,GeneratedTokens", ".csv",
                AZURE_COLUMNS, load_azure),
    TraceFormat("lengths", "length table CSV (ShareGPT, arXiv): num_prefill_tokens,num_decode_tokens; "
                "arrivals from --rate", ".csv", LENGTH_COLUMNS, load_lengths, needs_arrivals=True),
    TraceFormat("kvledger-jsonl", "kvledger JSONL: arrival_s, prompt_len, output_len [, group, prefix, prefix_len, "
                "n, priority, id]", ".jsonl", KVLEDGER_REQUIRED, load_kvledger),
    TraceFormat("kvledger-csv", "kvledger CSV: arrival_s,prompt_len,output_len[,group,prefix,prefix_len,n,priority,"
                "id]", ".csv", KVLEDGER_REQUIRED, load_kvledger),
):
    register_trace_format(_fmt)


def accepted_formats() -> str:
    """One line naming every registered format and its identifying columns."""
    return "; ".join(f"{f.name} ({','.join(f.columns)})" for f in TRACE_FORMATS.values())


def sniff_trace_format(path: str | Path) -> TraceFormat:
    """The registered format of a trace file, from its suffix and first non-blank line."""
    path = Path(path)
    head = _head(path)
    first = next((line for line in head.splitlines() if line.strip()), "")
    if not first:
        raise ConfigError(f"{path}: empty trace (accepted formats: {accepted_formats()})")
    suffix = ".jsonl" if path.suffix == ".jsonl" else ".csv"
    for fmt in TRACE_FORMATS.values():
        if fmt.matches(suffix, first.lstrip("\ufeff")):
            return fmt
    shown = first.strip()[:80]
    kind = "JSON keys of the first line" if suffix == ".jsonl" else "CSV header"
    raise ConfigError(f"{path}: unknown trace format ({kind} {shown!r}); accepted: {accepted_formats()}")


def trace_has_arrivals(path: str | Path) -> bool:
    """Whether a trace file carries its own arrival times: its sniffed format needs no arrival process
    (``TraceFormat.needs_arrivals``). The one answer every trace reader asks (the load client, diagnose);
    a file that cannot be read or sniffed counts as timed, so that loading it says what is wrong."""
    try:
        return not sniff_trace_format(path).needs_arrivals
    except (ConfigError, OSError):
        return True


def load_trace(path: str | Path, format: str | None = None, **kwargs: Any) -> list[SimRequest]:  # noqa: A002
    """Load a trace of any registered format (`TRACE_FORMATS`), named or sniffed from the file.

    Formats that carry no arrival times (`lengths`) need `arrivals=` (a Poisson/Gamma process or times).
    Keyword arguments a format's loader does not take are dropped, so one call fits every format.
    """
    path = Path(path)
    if format is None:
        fmt = sniff_trace_format(path)
    else:
        fmt = TRACE_FORMATS.get(format)
        if fmt is None:
            raise ConfigError(f"unknown trace format {format!r}; known: {', '.join(TRACE_FORMATS)}")
    import inspect

    known = {name for f in TRACE_FORMATS.values() for name in inspect.signature(f.loader).parameters}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ConfigError(f"load_trace got unknown argument(s) {', '.join(unknown)}")
    accepted = inspect.signature(fmt.loader).parameters
    args = {k: v for k, v in kwargs.items() if k in accepted}
    if fmt.needs_arrivals and "arrivals" not in args:
        raise ConfigError(f"{path}: a {fmt.name} trace has no arrival times; give an arrival rate")
    return fmt.loader(path, **args)


# ---- synthetic workloads -----------------------------------------------------------------------


def _group_names(trust_groups: int | Sequence[str]) -> list[str]:
    if _is_int(trust_groups):
        _check_int(trust_groups, "trust_groups", 1)
        return [DEFAULT_TRUST_GROUP] if trust_groups == 1 else [f"group-{i}" for i in range(trust_groups)]
    names = list(trust_groups)
    if not names or not all(isinstance(g, str) and g for g in names):
        raise ConfigError(f"trust_groups must be a positive count or non-empty names, got {trust_groups!r}")
    return names


def synthetic(
    count: int,
    *,
    arrivals: ArrivalProcess | Sequence[float],
    prompt_len: IntDist | int,
    output_len: IntDist | int,
    system_prompts: int = 0,
    system_prompt_len: int = 0,
    shared_fraction: float = 0.0,
    trust_groups: int | Sequence[str] = 1,
    n: IntDist | int = 1,
    priority: IntDist | int = 0,
    seed: int = 0,
    id_prefix: str = "syn-",
    token_base: int = 0,
) -> list[SimRequest]:
    """Generate `count` requests, deterministically for a given `seed`.

    A fraction `shared_fraction` of requests starts with one of `system_prompts` shared system
    prompts (chosen uniformly) of `system_prompt_len` tokens; `prompt_len` is the length of the
    request's own part after it, whose token ids are unique to the request. System prompts use the
    same token ids in every trust group: only the ledger's trust isolation keeps them apart.
    Requests go to the trust groups uniformly at random; `n` and `priority` are drawn per request.
    Each aspect draws from its own seeded stream, so changing one leaves the others unchanged.
    """
    _check_int(count, "count", 0)
    _check_int(system_prompts, "system_prompts", 0)
    _check_int(system_prompt_len, "system_prompt_len", 0)
    _check_int(token_base, "token_base", 0)
    if not (isinstance(shared_fraction, int | float) and 0 <= shared_fraction <= 1):
        raise ConfigError(f"shared_fraction must be in [0, 1], got {shared_fraction!r}")
    if shared_fraction > 0 and (system_prompts == 0 or system_prompt_len == 0):
        raise ConfigError("shared_fraction > 0 needs system_prompts >= 1 and system_prompt_len >= 1")
    len_dist, out_dist = _as_dist(prompt_len, "prompt_len"), _as_dist(output_len, "output_len")
    n_dist, prio_dist = _as_dist(n, "n"), _as_dist(priority, "priority")
    groups = _group_names(trust_groups)

    times = _arrivals(arrivals, count, _rng(seed, "arrivals"))
    r_len, r_out, r_share = _rng(seed, "prompt_len"), _rng(seed, "output_len"), _rng(seed, "sharing")
    r_group, r_n, r_prio = _rng(seed, "groups"), _rng(seed, "n"), _rng(seed, "priority")
    next_id = token_base + system_prompts * system_prompt_len  # system prompt k: [base + k*L, base + (k+1)*L)
    out = []
    for i in range(count):
        runs = []
        if shared_fraction and r_share.random() < shared_fraction:
            k = r_share.randrange(system_prompts)
            runs.append((token_base + k * system_prompt_len, system_prompt_len))
        own = len_dist.sample(r_len)
        if own < 0 or (own == 0 and not runs):
            raise ConfigError(f"prompt_len distribution gave {own} tokens for a request "
                              "without a system prompt")
        if own:
            runs.append((next_id, own))
            next_id += own
        if next_id > TOKEN_ID_LIMIT:
            raise ConfigError(f"synthetic token ids would exceed {TOKEN_ID_LIMIT - 1}; "
                              "use fewer or shorter prompts")
        out.append(SimRequest(
            f"{id_prefix}{i}", times[i], Prompt(runs), out_dist.sample(r_out),
            groups[r_group.randrange(len(groups))], n_dist.sample(r_n), prio_dist.sample(r_prio),
        ))
    return _by_arrival(out)


# ---- transforms ------------------------------------------------------------------------------


def scale_time(requests: Iterable[SimRequest], speedup: float) -> list[SimRequest]:
    """Arrival times divided by `speedup`: 2 replays twice as fast (double the load), 0.5 half as fast."""
    if isinstance(speedup, bool) or not isinstance(speedup, int | float) or not (speedup > 0
                                                                                 and math.isfinite(speedup)):
        raise ConfigError(f"speedup must be a positive number, got {speedup!r}")
    return _by_arrival(replace(r, arrival_s=r.arrival_s / speedup) for r in requests)


def offered_rate(requests: Sequence[SimRequest]) -> float:
    """Arrivals per second of a workload: (N - 1) / (last arrival - first arrival)."""
    if len(requests) < 2:
        raise ConfigError("an arrival rate needs at least two requests")
    times = [r.arrival_s for r in requests]
    span = max(times) - min(times)
    if span <= 0:
        raise ConfigError("every request arrives at the same instant: the workload has no arrival rate")
    return (len(requests) - 1) / span


def at_rate(requests: Sequence[SimRequest], rate: float) -> list[SimRequest]:
    """The same requests replayed at `rate` arrivals per second: arrival times scaled so the offered rate is
    `rate`, keeping the workload's burstiness (for Poisson arrivals this equals drawing them at `rate`)."""
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not (0 < rate <= 1e6 and math.isfinite(rate)):
        raise ConfigError(f"rate must be a number of requests per second in (0, 1e6], got {rate!r}")
    reqs = list(requests)
    return scale_time(reqs, rate / offered_rate(reqs))


def scale_lengths(requests: Sequence[SimRequest], scale: float, *, block_size: int = 16,
                  trace_block: int = MOONCAKE_BLOCK_TOKENS) -> list[SimRequest]:
    """Prompts and outputs `scale` times as long, for replaying a trace on a small model or a CPU.

    Every `trace_block` tokens of a prompt (Mooncake's 512-token hash blocks) become `chunk` tokens, a whole
    number of `block_size`-token KV blocks (at least one): a prefix two requests share in the trace is a
    shared run of whole KV blocks after scaling too, never a partial block. Block identities are kept
    (equal trace blocks stay equal), so prefix sharing is exactly the trace's. Outputs of at least one
    token stay at least one token. `kvledger serve-trace --scale` and `kvledger simulate --scale` both use
    this, so a simulated and a real replay see the same lengths.
    """
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 < scale <= 1:
        raise ConfigError(f"scale must be in (0, 1], got {scale!r}")
    _check_int(block_size, "block_size", 1)
    _check_int(trace_block, "trace_block", 1)
    chunk = max(1, round(trace_block * scale / block_size)) * block_size
    ids: dict[int, int] = {}
    out = []
    for r in requests:
        n = r.prompt_len
        length = max(1, round(n * chunk / trace_block))
        keys = [r.prompt_tokens[i] for i in range(0, n, trace_block)][: -(-length // chunk)]
        keys += [keys[-1]] * (-(-length // chunk) - len(keys))  # a prompt that grew past its trace blocks
        dense = [ids.setdefault(k, len(ids)) for k in keys]
        prompt = Prompt.from_blocks(dense, chunk, length)
        output = max(1, round(r.output_len * scale)) if r.output_len else 0
        out.append(replace(r, prompt_tokens=prompt, output_len=output))
    return out


WORKLOAD_TRANSFORMS = ("rate", "speedup")  # sweep keys that change the workload rather than the deployment


def transform_workload(requests: Sequence[SimRequest], key: str, value: float) -> list[SimRequest]:
    """Apply a workload-level sweep value: `rate` (arrivals per second) or `speedup` (times faster)."""
    if key == "rate":
        return at_rate(requests, value)
    if key == "speedup":
        return scale_time(requests, value)
    raise ConfigError(f"unknown workload transform {key!r}; known: {', '.join(WORKLOAD_TRANSFORMS)}")


def slice_requests(requests: Iterable[SimRequest], *, start_s: float | None = None,
                   end_s: float | None = None, first_n: int | None = None,
                   rebase: bool = True) -> list[SimRequest]:
    """Requests arriving in [start_s, end_s), then the first `first_n` of those by arrival.

    With `rebase` (the default) arrival times are shifted by -start_s so the window starts at 0.
    """
    if start_s is not None and end_s is not None and end_s < start_s:
        raise ConfigError(f"end_s ({end_s}) is before start_s ({start_s})")
    if first_n is not None:
        _check_int(first_n, "first_n", 0)
    lo = -math.inf if start_s is None else start_s
    hi = math.inf if end_s is None else end_s
    kept = _by_arrival(r for r in requests if lo <= r.arrival_s < hi)
    if first_n is not None:
        kept = kept[:first_n]
    if rebase and start_s:
        kept = [replace(r, arrival_s=max(0.0, r.arrival_s - start_s)) for r in kept]
    return kept


def assign_trust_groups(requests: Iterable[SimRequest], trust_groups: int | Sequence[str], *,
                        seed: int = 0) -> list[SimRequest]:
    """Put each request in a trust group chosen uniformly at random (seeded). Loaded traces have a
    single group; this splits them into tenants (which also splits their prefix sharing)."""
    groups = _group_names(trust_groups)
    rng = _rng(seed, "groups")
    return [replace(r, trust_group=groups[rng.randrange(len(groups))]) for r in requests]


__all__ = [
    "AZURE_COLUMNS", "KVLEDGER_FIELDS", "LENGTH_COLUMNS", "MOONCAKE_BLOCK_TOKENS", "TOKEN_ID_LIMIT", "TRACE_FORMATS",
    "WORKLOAD_TRANSFORMS", "ArrivalProcess", "Choice", "Fixed", "Gamma", "IntDist", "LogNormal", "Poisson", "Prompt",
    "SimRequest", "TraceFormat", "Uniform", "accepted_formats", "assign_trust_groups", "at_rate", "load_azure",
    "load_kvledger", "load_lengths", "load_mooncake", "load_trace", "offered_rate", "register_trace_format",
    "scale_lengths", "scale_time", "slice_requests", "sniff_trace_format", "synthetic", "transform_workload",
]
