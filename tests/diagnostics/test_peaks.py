"""Transient peaks: the CPU meter (profiler allocation events) and the CUDA meter (fakes), step shapes from
plans, forward-pass peaks on a tiny model against the workspace formula, and the planner's rows."""

from __future__ import annotations

import pytest
import torch

from kvledger.core.sizing.inventory import workspace_peak_bytes
from kvledger.errors import ConfigError
from kvledger.runtime.measure.diagnostics.peaks import (
    CpuProfilerPeak,
    CudaPeak,
    ForwardPeak,
    StepShape,
    measure_forward_peaks,
    peak_rows,
    synthetic_steps,
)
from kvledger.scheduler import ConstantExecutor, Driver, GenRequest, Scheduler

MiB = 1 << 20


def test_the_cpu_meter_sees_a_transient_and_what_is_left():
    meter = CpuProfilerPeak()
    meter.start()
    a = torch.ones(2 * MiB)  # 8 MiB
    b = torch.ones(MiB)  # 4 MiB: 12 MiB at the top
    del a
    c = torch.ones(MiB // 2)  # 2 MiB: 6 MiB left
    reading = meter.stop()
    assert 12 * MiB <= reading.peak_bytes <= 12 * MiB + 64 * 1024
    assert 6 * MiB <= reading.net_bytes <= 6 * MiB + 64 * 1024
    assert reading.events >= 4
    del b, c
    assert CpuProfilerPeak().stop().peak_bytes == 0  # stop without start


def test_the_cuda_meter_with_fake_functions():
    state = {"alloc": 100, "peak": 100}
    calls = []
    meter = CudaPeak(allocated=lambda: state["alloc"], max_allocated=lambda: state["peak"],
                     reset_peak=lambda: state.update(peak=state["alloc"]), synchronize=lambda: calls.append(1))
    meter.start()
    state.update(alloc=150, peak=400)  # a 300-byte burst above the start, 50 left
    r = meter.stop()
    assert (r.peak_bytes, r.net_bytes) == (300, 50) and len(calls) == 2


def test_step_shapes_of_a_plan():
    sched = Scheduler(__import__("kvledger.core", fromlist=["KVLedger"]).KVLedger(64, 4))
    driver = Driver(sched, ConstantExecutor())
    driver.submit(GenRequest("a", tuple(range(10)), 4))
    r1 = driver.step()
    s1 = StepShape.of_plan(r1.plan)
    assert (s1.kind, s1.tokens, s1.seqs, s1.prefill_tokens, s1.context_tokens) == ("prefill", 10, 1, 10, 10)
    driver.submit(GenRequest("b", tuple(range(100, 106)), 4))
    s2 = StepShape.of_plan(driver.step().plan)
    assert (s2.kind, s2.tokens, s2.seqs, s2.decode_seqs, s2.prefill_seqs) == ("mixed", 7, 2, 1, 1)
    assert s2.context_tokens == 11 + 6 and s2.max_context == 11


def test_synthetic_shapes_and_their_checks():
    steps, blocks = synthetic_steps("prefill", 10, 3, 0, 4)
    assert [len(s.token_ids) for s in steps] == [4, 3, 3] and blocks == 1  # one shared table: 4 tokens, 1 block
    steps, blocks = synthetic_steps("decode", 5, 5, 33, 16)
    assert blocks == 3 and all(s.start == 32 and len(s.token_ids) == 1 for s in steps)
    with pytest.raises(ConfigError):
        synthetic_steps("decode", 5, 4, 33, 16)
    with pytest.raises(ConfigError):
        synthetic_steps("sideways", 5, 5, 0, 16)


def test_forward_peaks_on_a_tiny_model_against_the_formula(tiny_checkpoint):
    from kvledger.runtime.weights import resolve_checkpoint

    shapes = [("prefill", 64, 1, 0), ("prefill", 256, 1, 0), ("decode", 8, 8, 128)]
    rows = measure_forward_peaks(str(tiny_checkpoint), shapes, dtypes=[torch.float32], repeats=1)
    assert [(r.kind, r.tokens, r.seqs) for r in rows] == [("prefill", 64, 1), ("prefill", 256, 1), ("decode", 8, 8)]
    cfg = resolve_checkpoint(tiny_checkpoint).config
    for r in rows:
        assert r.dtype == "fp32" and r.peak_bytes > 0
        assert r.formula_bytes == workspace_peak_bytes(cfg, 1, r.tokens, r.seqs, 4)
    assert rows[1].peak_bytes > 2 * rows[0].peak_bytes  # activations grow with the tokens of the step


def test_planner_rows_take_the_worst_covered_step():
    def fp(kind, tokens, seqs, ctx, peak):
        return ForwardPeak("m", "bf16", "cpu-x", kind, tokens, seqs, ctx, peak, 1)

    peaks = [fp("prefill", 512, 1, 512, 10), fp("prefill", 2048, 64, 32, 30), fp("decode", 64, 64, 2048, 50),
             fp("decode", 64, 64, 8192, 200)]
    rows = peak_rows(peaks, "test", max_context=2048)
    assert {k for row in rows for k in row} == {"model", "dtype", "tp", "max_batched_tokens", "max_seqs",
                                                 "peak_bytes", "device", "source"}
    by = {(r["max_batched_tokens"], r["max_seqs"]): r for r in rows}
    assert by[(512, 1)]["peak_bytes"] == 10
    assert by[(2048, 64)]["peak_bytes"] == 50  # the 64-sequence decode is a step of that shape or smaller
    assert "decode of 64 tokens over 64 sequences at context 2048" in by[(2048, 64)]["source"]
    assert max(r["peak_bytes"] for r in rows) == 50  # the 8192-context decode is outside the rows' assumption
