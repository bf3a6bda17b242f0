"""`kvledger simulate` and `kvledger calibrate` through the real CLI (in-process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvledger.cli import sim_cmds
from kvledger.cli.main import main
from kvledger.sim.calibrate import CALIBRATION_SHAPES, Measurement
from kvledger.sim.cost_model import CostModel, DeviceProfile, get_profile

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
AZURE = TRACES / "azure_llm_2023_conv.csv"
SHAREGPT = TRACES / "sharegpt_8k_filtered_lengths_llama2.csv"
needs_traces = pytest.mark.skipif(not AZURE.is_file(), reason=f"trace folder {TRACES} is absent")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@needs_traces
def test_simulate_prints_a_table_and_writes_the_report(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "simulate", "--trace", str(AZURE), "--model", "llama-3.1-8b", "--gpu",
                           "h100-80gb", "--tp", "1", "--policy", "incremental", "--duration-s", "20",
                           "--out", str(tmp_path / "rep"))
    assert rc == 0, err
    assert "Simulation of azure_llm_2023_conv.csv" in out and "TTFT" in out and "throughput" in out
    assert (tmp_path / "rep" / "metrics.json").is_file() and (tmp_path / "rep" / "occupancy.png").is_file()


@needs_traces
def test_simulate_json_and_prefix_bound(capsys):
    rc, out, err = run_cli(capsys, "simulate", "--trace", str(AZURE), "--limit", "15", "--no-report",
                           "--prefix-bound", "--isolate-groups", "--block-size", "32", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["requests"] == 15 and data["completed"] == 15 and data["block_size"] == 32
    assert data["trust_groups"] == "request" and data["prefix_bound"]["bound"] == 0.0
    assert data["report"] is None


@needs_traces
def test_simulate_sweep_writes_a_comparison(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "simulate", "--trace", str(AZURE), "--limit", "12", "--sweep",
                           "policy=full,predicted", "--sweep", "prefix-cache=on,off", "--out", str(tmp_path / "s"))
    assert rc == 0, err
    assert "Sweep" in out and "predicted" in out
    rows = (tmp_path / "s" / "comparison.csv").read_text().splitlines()
    assert rows[0].startswith("policy,prefix_cache,throughput_tok_s") and len(rows) == 5


@pytest.mark.skipif(not SHAREGPT.is_file(), reason="ShareGPT lengths are absent")
def test_simulate_fragmentation(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "simulate", "--fragmentation", "--trace", str(SHAREGPT), "--limit", "60",
                           "--capacity-tokens", "32768", "--frag-block-sizes", "16,64", "--out", str(tmp_path / "f"))
    assert rc == 0, err
    assert "contiguous (max)" in out and "paged, block 16" in out and "20.4%" in out
    assert (tmp_path / "f" / "fragmentation.csv").is_file()


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--trace", "/no/such/trace.csv"], "no trace file at /no/such/trace.csv"),
    (["simulate", "--trace", str(AZURE), "--sweep", "colour=red"], "unknown sweep key 'colour'"),
    (["simulate", "--trace", str(AZURE), "--sweep", "policy"], "--sweep takes key=v1,v2"),
    (["simulate"], "give --trace PATH"),
    (["simulate", "--trace", str(AZURE), "--gpu", "tpu-v9", "--limit", "3"], "unknown device profile"),
])
def test_simulate_errors_are_one_line(capsys, argv, message):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("kvledger: error:") and message in err


def test_calibrate_fits_and_writes_the_profile(capsys, tmp_path, monkeypatch):
    """The measuring half is replaced by step times generated from a known profile; the fit must
    recover it and write a profile that get_profile('cpu-local') then reads."""
    from kvledger.core.geometry import KVSpec
    from kvledger.core.models import load_model_config

    cfg = load_model_config("smollm2-135m")
    spec = KVSpec.from_hf_config(cfg, kv_dtype="fp32")
    truth = DeviceProfile("truth", 80e9, 12e9, 1.0, 1.0, 2e-3, 5e9, 1e-6, "test")
    cost = CostModel(cfg, spec, truth, weight_dtype="fp32")
    fake = {"checkpoint": "fake", "config": cfg, "spec": spec, "threads": 2, "host_link_Bps": 5e9,
            "transfer_overhead_s": 1e-6,
            "measurements": [Measurement(s, cost.step_time(list(s.prefill), list(s.decode)))
                             for s in CALIBRATION_SHAPES]}
    monkeypatch.setattr(sim_cmds, "measure_runtime", lambda *a, **k: fake)
    monkeypatch.setenv("KVLEDGER_CACHE", str(tmp_path))
    rc, out, err = run_cli(capsys, "calibrate", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["path"] == str(tmp_path / "cpu-local.json")
    assert data["fit"]["rms_log_error"] < 0.02
    prof = get_profile("cpu-local")
    assert prof.peak_flops == pytest.approx(80e9, rel=0.1)
    assert prof.mem_bandwidth_Bps == pytest.approx(12e9, rel=0.1)
    assert prof.step_overhead_s == pytest.approx(2e-3, rel=0.2)
    assert (tmp_path / "cpu-local.fit.json").is_file()
