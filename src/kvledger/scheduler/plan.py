"""What the scheduler hands the executor each step, and the scheduler's view of a request."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

from ..core.identity import CacheContext
from ..core.types import CopyOp

_DEFAULT_CONTEXT = CacheContext()


@dataclass(frozen=True, slots=True)
class GenRequest:
    """A generation request as the scheduler sees it. ``payload`` carries what only the executor
    needs (sampling parameters, a tokenizer's text): the scheduler never looks inside."""

    request_id: str
    prompt: tuple[int, ...] | list[int]
    max_new_tokens: int
    context: CacheContext = _DEFAULT_CONTEXT
    n: int = 1  # parallel samples (branches)
    priority: int = 0  # larger = more important
    arrival_s: float = 0.0
    stop_token_ids: frozenset[int] = frozenset()
    lookahead: int = 0  # speculative draft slots per decode step
    payload: Any = None


class Status(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True)
class Branch:
    """One sequence of a request (branch 0 has the request's id; others ``<id>/<i>``)."""

    seq_id: str
    request: GenRequest
    tokens: list[int]
    status: Status = Status.WAITING
    computed: int = 0  # tokens whose KV is written
    in_ledger: int = 0  # tokens the ledger knows (the rest are sampled but not yet appended)
    finish_reason: str | None = None
    admitted_order: int = -1
    preemptions: int = 0
    deferred: bool = False  # could not grow this step
    limit: int = 0  # prompt + max_new_tokens: the length at which the branch is done
    host_blocks: list[int] = field(default_factory=list)  # while swapped: host copy of each block

    def __post_init__(self) -> None:
        self.limit = len(self.request.prompt) + self.request.max_new_tokens

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.request.prompt):]


class Work(NamedTuple):
    """Compute KV for token positions ``[start, end)`` of ``seq_id``; ``sample`` when the executor
    must sample a token from the logits of position ``end - 1``. ``lookahead`` draft slots follow.
    (A named tuple: hundreds are made every step, and tuples are the cheapest immutable record.)"""

    seq_id: str
    start: int
    end: int
    sample: bool
    lookahead: int = 0


@dataclass(frozen=True, slots=True)
class Preemption:
    request_id: str
    mode: str  # recompute | swap
    reason: str


@dataclass(slots=True)
class StepPlan:
    step: int
    prefills: list[Work] = field(default_factory=list)
    decodes: list[Work] = field(default_factory=list)
    copies: list[CopyOp] = field(default_factory=list)  # execute first
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    admitted: list[str] = field(default_factory=list)
    preempted: list[Preemption] = field(default_factory=list)
    ended: list[tuple[str, str]] = field(default_factory=list)  # (seq_id, reason) ended while planning
    lease: int | None = None
    transfer_wait_s: float = 0.0  # what the step must wait for transfers that do not overlap

    @property
    def num_tokens(self) -> int:
        return sum(w.end - w.start for w in self.prefills) + sum(1 + w.lookahead for w in self.decodes)

    @property
    def empty(self) -> bool:
        return not (self.prefills or self.decodes or self.swap_out or self.swap_in or self.copies)
