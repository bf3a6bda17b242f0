"""Edges of the workload readers a user meets: the names in their refusals (a distribution's bound, a CSV's
missing columns, a trace's named-prefix limit, a timestamp's parts) and the calibration's step limit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvledger.errors import ConfigError
from kvledger.sim.calibrate import step_measurements
from kvledger.workloads import LogNormal, Uniform, load_trace


def test_a_distributions_bounds_are_named_in_its_refusal() -> None:
    with pytest.raises(ConfigError, match=r"^Uniform low must be an integer >= 0, got -1$"):
        Uniform(-1, 3)
    with pytest.raises(ConfigError, match=r"^Uniform high must be an integer >= 5, got 4$"):
        Uniform(5, 4)
    with pytest.raises(ConfigError, match=r"^LogNormal low must be an integer >= 0, got -2$"):
        LogNormal(10.0, 0.5, low=-2)


def test_a_csv_without_its_columns_names_them_all(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,Other\n2023-11-16 18:17:03.97,1\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r":1: missing column\(s\) ContextTokens, GeneratedTokens"):
        load_trace(path, format="azure")


def test_at_most_512_named_prefixes(tmp_path: Path) -> None:
    def write(n: int) -> Path:
        path = tmp_path / f"prefixes-{n}.jsonl"
        rows = [{"arrival_s": i, "prompt_len": 8, "output_len": 2, "prefix": f"p{i}", "prefix_len": 4}
                for i in range(n)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        return path

    assert len(load_trace(write(512), format="kvledger-jsonl")) == 512
    with pytest.raises(ConfigError, match=r"prefixes-513\.jsonl:513: more than 512 named prefixes$"):
        load_trace(write(513), format="kvledger-jsonl")


@pytest.mark.parametrize("stamp", ["2023-11-16 1x:17:03.5", "2023-11-16 18:1x:03.5", "2023-11-16 18:17:0x",
                                   "2023-11-16 +8:17:03.5", "2023-11-16 18:-7:03.5"])  # int() would take a sign
def test_every_part_of_a_timestamp_must_be_digits(tmp_path: Path, stamp: str) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n{stamp},10,2\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r":2: TIMESTAMP must look like"):
        load_trace(path, format="azure")


def test_the_calibration_keeps_between_three_and_ten_thousand_steps() -> None:
    steps = [(((4, 0),), (), 0.01), ((), (8, 9), 0.002), (((2, 4),), (5,), 0.003)]
    assert len(step_measurements(steps, limit=10_000)) == len(step_measurements(steps, limit=3)) == 3
    for bad in (2, 10_001, True):
        with pytest.raises(ConfigError, match=r"^step_measurements: limit must be an integer in 3\.\.10000"):
            step_measurements(steps, limit=bad)
