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
    rows = json.loads(out)["rows"]
    cheapest = {(r["gpu"], r["tp"]) for r in rows if r["cheapest"]}
    assert cheapest == {("a100-80gb", 1), ("h100-80gb", 1)}  # one GPU at 2 each: neither is cheaper
    assert {(r["gpu"], r["tp"]) for r in rows if r["tie"]} == cheapest  # and the JSON says it is a tie
    rc, out, err = run_cli(capsys, "plan", "--model", "llama-3.1-8b", "--matrix", "--prompt", "1024", "--max-new",
                           "256", "--concurrency", "4", "--prices", "h100-80gb=2,a100-80gb=2")
    assert rc == 0, err
    assert out.count("<- tied cheapest") == 2 and "<- cheapest" not in out  # the table names it a tie


def test_matrix_names_a_single_cheapest_row_without_a_tie(capsys):
    rc, out, err = run_cli(capsys, "plan", "--model", "llama-3.1-8b", "--matrix", "--prompt", "1024", "--max-new",
                           "256", "--concurrency", "4", "--prices", "h100-80gb=2,a100-80gb=3", "--json")
    assert rc == 0, err
    rows = json.loads(out)["rows"]
    assert [(r["gpu"], r["tp"]) for r in rows if r["cheapest"]] == [("h100-80gb", 1)]
    assert not any(r["tie"] for r in rows)
    rc, out, err = run_cli(capsys, "plan", "--model", "llama-3.1-8b", "--matrix", "--prompt", "1024", "--max-new",
                           "256", "--concurrency", "4", "--prices", "h100-80gb=2,a100-80gb=3")
    assert rc == 0, err
    assert out.count("<- cheapest") == 1 and "tied" not in out


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


def test_gpus_marks_a_datasheet_memory_figure(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    rc, out, err = run_cli(capsys, "gpus")
    assert rc == 0, err
    for name in ("l40s", "a10g", "h100-pcie", "h100-nvl", "h20", "b200", "mi300x", "rtx4090"):
        assert f"│ {name} " in out, name
    row = next(line for line in out.splitlines() if line.startswith("│ a10g "))
    assert "24.00 GiB *" in row and "23,028 MiB" in row  # datasheet-marked, beside nvidia-smi's published total
    assert "44.42 GiB" in next(line for line in out.splitlines() if line.startswith("│ l40s "))
    assert "│           - │" in next(line for line in out.splitlines() if line.startswith("│ h20 "))  # no nvidia-smi
    assert "* the datasheet's capacity" in out and "8 TB/s" in out and "2.25 PFLOP/s" in out
    rc, out, err = run_cli(capsys, "gpus", "--json")
    rows = json.loads(out)
    assert rows["a10g"]["memory_from_datasheet"] is True and rows["l40s"]["memory_from_datasheet"] is False
    assert rows["h20"]["nvidia_smi_total_mib"] is None and "4090" in rows["rtx4090"]["aliases"]


def test_plan_on_a_rented_gpu_and_one_line_when_its_memory_is_the_datasheets(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")
    rc, out, err = run_cli(capsys, "plan", "--gpu", "l40s", "--model", "llama-3.1-8b")
    assert rc == 0, err
    assert "44.42 GiB as the driver reports it (l40s; datasheet 48GB, nvidia-smi 46,068 MiB)" in out
    assert "datasheet's" not in out
    rc, out, err = run_cli(capsys, "plan", "--gpu", "a10g", "--model", "llama-3.1-8b")
    assert rc == 0, err
    notes = [line for line in out.splitlines() if "not driver-reported" in line]
    assert notes == ["note: a10g: memory is the datasheet's 24GiB, not driver-reported (none is published; drivers "
                     "report 1-8% less)"]
    rc, out, err = run_cli(capsys, "plan", "--gpu", "a10g", "--model", "llama-3.1-8b", "--json")
    assert "datasheet" in json.loads(out)["device_memory_note"]
    rc, out, err = run_cli(capsys, "plan", "--gpu", "l40s", "--model", "llama-3.1-8b", "--json")
    assert "device_memory_note" not in json.loads(out)


def test_a_fit_hint_never_suggests_a_gpu_whose_memory_is_the_datasheets(capsys):
    """A hint is a promise: a10g's 24 GiB is the datasheet's, so a request that needs just more than 23.95 GiB
    gives is pointed at the next GPU with a driver-reported figure (a100-40gb), not at a10g."""
    plan = ["plan", "--model", "llama-3.1-8b", "--json"]
    rc, out, err = run_cli(capsys, *plan, "--device-memory", "23.95GiB")
    here = json.loads(out)["pool_blocks"]
    rc, out, err = run_cli(capsys, *plan, "--gpu", "a10g")
    assert json.loads(out)["pool_blocks"] > here  # a10g's datasheet figure would hold one more block
    tokens = (here + 1) * 16
    rc, out, err = run_cli(capsys, "plan", "--model", "llama-3.1-8b", "--device-memory", "23.95GiB", "--prompt",
                           str(tokens - 16), "--max-new", "16")
    assert rc == 2 and "--gpu a100-40gb" in err and "a10g" not in err, err
