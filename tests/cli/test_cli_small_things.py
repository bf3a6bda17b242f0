"""The small things of issue 33: `gpus` with units and whole names, `--matrix` ties named as ties, `admit`
summarising a long table."""

from __future__ import annotations

import json

from kvledger.cli.main import main

SEED = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--kv-dtype", "bf16", "--block-size", "16"]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_gpus_prints_rates_with_units_and_whole_names(capsys, monkeypatch):
    from kvledger.core.sizing.gpus import GPUS

    monkeypatch.setenv("COLUMNS", "140")
    rc, out, err = run_cli(capsys, "gpus")
    assert rc == 0, err
    assert "e+" not in out  # was 3.35e+12 B/s
    assert "3.35 TB/s" in out and "989 TFLOP/s" in out and "64 GB/s" in out
    monkeypatch.setenv("COLUMNS", "80")
    rc, out, err = run_cli(capsys, "gpus")
    assert rc == 0 and "…" not in out  # the other columns wrap; no name (or value) is cut
    for name in GPUS:
        assert f"│ {name} " in out, name


def test_matrix_marks_every_row_of_a_tie_as_cheapest(capsys):
    rc, out, err = run_cli(capsys, "plan", "--model", "llama-3.1-8b", "--matrix", "--prompt", "1024", "--max-new",
                           "256", "--concurrency", "4", "--prices", "h100-80gb=2,a100-80gb=2", "--json")
    assert rc == 0, err
    cheapest = {(r["gpu"], r["tp"]) for r in json.loads(out)["rows"] if r["cheapest"]}
    assert cheapest == {("a100-80gb", 1), ("h100-80gb", 1)}  # one GPU at 2 each: neither is cheaper


def test_admit_summarises_a_long_table_and_shows_all_on_request(capsys):
    lab = ["admit", *SEED, "--pool", "4GiB", "--requests", "64", "--prompt", "64", "--max-new", "16"]
    rc, out, err = run_cli(capsys, *lab)
    assert rc == 0, err
    assert "req-19 " in out and "req-20 " not in out and "... 44 more (--all shows every row" in out
    assert "admitted 64 using" in out  # the summary is still printed
    rc, out, err = run_cli(capsys, *lab, "--all")
    assert rc == 0 and "req-63 " in out and "more (--all" not in out
    rc, out, err = run_cli(capsys, *lab, "--no-geometry")
    assert rc == 0 and "KV geometry" not in out
