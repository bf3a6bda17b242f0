"""A vLLM user's words carry over: ``--kv-cache-dtype fp8`` is vLLM's unscaled e4m3, ``plan --engine vllm``
refuses the KV formats vLLM cannot serve, Hugging Face ids find the bundled configs, GPU short names find the
catalogue's entries, and a size without a unit is refused instead of read as bytes. Each is what a user sees:
the exit code, the one error line, the planned figures."""

from __future__ import annotations

import json

import pytest

from cli_run import run  # tests/cli_run.py (pytest's pythonpath)


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


# ---- Hugging Face ids find the bundled configs ---------------------------------------------------------
@pytest.mark.parametrize("hf_id", ["meta-llama/Llama-3.1-8B", "meta-llama/llama-3.1-8b", "META-LLAMA/LLAMA-3.1-8B",
                                   "meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Meta-Llama-3.1-8B",
                                   "meta-llama/Meta-Llama-3.1-8B-Instruct", "Llama-3.1-8B"])
def test_a_hugging_face_id_plans_the_bundled_config(capsys: pytest.CaptureFixture[str], hf_id: str) -> None:
    bundled = run_json(capsys, *H100)
    assert run_json(capsys, "plan", "--model", hf_id, "--gpu", "h100-80gb") == bundled
    assert bundled["model"] == "llama-3.1-8b"


@pytest.mark.parametrize("hf_id, name", [("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
                                         ("google/gemma-2-9b-it", "gemma-2-9b"),
                                         ("mistralai/Mistral-7B-Instruct-v0.1", "mistral-7b"),
                                         ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m")])
def test_other_bundled_configs_answer_to_their_ids(capsys: pytest.CaptureFixture[str], hf_id: str, name: str) -> None:
    assert run_json(capsys, "plan", "--model", hf_id)["model"] == name


@pytest.mark.parametrize("model, closest", [("meta-llama/Llama-3.3-70B-Instruct", "llama-3.1-70b"),
                                            ("meta-llama/Meta-Llama-3-8B", "llama-3.1-8b"),
                                            ("llama3.1-8b", "llama-3.1-8b")])
def test_an_unknown_id_names_the_closest_bundled_configs(capsys: pytest.CaptureFixture[str], model: str,
                                                         closest: str) -> None:
    line = one_error_line(capsys, "plan", "--model", model)
    assert f"unknown model {model!r}; closest bundled: {closest}" in line


def test_simulate_and_admit_take_hugging_face_ids(capsys: pytest.CaptureFixture[str]) -> None:
    admit = ["admit", "--gpu", "l4", "--requests", "2", "--prompt", "64", "--max-new", "8"]
    assert run_json(capsys, *admit, "--model", "meta-llama/Llama-3.1-8B") == \
        run_json(capsys, *admit, "--model", "llama-3.1-8b")
    sim = ["simulate", "--workload", "synthetic", "--requests", "3", "--no-report", "--pool-blocks", "200"]
    assert run_json(capsys, *sim, "--model", "Qwen/Qwen2.5-7B")["model"] == "qwen2.5-7b"


# ---- GPU short names ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("short, name", [("h100", "h100-80gb"), ("H100", "h100-80gb"), ("h100-sxm", "h100-80gb"),
                                         ("NVIDIA H100 80GB HBM3", "h100-80gb"), ("a100-80gb", "a100-80gb"),
                                         ("A100-80G", "a100-80gb"), ("a100 40gb", "a100-40gb"), ("l4", "l4"),
                                         ("L4", "l4"), ("h200", "h200-141gb"), ("a10", "a10")])
def test_a_gpu_short_name_plans_its_catalogue_entry(capsys: pytest.CaptureFixture[str], short: str,
                                                    name: str) -> None:
    plan = ["plan", "--model", "llama-3.1-8b", "--engine", "kvledger"]
    assert run_json(capsys, *plan, "--gpu", short) == run_json(capsys, *plan, "--gpu", name)


def test_an_ambiguous_short_name_lists_its_candidates(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_error_line(capsys, *H100[:3], "--gpu", "a100")
    assert "GPU 'a100' is ambiguous: give one of a100-40gb, a100-80gb" in line
    line = one_error_line(capsys, *H100[:3], "--gpu", "h100-80")  # the SXM and the PCIe part both have 80 GB
    assert "GPU 'h100-80' is ambiguous: give one of h100-80gb, h100-pcie" in line


def test_an_unknown_gpu_names_the_closest(capsys: pytest.CaptureFixture[str]) -> None:
    # (h100-pcie was the example of an unknown name until the catalogue grew one)
    assert "unknown GPU 'h100-pci'; closest: h100-pcie" in one_error_line(capsys, *H100[:3], "--gpu", "h100-pci")


def test_short_names_reach_the_matrix_the_prices_and_simulate(capsys: pytest.CaptureFixture[str]) -> None:
    matrix = ["plan", "--model", "llama-3.1-8b", "--matrix", "--prompt", "1000", "--max-new", "100",
              "--concurrency", "4", "--tps", "1"]
    short = run_json(capsys, *matrix, "--gpus", "h100,L4", "--prices", "h100=2.5,l4=0.8")
    full = run_json(capsys, *matrix, "--gpus", "h100-80gb,l4", "--prices", "h100-80gb=2.5,l4=0.8")
    assert short == full and [r["gpu"] for r in short["rows"]] == ["h100-80gb", "l4"]
    sim = ["simulate", "--workload", "synthetic", "--requests", "3", "--no-report"]
    assert run_json(capsys, *sim, "--gpu", "H100")["gpu"] == "h100-80gb"
    assert "is ambiguous" in one_error_line(capsys, *sim, "--gpu", "a100")


# ---- a size needs its unit -----------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [
    ["plan", "--model", "llama-3.1-8b", "--device-memory", "80"],
    ["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--pool", "512"],
    ["plan", "--model", "llama-3.1-8b", "--gpu", "l4", "--reserve", "1"],
    ["plan", "--model", "llama-3.1-8b", "--gpu", "l4", "--workspace", "2"],
    ["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--device-memory", "80GiB", "--weights", "16"],
    ["admit", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--pool", "512"],
    ["simulate", "--workload", "synthetic", "--host-pool", "64"],
    ["simulate", "--workload", "synthetic", "--gpu", "cpu-local", "--device-memory", "2"],
    ["generate", "hi", "--pool", "64"],
    ["serve-trace", "--trace", "t.csv", "--pool", "64"],
    ["serve", "--pool", "64"],
    ["serve", "--max-request-body-bytes", "4000000"],
    ["diagnose", "--inject-bytes", "64"],
    ["diagnose", "--min-bytes", "16"],
])
def test_a_size_without_a_unit_is_refused_naming_the_units(capsys: pytest.CaptureFixture[str],
                                                           args: list[str]) -> None:
    """The issue: `--device-memory 80` was read as 80 bytes. Every size-taking flag now asks for the unit."""
    number = args[-1]
    line = one_error_line(capsys, *args)
    assert f"size '{number}' has no unit: write {number}GiB (binary), {number}GB (decimal) or {number}B (bytes)" \
        in line


def test_a_size_with_a_unit_or_zero_is_taken(capsys: pytest.CaptureFixture[str]) -> None:
    geometry = ["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128"]
    in_bytes = run_json(capsys, *geometry, "--pool", f"{512 * 2**20}B")
    assert in_bytes == run_json(capsys, *geometry, "--pool", "512MiB") and in_bytes["pool_blocks"] == 256
    assert run_json(capsys, "plan", "--model", "llama-3.1-8b", "--gpu", "l4", "--reserve", "0")["pool_blocks"] > 0
