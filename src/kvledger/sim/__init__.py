"""Simulation inputs: workloads (trace loaders, synthetic generator) and the step-time cost model.

Pure Python on top of `kvledger.core`; nothing here imports the runtime or the CLI.
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
from .workloads import (
    Choice,
    Fixed,
    Gamma,
    LogNormal,
    Poisson,
    Prompt,
    SimRequest,
    Uniform,
    assign_trust_groups,
    load_azure,
    load_lengths,
    load_mooncake,
    load_trace,
    scale_time,
    slice_requests,
    synthetic,
)

__all__ = [
    "Choice", "CostModel", "DeviceProfile", "Fixed", "Gamma", "LogNormal", "Poisson", "Prompt", "SimRequest",
    "StepBreakdown", "Uniform", "assign_trust_groups", "cpu_profile_path", "get_profile", "list_profiles",
    "load_azure", "load_cpu_profile", "load_lengths", "load_mooncake", "load_trace", "profile_from_gpu",
    "scale_time", "slice_requests", "synthetic",
]
