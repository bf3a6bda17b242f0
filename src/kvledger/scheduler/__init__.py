"""Per-step planning on top of the ledger core: admission policies, growth under pressure,
preemption by recompute or swap, a host tier, speculative slots. No tensors here."""

from __future__ import annotations

from .config import SchedulerConfig
from .host import HostPool, TransferModel
from .plan import Branch, GenRequest, Preemption, Status, StepPlan, Work
from .recovery import RecoveryCosts
from .scheduler import Scheduler

__all__ = ["Branch", "GenRequest", "HostPool", "Preemption", "RecoveryCosts", "Scheduler", "SchedulerConfig",
           "Status", "StepPlan", "TransferModel", "Work"]
