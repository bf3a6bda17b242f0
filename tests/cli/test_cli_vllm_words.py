"""A vLLM user's words carry over: ``--kv-cache-dtype fp8`` is vLLM's unscaled e4m3, ``plan --engine vllm``
refuses the KV formats vLLM cannot serve, Hugging Face ids find the bundled configs, GPU short names find the
catalogue's entries, and a size without a unit is refused instead of read as bytes. Each is what a user sees:
the exit code, the one error line, the planned figures."""

from __future__ import annotations

import json

import pytest

from kvledger.cli.main import main


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    rc, out, err = run(capsys, *args, "--json")
    assert (rc, err) == (0, ""), err
    return json.loads(out)


def one_error_line(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    rc, out, err = run(capsys, *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and out == "" and len(lines) == 1 and lines[0].startswith("kvledger: error: "), (rc, out, err)
    return lines[0]


H100 = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb"]


# ---- --kv-cache-dtype: vLLM's values, vLLM's meanings ----------------------------------------------------
def test_vllms_fp8_is_the_unscaled_cast_at_half_the_bytes_of_auto(capsys: pytest.CaptureFixture[str]) -> None:
    auto = run_json(capsys, *H100, "--kv-cache-dtype", "auto")
    fp8 = run_json(capsys, *H100, "--kv-cache-dtype", "fp8")
    e4m3 = run_json(capsys, *H100, "--kv-dtype", "fp8_e4m3")
    assert auto["kv_dtype"] == "bf16" and auto["kv_bytes_per_token"] == 131072
    assert fp8 == e4m3 and fp8["kv_dtype"] == "fp8_e4m3" and fp8["kv_bytes_per_token"] == 65536
    assert [p["part"] for p in fp8["kv_format_parts"]] == ["values", "values"]  # no scale metadata
    assert fp8["pool_blocks"] - 2 * auto["pool_blocks"] in (0, 1)  # the same KV budget in blocks of half the size


def test_kvledgers_scaled_fp8_is_planned_under_its_own_name(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, *H100, "--engine", "kvledger", "--kv-dtype", "fp8-scaled")
    assert data["kv_dtype"] == "fp8-scaled" and data["kv_bytes_per_token"] == 32 * 2 * 8 * 130


# ---- --engine vllm and the formats vLLM cannot serve ----------------------------------------------------
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8-scaled"])
def test_plan_for_vllm_refuses_a_format_vllm_cannot_serve(capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    line = one_error_line(capsys, *H100, "--kv-cache-dtype", fmt)
    assert f"vLLM cannot serve the KV format {fmt}" in line
    assert "fp8 (= fp8_e4m3) and fp8_e5m2" in line and "--engine kvledger" in line
    assert fmt in one_error_line(capsys, "plan", "--model", "llama-3.1-8b", "--matrix", "--prompt", "100",
                                 "--max-new", "10", "--concurrency", "2", "--kv-dtype", fmt)
    assert run_json(capsys, *H100, "--engine", "kvledger", "--kv-dtype", fmt)["kv_dtype"] == fmt


@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2", "auto", "bf16"])
def test_plan_for_vllm_takes_the_formats_vllm_serves(capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    assert run_json(capsys, *H100, "--kv-cache-dtype", fmt)["pool_blocks"] > 0
