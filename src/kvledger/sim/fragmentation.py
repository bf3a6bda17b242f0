"""Fragmentation: where KV memory goes under contiguous reservation versus paged blocks.

The same workload (prompt and output lengths, all queued at t = 0 so memory is the binding constraint)
runs on a KV memory of ``capacity_tokens`` token slots under two kinds of allocator:

* **contiguous**: each request gets one contiguous range of slots for its whole life, placed first-fit in
  a linear address space of ``capacity_tokens`` slots (holes merge when freed). The range is
  ``max`` -- the model's maximum sequence length (Orca (Max)); ``pow2`` -- the true prompt + output
  length rounded up to a power of two, capped at the maximum (Orca (Pow2)); ``oracle`` -- exactly the
  true prompt + output length (Orca (Oracle)). When the head of the queue does not fit although the
  total free space would hold it, that is a *contiguous-hole failure* (counted per refused attempt and
  per request).
* **paged**: the real :class:`~kvledger.core.ledger.KVLedger` with blocks of ``block_size`` slots.
  Admission takes the prompt's blocks (no output reservation, as vLLM does, keeping ``watermark`` of the
  pool free), each token takes a new block when the tail fills, and a request that cannot grow preempts
  the newest running request (recompute: it re-queues at the front and replays prompt + output so far).

Each step every running request gains one token (its prefill happens in its admission step). The pool is
broken down as in Figure 2 of the PagedAttention paper (Kwon et al., SOSP'23), for every request with
allocation ``A`` slots, ``n`` tokens now and final length ``L``:

    token states            n                       KV of tokens that exist
    reservation             min(A, L) - n           slots its future tokens will fill
    internal fragmentation  max(A - L, 0)           slots it will never use
    external frag. & free   capacity - sum(A)       slots no request holds

averaged over the steps in which the queue was not empty (memory-bound steady state). Paged allocation
``A`` is held blocks x block_size plus promised blocks (none under this policy).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.ledger import KVLedger
from ..core.sizing.contiguous import FirstFit
from ..core.types import Outcome, Request
from ..errors import ConfigError, OutOfBlocksError
from ..workloads import SimRequest

CONTIGUOUS_MODES = ("max", "pow2", "oracle")
FIG2_KEYS = ("token_states", "reservation", "internal", "external")

# Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention",
# SOSP 2023, Figure 2 (OPT-13B on ShareGPT): the share of KV memory holding token states. Quoted from
# memory of the figure: 20.4% and 38.2% (the range the text cites for existing systems: "as low as
# 20.4%") are certain; 26.8% (Pow2) and 96.3% (vLLM) are as we recall the bars -- check the paper
# before citing them.
PAPER_TOKEN_STATES = {"max": 0.204, "pow2": 0.268, "oracle": 0.382, "paged": 0.963}
PAPER_CERTAIN = {"max": True, "pow2": False, "oracle": True, "paged": False}


# ---- results ---------------------------------------------------------------------------------------


@dataclass
class FragResult:
    """One allocator on one workload. ``fractions`` are shares of the KV memory (sum to 1)."""

    allocator: str  # "contiguous" | "paged"
    mode: str  # max | pow2 | oracle | paged
    block_size: int | None
    capacity_tokens: int
    fractions: dict[str, float]
    measured_steps: int
    steps: int
    completed: int
    mean_running: float
    peak_running: int
    hole_failures: int = 0  # admission attempts refused although total free space sufficed
    hole_failure_requests: int = 0  # distinct requests that were refused that way at least once
    preemptions: int = 0
    rejected: int = 0  # larger than the whole memory
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.allocator == "paged":
            return f"paged, block {self.block_size}"
        return f"contiguous ({self.mode})"

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "allocator": self.allocator, "mode": self.mode,
                "block_size": self.block_size, "capacity_tokens": self.capacity_tokens, **self.fractions,
                "measured_steps": self.measured_steps, "steps": self.steps, "completed": self.completed,
                "mean_running": self.mean_running, "peak_running": self.peak_running,
                "hole_failures": self.hole_failures, "hole_failure_requests": self.hole_failure_requests,
                "preemptions": self.preemptions, "rejected": self.rejected,
                "paper_token_states": PAPER_TOKEN_STATES.get(self.mode)}


class _Acc:
    """Sums of the Figure 2 components over measured steps."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.sums = dict.fromkeys(FIG2_KEYS, 0)
        self.steps = 0
        self.running = 0
        self.peak = 0

    def add(self, tokens: int, reservation: int, internal: int, external: int, running: int) -> None:
        if tokens + reservation + internal + external != self.capacity:
            raise AssertionError(f"breakdown {tokens}+{reservation}+{internal}+{external} != {self.capacity}")
        s = self.sums
        s["token_states"] += tokens
        s["reservation"] += reservation
        s["internal"] += internal
        s["external"] += external
        self.steps += 1
        self.running += running
        self.peak = max(self.peak, running)

    def fractions(self) -> dict[str, float]:
        total = self.steps * self.capacity
        return {k: (v / total if total else 0.0) for k, v in self.sums.items()}


def _lengths(requests: Sequence[SimRequest | tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for r in requests:
        p, o = (r.prompt_len, r.output_len) if isinstance(r, SimRequest) else r
        if p < 1 or o < 1:
            raise ConfigError(f"fragmentation workloads need prompt >= 1 and output >= 1, got ({p}, {o})")
        out.append((p, o))
    return out


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


# ---- contiguous ------------------------------------------------------------------------------------


def run_contiguous(requests: Sequence[SimRequest | tuple[int, int]], capacity_tokens: int, mode: str,
                   max_len: int) -> FragResult:
    """Per-request contiguous reservation (``max`` | ``pow2`` | ``oracle``), first fit, FCFS."""
    if mode not in CONTIGUOUS_MODES:
        raise ConfigError(f"contiguous mode must be one of {', '.join(CONTIGUOUS_MODES)}, got {mode!r}")
    lengths = _lengths(requests)
    alloc = FirstFit(capacity_tokens)
    waiting = deque(range(len(lengths)))
    running: list[list[int]] = []  # [start, size, final_len, tokens_now, remaining]
    acc = _Acc(capacity_tokens)
    hole_failures = 0
    hole_requests: set[int] = set()
    rejected = completed = steps = 0
    while waiting or running:
        steps += 1
        while waiting:
            i = waiting[0]
            p, o = lengths[i]
            final = p + o
            size = max_len if mode == "max" else min(_pow2(final), max_len) if mode == "pow2" else final
            if final > max_len or size > capacity_tokens:
                waiting.popleft()
                rejected += 1
                continue
            start = alloc.allocate(size)
            if start is None:
                if alloc.free_total >= size:
                    hole_failures += 1
                    hole_requests.add(i)
                break
            waiting.popleft()
            running.append([start, size, final, p, o])
        if waiting:
            tokens = sum(r[3] for r in running)
            reserved = sum(min(r[1], r[2]) for r in running)
            held = sum(r[1] for r in running)
            acc.add(tokens, reserved - tokens, held - reserved, capacity_tokens - held, len(running))
        still = []
        for r in running:
            r[3] += 1
            r[4] -= 1
            if r[4] == 0:
                alloc.free(r[0], r[1])
                completed += 1
            else:
                still.append(r)
        running = still
    return FragResult("contiguous", mode, None, capacity_tokens, acc.fractions(), acc.steps, steps, completed,
                      acc.running / acc.steps if acc.steps else 0.0, acc.peak, hole_failures,
                      len(hole_requests), 0, rejected, {"max_len": max_len})


# ---- paged (the real ledger) -----------------------------------------------------------------------


def run_paged(requests: Sequence[SimRequest | tuple[int, int]], capacity_tokens: int, block_size: int,
              *, watermark: float = 0.01, max_len: int | None = None) -> FragResult:
    """The KVLedger with ``capacity_tokens // block_size`` blocks; incremental growth, recompute
    preemption of the newest request when a running request cannot grow."""
    lengths = _lengths(requests)
    num_blocks = capacity_tokens // block_size
    if num_blocks < 1:
        raise ConfigError(f"capacity {capacity_tokens} holds no block of {block_size} tokens")
    capacity = num_blocks * block_size
    ledger = KVLedger(num_blocks, block_size, prefix_caching=False)
    keep_free = int(watermark * num_blocks)
    waiting = deque(range(len(lengths)))
    generated = [0] * len(lengths)
    running: list[tuple[int, Any, int]] = []  # (request index, its SequenceState, final length), admission order
    acc = _Acc(capacity)
    preemptions = rejected = completed = steps = 0
    base = [0] * len(lengths)
    nxt = 0
    for i, (p, o) in enumerate(lengths):
        base[i] = nxt
        nxt += p + o
    if nxt > 2**32:  # ids 0 .. nxt - 1 must all be 32-bit token ids
        raise ConfigError("workload too large for distinct 32-bit token ids")
    head: tuple[int, int, Request] | None = None  # the queue head's request, kept while it waits
    while waiting or running:
        steps += 1
        while waiting:
            i = waiting[0]
            p, o = lengths[i]
            if max_len is not None and p + o > max_len:
                waiting.popleft()
                rejected += 1
                continue
            done = generated[i]
            if head is None or head[0] != i or head[1] != done:
                prompt = range(base[i], base[i] + p + done)  # a recompute replays prompt + output so far
                head = (i, done, Request(str(i), prompt, o - done, reserve_new_tokens=0))
            decision = ledger.admit(head[2], keep_free)
            if decision.outcome is Outcome.NEVER:
                waiting.popleft()
                rejected += 1
                continue
            if not decision.admitted:
                break
            waiting.popleft()
            running.append((i, ledger.sequence(str(i)), p + o))
        if waiting:
            tokens = reserved = 0
            for _i, seq, final in running:
                n = len(seq.tokens)
                a = (len(seq.table.blocks) + seq.promised) * block_size
                tokens += n
                reserved += a if a < final else final
            held = (ledger.pool.num_active + ledger.promised) * block_size
            acc.add(tokens, reserved - tokens, held - reserved, capacity - held, len(running))
        # One token for every running request: the ledger's batched decode path, and one by one (with
        # preemption of the newest request) from the first request that could not grow.
        k = 0
        try:
            ledger.decode_step([(str(i), base[i] + lengths[i][0] + generated[i]) for i, _s, _f in running])
            k = len(running)
        except OutOfBlocksError:
            while k < len(running):
                i = running[k][0]
                if len(running[k][1].tokens) != lengths[i][0] + generated[i] + 1:
                    break  # the first request whose token was not appended
                k += 1
        while k < len(running):
            i = running[k][0]
            try:
                ledger.append_token(str(i), base[i] + lengths[i][0] + generated[i])
            except OutOfBlocksError:
                victim = running.pop()[0]  # the newest request gives its memory back
                ledger.preempt(str(victim))
                waiting.appendleft(victim)
                preemptions += 1
                continue  # retry the same request (or stop if it was the victim itself)
            k += 1
        still = []
        for entry in running:
            i = entry[0]
            generated[i] += 1
            if generated[i] == lengths[i][1]:
                ledger.release(str(i))
                completed += 1
            else:
                still.append(entry)
        running = still
    return FragResult("paged", "paged", block_size, capacity, acc.fractions(), acc.steps, steps, completed,
                      acc.running / acc.steps if acc.steps else 0.0, acc.peak, 0, 0, preemptions, rejected,
                      {"num_blocks": num_blocks, "watermark": watermark})


def fragmentation_study(requests: Sequence[SimRequest | tuple[int, int]], capacity_tokens: int, *,
                        max_len: int = 8192, block_sizes: Sequence[int] = (8, 16, 32, 64, 128),
                        modes: Sequence[str] = CONTIGUOUS_MODES) -> list[FragResult]:
    """Every contiguous mode, then paged at every block size, on the same workload."""
    out = [run_contiguous(requests, capacity_tokens, m, max_len) for m in modes]
    out += [run_paged(requests, capacity_tokens, bs, max_len=max_len) for bs in block_sizes]
    return out


__all__ = ["CONTIGUOUS_MODES", "FIG2_KEYS", "FirstFit", "FragResult", "PAPER_CERTAIN", "PAPER_TOKEN_STATES",
           "fragmentation_study", "run_contiguous", "run_paged"]
