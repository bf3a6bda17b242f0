"""Value types shared by the ledger's modules: requests, decisions, sequence state, usage."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from ..errors import AdmissionError
from .identity import CacheContext
from .table import BlockTable

_DEFAULT_CONTEXT = CacheContext()


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


@dataclass(frozen=True, slots=True)
class Request:
    """What admission needs to know.

    ``reserve_new_tokens`` is the output allowance to reserve now; ``None`` means all of
    ``max_new_tokens`` (full reservation, the default policy). ``branches`` > 1 admits n-way sampling:
    the prompt is stored once and each extra branch is charged its own output allowance plus one
    copy-on-write copy of the prompt's partial tail block.
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

    def __post_init__(self) -> None:
        # An immutable copy: the ledger may remember the prompt's digests between admission attempts,
        # which is only sound if nobody can change the tokens behind its back.
        if type(self.prompt) is not tuple:
            object.__setattr__(self, "prompt", tuple(self.prompt))


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
