"""Sampling an engine's four ledgers at step boundaries, synchronised with its steps and request events.

``MemorySampler(engine, every=N).attach()`` takes a baseline snapshot, then after every N-th step (the
engine's ``step_observers``, called once the step is confirmed and streamed) a snapshot of the four
ledgers, and for every step a :class:`StepRecord`: the scheduler's step id, the step's shape, the
requests admitted, preempted and finished in it, and -- on sampled steps -- the step's transient peak
(measured from the moment the plan is made, ``Driver.on_planned``, to the step boundary). ``finish()``
takes a last snapshot; ``diagnose()`` reconciles the series (:mod:`.reconcile`).

Call everything from the thread that steps the engine (``engine.step`` / ``run_until_idle`` /
``generate``); a background engine thread samples itself through the same hooks.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ....core import checks
from .peaks import PeakMeter, StepShape, meter_for
from .providers import Providers
from .snapshot import MemorySnapshot, engine_registry, take_snapshot
from .tensors import CreationSites, TensorRegistry

StepHook = Callable[[Any, Any], None]  # (sampler, plan or StepResult)


@dataclass(slots=True)
class StepRecord:
    """One engine step as the sampler saw it."""

    step: int
    time_s: float
    shape: StepShape
    peak_bytes: int | None  # transient peak above the step's start (sampled steps only)
    admitted: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    running: list[str] = field(default_factory=list)  # after the step
    sampled: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "time_s": round(self.time_s, 6), **self.shape.as_dict(),
                "peak_bytes": self.peak_bytes, "admitted": self.admitted, "preempted": self.preempted,
                "finished": self.finished, "running": len(self.running), "sampled": self.sampled}


class MemorySampler:
    """Samples an :class:`~kvledger.runtime.engine.Engine` every ``every`` steps.

    ``peaks``: measure each sampled step's transient peak (CPU: through torch's profiler, which slows
    the sampled steps by about a third). ``sites``: record where large tensors are created while the
    sampler is attached (a torch function mode: a few microseconds per torch call), so unregistered
    storages can name their creation line. ``registry``/``providers`` override the engine's owners and the
    device's allocator and device readers (tests pass fakes)."""

    def __init__(self, engine: Any, *, every: int = 1, peaks: bool = True, sites: bool = False,
                 registry: TensorRegistry | None = None, providers: Providers | None = None,
                 meter: PeakMeter | None = None) -> None:
        self.engine = engine
        self.every = checks.positive(every, "sampler: every (steps between samples)")
        self.registry = registry if registry is not None else engine_registry(engine)
        device = engine.runner.store.device
        self.providers = providers if providers is not None else Providers.for_device(device)
        self.meter = meter if meter is not None else (meter_for(device) if peaks else None)
        self.sites = CreationSites() if sites else None
        self.snapshots: list[MemorySnapshot] = []
        self.steps: list[StepRecord] = []
        self.during_step: list[StepHook] = []  # after the peak meter starts, before the step executes
        self.after_step: list[StepHook] = []  # at the step boundary, before the snapshot
        # A failure inside the sampler never stops the engine: it is recorded here (step, error) and the
        # peak meter is turned off if it was the meter that failed (another profiler running, say).
        self.errors: list[tuple[int, str]] = []
        self.t0 = time.perf_counter()
        self._attached = False
        self._metering = False
        self._previous_planned: Any = None

    # ---- attaching ------------------------------------------------------------------------------------
    def attach(self) -> MemorySampler:
        """Take the baseline snapshot and start sampling. Garbage awaiting collection is collected first:
        freed later, in the middle of the run, it would move the allocator for reasons the run never had."""
        if self._attached:
            return self
        gc.collect()
        driver = self.engine.driver
        self._previous_planned = driver.on_planned
        driver.on_planned = self._planned
        self.engine.step_observers.append(self._observed)
        if self.sites is not None:
            self.sites.__enter__()
        self._attached = True
        self.sample()
        return self

    def detach(self) -> None:
        if not self._attached:
            return
        if self._metering and self.meter is not None:
            self.meter.stop()
            self._metering = False
        driver = self.engine.driver
        if driver.on_planned == self._planned:
            driver.on_planned = self._previous_planned
        if self._observed in self.engine.step_observers:
            self.engine.step_observers.remove(self._observed)
        if self.sites is not None:
            self.sites.__exit__(None, None, None)
        self._attached = False

    def __enter__(self) -> MemorySampler:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.finish()

    # ---- sampling -------------------------------------------------------------------------------------
    def sample(self) -> MemorySnapshot:
        """A snapshot now, added to the series."""
        snap = take_snapshot(self.engine, registry=self.registry, providers=self.providers, sites=self.sites,
                             step=self._last_step())
        snap.time_s -= self.t0
        self.snapshots.append(snap)
        return snap

    def finish(self) -> MemorySnapshot:
        """The last snapshot (the run is over); stops sampling."""
        snap = self.sample()
        self.detach()
        return snap

    def diagnose(self, **options: Any) -> Any:
        """Reconcile the series: a :class:`~.reconcile.Diagnosis` (options: :class:`~.reconcile.Thresholds`)."""
        from .reconcile import Thresholds, reconcile

        diagnosis = reconcile(self.snapshots, self.steps, Thresholds(**options))
        diagnosis.notes.extend(f"the sampler failed at step {step} ({error}); that sample is missing"
                               for step, error in self.errors)
        return diagnosis

    def _last_step(self) -> int:
        return self.steps[-1].step if self.steps else -1

    def _sampled(self, step: int) -> bool:
        return (step + 1) % self.every == 0

    # ---- hooks ------------------------------------------------------------------------------------------
    def _planned(self, plan: Any, t: float) -> None:
        if self._previous_planned is not None:
            self._previous_planned(plan, t)
        if self.meter is not None and self._sampled(plan.step):
            try:
                self.meter.start()
                self._metering = True
            except Exception as exc:  # noqa: BLE001 -- recorded; the engine goes on without peaks
                self._failed(plan.step, "peak meter", exc)
                self.meter = None
        for hook in self.during_step:
            hook(self, plan)

    def _failed(self, step: int, what: str, exc: BaseException) -> None:
        self.errors.append((step, f"{what}: {type(exc).__name__}: {exc}"))

    def _observed(self, result: Any) -> None:
        try:
            self._record(result)
        except Exception as exc:  # noqa: BLE001 -- diagnostics must never stop the engine
            self._failed(result.plan.step if result.plan is not None else -1, "sample", exc)

    def _record(self, result: Any) -> None:
        plan = result.plan
        peak = None
        if self._metering and self.meter is not None:
            self._metering = False
            try:
                peak = self.meter.stop().peak_bytes
            except Exception as exc:  # noqa: BLE001 -- recorded; no more peaks
                self._failed(plan.step if plan is not None else -1, "peak meter", exc)
                self.meter = None
        if plan is None:
            return
        sched = self.engine.scheduler
        record = StepRecord(
            plan.step, time.perf_counter() - self.t0, StepShape.of_plan(plan), peak,
            [a.request_id for a in plan.admissions], [p.request_id for p in plan.preempted],
            [f.request.request_id for f in result.finished], sorted(sched.running), self._sampled(plan.step))
        self.steps.append(record)
        for hook in self.after_step:
            hook(self, result)
        if record.sampled:
            self.sample()


__all__ = ["MemorySampler", "StepRecord"]
