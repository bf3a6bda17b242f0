"""Where did the memory go: four ledgers sampled at step boundaries, reconciled into named causes.

* **tensors** (:mod:`.tensors`) -- live torch tensors by owner (weights, KV store per tier, host/staging,
  workspace, sampling) from a registry of owners, plus a storage-deduplicated scan of the rest;
* **allocator** (:mod:`.providers`) -- CUDA's caching allocator (``memory_stats``, snapshot) or glibc's
  ``malloc`` (``mallinfo2``);
* **pool** (:mod:`.pool`) -- the KV ledger's blocks by state, tier and trust group, and the blocks no live
  owner holds;
* **device** (:mod:`.providers`) -- NVML / ``mem_get_info`` on CUDA, the resident set and the cgroup on CPU.

Library use::

    from kvledger.runtime.measure.diagnostics import MemorySampler, take_snapshot, diff

    before = take_snapshot(engine)
    ...                                   # run something
    print(diff(before, take_snapshot(engine)).notes())

    sampler = MemorySampler(engine, every=10).attach()   # sample every 10 steps
    engine.generate(prompts, 64)
    sampler.finish()
    for f in sampler.diagnose().findings:
        print(f.kind, f.bytes, f.steps, f.summary)

``kvledger diagnose`` runs a workload under a sampler and writes ``diagnosis.json`` and a timeline PNG.
This is runtime (torch) code: the core, the scheduler and the simulator never import it.
"""

from __future__ import annotations

from .inject import INJECTIONS, Injection, make_injections
from .peaks import CpuProfilerPeak, CudaPeak, ForwardPeak, StepShape, measure_forward_peaks, peak_rows
from .pool import Orphan, PoolSample, pool_sample
from .providers import (
    AllocatorStats,
    CudaAllocator,
    CudaMemGetInfo,
    DeviceStats,
    FakeCuda,
    GlibcMalloc,
    NvmlDevice,
    ProcessMemory,
    Providers,
)
from .reconcile import FINDING_KINDS, Diagnosis, Finding, Thresholds, reconcile
from .run import DiagnosisRun, run_diagnosis
from .sampler import MemorySampler, StepRecord
from .snapshot import MemorySnapshot, SnapshotDiff, diff, engine_registry, take_snapshot
from .tensors import CreationSites, TensorRegistry, TensorSample, scan
from .workload import WorkItem, Workload, default_workload, run_workload

__all__ = [
    "FINDING_KINDS", "INJECTIONS", "AllocatorStats", "CpuProfilerPeak", "CreationSites", "CudaAllocator",
    "CudaMemGetInfo", "CudaPeak", "DeviceStats", "Diagnosis", "DiagnosisRun", "FakeCuda", "Finding", "ForwardPeak",
    "GlibcMalloc", "Injection", "MemorySampler", "MemorySnapshot", "NvmlDevice", "Orphan", "PoolSample",
    "ProcessMemory", "Providers", "SnapshotDiff", "StepRecord", "StepShape", "TensorRegistry", "TensorSample",
    "Thresholds", "WorkItem", "Workload", "default_workload", "diff", "engine_registry", "make_injections",
    "measure_forward_peaks", "peak_rows", "pool_sample", "reconcile", "run_diagnosis", "run_workload", "scan",
    "take_snapshot",
]
