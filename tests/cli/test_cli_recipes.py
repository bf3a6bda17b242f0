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


def _report(folder: Path, **fields) -> Path:
    folder.mkdir()
    base = {"requests": 10, "completed": 10, "throughput_tok_s": 100.0, "ttft_s": {"p50": 0.001}}
    (folder / "metrics.json").write_text(json.dumps({**base, **fields}))
    return folder


def test_compare_refuses_a_gpu_simulation_against_a_cpu_run(capsys, tmp_path):
    sim = _report(tmp_path / "sim", source="simulator", gpu="h100-80gb", model="smollm2-135m", policy="full",
                  pool_blocks=512, block_size=16)
    real = _report(tmp_path / "real", source="runtime", device="cpu", model="smollm2-135m", policy="full",
                   memory={"pool_blocks": 512, "block_size": 16}, ttft_s={"p50": 36.0})
    rc, out, err = run_cli(capsys, "compare", str(sim), str(real))
    assert (rc, out) == (2, "") and err.count("\n") == 1, err
    assert "GPU (h100-80gb)" in err and "CPU (cpu)" in err and "cpu-local" in err
    rc, out, err = run_cli(capsys, "compare", str(sim), str(real), "--force")  # asked for: shown, and warned
    assert rc == 0 and "warning: the two runs differ in device (h100-80gb vs cpu)" in err
    # A serve-trace report written before reports named their device is still a CPU run.
    old = _report(tmp_path / "old", source="runtime", model="smollm2-135m", policy="full")
    assert run_cli(capsys, "compare", str(sim), str(old))[0] == 2


def test_compare_warns_for_each_difference_in_pool_policy_and_model(capsys, tmp_path):
    a = _report(tmp_path / "a", source="simulator", gpu="cpu-local", model="smollm2-135m", policy="incremental",
                pool_blocks=4096, block_size=16)
    b = _report(tmp_path / "b", source="runtime", device="cpu", model="qwen2.5-0.5b", policy="full",
                memory={"pool_blocks": 128, "block_size": 16})
    rc, out, err = run_cli(capsys, "compare", str(a), str(b), "--json")
    assert rc == 0 and err.count("\n") == 1 and err.startswith("warning: the two runs differ in ")
    for text in ("model (smollm2-135m vs qwen2.5-0.5b)", "policy (incremental vs full)",
                 "pool (4,096 blocks x 16 tokens vs 128 blocks x 16 tokens)"):
        assert text in err, text
    assert "device" not in err  # cpu-local and cpu are the same device class, and not named as a difference
    assert {d["what"] for d in json.loads(out)["differences"]} == {"model", "policy", "pool"}
    same = _report(tmp_path / "same", source="simulator", gpu="cpu-local", model="smollm2-135m",
                   policy="incremental", pool_blocks=4096, block_size=16)
    rc, out, err = run_cli(capsys, "compare", str(a), str(same))
    assert (rc, err) == (0, "")


def test_simulate_and_plan_size_the_same_setup_to_the_same_pool(capsys):
    """The issue's setup: plan said 26,645 blocks, simulate 30,336 (it had no --engine and used kvledger's)."""
    setup = ["--model", "llama-3.1-70b", "--tp", "4", "--gpu", "h100-80gb"]
    sim = ["simulate", "--workload", "synthetic", "--requests", "4", *setup, "--no-report", "--json"]
    for engine in (None, "vllm", "kvledger"):
        flag = [] if engine is None else ["--engine", engine]
        rc, out, err = run_cli(capsys, "plan", *setup, *flag, "--json")
        assert rc == 0, err
        plan = json.loads(out)["pool_blocks"]
        rc, out, err = run_cli(capsys, *sim, *flag)
        assert rc == 0, err
        assert json.loads(out)["pool_blocks"] == plan, engine
        if engine is None:
            assert plan == 26_645
    rc, out, err = run_cli(capsys, *sim, "--engine", "sglang")
    assert rc == 2 and err.count("\n") == 1 and "sglang" in err


def test_calibrate_out_prints_a_simulate_command_that_reads_that_file(capsys, tmp_path, monkeypatch):
    """`calibrate --out F` used to suggest `--gpu cpu-local`, which reads the cache's profile, not F."""
    import shlex

    from kvledger.cli import calibrate_cmds
    from kvledger.core.sizing.geometry import KVSpec
    from kvledger.core.sizing.models import load_model_config
    from kvledger.sim.calibrate import CALIBRATION_SHAPES, Measurement
    from kvledger.sim.cost_model import CostModel, DeviceProfile

    cfg = load_model_config("smollm2-135m")
    spec = KVSpec.from_hf_config(cfg, kv_dtype="fp32")
    cost = CostModel(cfg, spec, DeviceProfile("truth", 80e9, 12e9, 1.0, 1.0, 2e-3, 5e9, 1e-6, "test"),
                     weight_dtype="fp32")
    points = {"out": [(n, 2e-5 + n * 7e-5) for n in (1, 2, 4, 8)], "in": [(n, 1e-5 + n * 6e-5) for n in (1, 2, 4, 8)]}
    fake = {"checkpoint": "fake", "config": cfg, "spec": spec, "threads": 2,
            "links": {"block_bytes": 737_280, "sizes": [1, 2, 4, 8],
                      "tiers": {"host": {"points": points}, "disk": {"points": points}}},
            "measurements": [Measurement(s, cost.step_time(list(s.prefill), list(s.decode)))
                             for s in CALIBRATION_SHAPES]}
    monkeypatch.setattr(calibrate_cmds, "measure_runtime", lambda *a, **k: fake)
    monkeypatch.setenv("KVLEDGER_CACHE", str(tmp_path / "cache"))  # no profile where --gpu cpu-local looks
    prof = tmp_path / "my profile.json"
    rc, out, err = run_cli(capsys, "calibrate", "--out", str(prof))
    assert rc == 0, err
    hint = out.split("simulate this machine with:")[1].strip().splitlines()[0]
    argv = shlex.split(hint)
    assert argv[:2] == ["kvledger", "simulate"] and argv[argv.index("--profile") + 1] == str(prof)
    rc, out, err = run_cli(capsys, *argv[1:], "--requests", "5", "--no-report", "--json")
    assert rc == 0, err
    assert json.loads(out)["gpu"] == "cpu-local"
    without = [a for i, a in enumerate(argv[1:]) if "--profile" not in (a, argv[1:][i - 1] if i else "")]
    rc, out, err = run_cli(capsys, *without, "--requests", "5", "--no-report")
    assert rc == 2 and "not calibrated yet" in err  # what the old hint led to
    rc, out, err = run_cli(capsys, "simulate", "--workload", "synthetic", "--profile", str(prof), "--no-report")
    assert rc == 2 and err.count("\n") == 1 and "--gpu cpu-local" in err
    # Written to the cache's own path, the hint needs no --profile.
    rc, out, err = run_cli(capsys, "calibrate", "--json")
    hint = json.loads(out)["simulate"]
    assert rc == 0 and "--profile" not in hint and "--gpu cpu-local" in hint
