"""`kvledger plan` against measured memory: vLLM's start-up accounting, the GPU catalogue, any HF config,
capacity answers, fit hints, the matrix and our own runtime's measured peaks."""

from __future__ import annotations

import json
import re
from importlib import resources

import pytest

from cli_run import run  # tests/cli_run.py (pytest's pythonpath)
from kvledger.cli.options import flag_name
from kvledger.cli.plan_cmds import plan_cmd
from kvledger.core.sizing import gpus
from kvledger.core.sizing.capacity import fit_hints as _fit_hints
from kvledger.core.sizing.engines import find_peak, load_measured_peaks, vllm_batch_defaults
from kvledger.core.sizing.geometry import KVSpec
from kvledger.core.sizing.inventory import build_inventory
from kvledger.core.sizing.models import load_model_config
from kvledger.errors import ConfigError
from kvledger.units import parse_bytes

GiB = 2**30
H100_DRIVER = "79.18GiB"  # what vLLM logs as the H100's total ('Free memory on device 78.57/79.18 GiB')


def fit_hints(*args, **kwargs) -> list[str]:
    """The hints as `kvledger plan` prints them: each option under plan's first flag name (vLLM's)."""
    return [h.text(lambda option: flag_name(plan_cmd, option)) for h in _fit_hints(*args, **kwargs)]


def run_json(capsys, *argv):
    rc, out, err = run(capsys, *argv)
    assert (rc, err) == (0, ""), err
    return json.loads(out)


def one_line_error(capsys, *argv) -> str:
    rc, out, err = run(capsys, *argv)
    assert (rc, out) == (2, ""), (rc, out)
    assert err.startswith("kvledger: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ---- vLLM's KV cache, checked against its own logs ----------------------------------------------------

QWEN3_06B = {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936,
             "tie_word_embeddings": True, "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}
QWEN3_32B = {**QWEN3_06B, "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 64,
             "intermediate_size": 25600, "tie_word_embeddings": False}
LLAMA33_70B_FP8 = {**load_model_config("llama-3.1-70b"), "quantization_config": {
    "quant_method": "compressed-tensors", "ignore": ["lm_head"],
    "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}}

# llm-d config explorer's vLLM v0.11 logs on H100 (79.18 GiB, utilization 0.9, max-model-len 16000):
# (config, tp, weights GiB, peak activation GiB, KV cache GiB)
LLMD_MEASURED = {
    "llama-3.1-8b": (load_model_config("llama-3.1-8b"), 1, 14.99, 4.76, 51.38),
    "qwen3-0.6b": (QWEN3_06B, 1, 1.12, 5.56, 64.45),
    "qwen3-32b": (QWEN3_32B, 1, 61.03, 5.64, 4.45),
    "qwen3-32b-tp2": (QWEN3_32B, 2, 30.59, 5.64, 34.49),
    "llama-3.3-70b-fp8-tp2": (LLAMA33_70B_FP8, 2, 33.88, 4.84, 32.00),
}


@pytest.mark.parametrize("name", sorted(LLMD_MEASURED))
def test_vllm_engine_predicts_the_logged_kv_cache(name):
    cfg, tp, weights, activation, kv = LLMD_MEASURED[name]
    inv = build_inventory(KVSpec.from_hf_config(cfg, tp=tp), cfg, device_bytes=H100_DRIVER, engine="vllm",
                          gpu=None)
    predicted = inv.kv_budget_bytes / GiB
    assert kv * 0.95 <= predicted <= kv * 1.02  # within 5%, and never more than 2% above
    assert predicted == pytest.approx(kv, rel=0.01)  # in fact within 1% for every logged model
    terms = {t.key: t.bytes / GiB for t in inv.terms}
    assert terms["weights"] == pytest.approx(weights, rel=0.01)
    assert terms["activation"] == pytest.approx(activation, rel=0.03)


def test_plan_llama_8b_on_the_logged_h100_beside_vllm(capsys):
    data = run_json(capsys, "plan", "--model", "llama-3.1-8b", "--device-memory", H100_DRIVER, "--json")
    assert data["device_bytes"] == int(79.18 * GiB) and data["engine"] == "vllm"
    kv = data["kv_budget_bytes"] / GiB
    assert 51.38 * 0.95 <= kv <= 51.38 * 1.02
    assert round(kv, 2) == 51.37  # vLLM logged 51.38 GiB
    terms = {t["key"]: t for t in data["terms"]}
    assert round(terms["weights"]["bytes"] / GiB, 2) == 14.99  # vLLM: 14.99 GiB
    assert round(terms["activation"]["bytes"] / GiB, 2) == 4.77  # vLLM: 4.76 GiB
    assert round(terms["non_torch"]["bytes"] / GiB, 2) == 0.13  # vLLM: 0.13 GiB
    assert not terms["cuda_graphs"]["in_budget"] and not terms["cuda_context"]["in_budget"]
    for term in data["terms"]:
        assert term["formula"] and term["source"]
    assert (data["max_batched_tokens"], data["max_seqs"]) == (8192, 1024)  # vLLM's H100 defaults
    # The pool is whole 2 MiB blocks of that budget; vLLM's 'GPU KV cache size' is the same in tokens.
    assert data["pool_blocks"] == data["kv_budget_bytes"] // (2 * 2**20) == 26301
    assert data["capacity_tokens"] == 26301 * 16 == data["largest_context"]
    rc, out, err = run(capsys, "plan", "--model", "llama-3.1-8b", "--device-memory", H100_DRIVER, "--explain",
                       "--context", "16000")
    assert rc == 0, err
    text = " ".join(out.split())
    assert "51.37 GiB" in text and "14.99 GiB" in text and "4.77 GiB" in text
    assert "maximum concurrency for 16,000 tokens per request: 26.30x" in text
    assert "sampler = N x vocab x 38 B" in text


def test_the_old_workspace_over_promised_by_six_percent():
    """The regression the issue reports: the kvledger formula (0.62 GiB workspace) promised 54.68 GiB."""
    cfg = load_model_config("llama-3.1-8b")
    spec = KVSpec.from_hf_config(cfg)
    old = build_inventory(spec, cfg, device_bytes="79.18GiB", engine="kvledger", runtime_reserve_bytes=0,
                          max_batched_tokens=8192, max_seqs=256)
    new = build_inventory(spec, cfg, device_bytes="79.18GiB", engine="vllm")
    assert old.kv_budget_bytes / GiB > 51.38 * 1.05  # over-promises against vLLM's log
    assert new.kv_budget_bytes / GiB <= 51.38 * 1.02


def test_vllm_batch_defaults_follow_the_gpu_class():
    from kvledger.core.sizing.gpus import get_gpu

    for name, expected in (("h100-80gb", (8192, 1024)), ("h200-141gb", (8192, 1024)), ("a100-80gb", (2048, 256)),
                           ("l4", (2048, 256)), ("a10", (2048, 256))):
        gpu = get_gpu(name)
        d = vllm_batch_defaults(gpu.memory_bytes, gpu.name)
        assert (d.max_num_batched_tokens, d.max_num_seqs) == expected, name
    assert vllm_batch_defaults(80 * GiB, "", offline=True).max_num_batched_tokens == 16384
    cfg = load_model_config("llama-3.1-8b")
    l4 = build_inventory(KVSpec.from_hf_config(cfg), cfg, gpu="l4", engine="vllm")
    assert (l4.max_batched_tokens, l4.max_seqs) == (2048, 256)
    # A quarter of the sequences: a quarter of the sampler's logits.
    act = {t.key: t.bytes for t in l4.terms}["activation"]
    assert act == pytest.approx(38 * 256 * 128256 + 2 * 2048 * 4096 * 2)


def test_decimal_sizes_round_down_to_bytes():
    assert parse_bytes("79.18GiB") == int(79.18 * 2**30) == 85_018_877_624
    assert parse_bytes("1.5KiB") == 1536 and parse_bytes("1.9B") == 1
    with pytest.raises(ConfigError, match="less than one byte"):
        parse_bytes("0.5B")
    with pytest.raises(ConfigError, match="larger than"):
        parse_bytes("99999999999TiB")
    with pytest.raises(ConfigError, match="too long"):
        parse_bytes("9" * 300)


# ---- what plan answers -----------------------------------------------------------------------------


def test_geometry_without_a_pool_prints_the_geometry(capsys):
    data = run_json(capsys, "plan", "--model", "llama-3.1-70b", "--json")
    assert (data["kv_bytes_per_token"], data["pool_blocks"], data["block_bytes"]) == (327680, None, 5 * 2**20)
    rc, out, err = run(capsys, "plan", "--model", "llama-3.1-70b")
    assert rc == 0 and "KV geometry" in out and "327,680" in out and "--gpu NAME" in out


def test_hand_given_geometry_with_a_gpu_needs_params_or_weights(capsys):
    seed = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128"]
    err = one_line_error(capsys, "plan", *seed, "--gpu", "h100-80gb")
    assert "needs --params or --weights" in err  # it used to assume zero weights: a 71 GiB pool for an 8B shape
    data = run_json(capsys, "plan", *seed, "--gpu", "h100-80gb", "--params", "8.03B", "--json")
    assert data["weights_bytes_per_rank"] == 2 * 8_030_000_000
    assert data["kv_budget_bytes"] < 57 * GiB
    given = run_json(capsys, "plan", *seed, "--gpu", "h100-80gb", "--weights", "15GiB", "--workspace", "5GiB",
                     "--json")
    assert given["weights_bytes_per_rank"] == 15 * GiB and given["workspace_bytes"] == 5 * GiB


def test_a_request_that_can_never_fit_says_so_and_exits_2(capsys):
    err = one_line_error(capsys, "plan", "--model", "llama-3.1-8b", "--gpu", "l4", "--prompt", "100000",
                         "--max-new", "32000")
    assert "can never be admitted" in err and "try" in err
    err = one_line_error(capsys, "plan", "--model", "llama-3.1-8b", "--pool", "64MiB", "--prompt", "2048",
                         "--max-new", "257")
    assert "needs 145 blocks but the pool holds 32" in err


def test_a_model_that_does_not_fit_gets_a_hint(capsys):
    err = one_line_error(capsys, "plan", "--model", "llama-3.1-70b", "--gpu", "h100-80gb")
    assert "model does not fit" in err and "weights (model loading) 131." in err
    assert "try --tensor-parallel-size 4" in err  # vLLM's flag; and the hint was checked: tp=4 really fits
    tp2 = run_json(capsys, "plan", "--model", "llama-3.1-70b", "--gpu", "h100-80gb", "--tp", "2", "--json")
    assert tp2["capacity_tokens"] < 8192  # tp=2 "fits" with a few hundred tokens of cache: not worth a hint
    tp4 = run_json(capsys, "plan", "--model", "llama-3.1-70b", "--gpu", "h100-80gb", "--tp", "4", "--json")
    assert f"--tensor-parallel-size 4 ({tp4['pool_blocks']:,} blocks = {tp4['capacity_tokens']:,} tokens)" in err
    err = one_line_error(capsys, "plan", "--model", "llama-3.1-70b", "--gpu", "l4", "--tp", "4")
    assert "--tensor-parallel-size 8" in err or "--gpu" in err


def test_capacity_answers(capsys):
    data = run_json(capsys, "plan", "--model", "qwen2.5-7b", "--gpu", "h100-80gb", "--prompt", "4000",
                    "--max-new", "1000", "--context", "32768", "--json")
    blocks = data["pool_blocks"]
    assert data["capacity_tokens"] == blocks * 16
    assert data["max_concurrency_for_context"] == round(blocks / 2048, 2)
    assert data["blocks_per_request"] == 313 and data["max_concurrent_requests"] == blocks // 313


def test_mixtral_is_planned_with_a_pool_and_a_gpu(capsys):
    pool = run_json(capsys, "plan", "--model", "mixtral-8x7b", "--pool", "10GiB", "--json")
    assert pool["parameters"] == 46_702_792_704 and pool["pool_blocks"] == 10 * GiB // (2 * 2**20)
    tp2 = run_json(capsys, "plan", "--model", "mixtral-8x7b", "--gpu", "h100-80gb", "--tp", "2", "--json")
    assert tp2["pool_blocks"] > 0 and tp2["weights_bytes_per_rank"] > 43 * GiB
    awq = run_json(capsys, "plan", "--model", "mixtral-8x7b", "--gpu", "h100-80gb", "--weight-dtype", "int4",
                   "--json")
    assert 22 * GiB < awq["weights_bytes_per_rank"] < 26 * GiB and awq["weight_format"].startswith("int4")


def test_matrix_marks_the_cheapest_combination(capsys):
    data = run_json(capsys, "plan", "--model", "llama-3.1-8b", "--matrix", "--prompt", "4096", "--max-new", "1024",
                    "--concurrency", "64", "--gpus", "l4,h100-80gb,a100-80gb", "--tps", "1,2", "--json")
    rows = data["rows"]
    assert len(rows) == 6
    assert sum(r["cheapest"] for r in rows) == 1
    best = next(r for r in rows if r["cheapest"])
    fitting = [r for r in rows if r["fits"]]
    assert best["cost"] == min(r["cost"] for r in fitting)
    for r in fitting:
        assert r["instances"] == -(-64 // r["per_instance"]) and r["gpus_total"] == r["instances"] * r["tp"]
    priced = run_json(capsys, "plan", "--model", "llama-3.1-8b", "--matrix", "--prompt", "4096", "--max-new",
                      "1024", "--concurrency", "64", "--gpus", "l4,h100-80gb", "--tps", "1", "--prices",
                      "l4=0.1,h100-80gb=10", "--json")
    assert next(r for r in priced["rows"] if r["cheapest"])["gpu"] == "l4"
    # Prices for some GPUs only: the others fit but carry no cost (this crashed with a TypeError).
    partly = run_json(capsys, "plan", "--model", "llama-3.1-8b", "--matrix", "--prompt", "4096", "--max-new",
                      "1024", "--concurrency", "64", "--gpus", "l4,h100-80gb", "--tps", "1,2", "--prices",
                      "h100-80gb=2.5", "--json")
    l4 = [r for r in partly["rows"] if r["gpu"] == "l4" and r["fits"]]
    assert l4 and all(r["cost"] is None and not r["cheapest"] for r in l4)
    best = next(r for r in partly["rows"] if r["cheapest"])
    assert best["gpu"] == "h100-80gb" and best["cost"] == 2.5 * best["gpus_total"]
    rc, out, err = run(capsys, "plan", "--model", "llama-3.1-8b", "--matrix", "--prompt", "4096", "--max-new",
                       "1024", "--concurrency", "64")
    assert rc == 0 and "<- cheapest" in out
    assert "needs --prompt" in one_line_error(capsys, "plan", "--model", "llama-3.1-8b", "--matrix")
    assert "--prices takes" in one_line_error(capsys, "plan", "--model", "llama-3.1-8b", "--matrix", "--prompt",
                                              "1", "--max-new", "1", "--concurrency", "1", "--prices", "tpu=1")


# ---- our own runtime: measured peaks where we have them, the formula otherwise ----------------------


def test_kvledger_engine_uses_a_measured_peak_when_one_exists(capsys, tmp_path):
    assert isinstance(load_measured_peaks(), list)  # the bundled file parses (it may hold no entry yet)
    peaks = tmp_path / "peaks.json"
    peaks.write_text(json.dumps({"peaks": [
        {"model": "llama-3.1-8b", "dtype": "bf16", "tp": 1, "max_batched_tokens": 8192, "max_seqs": 256,
         "peak_bytes": 3 * GiB, "device": "test", "source": "made up for this test"},
        {"model": "llama-3.1-8b", "dtype": "bf16", "tp": 1, "max_batched_tokens": 16384, "max_seqs": 512,
         "peak_bytes": 5 * GiB, "device": "test", "source": "made up, larger shape"}]}))
    base = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--engine", "kvledger", "--json"]
    formula = run_json(capsys, *base)
    assert formula["workspace_source"].startswith("formula")
    measured = run_json(capsys, *base, "--peaks", str(peaks))
    assert measured["workspace_bytes"] == 3 * GiB and measured["workspace_source"].startswith("measured")
    covering = run_json(capsys, *base, "--peaks", str(peaks), "--max-num-batched-tokens", "10000")
    assert covering["workspace_bytes"] == 5 * GiB  # the smallest measured shape that covers the step
    beyond = run_json(capsys, *base, "--peaks", str(peaks), "--max-num-seqs", "1024")
    assert beyond["workspace_source"].startswith("formula")  # nothing measured covers 1,024 sequences
    rows = load_measured_peaks(peaks)
    assert find_peak("LLAMA-3.1-8B", "bf16", tp=1, max_batched_tokens=1, max_seqs=1, peaks=rows).peak_bytes == 3 * GiB
    assert find_peak("llama-3.1-8b", "fp8", tp=1, max_batched_tokens=1, max_seqs=1, peaks=rows) is None
    bad = tmp_path / "bad.json"
    bad.write_text('{"peaks": [{"model": "x"}]}')
    assert "lacks or mistypes" in one_line_error(capsys, *base, "--peaks", str(bad))


# ---- fit hints and the GPU catalogue's refusals -------------------------------------------------------

H100_VLLM = {"gpu": "h100-80gb", "engine": "vllm"}


def test_no_fp8_weight_hint_for_int4_weights() -> None:
    """int4 weights are already smaller than fp8: fit_hints never suggests `--weight-dtype fp8` for them."""
    cfg = load_model_config("smollm2-135m")
    spec = KVSpec.from_hf_config(cfg)
    hints = fit_hints(spec, cfg, {"device_bytes": "8GiB", "weight_dtype": "int4"})
    assert not any(h.startswith("--weight-dtype") for h in hints)
    # bf16 weights do get the hint, so the check above is not vacuous
    assert any(h.startswith("--weight-dtype fp8") for h in fit_hints(spec, cfg, {"device_bytes": "8GiB"}))


def test_a_bad_nvidia_smi_total_in_the_gpu_catalogue_names_the_field() -> None:
    """A catalogue row whose nvidia-smi total is not positive is refused with a message naming
    ``nvidia_smi_total_mib``."""
    rows = json.loads(resources.files("kvledger").joinpath("data", "gpus.json").read_text(encoding="utf-8"))["gpus"]
    h100 = next(r for r in rows if r["name"] == "h100-80gb")
    with pytest.raises(ConfigError, match=r"^GPU catalogue: nvidia_smi_total_mib must be a positive number, got 0$"):
        gpus._gpu(dict(h100, nvidia_smi_total_mib=0))


def test_tp_hint_keeps_the_block_size_of_the_plan() -> None:
    """A --tp hint for a plan with 32-token blocks counts 32-token blocks: its token figure is its block
    count x 32, and both are what the plan at that TP degree (same block size) would say."""
    cfg = load_model_config("llama-3.1-8b")
    spec = KVSpec.from_hf_config(cfg, block_size=32)
    hint = fit_hints(spec, cfg, H100_VLLM)[0]
    m = re.fullmatch(r"--tensor-parallel-size 2 \(([\d,]+) blocks = ([\d,]+) tokens\)", hint)
    assert m, hint
    blocks, tokens = (int(g.replace(",", "")) for g in m.groups())
    assert tokens == blocks * 32
    at_tp2 = build_inventory(KVSpec.from_hf_config(cfg, tp=2, block_size=32), cfg, **H100_VLLM)
    assert (blocks, tokens) == (at_tp2.pool_blocks, at_tp2.capacity_tokens)


def test_tp_hint_suggests_the_smallest_degree_that_fits() -> None:
    """Llama-3.1-8B at tp 1 on an H100: the first hint is the next TP degree, 2 (not a larger one)."""
    cfg = load_model_config("llama-3.1-8b")
    hints = fit_hints(KVSpec.from_hf_config(cfg), cfg, H100_VLLM)
    assert hints[0].startswith("--tensor-parallel-size 2 (")


def test_fp8_kv_hint_says_how_many_tokens_fp8_kv_gives() -> None:
    """The fp8-KV hint is a line of text with the capacity the plan with vLLM's --kv-cache-dtype fp8 (the
    unscaled e4m3 cast, which vLLM serves) gives."""
    cfg = load_model_config("llama-3.1-8b")
    hints = fit_hints(KVSpec.from_hf_config(cfg), cfg, H100_VLLM)
    fp8 = build_inventory(KVSpec.from_hf_config(cfg, kv_dtype="fp8_e4m3"), cfg, **H100_VLLM)
    assert f"--kv-cache-dtype fp8 ({fp8.capacity_tokens:,} tokens)" in hints
    assert all(isinstance(h, str) for h in hints)


def test_hints_name_vllms_flags_that_plan_takes(capsys) -> None:
    """A user from vLLM reads vLLM's flag in every hint (--tensor-parallel-size, --gpu-memory-utilization,
    --kv-cache-dtype), taken from plan's own options, and can paste each one back into `kvledger plan`
    (values without thousands separators). Before: `try --tp 8 (...)`, `--utilization 0.95`, `--max-new 5,736`."""
    from kvledger.cli.engine_options import FLAGS

    err = one_line_error(capsys, "plan", "--model", "llama-3.1-70b", "--gpu", "l4")
    assert "; try --tensor-parallel-size 8 (724 blocks = 11,584 tokens)" in err
    err = one_line_error(capsys, "plan", "--model", "llama-3.1-8b", "--gpu", "l4", "--gpu-memory-utilization", "0.8",
                         "--prompt", "20000", "--max-new", "8000")
    assert "--tensor-parallel-size 2 (" in err and "--gpu-memory-utilization 0.95 (37,808 tokens)" in err
    assert "--tp " not in err and "--utilization" not in err
    rc, out, err = run(capsys, "plan", "--model", "llama-3.1-8b", "--gpu", "l4")
    assert rc == 0 and "give vLLM --max-model-len 28784 or less" in " ".join(out.split())  # pastes into vLLM
    cfg = load_model_config("llama-3.1-8b")
    l4 = {"gpu": "l4", "engine": "vllm", "utilization": 0.8}
    shorter = fit_hints(KVSpec.from_hf_config(cfg), cfg, l4, prompt=5000, max_new=8000, limit=10)[-1]
    assert shorter == "--max-new 5736 (the pool holds 10,736 tokens)"
    assert run_json(capsys, "plan", "--model", "llama-3.1-8b", "--gpu", "l4", "--gpu-memory-utilization", "0.8",
                    "--prompt", "5000", "--max-new", "5736", "--json")["max_concurrent_requests"] == 1
    # Every option a hint can name is one of plan's, and an engine knob's is the registry's first (vLLM's) name.
    hints = _fit_hints(KVSpec.from_hf_config(cfg), cfg, l4, prompt=2000, max_new=8000, limit=10)
    assert {h.option for h in hints} >= {"tensor_parallel_size", "gpu", "kv_dtype", "weight_dtype",
                                         "gpu_memory_utilization"}
    for hint in hints:
        if hint.option is not None:
            name = flag_name(plan_cmd, hint.option)
            assert name == (FLAGS[hint.option][0][0] if hint.option in FLAGS else name)
    assert [flag_name(plan_cmd, k) for k in ("tensor_parallel_size", "gpu_memory_utilization", "kv_dtype")] == [
        "--tensor-parallel-size", "--gpu-memory-utilization", "--kv-cache-dtype"]


def test_fp8_weights_hint_is_offered_for_a_bf16_checkpoint() -> None:
    """A bf16 checkpoint gets a --weight-dtype fp8 hint with the capacity fp8 weights give."""
    cfg = load_model_config("llama-3.1-8b")
    spec = KVSpec.from_hf_config(cfg)
    hints = fit_hints(spec, cfg, H100_VLLM)
    fp8w = build_inventory(spec, cfg, weight_dtype="fp8", **H100_VLLM)
    assert f"--weight-dtype fp8 ({fp8w.capacity_tokens:,} tokens)" in hints


def test_the_gpu_catalogue_rows_parse_to_the_catalogue_and_bad_figures_are_refused() -> None:
    import json
    from importlib import resources

    from kvledger.core.sizing import gpus
    rows = json.loads(resources.files("kvledger").joinpath("data", "gpus.json").read_text(encoding="utf-8"))["gpus"]
    parsed = {row["name"]: gpus._gpu(row) for row in rows}
    assert parsed == gpus.GPUS
    h100 = next(r for r in rows if r["name"] == "h100-80gb")
    assert parsed[h100["name"]].datasheet_memory == str(h100["datasheet_memory"])
    for bad in (0, -1.5, True, "80"):
        with pytest.raises(ConfigError, match=f"host_link_Bps must be a positive number, got {bad!r}"):
            gpus._gpu(dict(h100, host_link_Bps=bad))
    with pytest.raises(ConfigError, match="lacks 'source'"):
        gpus._gpu({k: v for k, v in h100.items() if k != "source"})


def test_the_capacity_matrix_says_why_a_row_does_not_fit() -> None:
    """A request longer than the pool gets the pool's size and the request's need; a TP degree the
    model cannot be split by gets the first clause of the reason."""
    from kvledger.core.sizing.capacity import capacity_matrix
    from kvledger.core.sizing.models import load_model_config
    rows = capacity_matrix(load_model_config("llama-3.1-8b"), prompt=2_000_000, max_new=1, concurrency=4,
                           model_name="llama-3.1-8b", gpus=["l4"], tps=(1, 3))
    long, odd = rows
    assert (long.fits, long.pool_blocks, long.blocks_per_request) == (False, 1799, 125_001)
    assert long.note == "one request needs 125,001 of 1,799 blocks"
    assert (odd.fits, odd.pool_blocks, odd.note) == (
        False, 0, "tp=3 must divide the 8 KV heads or be a multiple of them")


def test_prices_that_are_not_numbers_are_named() -> None:
    from kvledger.core.sizing.capacity import parse_prices
    with pytest.raises(ConfigError, match=r"--prices: 'cheap' is not a number"):
        parse_prices("l4=cheap")
