"""Tests written because mutants of ``core/params`` and ``core/kv_formats`` drawn by ``tests/mutation.py
sample`` (a seeded uniform sample of every mutant, seed 3; docs/testing.md) survived the suite. Each pins
down something a caller can see -- the parts a KV layout report lists, a checkpoint's group size and the
reason given for it, whether a model carries an lm_head, a mixture-of-experts layout and its refusal --
that no other test checked."""

from __future__ import annotations

import pytest

from kvledger.core.geometry import KVSpec
from kvledger.core.inventory import kv_layout
from kvledger.core.params import model_tensors, moe_layout, weight_plan
from kvledger.errors import ConfigError

# A tiny Llama-shaped decoder (no tie_word_embeddings key: the model type decides).
DENSE = {"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 10, "num_attention_heads": 2,
         "num_key_value_heads": 2, "intermediate_size": 12}


def layout(dtype: str) -> list[tuple[str, str, list[int]]]:
    spec = KVSpec(layers=1, kv_heads=2, head_dim=8, kv_dtype=dtype, block_size=4)
    return [(p["kv"], p["part"], p["shape"]) for p in kv_layout(spec)]


# ---- kv_formats: part names a layout report shows -----------------------------------------------------

def test_plain_layout_names_k_and_v_values_in_lower_case() -> None:
    """`kv_layout` of a plain fp16 cache lists K's values then V's, tagged 'k' and 'v' (block 4, 2 heads
    of 8: each [4, 2, 8])."""
    assert layout("fp16") == [("k", "values", [4, 2, 8]), ("v", "values", [4, 2, 8])]


def test_int4_layout_names_every_part_of_k_and_v() -> None:
    """int4 (KIVI), block 4, 2 heads of 8: packed codes [4, 2, 8 // 2] for K and V; K's scale and min per
    channel [2, 8]; V's scale and min per token [4, 2] -- tagged 'v' and named 'min'."""
    assert layout("int4") == [
        ("k", "codes", [4, 2, 4]), ("k", "scale", [2, 8]), ("k", "min", [2, 8]),
        ("v", "codes", [4, 2, 4]), ("v", "scale", [4, 2]), ("v", "min", [4, 2])]


# ---- quantization_config: a checkpoint's own group size -----------------------------------------------

def test_compressed_tensors_int4_uses_the_checkpoints_group_size() -> None:
    """A compressed-tensors 4-bit int checkpoint with `group_size: 64` is sized with groups of 64, and the
    reason says so.

    A 128 x 4 weight: 128 * 4 * 4 bits = 256 bytes of codes; 128 / 64 = 2 groups per column, 8 scales:
    8 fp16 scales = 16 bytes and 8 4-bit zeros = 4 bytes: 276 (one group per column would be 266)."""
    cfg = {**DENSE, "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"num_bits": 4, "type": "int", "group_size": 64}}}}}
    plan = weight_plan(cfg)
    assert plan.linear.name == "int4"
    assert plan.source == "quantization_config compressed-tensors int4, group 64"
    assert plan.group_override == 64
    assert plan.linear_bytes(128, 4) == 276


# ---- model_tensors: the lm_head a tied model does not have ---------------------------------------------

def test_gemma_without_a_tie_key_has_no_lm_head() -> None:
    """A Gemma config that omits `tie_word_embeddings` shares its embedding with the output (no lm_head
    tensor); a Llama config that omits it has its own lm_head."""
    gemma = [t.name for t in model_tensors({**DENSE, "model_type": "gemma"})]
    llama = [t.name for t in model_tensors({**DENSE, "model_type": "llama"})]
    assert "embed_tokens" in gemma and "lm_head" not in gemma
    assert "lm_head" in llama


# ---- moe_layout: Qwen/OLMoE-style configs ---------------------------------------------------------------

def test_num_experts_without_moe_intermediate_size_uses_intermediate_size() -> None:
    """An OLMoE-style config (num_experts, no moe_intermediate_size) sizes each expert by
    intermediate_size (12); both layers are MoE layers (decoder_sparse_step defaults to 1)."""
    cfg = {**DENSE, "num_experts": 4, "num_experts_per_tok": 2}
    assert moe_layout(cfg) == {"experts": 4, "top_k": 2, "expert_inter": 12, "shared_inter": 0,
                               "shared_gate": False, "moe_layers": [0, 1], "style": "qwen"}


def test_mlp_only_layers_that_is_not_a_list_is_refused_with_its_message() -> None:
    """`mlp_only_layers: "0"` is refused with a message naming the key and what it must be."""
    cfg = {**DENSE, "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": "0"}
    with pytest.raises(ConfigError, match=r"model config key 'mlp_only_layers' must be a list of layer indices"):
        moe_layout(cfg)
