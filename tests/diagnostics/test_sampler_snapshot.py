"""Snapshots, diffs and the sampler attached to an engine: step ids and request events line up, sampling
every N steps, hooks restored on detach, the attribution is a partition of the process's bytes, and the
seed's warning observed on SmolLM2 -- blocks go back to the free list, the allocator does not move."""

from __future__ import annotations

import pytest

from kvledger.errors import ConfigError
from kvledger.runtime.engine import Engine
from kvledger.runtime.measure.diagnostics import MemorySampler, default_workload, diff, run_workload, take_snapshot


def partition_holds(snapshot) -> None:
    a = snapshot.attribution()
    assert sum(v for k, v in a.items() if k != "device_used") == a["device_used"]
    kv = sum(a[k] for k in ("kv_live", "kv_orphaned", "kv_retained", "kv_promised", "kv_free"))
    assert kv == snapshot.tensors.owner_bytes("kv/device", snapshot.device)


def test_sampling_every_n_steps_in_step_with_the_engine(tiny_checkpoint):
    engine = Engine.from_model(tiny_checkpoint, num_blocks=64)
    previous = engine.driver.on_planned
    sampler = MemorySampler(engine, every=3).attach()
    assert engine.driver.on_planned != previous and sampler._observed in engine.step_observers
    results = run_workload(engine, default_workload(5, vocab=256, max_prompt=40, max_new=10, wave=2, wave_gap=3))
    sampler.finish()
    assert engine.driver.on_planned is previous and sampler._observed not in engine.step_observers
    steps = [r.step for r in sampler.steps]
    assert steps == list(range(len(steps)))  # the scheduler's step ids, every step recorded
    sampled = [r.step for r in sampler.steps if r.sampled]
    assert sampled == [s for s in steps if (s + 1) % 3 == 0]
    assert [s.step for s in sampler.snapshots] == [-1, *sampled, steps[-1]]  # baseline, samples, the end
    assert all(r.peak_bytes is not None for r in sampler.steps if r.sampled)
    assert all(r.peak_bytes is None for r in sampler.steps if not r.sampled)
    # Request events: each request admitted once and finished once, at steps the records name.
    admitted = [rid for r in sampler.steps for rid in r.admitted]
    finished = [rid for r in sampler.steps for rid in r.finished]
    assert sorted(admitted) == sorted(finished) == sorted(r.request_id for r in results)
    for snap in sampler.snapshots:
        partition_holds(snap)
    with pytest.raises(ConfigError):
        MemorySampler(engine, every=0)


@pytest.mark.model
def test_blocks_return_to_the_free_list_while_the_allocator_stays(smollm2_engine):
    engine = smollm2_engine(num_blocks=96)
    prompts = [[100 + (i * 37 + j) % 40000 for j in range(150 + 40 * i)] for i in range(4)]
    handles = [engine.submit(p, 12) for p in prompts]
    engine.step()  # the prefill: every request holds its blocks
    during = take_snapshot(engine)
    while engine.has_work():
        engine.step()
    assert all(h.done() for h in handles)
    after = take_snapshot(engine)
    d = diff(during, after)
    freed = -d.pool["active_bytes"]
    assert freed >= 20 * engine.spec.block_bytes  # ownership moved: blocks are free or cached again ...
    assert d.owners["kv/device"] == 0  # ... the KV store tensor did not change
    # ... and neither the allocator nor the process gave the freed bytes back (they may grow a little on
    # their own: decode steps allocate and free their temporaries meanwhile).
    assert d.allocator["reserved"] > -freed / 4 and d.device > -freed / 4
    assert any("changes who owns it, not what is allocated" in n for n in d.notes())
    partition_holds(during)
    partition_holds(after)
    assert d.as_dict()["from_step"] == during.step and d.as_dict()["to_step"] == after.step


def test_a_failing_sampler_never_stops_the_engine(tiny_checkpoint):
    engine = Engine.from_model(tiny_checkpoint, num_blocks=64)

    class Broken:
        def start(self):
            raise RuntimeError("another profiler is running")

        def stop(self):
            raise AssertionError("never started")

    sampler = MemorySampler(engine, meter=Broken()).attach()
    sampler.after_step.append(lambda s, r: 1 / 0 if r.plan is not None and r.plan.step == 2 else None)
    results = run_workload(engine, default_workload(3, vocab=256, max_prompt=30, max_new=8, wave=3, wave_gap=0))
    sampler.finish()
    assert all(r.finish_reasons for r in results)  # every request finished
    assert sampler.errors[0][1].startswith("peak meter: RuntimeError: another profiler is running")
    assert any("ZeroDivisionError" in e for _, e in sampler.errors)
    assert all(r.peak_bytes is None for r in sampler.steps)
    notes = sampler.diagnose().notes
    assert any("the sampler failed at step 2" in n for n in notes)
