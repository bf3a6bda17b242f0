"""Tests written because mutants of the memory planner (``core/engines.py`` and ``core/inventory.py``)
drawn by ``tests/mutation.py sample`` (seed 2) survived the suite. Each pins down something a caller of
``build_inventory`` or ``kvledger plan`` can see -- a byte figure, a term's label, formula or source as
the plan report shows it, a weight format, an error message -- that no other test checked."""

from __future__ import annotations

import pytest

from kvledger.core.engines import MeasuredPeak, workspace_peak_bytes
from kvledger.core.geometry import KVSpec
from kvledger.core.inventory import build_inventory
from kvledger.core.models import load_model_config
from kvledger.errors import ConfigError

MiB, GiB = 2**20, 2**30
HAND = KVSpec(layers=32, kv_heads=8, head_dim=128)  # Llama-3-8B-like geometry given by hand (2 MiB blocks)


def terms_by_key(inv):
    return {t.key: t for t in inv.terms}


# ---- core.engines ----------------------------------------------------------------------------------


def test_a_measured_workspace_is_labelled_measured() -> None:
    """The plan report labels the workspace 'activation workspace (measured)' when a measured peak is
    used, so a reader can tell it from the formula's estimate."""
    cfg = load_model_config("smollm2-135m")
    peak = MeasuredPeak("smollm2-135m", "bf16", 1, 8192, 256, 123 * MiB, "cpu", "a test row")
    inv = build_inventory(KVSpec.from_hf_config(cfg), cfg, device_bytes="8GiB", model_name="smollm2-135m",
                          peaks=[peak])
    ws = terms_by_key(inv)["workspace"]
    assert (ws.label, ws.bytes, ws.source) == ("activation workspace (measured)", 123 * MiB, "measured: a test row")
    assert inv.workspace_bytes == 123 * MiB


def test_vllm_activation_formula_ends_with_the_step_shape_and_why() -> None:
    """The vLLM activation term's explanation ends with the step shape it assumed (T and N) and why
    (the default for a GPU of at least 70 GiB): 8192 tokens and min(1024, 8192) = 1024 sequences."""
    cfg = load_model_config("llama-3.1-8b")
    inv = build_inventory(KVSpec.from_hf_config(cfg), cfg, device_bytes="80GiB", engine="vllm")
    formula = terms_by_key(inv)["activation"].formula
    assert formula.endswith("; T = max_num_batched_tokens 8,192, N = min(max_num_seqs, T) = 1,024 "
                            "(vLLM default for GPUs of >= 70 GiB other than the A100)")


def test_vllm_cuda_graph_term_cites_its_source() -> None:
    """The CUDA-graph allowance (from the headroom) cites where the figure comes from."""
    cfg = load_model_config("llama-3.1-8b")
    inv = build_inventory(KVSpec.from_hf_config(cfg), cfg, device_bytes="80GiB", engine="vllm")
    graphs = terms_by_key(inv)["cuda_graphs"]
    assert graphs.source == "vLLM Worker.compile_or_warm_up_model; llm-d measured -0.88 to +1.03 GiB on H100"
    assert graphs.in_budget is False


def test_mla_workspace_of_deepseek_v3_at_tp8() -> None:
    """kvledger's workspace formula for an MLA model (DeepSeek-V3) reads the q/k head width from
    qk_nope_head_dim + qk_rope_head_dim and gives the documented figure."""
    cfg = load_model_config("deepseek-v3")
    # per rank: 128 / 8 = 16 heads; q = k = 16 x (128 + 64) = 3072, v = 16 x 128 = 2048, hidden 7168
    attention = 8192 * (3072 + 3072 + 2048 + 7168)
    # mlp: max(dense 18432, 8 x 2048 + 2048 shared) = 18432 -> 2 x 18432 / 8 + 7168 = 11776 per token (smaller)
    assert attention > 8192 * (2 * 2304 + 7168)
    logits = 256 * -(-129280 // 8) * 4
    assert workspace_peak_bytes(cfg, 8, 8192, 256) == attention * 2 + logits == 268_206_080


# ---- core.inventory: geometry given by hand ------------------------------------------------------


def test_hand_weights_from_params_explain_the_bits() -> None:
    """With --params the weights term says how it was computed: parameters x bits (format)."""
    inv = build_inventory(HAND, device_bytes="80GiB", params=8_000_000_000)
    weights = terms_by_key(inv)["weights"]
    assert weights.formula == "8,000,000,000 parameters x 16 bits (bf16)"
    assert weights.bytes == 16_000_000_000  # 8e9 x 16 bits / 8
    assert inv.weight_format == "bf16"


def test_hand_weights_given_directly_report_the_format_given() -> None:
    """With --weights the bytes are taken as given: the weight format is reported as 'given', not a dtype."""
    inv = build_inventory(HAND, device_bytes="80GiB", weights_bytes=10 * GiB)
    assert inv.weight_format == "given"
    assert terms_by_key(inv)["weights"].formula == "given (--weights)"
    assert inv.to_dict()["weight_format"] == "given"


def test_hand_vllm_non_torch_term_explains_itself() -> None:
    """For vLLM, hand-given geometry still charges the non-torch memory, explained as 'by TP degree'."""
    inv = build_inventory(HAND, device_bytes="80GiB", params=8_000_000_000, engine="vllm")
    non_torch = terms_by_key(inv)["non_torch"]
    assert (non_torch.formula, non_torch.source) == ("by TP degree", "vLLM measured (see core.engines)")
    assert non_torch.bytes == int(0.13 * GiB)  # tp=1


def test_hand_reserve_term_names_the_option_that_sets_it() -> None:
    """The runtime reserve's source names the command-line option a user changes it with: --reserve."""
    inv = build_inventory(HAND, device_bytes="80GiB", params=8_000_000_000)
    reserve = terms_by_key(inv)["reserve"]
    assert (reserve.bytes, reserve.source) == (GiB, "--reserve")


def test_pool_given_with_hand_weights_reports_them_as_given_by_hand() -> None:
    """With --pool and --weights the weights are only reported; their term says 'given by hand'."""
    inv = build_inventory(HAND, pool_bytes=512 * MiB, weights_bytes=3 * GiB)
    [weights] = inv.terms
    assert (weights.formula, weights.source, weights.bytes) == ("given by hand", "given by hand", 3 * GiB)
    assert inv.pool_blocks == 256  # 512 MiB / 2 MiB blocks: nothing is subtracted from a given pool


def test_kvledger_engine_names_a_bad_max_batched_tokens() -> None:
    """A bad step size is refused with a message naming max_batched_tokens."""
    with pytest.raises(ConfigError, match=r"^max_batched_tokens must be an integer in \[1, 16,777,216\], got 0$"):
        build_inventory(HAND, device_bytes="80GiB", params=8_000_000_000, max_batched_tokens=0)
