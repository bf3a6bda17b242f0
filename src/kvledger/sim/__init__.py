"""The simulator: the step-time cost model, the discrete-event simulator, the fleet simulator, the
fragmentation study and reports. Workloads (trace readers, the synthetic generator) are
:mod:`kvledger.workloads`, below the simulator and the server.

Pure Python on top of `kvledger.core` and the scheduler; nothing here imports the runtime or the CLI.
"""

from __future__ import annotations

from .cost_model import (
    CostModel,
    DeviceProfile,
    StepBreakdown,
    cpu_profile_path,
    get_profile,
    list_profiles,
    load_cpu_profile,
    profile_from_gpu,
)

__all__ = [
    "CostModel", "DeviceProfile", "StepBreakdown", "cpu_profile_path", "get_profile", "list_profiles",
    "load_cpu_profile", "profile_from_gpu",
]
