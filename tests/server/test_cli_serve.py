"""`kvledger serve` and `kvledger bench serve` from the command line: bad input is one line and exit 2;
the load client measures a live server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_run import one_error_line, run  # tests/cli_run.py (pytest's pythonpath)

_REPO = Path(__file__).resolve().parents[2]
# CI puts shared/ beside the clone; a worktree sits one level deeper.
TRACES = next((p / "shared" / "traces" for p in (_REPO.parent, _REPO.parent.parent)
               if (p / "shared" / "traces").is_dir()), _REPO.parent / "shared" / "traces")


@pytest.mark.parametrize("args, message", [
    (["serve", "--tenants", "/nonexistent/tenants.toml"], "no tenants file"),
    (["serve", "--tenants", "x.toml", "--api-key", "k"], "not both"),
    (["serve", "--max-queue", "0"], "--max-queue"),
    (["serve", "--policy", "greedy"], "'greedy' is not one of 'full', 'incremental', 'predicted'"),
    (["serve", "--recovery", "swap"], "--host-blocks"),
    (["serve", "--port", "70000"], "--port"),
    (["bench", "serve", "--workload", "synthetic"], "needs --rate"),
    (["bench", "serve"], "--trace FILE or --workload"),
    (["bench", "serve", "--workload", "synthetic", "--rate", "1", "--url", "http://10.1.2.3:8000"], "loopback"),
    (["bench", "serve", "--workload", "synthetic", "--rate", "0"], "--rate"),
    (["bench", "serve", "--trace", "/nonexistent.csv", "--rate", "1"], "no trace file"),
])
def test_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    rc, _, err = run(capsys, *args)
    assert rc == 2
    assert message in one_error_line(err)


def test_bench_serve_against_a_dead_port_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, _, err = run(capsys, "bench", "serve", "--url", f"http://127.0.0.1:{port}", "--workload", "synthetic",
                     "--rate", "1", "--duration", "1")
    assert rc == 2 and "cannot reach" in one_error_line(err)


@pytest.mark.model
def test_bench_serve_synthetic(server, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "bench", "serve", "--url", server.url, "--workload", "synthetic", "--rate", "8",
                       "--duration", "1.5", "--concurrency", "4", "--prompt-len", "24", "--output-len", "4",
                       "--shared-prefix", "32", "--api-key", server.keys["acme"], "--json")
    assert rc == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["requests"] >= 1 and report["completed"] == report["requests"], report
    assert report["errors"] == {}
    assert report["output_tokens"] == 4 * report["completed"]  # ignore_eos: exactly what was asked
    assert report["prompt_tokens"] == 56 * report["completed"]
    assert report["ttft_s"]["count"] == report["completed"]
    assert report["tpot_s"]["p50"] > 0 and report["e2e_s"]["p99"] >= report["ttft_s"]["p50"]
    if report["completed"] > 1:
        assert report["cached_tokens"] > 0  # the shared system prompt hits from the second request on


@pytest.mark.model
@pytest.mark.skipif(not (TRACES / "sharegpt_8k_filtered_lengths_llama2.csv").exists(), reason="no traces")
def test_bench_serve_trace_table(server, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "bench", "serve", "--url", server.url, "--trace",
                       str(TRACES / "sharegpt_8k_filtered_lengths_llama2.csv"), "--rate", "4", "--duration", "1",
                       "--num-requests", "3", "--scale", "0.05", "--max-prompt", "48", "--max-tokens", "4",
                       "--api-key", server.keys["acme"])
    assert rc == 0, err
    assert "TTFT" in out and "TPOT" in out and "end-to-end" in out
    report = json.loads(out.strip().splitlines()[-1])
    assert 1 <= report["requests"] <= 3 and report["errors"] == {}
    assert 1 <= report["output_tokens"] <= 4 * report["requests"]


@pytest.mark.model
def test_bench_serve_counts_errors(server, capsys: pytest.CaptureFixture[str]) -> None:
    """A wrong key: every request is an error, counted by kind, and the run still ends."""
    rc, out, _ = run(capsys, "bench", "serve", "--url", server.url, "--workload", "synthetic", "--rate", "5",
                     "--duration", "0.5", "--model", "smollm2-135m", "--api-key", "sk-wrong", "--json")
    assert rc == 0
    report = json.loads(out.strip().splitlines()[-1])
    assert report["completed"] == 0 and report["errors"] == {"http_401": report["requests"]}
