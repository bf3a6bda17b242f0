"""Whether a trace carries its own arrival times is asked of the trace-format registry, by every reader.

The load client and `kvledger diagnose --trace` used to decide it by two private sniffs of their own
("a CSV whose header starts with TIMESTAMP"), so a kvledger CSV -- which has an ``arrival_s`` column --
was taken for a length table: the load client refused it without ``--rate``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvledger.errors import ConfigError
from kvledger.loadgen import LoadSpec, trace_workload
from kvledger.workloads import trace_has_arrivals

KVLEDGER_CSV = "arrival_s,prompt_len,output_len\n0.0,12,3\n0.5,20,4\n2.0,8,2\n"
AZURE_CSV = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n" \
            "2023-11-16 18:15:50.9951690,396,109\n"
LENGTHS_CSV = "num_prefill_tokens,num_decode_tokens\n12,3\n20,4\n"
KVLEDGER_JSONL = ('{"arrival_s": 0.0, "prompt_len": 12, "output_len": 3}\n'
                  '{"arrival_s": 1.5, "prompt_len": 9, "output_len": 2}\n')


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(("name", "text", "timed"), [
    ("k.csv", KVLEDGER_CSV, True), ("a.csv", AZURE_CSV, True), ("l.csv", LENGTHS_CSV, False),
    ("k.jsonl", KVLEDGER_JSONL, True),
])
def test_the_registry_says_which_traces_carry_arrival_times(tmp_path: Path, name: str, text: str, timed: bool) -> None:
    assert trace_has_arrivals(_write(tmp_path, name, text)) is timed


def test_an_unreadable_trace_counts_as_timed_so_loading_it_says_what_is_wrong(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere.csv")
    assert trace_has_arrivals(missing) is True
    with pytest.raises(ConfigError):
        trace_workload(missing, LoadSpec("http://127.0.0.1:1"))


def test_the_load_client_replays_a_kvledger_csv_at_its_own_arrival_times(tmp_path: Path) -> None:
    items = trace_workload(_write(tmp_path, "k.csv", KVLEDGER_CSV), LoadSpec("http://127.0.0.1:1"), vocab=32000)
    assert [i.arrival_s for i in items] == [0.0, 0.5, 2.0]
    assert [len(i.prompt) for i in items] == [12, 20, 8] and [i.max_tokens for i in items] == [3, 4, 2]


def test_the_load_client_still_asks_for_a_rate_for_a_length_table(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no arrival times: give --rate"):
        trace_workload(_write(tmp_path, "l.csv", LENGTHS_CSV), LoadSpec("http://127.0.0.1:1"))
    items = trace_workload(_write(tmp_path, "l2.csv", LENGTHS_CSV), LoadSpec("http://127.0.0.1:1", rate=4.0))
    assert [len(i.prompt) for i in items] == [12, 20]
