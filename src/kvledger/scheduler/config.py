"""Scheduler configuration: the admission policy, what to do when growth fails, victim choice and
recovery mode. Every value is validated here, so a bad setting fails at construction, not mid-run.
The choices come from the registries (:data:`ADMISSION_POLICIES`, :data:`GROWTH_ACTIONS`,
:data:`VICTIM_POLICIES`, :data:`RECOVERY_MODES`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..core import checks
from ..errors import ConfigError
from .growth import GROWTH_ACTIONS
from .policies import ADMISSION_POLICIES
from .recovery import RECOVERY_MODES
from .victims import VICTIM_POLICIES

REGISTRIES = {"policy": ADMISSION_POLICIES, "on_growth_failure": GROWTH_ACTIONS, "victim": VICTIM_POLICIES,
              "recovery": RECOVERY_MODES}


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """``policy``: what admission reserves.

    * ``full`` -- prompt + declared output allowance (+ lookahead slots). A running request is never
      preempted for memory; growth cannot fail.
    * ``incremental`` -- prompt + the next token only, admitted while ``watermark`` of the pool stays
      free. When a running request cannot grow, ``on_growth_failure`` says what happens.
    * ``predicted`` -- prompt + the ``predicted_quantile`` of output lengths observed so far (the full
      allowance until ``predicted_min_samples`` requests have finished); beyond it, as incremental.

    ``on_growth_failure``: ``defer`` (skip the request's step and retry), ``preempt`` (take memory from a
    victim chosen by ``victim``, recovered by ``recovery``), ``reject`` (end the request's growth with a
    clear reason), ``headroom`` (admission keeps ``headroom_blocks`` free for growth; if even that runs
    out, preempt).

    ``offload_prefixes``: with tiers below the device pool (the scheduler's ``host``), a retained prefix
    block the pool evicts is demoted to a tier instead of forgotten, and a prompt whose next blocks a tier
    holds (same trust group) gets them promoted back at admission; ``writeback_blocks`` of the retained
    blocks next in line for eviction are copied down ahead of it, beside the compute, so their eviction later
    copies nothing (0: every copy happens at eviction, on the step's critical path). ``restore_ahead``: a
    request restored from a swap or admitted with promoted blocks computes from the next step, so the
    transfer can hide behind this step's compute instead of stalling it (one step later for that request).
    """

    policy: str = "full"
    on_growth_failure: str = "preempt"
    victim: str = "latest"
    recovery: str = "recompute"
    max_running: int = 256
    token_budget: int = 8192  # tokens per step (prefill chunks + decodes)
    prefill_chunk: int = 2048  # largest prefill chunk per sequence per step
    watermark: float = 0.01  # fraction of the pool incremental admission keeps free
    headroom_blocks: int = 0
    predicted_quantile: float = 0.9
    predicted_min_samples: int = 20
    offload_prefixes: bool = False  # demote evicted prefix blocks to the tiers below, promote them on a hit
    restore_ahead: bool = False  # a request whose blocks arrive from a tier computes from the next step
    writeback_blocks: int = 32  # with offload_prefixes: retained blocks next in line for eviction copied down

    def __post_init__(self) -> None:
        for name, registry in REGISTRIES.items():
            registry.check(getattr(self, name), name)
        for name in ("max_running", "token_budget", "prefill_chunk", "predicted_min_samples", "headroom_blocks",
                     "writeback_blocks"):
            value = getattr(self, name)
            low = 0 if name in ("headroom_blocks", "writeback_blocks") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        for name in ("offload_prefixes", "restore_ahead"):
            checks.flag(getattr(self, name), name)
        for name, low, high, closed_low in (("watermark", 0, 1, True), ("predicted_quantile", 0, 1, False)):
            value = getattr(self, name)
            ok = isinstance(value, int | float) and not isinstance(value, bool) and value == value
            ok = ok and (low <= value if closed_low else low < value)
            ok = ok and (value < high if name == "watermark" else value <= high)
            if not ok:
                bounds = "[0, 1)" if name == "watermark" else "(0, 1]"
                raise ConfigError(f"{name} must be in {bounds}, got {value!r}")

    @property
    def exact(self) -> bool:
        """The admission policy reserves the whole allowance: growth never fails."""
        return ADMISSION_POLICIES[self.policy].exact

    def keep_free(self, num_blocks: int) -> int:
        """Blocks admission keeps unpromised for the growth of running requests."""
        watermark = 0 if self.exact else int(self.watermark * num_blocks)
        headroom = self.headroom_blocks if GROWTH_ACTIONS[self.on_growth_failure].keeps_headroom else 0
        return watermark + headroom

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


SCHEDULER_KEYS = tuple(f.name for f in fields(SchedulerConfig))
