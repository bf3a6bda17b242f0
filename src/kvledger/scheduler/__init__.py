"""Per-step planning on top of the ledger core: admission policies, growth under pressure,
preemption by recompute or swap, a host tier, speculative slots, beam search, and the one step loop
(the driver) with its request metrics. No tensors here."""

from __future__ import annotations

from ..core.registry import Registry
from .config import SCHEDULER_KEYS, SchedulerConfig
from .driver import Driver, FinishedRequest, StepResult
from .execution import Clock, ConstantExecutor, Executor, StepOutput, VirtualClock, WallClock
from .growth import GROWTH_ACTIONS
from .host import HostPool, TransferModel
from .metrics import RequestMetrics, distribution, percentile, summarize_requests
from .plan import Admission, Branch, GenRequest, Preemption, SharedRead, Status, StepPlan, Work, validate_request
from .policies import ADMISSION_POLICIES
from .recovery import RECOVERY_MODES, RecoveryCosts
from .scheduler import Scheduler
from .victims import VICTIM_POLICIES

__all__ = ["ADMISSION_POLICIES", "Admission", "Branch", "Clock", "ConstantExecutor", "Driver", "Executor",
           "FinishedRequest", "GROWTH_ACTIONS", "GenRequest", "HostPool", "Preemption", "RECOVERY_MODES",
           "RecoveryCosts", "Registry", "RequestMetrics", "SCHEDULER_KEYS", "Scheduler", "SchedulerConfig",
           "SharedRead", "Status", "StepOutput", "StepPlan", "StepResult", "TransferModel", "VICTIM_POLICIES",
           "VirtualClock", "WallClock", "Work", "distribution", "percentile", "summarize_requests", "validate_request"]
