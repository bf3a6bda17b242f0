"""Options that used to be dropped in silence and recipes that misled (issue 33): `simulate --replicas --out`,
`compare` across unlike runs, `simulate --engine` agreeing with `plan`, `quality`'s exit status and
`calibrate`'s hint."""

from __future__ import annotations

import json
from pathlib import Path

from kvledger.cli import sim_cmds
from kvledger.cli.main import main

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
MOONCAKE = TRACES / "mooncake_conversation_head300.jsonl"
FLEET = ["simulate", "--trace", str(MOONCAKE), "--limit", "40", "--block-size", "512", "--pool-blocks", "120",
         "--replicas", "2"]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_fleet_simulation_writes_its_report_to_out_and_reports_progress(capsys, tmp_path, monkeypatch):
    calls: list[tuple[float, int, int]] = []
    real_bar = sim_cmds._progress_bar

    def spy(label: str):
        update, bar, task = real_bar(label)

        def record(now: float, done: int, total: int) -> None:
            calls.append((now, done, total))
            update(now, done, total)

        return record, bar, task

    monkeypatch.setattr(sim_cmds, "_progress_bar", spy)
    rc, out, err = run_cli(capsys, *FLEET, "--out", str(tmp_path / "fleet"))
    assert (rc, err) == (0, ""), err  # not a terminal: no progress bar on stderr
    assert f"report: {tmp_path / 'fleet'}" in out
    metrics = json.loads((tmp_path / "fleet" / "metrics.json").read_text())
    assert metrics["source"] == "fleet simulator" and metrics["replicas"] == 2
    assert len(metrics["per_replica"]) == 2 and (tmp_path / "fleet" / "replicas.csv").is_file()
    assert calls and calls[-1][1] == calls[-1][2] == 40  # the bar was fed to the end
    rc, out, err = run_cli(capsys, *FLEET, "--out", str(tmp_path / "none"), "--no-report", "--json")
    assert rc == 0 and json.loads(out)["report"] is None and not (tmp_path / "none").exists()
