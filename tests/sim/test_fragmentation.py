"""Lesson 06: the first-fit allocator, Figure-2 breakdowns on hand-made workloads, and the acceptance
numbers on ShareGPT lengths."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvledger.errors import ConfigError
from kvledger.sim.fragmentation import FirstFit, fragmentation_study, run_contiguous, run_paged
from kvledger.workloads import Poisson, load_lengths

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"  # committed slices (see README there)
SHAREGPT = TRACES / "sharegpt_lengths_head1000.csv"


def test_first_fit_places_merges_and_refuses():
    a = FirstFit(30)
    assert a.allocate(10) == 0 and a.allocate(10) == 10 and a.allocate(10) == 20
    assert a.allocate(1) is None and a.free_total == 0
    a.free(0, 10)
    a.free(20, 10)
    assert a.free_total == 20 and a.largest_hole() == 10
    assert a.allocate(15) is None  # 20 slots free, but in two holes of 10
    a.free(10, 10)  # the middle range joins both neighbours
    assert a.holes == [(0, 30)]
    with pytest.raises(ConfigError):
        a.free(5, 2)


def test_contiguous_oracle_by_hand():
    # 40 slots, requests of 8 + 4 tokens: three fit at once (36 slots), the fourth waits four steps.
    r = run_contiguous([(8, 4)] * 4, 40, "oracle", max_len=20)
    assert r.measured_steps == 4
    # tokens 24, 27, 30, 33; reservation 12, 9, 6, 3; 4 slots free each step; of 4 x 40 slots.
    assert r.fractions == pytest.approx({"token_states": 114 / 160, "reservation": 30 / 160, "internal": 0.0,
                                         "external": 16 / 160})
    assert r.completed == 4 and r.steps == 8 and r.hole_failures == 0


def test_contiguous_max_and_pow2_by_hand():
    # max: 20 slots each, two fit; pow2: 16 slots each (12 rounded up), two fit, 8 slots stay free.
    m = run_contiguous([(8, 4)] * 4, 40, "max", max_len=20)
    assert m.fractions == pytest.approx({"token_states": 76 / 160, "reservation": 20 / 160,
                                         "internal": 64 / 160, "external": 0.0})
    p = run_contiguous([(8, 4)] * 4, 40, "pow2", max_len=20)
    assert p.fractions == pytest.approx({"token_states": 76 / 160, "reservation": 20 / 160,
                                         "internal": 32 / 160, "external": 32 / 160})


def test_contiguous_hole_failures_are_counted():
    # a (3 slots) at [0, 3), b (21 slots) at [3, 24); c needs 8. After a ends (2 steps) 9 slots are free
    # in holes of 3 and 6: c is refused for holes from step 3 until b ends after step 20.
    r = run_contiguous([(1, 2), (1, 20), (4, 4)], 30, "oracle", max_len=64)
    assert r.hole_failures == 18 and r.hole_failure_requests == 1
    assert r.completed == 3


def test_paged_on_the_real_ledger_by_hand():
    # 4 blocks of 16; prompts of 15 tokens and one output token: 4 run, the fifth waits one step.
    r = run_paged([(15, 1)] * 5, 64, 16, watermark=0.0)
    assert r.measured_steps == 1
    assert r.fractions == pytest.approx({"token_states": 60 / 64, "reservation": 4 / 64, "internal": 0.0,
                                         "external": 0.0})
    assert r.completed == 5 and r.preemptions == 0
    # One more token each: every request needs a second block at once, so the newest are preempted.
    r = run_paged([(16, 8)] * 5, 64, 16, watermark=0.0)
    assert r.preemptions >= 2 and r.completed == 5
    total = sum(r.fractions.values())
    assert total == pytest.approx(1.0)


def test_acceptance_on_sharegpt_lengths():
    reqs = load_lengths(SHAREGPT, arrivals=Poisson(1.0), shuffle=True, limit=400, seed=0)
    results = {r.label: r for r in fragmentation_study(reqs, 131072, max_len=8192, block_sizes=(16,))}
    paged = results["paged, block 16"].fractions["token_states"]
    contiguous = results["contiguous (max)"].fractions["token_states"]
    assert paged > 0.96
    assert contiguous < 0.40
    assert results["contiguous (oracle)"].fractions["token_states"] < paged
    assert results["contiguous (oracle)"].hole_failures > 0
