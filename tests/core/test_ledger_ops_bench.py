"""benchmarks/ledger_ops.py --eviction: how it pairs its runs (policy order reversed every other round, a case's
prompts made once) and what it reports (the median paired ratio between its quartiles). Nothing here is timed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "ledger_ops.py"


@pytest.fixture()
def bench():
    spec = importlib.util.spec_from_file_location("ledger_ops_under_test", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_cases_prompts_are_made_once_as_tuples(bench) -> None:
    first = bench.cached_prompts(6, 32, 16, 2, 0, True)
    assert bench.cached_prompts(6, 32, 16, 2, 0, True) is first
    assert [list(p) for p in first] == bench.make_prompts(6, 32, 16, 2, 0, True)
    assert all(type(p) is tuple for p in first)
    assert bench.cached_prompts(6, 32, 16, 2, 1, True) != first


def test_policy_order_reverses_every_other_round_and_ratios_pair_by_round(bench, monkeypatch, capsys) -> None:
    calls: list[tuple[str, str]] = []
    # LRU 100 us in every round; arc 110, 130, 120 us in rounds 1-3: paired ratios 1.1, 1.3, 1.2
    arc_us = iter([110.0, 130.0, 120.0])

    def fake_run(args, case, policy):
        calls.append((case, policy))
        return {"us_per_request": 100.0 if policy == "lru" else next(arc_us), "evictions": 7,
                "prefix_hit_blocks_per_request": 0.0}

    monkeypatch.setattr(bench, "run", fake_run)
    assert bench.main(["--eviction", "arc", "--cases", "evict", "--rounds", "3", "--requests", "5"]) == 0
    assert calls == [("evict", "lru"), ("evict", "arc"), ("evict", "arc"), ("evict", "lru"),
                     ("evict", "lru"), ("evict", "arc")]
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["ratio_to_lru_evict_arc"] == pytest.approx(1.2)
    q1, q3 = summary["ratio_to_lru_q1_q3_evict_arc"]
    assert q1 < 1.2 < q3
    assert summary["ratio_to_lru_evict_lru"] == 1.0
