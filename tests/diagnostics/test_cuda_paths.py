"""The CUDA paths of the sampler and the reconciliation, with a fake caching allocator and device: the
engine runs on CPU (a tiny model), the allocator and device ledgers and the peak meter read FakeCuda,
and pathologies are injected into the fake the way a real GPU would show them."""

from __future__ import annotations

import pytest

from kvledger.errors import ConfigError
from kvledger.runtime.engine import Engine
from kvledger.runtime.measure.diagnostics import (
    FakeCuda,
    MemorySampler,
    Providers,
    Thresholds,
    default_workload,
    reconcile,
    run_workload,
)
from kvledger.runtime.measure.diagnostics.peaks import CudaPeak

MiB = 1 << 20


def fake_sampler(tiny_checkpoint, fake: FakeCuda, every: int = 1):
    engine = Engine.from_model(tiny_checkpoint, num_blocks=64)
    alloc, dev = fake.providers()

    def reset_peak() -> None:
        fake.peak = fake.allocated

    meter = CudaPeak(allocated=lambda: fake.allocated, max_allocated=lambda: fake.peak, reset_peak=reset_peak,
                     synchronize=lambda: None)
    sampler = MemorySampler(engine, every=every, providers=Providers("cuda", alloc, dev), meter=meter)
    return engine, sampler


def at_step(step: int, action):
    """An after-step hook that runs ``action`` once, at ``step``."""
    def hook(sampler, result):
        if result.plan is not None and result.plan.step == step:
            action()
    return hook


def test_a_clean_fake_gpu_run_names_nothing(tiny_checkpoint):
    fake = FakeCuda()
    fake.allocate(300 * MiB)  # weights and the KV pool, allocated before the run
    engine, sampler = fake_sampler(tiny_checkpoint, fake)
    sampler.attach()
    run_workload(engine, default_workload(6, vocab=256, max_prompt=40, max_new=10, wave=3, wave_gap=4))
    sampler.finish()
    d = sampler.diagnose()
    assert d.findings == []
    assert sampler.snapshots[-1].allocator.backend == "cuda"
    assert sampler.snapshots[-1].device == "cuda"


def test_fake_gpu_pathologies_are_named_with_their_bytes(tiny_checkpoint):
    fake = FakeCuda()
    fake.allocate(300 * MiB)
    engine, sampler = fake_sampler(tiny_checkpoint, fake)
    def during(s, plan):
        if plan.step == 3:
            fake.allocate(48 * MiB)  # a burst inside the step ...

    def after(s, result):
        if result.plan is not None and result.plan.step == 3:
            fake.free(48 * MiB)  # ... freed at its end: the caching allocator keeps it reserved

    sampler.after_step.append(at_step(6, lambda: fake.cache(96 * MiB)))  # reserved, never handed out
    sampler.after_step.append(at_step(9, lambda: fake.external(80 * MiB)))  # cuBLAS workspace, NCCL, ...

    sampler.during_step.append(during)
    sampler.after_step.append(after)
    sampler.attach()
    run_workload(engine, default_workload(6, vocab=256, max_prompt=40, max_new=12, wave=3, wave_gap=4))
    sampler.finish()
    d = sampler.diagnose()
    found = {f.kind: f for f in d.findings}
    assert sorted(found) == ["cached_reservation", "external_allocation", "transient_peak"]
    assert found["cached_reservation"].bytes == 96 * MiB and found["cached_reservation"].steps == (6, 6)
    assert found["cached_reservation"].evidence["backend"] == "cuda"
    assert found["external_allocation"].bytes == 80 * MiB and found["external_allocation"].steps == (9, 9)
    assert found["transient_peak"].bytes == 48 * MiB and found["transient_peak"].steps == (3, 3)
    # The burst's 48 MiB stayed reserved (cached) too, but the step's peak explains it: no second finding.
    assert sampler.snapshots[-1].allocator.cached == 96 * MiB + 48 * MiB


def test_the_pool_frees_while_the_fake_gpu_does_not_move(tiny_checkpoint):
    fake = FakeCuda()
    fake.allocate(300 * MiB)
    engine, sampler = fake_sampler(tiny_checkpoint, fake)
    sampler.attach()
    run_workload(engine, default_workload(4, vocab=256, max_prompt=60, max_new=8, wave=4, wave_gap=0))
    sampler.finish()
    [note] = sampler.diagnose().notes
    assert "allocated bytes by 0 B" in note and "reserved bytes by 0 B" in note and "device by 0 B" in note
    first, last = sampler.snapshots[1], sampler.snapshots[-1]
    assert last.pool.active < first.pool.active  # ownership moved ...
    assert last.device_stats.used == first.device_stats.used  # ... allocation did not


def test_thresholds_and_series_are_checked():
    with pytest.raises(ConfigError):
        Thresholds(min_bytes=-1)
    with pytest.raises(ConfigError):
        Thresholds(leak_min_samples=0)
    with pytest.raises(ConfigError, match="two snapshots"):
        reconcile([], [])
