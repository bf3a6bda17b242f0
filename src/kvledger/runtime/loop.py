"""A minimal greedy generation call: the scheduler's one step loop on a bare runner and ledger.

Not an engine (no streaming, no threads, no sampling knobs): it admits the prompts first come first
served under full reservation, prefills them (in chunks if asked) alongside the running decodes, and
returns each one's tokens. It drives the very :class:`~kvledger.scheduler.driver.Driver` and torch
executor the engine uses, so tests and benchmarks that call it exercise the production step loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from ..core import KVLedger, checks
from ..errors import AdmissionError
from ..scheduler import GenRequest, SchedulerConfig, StepOutput, StepPlan
from ..scheduler.replica import Replica
from .executor import Sampling, TorchExecutor
from .model import ModelRunner
from .sampling import SamplingParams

_CALLS = itertools.count()


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
    """Greedy-decode every prompt; returns the generated token ids of each (prompt order). A prompt
    that can never fit ``ledger`` is an :class:`AdmissionError`."""
    checks.positive(max_new_tokens, "max_new_tokens")
    if chunk_size is not None:
        checks.positive(chunk_size, "chunk_size")
    stats = LoopStats() if stats is None else stats
    big = 1 << 30
    config = SchedulerConfig(policy="full", max_running=max(1, len(prompts)), token_budget=big,
                             prefill_chunk=chunk_size or big)
    from .engine import EngineStats  # the executor's counters; engine imports this module's siblings only

    executor = TorchExecutor(runner, None, EngineStats())

    def count(plan: StepPlan, output: StepOutput) -> None:
        stats.steps += 1
        works = len(plan.prefills) + len(plan.decodes)
        stats.max_batch = max(stats.max_batch, works)
        stats.mixed_steps += bool(plan.decodes) and any(w.end - w.start > 1 for w in plan.prefills)

    driver = Replica.around(ledger, config).drive(executor, on_executed=count)
    # Ids unique per call, so one ledger can serve several calls (and other users) side by side.
    ids = [f"greedy-{next(_CALLS)}-{i}" for i in range(len(prompts))]
    payload = Sampling(SamplingParams(), 0)
    stop = frozenset() if eos_token_id is None else frozenset({eos_token_id})
    for rid, prompt in zip(ids, prompts, strict=True):
        driver.submit(GenRequest(rid, tuple(prompt), max_new_tokens, stop_token_ids=stop, payload=payload))
    outputs: dict[str, list[int]] = {}
    while driver.has_work():
        for f in driver.step().finished:
            rid = f.request.request_id
            if f.finish_reasons[0] not in ("length", "stop"):
                raise AdmissionError(f"{rid} cannot be admitted: {f.finish_reasons[0]}")
            outputs[rid] = f.outputs[0]
            stats.cached_prompt_tokens += f.metrics.hit_tokens
    return [outputs[rid] for rid in ids]


__all__ = ["LoopStats", "generate_greedy"]
