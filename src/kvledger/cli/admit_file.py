"""`kvledger admit --requests-file`: requests of mixed lengths and trust groups admitted through the real ledger.

The file is JSON Lines or CSV with one request per line:

    prompt      prompt tokens (required)
    max_new     output allowance (required)
    group       trust group [default]
    prefix      name of a prefix this request shares with every request of its group naming it [none]
    prefix_len  tokens of that prefix at the start of the prompt [0]
    id          request id [req-<line>]
    branches    parallel samples (n-way sampling) [1]

Requests are admitted in file order, each reserving what the admission policy reserves (``--policy``,
full output reservation by default, as the seed's lab does) with the policy's watermark kept free; a
refused request does not block later ones. Token ids are synthesised: a named prefix has the same ids in every
group (only the trust group keeps groups apart), the rest of each prompt is private.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from typing import Any

from ..core.identity import request_context
from ..core.ledger import KVLedger, Request
from ..errors import ConfigError
from ..scheduler import SchedulerConfig
from ..scheduler.policies import OutputLengthTracker, reserve_tokens
from .common import read_text

FIELDS = ("prompt", "max_new", "group", "prefix", "prefix_len", "id", "branches")
MAX_REQUESTS = 100_000
MAX_TOTAL_TOKENS = 50_000_000
MAX_PREFIXES = 512
_PREFIX_SPAN = 2**22  # token ids reserved per named prefix
_PRIVATE_BASE = MAX_PREFIXES * _PREFIX_SPAN  # 2**31: private tokens live above every prefix


@dataclass(frozen=True, slots=True)
class FileRequest:
    request_id: str
    prompt: int
    max_new: int
    group: str
    prefix: str | None
    prefix_len: int
    branches: int


def _int(value: Any, what: str, where: str, lo: int, hi: int) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: {what} must be an integer, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        if not text.lstrip("+-").isdigit() or len(text) > 18:
            raise ConfigError(f"{where}: {what} must be an integer in [{lo}, {hi:,}], got {text[:24]!r}")
        value = int(text)
    if not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{where}: {what} must be an integer in [{lo}, {hi:,}], got {str(value)[:24]!r}")
    return value


def _row(rec: dict[str, Any], where: str, index: int) -> FileRequest:
    unknown = sorted(set(rec) - set(FIELDS))
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)[:80]} (accepted: {', '.join(FIELDS)})")
    for key in ("prompt", "max_new"):
        if rec.get(key) in (None, ""):
            raise ConfigError(f"{where}: missing {key!r} (accepted fields: {', '.join(FIELDS)})")
    prompt = _int(rec["prompt"], "prompt", where, 1, 10**7)
    max_new = _int(rec["max_new"], "max_new", where, 0, 10**7)
    group = rec.get("group") or "default"
    prefix = rec.get("prefix") or None
    for what, text in (("group", group), ("prefix", prefix), ("id", rec.get("id"))):
        if text is not None and (not isinstance(text, str) or len(text) > 128):
            raise ConfigError(f"{where}: {what} must be a string of at most 128 characters")
    prefix_len = _int(rec.get("prefix_len") or 0, "prefix_len", where, 0, _PREFIX_SPAN)
    if prefix_len and prefix is None:
        raise ConfigError(f"{where}: prefix_len without a prefix name")
    if prefix_len > prompt:
        raise ConfigError(f"{where}: prefix_len ({prefix_len}) exceeds prompt ({prompt})")
    branches = _int(rec.get("branches") or 1, "branches", where, 1, 1024)
    return FileRequest(str(rec.get("id") or f"req-{index}"), prompt, max_new, str(group), prefix, prefix_len,
                       branches)


def load_requests_file(path: str) -> list[FileRequest]:
    """Parse a JSONL or CSV requests file (see the module doc); every error names the file and line."""
    text = read_text(path, "requests file", limit=64 * 2**20)
    rows: list[FileRequest] = []
    if path.endswith((".jsonl", ".json")):
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except RecursionError:
                raise ConfigError(f"{where}: JSON nested too deeply") from None
            except ValueError as exc:  # JSONDecodeError, and integers past Python's 4,300-digit limit
                raise ConfigError(f"{where}: not valid JSON ({str(exc)[:80]})") from None
            if not isinstance(rec, dict):
                raise ConfigError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            rows.append(_row(rec, where, len(rows)))
            if len(rows) > MAX_REQUESTS:
                raise ConfigError(f"{path}: more than {MAX_REQUESTS:,} requests")
    else:
        try:
            reader = csv.DictReader(io.StringIO(text, newline=""))
            header = reader.fieldnames or []
            bad = [h for h in header if h not in FIELDS]
            if bad or not header:
                raise ConfigError(f"{path}:1: unknown column(s) {', '.join(bad)[:80] or '(none)'}; accepted columns: "
                                  f"{', '.join(FIELDS)}")
            for rec in reader:
                if None in rec:
                    raise ConfigError(f"{path}:{reader.line_num}: more fields than the header has")
                rows.append(_row({k: v for k, v in rec.items() if v not in (None, "")}, f"{path}:{reader.line_num}",
                                 len(rows)))
                if len(rows) > MAX_REQUESTS:
                    raise ConfigError(f"{path}: more than {MAX_REQUESTS:,} requests")
        except csv.Error as exc:
            raise ConfigError(f"{path}: cannot parse CSV ({exc})") from None
    if not rows:
        raise ConfigError(f"{path} holds no requests")
    total = sum(r.prompt * r.branches for r in rows)
    if total > MAX_TOTAL_TOKENS:
        raise ConfigError(f"{path}: {total:,} prompt tokens in all, more than {MAX_TOTAL_TOKENS:,}")
    if len({r.prefix for r in rows if r.prefix}) > MAX_PREFIXES:
        raise ConfigError(f"{path}: more than {MAX_PREFIXES} named prefixes")
    return rows


def admit_requests(rows: list[FileRequest], pool_blocks: int, block_size: int, *, prefix_caching: bool = True,
                   model: str = "file", policy: str = "full") -> dict[str, Any]:
    """Admit `rows` in order into one pool, each reserving what `policy` reserves (the scheduler's code) and
    keeping its watermark free; the decisions and the pool afterwards."""
    ledger = KVLedger(pool_blocks, block_size, prefix_caching=prefix_caching)
    config = SchedulerConfig(policy=policy, token_budget=10**9, prefill_chunk=10**9, max_running=10**6)
    keep_free = config.keep_free(pool_blocks)
    lengths = OutputLengthTracker()  # nothing has finished: `predicted` reserves the whole allowance
    prefixes: dict[str, int] = {}
    private = _PRIVATE_BASE
    decisions = []
    seen: set[str] = set()
    for r in rows:
        if r.request_id in seen:
            raise ConfigError(f"request id {r.request_id!r} appears twice in the requests file")
        seen.add(r.request_id)
        tokens: list[int] = []
        if r.prefix is not None and r.prefix_len:
            start = 1_000 + prefixes.setdefault(r.prefix, len(prefixes)) * _PREFIX_SPAN
            tokens = list(range(start, start + r.prefix_len))
        own = r.prompt - len(tokens)
        tokens += range(private, private + own)
        private += own
        ctx = request_context(r.group, model)
        reserve = reserve_tokens(config, lengths, r.max_new, r.max_new)
        d = ledger.admit(Request(r.request_id, tokens, r.max_new, ctx, reserve_new_tokens=reserve,
                                 branches=r.branches), keep_free)
        decisions.append({"request": r.request_id, "group": r.group, "prompt": r.prompt, "max_new": r.max_new,
                          "branches": r.branches, "outcome": d.outcome.value, "blocks_shared": d.blocks_hit,
                          "blocks_new": d.blocks_new, "blocks_promised": d.blocks_promised, "reason": d.reason})
    ledger.check()
    usage = ledger.usage().as_dict()
    counts: dict[str, int] = {}
    for d in decisions:
        counts[d["outcome"]] = counts.get(d["outcome"], 0) + 1
    return {"policy": policy, "pool_blocks": pool_blocks, "block_size": block_size, "requests": len(rows),
            "groups": len({r.group for r in rows}), "outcomes": counts, "admitted": counts.get("admitted", 0),
            "admitted_blocks": usage["active"] + usage["promised"], "free_blocks_after": usage["available"],
            "usage": usage, "decisions": decisions}


__all__ = ["FIELDS", "FileRequest", "admit_requests", "load_requests_file"]
