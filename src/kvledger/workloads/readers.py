"""Trace readers: requests with arrival times, prompts and output lengths from a file.

- `load_mooncake`: Mooncake FAST'25 JSONL traces. Each `hash_ids` entry names one 512-token block
  *and its whole prefix*; every id expands to `block_tokens` consecutive synthetic token ids, so two
  requests share exactly the token prefix the trace says they share, and nothing else.
- `load_azure`: Azure LLM inference 2023 CSVs (absolute timestamps, no prefix information).
- `load_lengths`: ShareGPT / arXiv length tables (no arrival times: an arrival process is chosen).
- `load_kvledger`: kvledger's own JSONL / CSV schema.

Every reader returns a list sorted by arrival time (stable, so file order breaks ties) and bounds what it
reads (file size, lengths, timestamps, token ids).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator, Sequence
from datetime import date
from functools import lru_cache
from operator import itemgetter
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .distributions import ArrivalProcess, _arrivals, _rng
from .requests import DEFAULT_TRUST_GROUP, TOKEN_ID_LIMIT, Prompt, SimRequest, _by_arrival, _check_int, _is_int

MOONCAKE_BLOCK_TOKENS = 512
MAX_LENGTH = 10**8  # the longest prompt or output a trace line may declare
MAX_TIMESTAMP_MS = 10**13  # ~300 years: any real trace's timestamps in milliseconds
MAX_TRACE_BYTES = 2**30  # traces larger than 1 GiB are refused before reading


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


__all__ = [
    "AZURE_COLUMNS", "KVLEDGER_FIELDS", "LENGTH_COLUMNS", "MOONCAKE_BLOCK_TOKENS", "load_azure", "load_kvledger",
    "load_lengths", "load_mooncake",
]
