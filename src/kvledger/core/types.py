"""Value types shared by the ledger's modules: requests, decisions, sequence state, usage.

Every public value type checks its fields when it is built, so a wrong-typed call fails with one
:class:`~kvledger.errors.ConfigError` before the ledger changes anything. Counts are integers: ``bool``
and ``float`` are refused (``True`` is not one token, ``2.0`` is not two branches), integer-likes such
as numpy integers are accepted and stored as ``int``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..errors import AdmissionError, ConfigError, LedgerError
from . import checks
from .checks import show
from .identity import CacheContext, MMItem, mm_items_of, request_context
from .table import BlockTable

_DEFAULT_CONTEXT = request_context()


MAX_TOKEN_ID = 2**32 - 1  # token ids are hashed as uint32


def as_token_id(value: object, owner: str) -> int:
    """``value`` as a token id (a plain ``int`` in [0, 2**32)); anything else is a ConfigError naming
    ``owner`` (the sequence or request it was meant for). Integer types such as numpy's convert."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise ConfigError(f"{owner!r}: token id {show(value)} is not an integer")
    token = operator.index(value)
    if not 0 <= token <= MAX_TOKEN_ID:
        raise ConfigError(f"{owner!r}: token id {show(token)} is outside [0, 2**32)")
    return token


class Outcome(str, Enum):
    ADMITTED = "admitted"
    NOT_NOW = "not_now"  # fits an empty pool, but not beside what is running/promised now
    NEVER = "never"  # larger than the whole pool: waiting will not help


@dataclass(frozen=True, slots=True)
class Retention:
    """Retention priority (0..100) for the prompt tokens ``[start, end)``; ``duration_s`` None = forever.
    Used by the ``priority`` eviction policy; ignored by LRU."""

    start: int
    end: int
    priority: int
    duration_s: float | None = None

    def __post_init__(self) -> None:
        start = checks.count(self.start, "Retention.start")
        end = checks.count(self.end, "Retention.end")
        if end < start:
            raise ConfigError(f"Retention range [{show(start)}, {show(end)}) ends before it starts")
        priority = checks.count(self.priority, "Retention.priority")
        if priority > 100:
            raise ConfigError(f"Retention.priority must be in 0..100, got {show(priority)}")
        duration = self.duration_s
        if duration is not None:
            if isinstance(duration, bool) or not isinstance(duration, (int, float)):
                raise ConfigError(f"Retention.duration_s must be seconds or None, got {show(duration)}")
            duration = float(duration)
            if not (math.isfinite(duration) and duration >= 0):
                raise ConfigError(f"Retention.duration_s must be finite and >= 0, got {show(duration)}")
        for name, value in (("start", start), ("end", end), ("priority", priority), ("duration_s", duration)):
            if getattr(self, name) is not value:
                object.__setattr__(self, name, value)


@dataclass(frozen=True, slots=True)
class Request:
    """What admission needs to know.

    ``reserve_new_tokens`` is the output allowance to reserve now; ``None`` means all of
    ``max_new_tokens`` (full reservation, the default policy). ``branches`` > 1 admits n-way sampling:
    the prompt is stored once and each extra branch is charged its own output allowance plus one
    copy-on-write copy of the prompt's partial tail block.

    ``read_prefix_cache=False`` writes the cache but does not read it: the prompt gets no prefix hits
    (every prompt block is computed, as vLLM does for requests that want prompt logprobs), while its
    full blocks still enter the prefix index for later requests when no block holds that identity yet.
    ``readmission=True`` marks a request the scheduler brings back after preemption; its admission
    and prefix-cache figures are counted apart from first admissions (``KVLedger.stats()``).
    ``share_pending=False``: a prompt block another request is still computing (indexed, not yet
    written) is not shared; the prompt's hits stop before it and the request computes its own copy, as
    vLLM does (an engine that writes every block it computes must never write into a shared one).
    ``drop_last_hit_block=True`` (vLLM's rule with an EAGLE drafter): the hit first stops before the
    prompt's last token, then gives up its last block, whose tokens are computed again so the drafter gets
    their hidden states, which the cache does not keep. ``mm_items``: the prompt's images (`MMItem`); each
    is an extra key of exactly the blocks it covers, so text blocks before an image are shared across
    requests with different images, while the blocks it covers and every later one are the image's own.
    """

    request_id: str
    prompt: Sequence[int]
    max_new_tokens: int
    context: CacheContext = _DEFAULT_CONTEXT
    reserve_new_tokens: int | None = None
    branches: int = 1
    retention: tuple[Retention, ...] = ()
    lookahead: int = 0  # speculative slots per step, charged in the reservation, never indexed
    family: str | None = None  # the request a re-admitted branch belongs to (defaults to request_id)
    read_prefix_cache: bool = True
    readmission: bool = False
    share_pending: bool = True
    drop_last_hit_block: bool = False  # give up the prefix hit's last block (a drafter recomputes it: EAGLE)
    mm_items: tuple[MMItem, ...] = ()  # the prompt's images: each keys only the blocks it covers

    def __post_init__(self) -> None:
        if type(self.request_id) is not str or not self.request_id:
            raise ConfigError(f"request_id must be a non-empty string, got {show(self.request_id)}")
        rid = self.request_id
        prompt = self.prompt
        # An immutable copy: the ledger may remember the prompt's digests between admission attempts,
        # which is only sound if nobody can change the tokens behind its back. Token ids themselves are
        # checked by the ledger (once per prompt object), with or without prefix caching.
        if type(prompt) is not tuple:
            if prompt is None or isinstance(prompt, (str, bytes, bytearray)) or not hasattr(prompt, "__iter__"):
                raise ConfigError(f"request {rid!r}: the prompt must be a sequence of token ids, got {show(prompt)}")
            object.__setattr__(self, "prompt", tuple(prompt))
        max_new = checks.count(self.max_new_tokens, f"request {rid!r}: max_new_tokens")
        reserve = self.reserve_new_tokens
        if reserve is not None:
            reserve = checks.count(reserve, f"request {rid!r}: reserve_new_tokens")
            if reserve > max_new:
                raise ConfigError(f"request {rid!r}: reserve_new_tokens must be in [0, max_new_tokens]")
        branches = checks.count(self.branches, f"request {rid!r}: branches", 1)
        lookahead = checks.count(self.lookahead, f"request {rid!r}: lookahead")
        if not isinstance(self.context, CacheContext):
            raise ConfigError(f"request {rid!r}: context must be a CacheContext, got {show(self.context)}")
        retention = self.retention
        if type(retention) is not tuple:
            if isinstance(retention, (str, bytes)) or not hasattr(retention, "__iter__"):
                raise ConfigError(f"request {rid!r}: retention must be Retention ranges, got {show(retention)}")
            retention = tuple(retention)
        for r in retention:
            if not isinstance(r, Retention):
                raise ConfigError(f"request {rid!r}: retention entries must be Retention, got {show(r)}")
        if self.family is not None and (type(self.family) is not str or not self.family):
            raise ConfigError(f"request {rid!r}: family must be a non-empty string or None")
        checks.flag(self.read_prefix_cache, f"request {rid!r}: read_prefix_cache")
        checks.flag(self.readmission, f"request {rid!r}: readmission")
        checks.flag(self.share_pending, f"request {rid!r}: share_pending")
        checks.flag(self.drop_last_hit_block, f"request {rid!r}: drop_last_hit_block")
        if type(self.mm_items) is not tuple or self.mm_items:
            # Within the prompt and its output allowance: a re-admitted swapped sequence's prompt is the part
            # the pool held, its images may lie in the tokens it gets back later (keyed as they fill).
            object.__setattr__(self, "mm_items", mm_items_of(self.mm_items, len(self.prompt) + max_new,
                                                             f"request {rid!r}"))
        for name, value in (("max_new_tokens", max_new), ("reserve_new_tokens", reserve), ("branches", branches),
                            ("lookahead", lookahead), ("retention", retention)):
            if getattr(self, name) is not value:
                object.__setattr__(self, name, value)

    @property
    def reserved_new_tokens(self) -> int:
        """The output allowance admission reserves: ``reserve_new_tokens``, or all of ``max_new_tokens``."""
        return self.max_new_tokens if self.reserve_new_tokens is None else self.reserve_new_tokens


@dataclass(frozen=True, slots=True)
class Decision:
    request_id: str
    outcome: Outcome
    reason: str
    blocks_total: int  # blocks the sequence occupies at its reserved length, shared ones included
    blocks_hit: int  # leading full blocks found in the prefix index (charged once, to nobody new)
    blocks_hit_pending: int  # of those, blocks another request is still filling
    blocks_new: int  # blocks allocated now for the rest of the prompt
    blocks_promised: int  # blocks promised for the reserved output allowance (all branches)
    blocks_branches: int = 0  # of the promises, what the extra branches need (allowance + tail copy)
    # The operator's explanation: the pool-wide free / evictable / promised figures behind the outcome.
    # ``reason`` is what a tenant may see and never quotes them (they reveal other tenants' volume).
    detail: str = ""
    over_quota: bool = False  # refused by its trust group's quota (KVLedger.set_quota), not by the pool

    @property
    def admitted(self) -> bool:
        return self.outcome is Outcome.ADMITTED

    @property
    def blocks_charged(self) -> int:
        """Capacity this admission consumed: new blocks plus promises (hits are charged once, earlier)."""
        return self.blocks_new + self.blocks_promised

    def raise_for_outcome(self) -> Decision:
        if not self.admitted:
            raise AdmissionError(f"request {self.request_id!r} {self.outcome.value}: {self.reason}")
        return self


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy the first ``slots`` token slots of block ``src`` into block ``dst`` before writing ``dst``."""

    src: int
    dst: int
    slots: int


@dataclass(slots=True)
class SequenceState:
    """A running sequence (one branch of a request): its tokens, block table and promises."""

    request_id: str
    context: CacheContext
    root: bytes
    tokens: list[int]
    num_prompt: int
    max_new_tokens: int
    table: BlockTable
    promised: int
    digests: list[bytes] = field(default_factory=list)  # one per identified full block, in order
    computed_mark: int = 0  # tokens confirmed written by mark_computed or a block boundary
    written_blocks: int = 0  # leading blocks known to be written
    hit_blocks: int = 0
    limit: int = 0  # num_prompt + max_new_tokens: the declared maximum length
    cow_tail: bool = False  # the partial tail block may be shared with a sibling branch
    family: str = ""  # the request this branch belongs to
    retention: tuple[Retention, ...] = ()
    reserved_blocks: int = 0  # blocks this branch may hold at its reserved length (incl. lookahead)
    readmitted: bool = False  # admitted again after a preemption (counted apart in statistics)
    # End of the draft slots the last reserve_lookahead made (positions len(tokens)..draft_end - 1). They
    # are private to this sequence: check() names one that lies in a block another sequence holds.
    draft_end: int = 0
    mm_items: tuple[MMItem, ...] = ()  # the prompt's images: a block filled later that one covers is keyed by it

    def __post_init__(self) -> None:
        self.limit = self.num_prompt + self.max_new_tokens
        if not self.family:
            self.family = self.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def num_computed(self) -> int:
        """Tokens whose KV is written. Once a token has been sampled, every earlier token was run
        through the model, so during decode this is ``num_tokens - 1`` (the newest token is written by
        the next step); the ledger only records it eagerly at block boundaries."""
        if len(self.tokens) > self.num_prompt:
            return max(self.computed_mark, len(self.tokens) - 1)
        return self.computed_mark


def pop_known(entries: dict, key: object, what: str) -> Any:
    """``entries.pop(key)``, or the one error for a key that names no entry (``what`` says which kind and
    why it may be gone); an unhashable key names none either."""
    try:
        entry = entries.pop(key, None)  # type: ignore[call-overload]
    except TypeError:
        entry = None
    if entry is None:
        raise LedgerError(f"unknown {what.format(show(key))}")
    return entry


def find_sequence(sequences: Mapping[str, SequenceState], request_id: object) -> SequenceState:
    """``sequences[request_id]``, or the one error every ledger operation gives for an id it does not
    hold (an unhashable id is no sequence's id either)."""
    try:
        return sequences[request_id]  # type: ignore[index]
    except (KeyError, TypeError):
        raise LedgerError(f"unknown sequence {show(request_id)}") from None


@dataclass(frozen=True, slots=True)
class Usage:
    total: int
    free: int
    active: int
    retained: int
    evictable: int
    promised: int
    sequences: int
    pinned: int = 0  # blocks held by pins (part of active)
    deferred: int = 0  # blocks released but still leased (part of active)

    @property
    def available(self) -> int:
        """Blocks a new admission may still claim: free + evictable - already promised."""
        return self.free + self.evictable - self.promised

    def as_dict(self) -> dict[str, int]:
        return {
            "total": self.total, "free": self.free, "active": self.active, "retained": self.retained,
            "evictable": self.evictable, "promised": self.promised, "available": self.available,
            "pinned": self.pinned, "deferred": self.deferred, "sequences": self.sequences,
        }
