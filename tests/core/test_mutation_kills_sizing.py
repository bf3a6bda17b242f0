"""Tests written because mutants of the sizing code (``core/capacity.py``, ``core/engines.py``,
``core/geometry.py`` and ``core/inventory.py``) drawn by ``tests/mutation.py sample`` (seed 3) survived
the suite. Each pins down something a caller of ``fit_hints``, ``build_inventory`` or ``kvledger plan``
can see -- a hint's text and figures, a byte figure, a term's key or label, a dtype, an error message --
that no other test checked."""

from __future__ import annotations

import re

import pytest

from kvledger.core.capacity import fit_hints
from kvledger.core.engines import workspace_peak_bytes
from kvledger.core.geometry import KVSpec, default_dtype
from kvledger.core.inventory import build_inventory
from kvledger.core.models import load_model_config
from kvledger.errors import ConfigError

MiB, GiB = 2**20, 2**30
HAND = KVSpec(layers=32, kv_heads=8, head_dim=128)  # Llama-3-8B-like geometry given by hand (2 MiB blocks)
H100_VLLM = {"gpu": "h100-80gb", "engine": "vllm"}


def terms_by_key(inv):
    return {t.key: t for t in inv.terms}


# ---- core.capacity: fit hints ----------------------------------------------------------------------


def test_tp_hint_keeps_the_block_size_of_the_plan() -> None:
    """A --tp hint for a plan with 32-token blocks counts 32-token blocks: its token figure is its block
    count x 32, and both are what the plan at that TP degree (same block size) would say."""
    cfg = load_model_config("llama-3.1-8b")
    spec = KVSpec.from_hf_config(cfg, block_size=32)
    hint = fit_hints(spec, cfg, H100_VLLM)[0]
    m = re.fullmatch(r"--tp 2 \(([\d,]+) blocks = ([\d,]+) tokens\)", hint)
    assert m, hint
    blocks, tokens = (int(g.replace(",", "")) for g in m.groups())
    assert tokens == blocks * 32
    at_tp2 = build_inventory(KVSpec.from_hf_config(cfg, tp=2, block_size=32), cfg, **H100_VLLM)
    assert (blocks, tokens) == (at_tp2.pool_blocks, at_tp2.capacity_tokens)


def test_tp_hint_suggests_the_smallest_degree_that_fits() -> None:
    """Llama-3.1-8B at tp 1 on an H100: the first hint is the next TP degree, 2 (not a larger one)."""
    cfg = load_model_config("llama-3.1-8b")
    hints = fit_hints(KVSpec.from_hf_config(cfg), cfg, H100_VLLM)
    assert hints[0].startswith("--tp 2 (")


def test_fp8_kv_hint_says_how_many_tokens_fp8_kv_gives() -> None:
    """The fp8-KV hint is a line of text with the capacity the plan with --kv-dtype fp8 gives."""
    cfg = load_model_config("llama-3.1-8b")
    hints = fit_hints(KVSpec.from_hf_config(cfg), cfg, H100_VLLM)
    fp8 = build_inventory(KVSpec.from_hf_config(cfg, kv_dtype="fp8"), cfg, **H100_VLLM)
    assert f"--kv-dtype fp8 ({fp8.capacity_tokens:,} tokens)" in hints
    assert all(isinstance(h, str) for h in hints)


def test_fp8_weights_hint_is_offered_for_a_bf16_checkpoint() -> None:
    """A bf16 checkpoint gets a --weight-dtype fp8 hint with the capacity fp8 weights give."""
    cfg = load_model_config("llama-3.1-8b")
    spec = KVSpec.from_hf_config(cfg)
    hints = fit_hints(spec, cfg, H100_VLLM)
    fp8w = build_inventory(spec, cfg, weight_dtype="fp8", **H100_VLLM)
    assert f"--weight-dtype fp8 ({fp8w.capacity_tokens:,} tokens)" in hints


# ---- core.engines ----------------------------------------------------------------------------------


MLA_NO_ROPE = {  # a small DeepSeek-style MLA model whose q/k carry no rotary part (qk_rope_head_dim 0)
    "model_type": "deepseek_v3", "torch_dtype": "bfloat16", "hidden_size": 1024, "num_attention_heads": 16,
    "num_hidden_layers": 2, "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 0,
    "v_head_dim": 64, "intermediate_size": 512, "vocab_size": 1000,
}


def test_vllm_plans_an_mla_model_without_a_rotary_part() -> None:
    """qk_rope_head_dim 0 is a valid MLA config: vLLM's forward width is heads x (2 x qk + 2 x v) =
    16 x (128 + 128) = 4096 (> mlp 3 x 512), and the peak is the forward at T = 2048 (no device: vLLM's
    small-GPU default): 2048 x (2 x 1024 + 4096) x 2 B = 25,165,824 (sampler 38 x 256 x 1000 + resident
    2 x 2048 x 1024 x 2 = 18,116,608 is smaller)."""
    spec = KVSpec.from_hf_config(MLA_NO_ROPE)
    inv = build_inventory(spec, MLA_NO_ROPE, pool_bytes="1GiB", engine="vllm")
    act = terms_by_key(inv)["activation"]
    assert "widest attention width 4,096" in act.formula
    assert act.bytes == 25_165_824


def test_vllm_forward_term_counts_two_hidden_widths() -> None:
    """Llama-3.1-8B, vLLM on 80 GiB, one sequence: forward = T x (2 x hidden + widest mlp width) x 2 B =
    8192 x (8192 + 3 x 14336) x 2 = 838,860,800, larger than the sampler (38 x 128256) + resident
    (2 x 8192 x 4096 x 2 = 134,217,728), so it is the activation peak and the formula says so."""
    cfg = load_model_config("llama-3.1-8b")
    inv = build_inventory(KVSpec.from_hf_config(cfg), cfg, device_bytes="80GiB", engine="vllm", max_seqs=1)
    act = terms_by_key(inv)["activation"]
    assert "forward = T x (2 x hidden + widest mlp width 43,008) x 2 B = 838,860,800" in act.formula
    assert act.bytes == 838_860_800


def test_vllm_cuda_graph_term_label() -> None:
    """The plan report's row for CUDA graphs reads 'CUDA graphs (from the headroom)'."""
    cfg = load_model_config("llama-3.1-8b")
    inv = build_inventory(KVSpec.from_hf_config(cfg), cfg, device_bytes="80GiB", engine="vllm")
    assert terms_by_key(inv)["cuda_graphs"].label == "CUDA graphs (from the headroom)"


def test_workspace_peak_names_a_bad_activation_dtype_size() -> None:
    cfg = load_model_config("smollm2-135m")
    with pytest.raises(ConfigError, match=r"^act_dtype_bytes must be a positive integer, got 0$"):
        workspace_peak_bytes(cfg, act_dtype_bytes=0)


# ---- core.geometry ---------------------------------------------------------------------------------


def test_default_dtype_reads_either_key() -> None:
    """A config with only `torch_dtype` or only the newer `dtype` key is served in that dtype."""
    assert default_dtype({"torch_dtype": "float16"}) == "fp16"
    assert default_dtype({"dtype": "float16"}) == "fp16"
    assert default_dtype({}) == "bf16"


# ---- core.inventory --------------------------------------------------------------------------------


def test_vllm_extra_reserve_is_a_term_and_comes_off_the_kv_budget() -> None:
    """vLLM with --reserve 1GiB: the plan lists an 'extra reserve' term of 1 GiB and the KV budget is
    exactly 1 GiB smaller than without it."""
    cfg = load_model_config("llama-3.1-8b")
    spec = KVSpec.from_hf_config(cfg)
    plain = build_inventory(spec, cfg, device_bytes="80GiB", engine="vllm")
    inv = build_inventory(spec, cfg, device_bytes="80GiB", engine="vllm", runtime_reserve_bytes="1GiB")
    reserve = terms_by_key(inv)["reserve"]
    assert (reserve.label, reserve.bytes, reserve.formula) == ("extra reserve", GiB, "given (--reserve)")
    assert inv.reserve_bytes == GiB
    assert plain.kv_budget_bytes - inv.kv_budget_bytes == GiB


def test_a_given_workspace_replaces_the_model_formula() -> None:
    """--workspace with a model config: the inventory reports the given workspace under the key
    'workspace', second in the list, and the model's own activation estimate is gone."""
    cfg = load_model_config("llama-3.1-8b")
    inv = build_inventory(KVSpec.from_hf_config(cfg), cfg, device_bytes="80GiB", engine="vllm",
                          workspace_bytes=3 * GiB)
    assert [t.key for t in inv.terms][:2] == ["weights", "workspace"]
    assert "activation" not in terms_by_key(inv)
    assert inv.workspace_bytes == 3 * GiB
    assert inv.workspace_source == "given by hand"


def test_hand_params_with_a_pool_weigh_bf16_by_default() -> None:
    """With a pool and --params but no weight dtype, the reported weights are 2 bytes per parameter."""
    inv = build_inventory(HAND, pool_bytes="1GiB", params=1_000)
    assert inv.weights_bytes_per_rank == 2_000
    assert terms_by_key(inv)["weights"].bytes == 2_000


def test_int4_kv_charges_one_residual_page_per_running_sequence() -> None:
    """int4 KV keeps an unquantised bf16 page per running sequence: 32 layers x 2 (K, V) x 16 tokens x 8
    heads x 128 x 2 B = 2 MiB per page; 4 slots cost 8 MiB, and the term says so."""
    spec = KVSpec(layers=32, kv_heads=8, head_dim=128, kv_dtype="int4")
    inv = build_inventory(spec, pool_bytes="1GiB", residual_slots=4)
    residual = terms_by_key(inv)["residual"]
    assert residual.bytes == inv.residual_bytes == 8 * MiB
    assert residual.formula == ("4 running sequences x one unquantised page of 16 tokens "
                                "(2,097,152 B, bf16)")
