"""Scheduler configuration: the admission policy, what to do when growth fails, victim choice and
recovery mode. Every value is validated here, so a bad setting fails at construction, not mid-run."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

POLICIES = ("full", "incremental", "predicted")
GROWTH_ACTIONS = ("defer", "preempt", "reject", "headroom")
VICTIMS = ("latest", "priority", "least_computed", "min_waste")
RECOVERY = ("recompute", "swap", "auto")


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

    def __post_init__(self) -> None:
        for name, allowed in (("policy", POLICIES), ("on_growth_failure", GROWTH_ACTIONS),
                              ("victim", VICTIMS), ("recovery", RECOVERY)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        for name in ("max_running", "token_budget", "prefill_chunk", "predicted_min_samples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if not 0 <= self.watermark < 1:
            raise ConfigError("watermark must be in [0, 1)")
        if self.headroom_blocks < 0:
            raise ConfigError("headroom_blocks must be >= 0")
        if not 0 < self.predicted_quantile <= 1:
            raise ConfigError("predicted_quantile must be in (0, 1]")
