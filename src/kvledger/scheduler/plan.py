"""What the scheduler hands the executor each step, and the scheduler's view of a request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

from ..core.identity import CacheContext, MMItem, mm_items_of, request_context
from ..core.types import CopyOp
from ..errors import ConfigError

_DEFAULT_CONTEXT = request_context()


@dataclass(frozen=True, slots=True)
class GenRequest:
    """A generation request as the scheduler sees it. ``payload`` carries what only the executor
    needs (sampling parameters, a tokenizer's text): the scheduler never looks inside.

    ``arrival_s`` is the time the request arrives on the driver's clock (a driver holds a request back
    until its clock reaches it). ``beam``: the ``n`` branches are the beams of a beam search (the
    executor returns candidates for them, :mod:`kvledger.scheduler.beam` chooses). ``priority``: larger is
    more important, for admission order and for the ``priority`` victim policy. ``read_prefix_cache=False``
    computes the whole prompt even when it is cached (what prompt logprobs need) while still writing its
    blocks to the prefix cache for others."""

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
    beam: bool = False
    read_prefix_cache: bool = True  # False: write the prefix cache but never read it (prompt logprobs)
    drop_last_hit_block: bool = False  # a drafter (EAGLE) recomputes the prefix hit's last block: vLLM's rule
    mm_items: tuple[MMItem, ...] = ()  # the prompt's images: each keys only the prompt blocks it covers


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_request(request: GenRequest) -> None:
    """Raise one ConfigError for a request the scheduler cannot take (before anything changes)."""
    if not isinstance(request, GenRequest):
        raise ConfigError(f"expected a GenRequest, got {type(request).__name__}")
    rid = request.request_id
    if not isinstance(rid, str) or not rid or "/" in rid:
        raise ConfigError(f"a request id must be a non-empty string without '/', got {rid!r}")
    for name, low in (("n", 1), ("max_new_tokens", 1), ("lookahead", 0)):
        value = getattr(request, name)
        if not _is_int(value) or value < low:
            raise ConfigError(f"request {rid!r}: {name} must be an integer >= {low}, got {value!r}")
    if not _is_int(request.priority):
        raise ConfigError(f"request {rid!r}: priority must be an integer, got {request.priority!r}")
    if not request.prompt:
        raise ConfigError(f"request {rid!r} needs a non-empty prompt")
    if not isinstance(request.drop_last_hit_block, bool):
        raise ConfigError(f"request {rid!r}: drop_last_hit_block must be a bool, got {request.drop_last_hit_block!r}")
    if request.mm_items != ():
        mm_items_of(request.mm_items, len(request.prompt), f"request {rid!r}")
    if not isinstance(request.arrival_s, int | float) or request.arrival_s != request.arrival_s:
        raise ConfigError(f"request {rid!r}: arrival_s must be a number, got {request.arrival_s!r}")


class Status(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True)
class Branch:
    """One sequence of a request (branch 0 has the request's id; branch ``i`` is ``<id>/<i>``)."""

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
    # While swapped from a hybrid pool: (KV cache group, table entry, host copy) of its other groups' blocks.
    group_host: list[tuple[int, int, int]] = field(default_factory=list)
    index: int = 0  # the branch index (sampling keys, result order)
    blocks: list[int] = field(default_factory=list)  # while running: the ledger's block table of the branch
    hit_end: int = 0  # while running: tokens covered by the prefix hits found at its admission
    hits_counted: int = 0  # while running: prompt tokens up to here are accounted as computed or skipped
    # While running after a swap-in whose KV must partly be recomputed: the tokens the ledger knows,
    # which are computed again before the sampled tokens after them go to the ledger (appending a
    # token confirms every earlier one as written, and a prefix hit another request is still filling
    # is not). 0 otherwise.
    refill_end: int = 0
    # ... and up to where the KV that came back from the host is valid (what the branch had computed
    # when it was swapped out): past its prefix hits, the refill resumes there.
    refill_resume: int = 0
    ledger_prompt: tuple[int, ...] | None = None  # while queued: the prompt handed to admission, reused

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

    Everything an executor needs is here, so no executor reads the ledger behind the plan: ``request``
    (its id, payload, stop tokens), ``branch`` (the branch index: sampling keys), ``blocks`` (the
    sequence's block table: position ``p`` lives at slot ``p % block_size`` of ``blocks[p // block_size]``,
    with room for the lookahead slots) and ``tokens`` (the branch's token ids; the work computes
    ``tokens[start:end]``). ``blocks`` and ``tokens`` are the scheduler's own lists, shared to keep a step
    cheap: read them, never change them, and do not keep them past ``confirm``. ``groups``: a hybrid model's
    block table per KV cache group (the first is ``blocks``; a sliding group's entries before its window are
    ``core.groups.NULL_BLOCK``); empty for a uniform model, whose one table is ``blocks``.
    (A named tuple: hundreds are made every step, and tuples are the cheapest immutable record.)"""

    seq_id: str
    start: int
    end: int
    sample: bool
    lookahead: int = 0
    request: GenRequest | None = None
    branch: int = 0
    blocks: Sequence[int] = ()
    tokens: Sequence[int] = ()
    groups: tuple[Sequence[int], ...] = ()

    @property
    def request_id(self) -> str:
        return self.request.request_id if self.request is not None else self.seq_id.split("/", 1)[0]

    @property
    def input_ids(self) -> Sequence[int]:
        """The token ids this work computes."""
        return self.tokens[self.start:self.end]


@dataclass(frozen=True, slots=True)
class Preemption:
    request_id: str
    mode: str  # recompute | swap
    reason: str


class SharedRead(NamedTuple):
    """The work of ``seq_id`` reads positions ``[start, end)`` from prefix-cache blocks that ``writer``'s
    work writes in this very plan: blocks ``writer`` was admitted with (indexed, not written yet), whose
    positions the reader skips instead of computing them again.

    The executor contract makes it safe: every work's new K/V of a layer is written before any work of
    the plan reads that layer (one batched forward pass does this by construction). An executor that
    runs works apart must run ``writer``'s before this one, and must not run this one when ``writer``'s
    failed (the driver's fault isolation sends such a reader back to the waiting queue)."""

    seq_id: str
    writer: str
    start: int
    end: int


class Admission(NamedTuple):
    """A request (re-)admitted in this step. ``cached_tokens``: prompt tokens it skips because the prefix
    cache already holds them written. (Blocks another request is still filling are not counted here:
    the request reads them in the step their writer writes them -- :class:`SharedRead` -- or computes
    them itself if nobody will.) ``readmission``: it was admitted before and comes back after a
    preemption."""

    request_id: str
    cached_tokens: int
    readmission: bool


@dataclass(slots=True)
class StepPlan:
    step: int
    prefills: list[Work] = field(default_factory=list)
    decodes: list[Work] = field(default_factory=list)
    copies: list[CopyOp] = field(default_factory=list)  # execute first
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    # Lower tiers (scheduler/transfers.py has the order they run in and what a step waits for):
    demote: list[tuple[int, int]] = field(default_factory=list)  # (evicted device block, tier slot): urgent
    tier_moves: list[tuple[int, int]] = field(default_factory=list)  # (tier slot, slot of a slower tier)
    writeback: list[tuple[int, int]] = field(default_factory=list)  # (retained device block, tier slot): a copy
    promote: list[tuple[int, int]] = field(default_factory=list)  # (tier slot, device block): a prefix comes back
    admitted: list[str] = field(default_factory=list)
    admissions: list[Admission] = field(default_factory=list)  # what each admission found cached
    shared_reads: list[SharedRead] = field(default_factory=list)  # reads of blocks this plan writes
    # (request id, prompt tokens its first branch skips in this step beyond what its admission counted):
    # prefix blocks another request wrote while it waited, or writes in this very plan
    shared_hits: list[tuple[str, int]] = field(default_factory=list)
    preempted: list[Preemption] = field(default_factory=list)
    ended: list[tuple[str, str]] = field(default_factory=list)  # (seq_id, reason) ended while planning
    lease: int | None = None
    transfer_wait_s: float = 0.0  # the swaps' link time by the scheduler's TransferModel (executors split it)

    @property
    def num_tokens(self) -> int:
        return sum(w.end - w.start for w in self.prefills) + sum(1 + w.lookahead for w in self.decodes)

    @property
    def works(self) -> list[Work]:
        """Prefill chunks, then decodes: the order an executor batches them in."""
        return [*self.prefills, *self.decodes]

    @property
    def transfers(self) -> bool:
        return bool(self.copies or self.swap_out or self.swap_in or self.tier_transfers)

    @property
    def tier_transfers(self) -> bool:
        """Demotions, moves, write-backs or promotions: the prefix cache's transfers (no request owns them)."""
        return bool(self.demote or self.tier_moves or self.writeback or self.promote)

    @property
    def empty(self) -> bool:
        return not (self.prefills or self.decodes or self.swap_out or self.swap_in or self.copies
                    or self.tier_transfers)

    @property
    def progressed(self) -> bool:
        """Something happened: work, a transfer, or a request admitted, preempted or ended."""
        return not self.empty or bool(self.admitted or self.preempted or self.ended)
