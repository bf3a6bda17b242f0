"""The bundled measured workspace peaks (`kvledger/data/measured_peaks.json`) against the benchmark run they
come from (`benchmarks/results/workspace_peaks_smollm2_cpu.json`), and `kvledger plan --engine kvledger`
naming them. The rows must be what the runtime measures today, with its native attention kernels: a
row measured with the gathering reference backend overstated decode steps 8-60x."""

from __future__ import annotations

import json
from pathlib import Path

from kvledger.cli.main import main
from kvledger.core.sizing.engines import find_peak, load_measured_peaks

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "workspace_peaks_smollm2_cpu.json"


def test_every_bundled_row_is_the_worst_measured_step_it_covers() -> None:
    rows = load_measured_peaks()
    results = json.loads(RESULTS.read_text(encoding="utf-8"))
    measured = results["measurements"]
    assert {m["backend"] for m in measured} == {"NativePagedAttention"}
    smol = [r for r in rows if r.model == "smollm2-135m"]
    assert {r.dtype for r in smol} == {"fp32", "bf16"}
    for r in smol:
        covered = [m for m in measured if m["dtype"] == r.dtype and m["tokens"] <= r.max_batched_tokens
                   and m["seqs"] <= r.max_seqs and (m["kind"] != "decode" or m["context"] <= 2048)]
        assert r.peak_bytes == max(m["peak_bytes"] for m in covered), r
        # An honest source: the benchmark, the date, the backend, torch and the device.
        for part in ("benchmarks/workspace_peaks.py", results["date"], "attention NativePagedAttention",
                     f"torch {results['torch']}", "cpu"):
            assert part in r.source, (part, r.source)
    assert [r.to_dict() for r in smol] == results["peaks"]


def test_plan_for_our_runtime_reads_the_measured_peak(capsys) -> None:
    rc = main(["plan", "--engine", "kvledger", "--model", "smollm2-135m", "--device-memory", "8GiB", "--json"])
    out, err = capsys.readouterr()
    assert (rc, err) == (0, "")
    plan = json.loads(out)
    row = find_peak("smollm2-135m", "bf16", tp=1, max_batched_tokens=8192, max_seqs=256)
    assert row is not None
    assert plan["workspace_bytes"] == row.peak_bytes
    assert plan["workspace_source"] == f"measured: {row.source}"
    assert "NativePagedAttention" in plan["workspace_source"]
