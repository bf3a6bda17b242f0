"""One diagnosis end to end: an engine, a workload, a sampler, optional injected pathologies, the findings.

``run_diagnosis(workload)`` is what ``kvledger diagnose`` does, as a library call: it builds (or takes) an
engine, attaches a :class:`~.sampler.MemorySampler`, installs the injections, replays the workload
(arrivals counted in engine steps), takes the last snapshot, reconciles, and returns the diagnosis with its
versioned document. Injected memory is released afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ....core import checks
from ...loading import compute_dtype
from .inject import Injection, make_injections
from .reconcile import Diagnosis, Thresholds
from .report import document
from .sampler import MemorySampler
from .workload import Workload, run_workload

MiB = 1 << 20


@dataclass(slots=True)
class DiagnosisRun:
    diagnosis: Diagnosis
    document: dict[str, Any]
    injections: list[Injection] = field(default_factory=list)
    engine: Any = None
    wall_s: float = 0.0


def run_diagnosis(
    workload: Workload, *, engine: Any = None, model: str = "smollm2-135m", dtype: str = "fp32",
    num_blocks: int = 160, block_size: int = 16, every: int = 1, peaks: bool = True, sites: bool = False,
    inject: str | Sequence[str] = (), inject_bytes: int = 64 * MiB, inject_at: int = 2,
    thresholds: Thresholds | None = None, on_step: Callable[[int], None] | None = None,
) -> DiagnosisRun:
    """Run ``workload`` on ``engine`` (or a fresh engine of ``model`` in ``dtype`` with ``num_blocks``
    blocks) under a sampler, with the named injections, and reconcile."""
    compute = compute_dtype(dtype)  # refuses anything but fp32, bf16, fp16 (or vLLM's names)
    if engine is None:
        from ...engine import Engine

        num_blocks = checks.positive(num_blocks, "the KV pool's block count")
        engine = Engine.from_model(model, num_blocks=num_blocks, block_size=block_size, dtype=compute)
    injections = make_injections(list(inject) if not isinstance(inject, str) else inject, inject_bytes, inject_at)
    for item in workload.items:  # refuse what cannot run before anything is sampled
        engine.check_request(list(item.prompt), item.max_new_tokens, trust_group=item.trust_group,
                             request_id=item.request_id)
    sampler = MemorySampler(engine, every=every, peaks=peaks, sites=sites)
    for inj in injections:
        inj.install(sampler)
    t0 = time.perf_counter()
    sampler.attach()
    try:
        run_workload(engine, workload, on_step=on_step)
    finally:
        sampler.finish()
    wall = time.perf_counter() - t0
    diagnosis = sampler.diagnose(**({} if thresholds is None else _fields(thresholds)))
    spec = engine.spec
    store = engine.runner.store
    dev = store.device
    doc = document(
        diagnosis,
        model={"name": engine.model_name or model, "dtype": dtype, "kv_dtype": spec.kv_dtype,
               "pool_blocks": engine.ledger.num_blocks, "block_size": spec.block_size, "block_bytes": spec.block_bytes,
               "kv_bytes_per_token": spec.bytes_per_token, "pool_bytes": store.nbytes,
               "host_blocks": engine.host_store.num_blocks if engine.host_store else 0},  # every tier's slots
        device={"type": dev.type, "name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                "allocator": sampler.providers.allocator.read().backend,
                "device_reader": sampler.providers.device.read().backend},
        workload={**workload.summary(), "steps": len(diagnosis.steps), "wall_s": round(wall, 2)},
        sampling={"every": every, "peaks": peaks, "creation_sites": sites,
                  "thresholds": _fields(thresholds or Thresholds())},
        injected=[i.as_dict() for i in injections],
    )
    for inj in injections:
        inj.release()
    return DiagnosisRun(diagnosis, doc, injections, engine, wall)


def _fields(th: Thresholds) -> dict[str, Any]:
    return {name: getattr(th, name) for name in th.__dataclass_fields__}


__all__ = ["DiagnosisRun", "run_diagnosis"]
