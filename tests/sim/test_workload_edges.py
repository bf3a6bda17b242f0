"""Edges of the workload readers a user meets: the names in their refusals (a distribution's bound, a CSV's
missing columns, a trace's named-prefix limit, a timestamp's parts) and the calibration's step limit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvledger.errors import ConfigError
from kvledger.sim.calibrate import step_measurements
from kvledger.workloads import (
    LogNormal,
    SimRequest,
    Uniform,
    at_rate,
    load_kvledger,
    load_lengths,
    load_mooncake,
    load_trace,
    slice_requests,
    sniff_trace_format,
)


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


def _sim_request(rid: str, arrival_s: float, group: str = "g") -> SimRequest:
    return SimRequest(rid, arrival_s, [1, 2, 3], 4, group)


# ---- the simulator's workload files -------------------------------------------------------------------
def test_a_bad_output_length_in_a_length_table_names_the_file_and_line(tmp_path) -> None:
    table = tmp_path / "lengths.csv"
    table.write_text("num_prefill_tokens,num_decode_tokens\n12,3\n7,lots\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"lengths\.csv:3: column num_decode_tokens must be an integer"):
        load_lengths(table, arrivals=[0.0, 1.0])


def test_a_mooncake_record_may_ask_for_no_output(tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5, "output_length": 0, "hash_ids": [1]}\n', encoding="utf-8")
    (req,) = load_mooncake(trace, block_tokens=8)
    assert (req.prompt_len, req.output_len) == (5, 0)


def test_a_window_of_requests_starts_at_its_start() -> None:
    reqs = [_sim_request("a", 1.0), _sim_request("b", 2.0), _sim_request("c", 3.0)]
    kept = slice_requests(reqs, start_s=2.0, end_s=3.0)
    assert [(r.request_id, r.arrival_s) for r in kept] == [("b", 0.0)]  # [start, end): b in, c out


def test_workload_parameters_out_of_range_are_refused_with_their_reason(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"^rate must be a number of requests per second in \(0, 1e6\]"):
        at_rate([_sim_request("a", 0.0), _sim_request("b", 1.0)], 1e7)  # over a million a second
    with pytest.raises(ConfigError, match=r"^LogNormal needs mean > 0 and cv > 0, got mean=0 cv=1$"):
        LogNormal(0, 1)
    with pytest.raises(ConfigError, match=r"^request 'a': trust_group must be a non-empty string$"):
        _sim_request("a", 0.0, group="")
    with pytest.raises(ConfigError, match="token_base"):
        load_mooncake(tmp_path / "unused.jsonl", token_base=-1)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"empty\.jsonl: empty trace \(accepted formats: "):
        sniff_trace_format(empty)


def test_a_kvledger_trace_takes_negative_priorities_down_to_minus_a_million(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_len": 4, "output_len": 2, "priority": -100}\n'
                     '{"arrival_s": 1, "prompt_len": 4, "output_len": 2, "priority": -1000000}\n', encoding="utf-8")
    assert [r.priority for r in load_kvledger(trace)] == [-100, -1000000]
