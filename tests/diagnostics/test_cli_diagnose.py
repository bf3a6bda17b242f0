"""`kvledger diagnose`: the versioned document, the timeline, the table, injections, traces and bad input."""

from __future__ import annotations

import json

import pytest

from cli_run import run  # tests/cli_run.py (pytest's pythonpath)
from kvledger.cli.diagnose_cmds import INJECTION_NAMES
from kvledger.runtime.measure.diagnostics import FINDING_KINDS, INJECTIONS

SMALL = ["--requests", "3", "--max-prompt", "64", "--max-new", "8"]


def test_the_cli_lists_exactly_the_registered_injections():
    assert tuple(INJECTION_NAMES) == tuple(INJECTIONS)


@pytest.mark.model
def test_json_document_of_a_clean_run(capsys, tmp_path):
    rc, out, err = run(capsys, "diagnose", *SMALL, "--json", "--out", str(tmp_path))
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["schema"] == "kvledger.diagnosis" and doc["schema_version"] == 1
    assert set(doc["versions"]) == {"kvledger", "torch", "python"}
    assert doc["findings"] == []
    assert set(doc["ledgers"]["end"]) == {"tensors", "allocator", "pool", "device"}
    assert doc["ledgers"]["end"]["allocator"]["backend"] == "glibc"
    assert len(doc["workload"]["sha256"]) == 64 and doc["workload"]["requests"] == 3
    assert doc["model"]["name"] == "smollm2-135m" and doc["device"]["type"] == "cpu"
    assert len(doc["series"]) == len(doc["steps"]) + 2  # the baseline, one per step, the last sample
    # The attribution is a partition of the process's bytes.
    for row in doc["series"]:
        a = row["attribution"]
        assert sum(v for k, v in a.items() if k != "device_used") == a["device_used"]
    assert json.loads((tmp_path / "diagnosis.json").read_text()) == doc
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.model
def test_injected_pathologies_in_the_table(capsys, tmp_path):
    rc, out, err = run(capsys, "diagnose", *SMALL, "--max-new", "16", "--inject", "pool-leak,external-alloc",
                       "--inject-bytes", "32MiB", "--out", str(tmp_path), "--fail-on-findings")
    assert rc == 1, err  # findings and --fail-on-findings
    assert "logical_pool_leak" in out and "external_allocation" in out
    doc = json.loads((tmp_path / "diagnosis.json").read_text())
    kinds = sorted(f["kind"] for f in doc["findings"])
    assert kinds == ["external_allocation", "logical_pool_leak"]
    assert all(f["kind"] in FINDING_KINDS and f["bytes"] > 0 and len(f["steps"]) == 2 for f in doc["findings"])
    assert [i["name"] for i in doc["injected"]] == ["pool-leak", "external-alloc"]


@pytest.mark.model
def test_a_trace_slice_drives_the_run(capsys, tmp_path):
    trace = tmp_path / "slice.jsonl"
    rows = [{"timestamp": 0, "input_length": 2048, "output_length": 300, "hash_ids": [1, 2, 3, 4]},
            {"timestamp": 100, "input_length": 2560, "output_length": 200, "hash_ids": [1, 2, 3, 4, 5]},
            {"timestamp": 300, "input_length": 1024, "output_length": 400, "hash_ids": [9, 10]}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, out, err = run(capsys, "diagnose", "--trace", str(trace), "--json", "--out", str(tmp_path / "d"))
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["workload"]["name"] == "slice.jsonl" and doc["workload"]["requests"] == 3
    assert doc["findings"] == []


@pytest.mark.parametrize("argv, message", [
    (["--inject", "bogus"], "unknown injection bogus"),
    (["--requests", "0"], "--requests"),
    (["--every", "0"], "--every"),
    (["--inject-bytes", "lots"], "not a byte size"),
    (["--trace", "/nonexistent/trace.jsonl"], "no trace file"),
    (["--max-prompt", "8"], "--max-prompt"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    rc, out, err = run(capsys, "diagnose", *argv)
    assert rc == 2
    assert err.startswith("kvledger: error:") and message in err and err.count("\n") == 1


def test_out_must_be_a_folder(capsys, tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    rc, _, err = run(capsys, "diagnose", "--out", str(target))
    assert rc == 2 and "not a folder" in err
