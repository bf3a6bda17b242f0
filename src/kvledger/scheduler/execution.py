"""What a step runs on: the clocks a driver keeps time with, and the executor protocol.

An :class:`Executor` turns a :class:`~kvledger.scheduler.plan.StepPlan` into a :class:`StepOutput` --
sampled tokens per sequence (or beam candidates) and the seconds the step took -- reading nothing but
the plan. Within a step, every work's K/V of a layer is written before any work reads it (see
:meth:`Executor.execute`): the scheduler relies on it to let a request read prefix blocks that
another request writes in the same step. :class:`ConstantExecutor` is the one without a model (the lab,
tests, benchmarks); the torch runtime and the simulator have their own (``kvledger.runtime.executor``,
``kvledger.sim.simulator``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import InvariantError
from .plan import StepPlan

# ---- clocks -----------------------------------------------------------------------------------------


class Clock(Protocol):
    def now(self) -> float: ...

    def advance(self, seconds: float) -> None:
        """A step took ``seconds`` (a virtual clock moves; a wall clock has moved by itself)."""

    def wait_until(self, t: float, timeout: float | None = None) -> None:
        """Nothing to do before ``t``: jump there (virtual) or sleep towards it, at most ``timeout``."""


class VirtualClock:
    """Simulated time: it moves only by the executor's elapsed seconds and by jumps to arrivals."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = float(start)

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise InvariantError(f"a step cannot take {seconds} s")
        self.t += seconds

    def wait_until(self, t: float, timeout: float | None = None) -> None:
        if t > self.t:
            self.t = t


class WallClock:
    """Real time (``time.perf_counter`` by default)."""

    def __init__(self, source: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.source = source
        self.sleep = sleep

    def now(self) -> float:
        return self.source()

    def advance(self, seconds: float) -> None:
        pass

    def wait_until(self, t: float, timeout: float | None = None) -> None:
        delay = t - self.source()
        if timeout is not None:
            delay = min(delay, timeout)
        if delay > 0:
            self.sleep(delay)


# ---- executors --------------------------------------------------------------------------------------


@dataclass(slots=True)
class StepOutput:
    """What an executor returns: ``sampled`` maps each sequence that sampled to its new tokens (one, or
    the accepted drafts plus one); ``candidates`` maps each beam of a beam request to its best
    ``(logprob, token)`` pairs (``2 * width`` of them) instead; ``elapsed_s`` is the step's duration. The
    transfer figures split the step's transfers to and from lower tiers (:mod:`kvledger.scheduler.transfers`):
    ``transfer_s`` in all, ``transfer_hidden_s`` behind the step's compute, ``transfer_exposed_s`` waited
    for (part of ``elapsed_s``)."""

    sampled: dict[str, list[int]] = field(default_factory=dict)
    elapsed_s: float = 0.0
    candidates: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    transfer_s: float = 0.0
    transfer_hidden_s: float = 0.0
    transfer_exposed_s: float = 0.0


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> StepOutput:
        """Carry out ``plan``: its tier transfers (moves and demotions first; see
        :mod:`kvledger.scheduler.transfers`), copies, swap_out, swap_in, then the prefills and decodes.

        The prefills and decodes run as one batch in which **every work's K/V of a layer is written
        before any work reads that layer** (a batched forward pass that writes the new K/V and then
        attends, layer by layer, does exactly this). A work may read blocks that another work of the
        same plan writes: ``plan.shared_reads`` lists each such read, reader and writer. An executor
        that runs works one after another must run each writer's work before its readers'."""


class ConstantExecutor:
    """Every sampling work gets ``token`` (drafts are all rejected: one token per decode); beams get
    ``2 * width`` candidates ``token, token + 1, ...`` with falling logprobs. Each step takes
    ``step_s`` seconds. For the lab, benchmarks and tests of scheduling alone."""

    def __init__(self, token: int = 7, step_s: float = 0.0) -> None:
        self.token = token
        self.step_s = step_s

    def execute(self, plan: StepPlan) -> StepOutput:
        out = StepOutput(elapsed_s=self.step_s)
        one = [self.token]
        for w in (*plan.prefills, *plan.decodes):
            if not w.sample:
                continue
            req = w.request
            if req is not None and req.beam:
                out.candidates[w.seq_id] = [(-float(i), self.token + i) for i in range(2 * req.n)]
            else:
                out.sampled[w.seq_id] = one
        return out


__all__ = ["Clock", "ConstantExecutor", "Executor", "StepOutput", "VirtualClock", "WallClock"]
