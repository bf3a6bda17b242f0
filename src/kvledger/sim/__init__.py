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
    TRACE_FORMATS,
    Choice,
    Fixed,
    Gamma,
    LogNormal,
    Poisson,
    Prompt,
    SimRequest,
    Uniform,
    assign_trust_groups,
    at_rate,
    load_azure,
    load_kvledger,
    load_lengths,
    load_mooncake,
    load_trace,
    scale_lengths,
    scale_time,
    slice_requests,
    sniff_trace_format,
    synthetic,
)

__all__ = [
    "TRACE_FORMATS", "Choice", "CostModel", "DeviceProfile", "Fixed", "Gamma", "LogNormal", "Poisson", "Prompt",
    "SimRequest",
    "StepBreakdown", "Uniform", "assign_trust_groups", "at_rate", "cpu_profile_path", "get_profile",
    "list_profiles", "load_azure", "load_cpu_profile", "load_kvledger", "load_lengths", "load_mooncake", "load_trace",
    "profile_from_gpu", "scale_lengths", "scale_time", "slice_requests", "sniff_trace_format", "synthetic",
]
