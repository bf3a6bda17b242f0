"""A reference greedy decode loop: ledger decides, runner executes.

Not a scheduler (no preemption, no priorities, no budget per step): it admits requests in arrival
order whenever the ledger says they fit, prefills them (in chunks if asked) alongside the running
decodes, and releases each one when it finishes. Tests and benchmarks use it to drive the runtime
end to end through a real :class:`KVLedger`.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..core import KVLedger, Outcome, Request
from ..errors import AdmissionError, ConfigError
from .model import ModelRunner, SeqStep

_CALLS = itertools.count()


@dataclass(slots=True)
class _Live:
    request_id: str
    max_new_tokens: int
    computed: int  # tokens whose K/V is in the cache
    out: list[int] = field(default_factory=list)


@dataclass(slots=True)
class LoopStats:
    steps: int = 0
    max_batch: int = 0
    mixed_steps: int = 0  # steps that ran prefill chunks and decodes together
    cached_prompt_tokens: int = 0  # prompt tokens skipped because the prefix cache already held them


def generate_greedy(
    runner: ModelRunner,
    ledger: KVLedger,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    chunk_size: int | None = None,
    eos_token_id: int | None = None,
    stats: LoopStats | None = None,
) -> list[list[int]]:
    """Greedy-decode every prompt; returns the generated token ids of each (prompt order)."""
    if max_new_tokens <= 0:
        raise ConfigError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if chunk_size is not None and chunk_size <= 0:
        raise ConfigError(f"chunk_size must be positive, got {chunk_size}")
    # Ids unique per call, so one ledger can serve several calls (and other users) side by side.
    ids = [f"greedy-{next(_CALLS)}-{i}" for i in range(len(prompts))]
    waiting = deque((rid, list(p)) for rid, p in zip(ids, prompts, strict=True))
    running: list[_Live] = []
    results: dict[str, list[int]] = {}
    stats = LoopStats() if stats is None else stats
    while waiting or running:
        while waiting:
            rid, prompt = waiting[0]
            decision = ledger.admit(Request(rid, prompt, max_new_tokens))
            if decision.outcome is Outcome.NEVER or (not decision.admitted and not running):
                raise AdmissionError(f"{rid} cannot be admitted: {decision.reason}")
            if not decision.admitted:
                break  # wait for a running sequence to release its blocks
            waiting.popleft()
            # Prefix-cache hits that are already written need no compute, but the last prompt token
            # is always run: its logits give the first output token. (If it sits in a shared full
            # block, rewriting its K/V stores the values already there.)
            ready = min(ledger.ready_tokens(rid), len(prompt) - 1)
            stats.cached_prompt_tokens += ready
            running.append(_Live(rid, max_new_tokens, ready))
        steps, ends = [], []
        for live in running:
            seq = ledger.sequence(live.request_id)
            end = seq.num_tokens if chunk_size is None else min(seq.num_tokens, live.computed + chunk_size)
            steps.append(SeqStep.from_sequence(seq, live.computed, end))
            ends.append(end)
        # Copy-on-write copies the ledger decided (forked tails) must land before this step writes.
        runner.store.copy_blocks(ledger.take_copies())
        logits = runner.forward(steps)
        stats.steps += 1
        stats.max_batch = max(stats.max_batch, len(steps))
        lens = {len(s.token_ids) > 1 for s in steps}
        stats.mixed_steps += len(lens) == 2
        tokens = logits.argmax(-1).tolist()
        still: list[_Live] = []
        for live, end, token in zip(running, ends, tokens, strict=True):
            seq = ledger.sequence(live.request_id)
            live.computed = end
            if end <= seq.num_prompt:  # prompt chunks are marked here; decodes by append_token
                ledger.mark_computed(live.request_id, end)
            if end < seq.num_tokens:  # a prefill chunk that is not the last: no token sampled
                still.append(live)
                continue
            live.out.append(token)
            ledger.append_token(live.request_id, token)  # recorded even when last: the ledger sees it all
            if len(live.out) >= live.max_new_tokens or token == eos_token_id:
                ledger.release(live.request_id)
                results[live.request_id] = live.out
            else:
                still.append(live)
        running = still
    return [results[rid] for rid in ids]


__all__ = ["LoopStats", "generate_greedy"]
