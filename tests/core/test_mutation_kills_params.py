"""Tests written because mutants of ``core/params``, ``core/geometry`` and ``core/kv_formats`` drawn by
``tests/mutation.py sample`` (a seeded uniform sample of every mutant, seed 2; docs/testing.md) survived
the suite. Each pins down something a caller can see -- a weight format and the reason given for it, a
byte figure, the names of the tensors and KV parts a report lists -- that no other test checked."""

from __future__ import annotations

from kvledger.core.geometry import KVSpec, default_dtype
from kvledger.core.inventory import kv_layout
from kvledger.core.params import model_tensors, weight_plan, weights_bytes_per_rank

# A tiny Llama-shaped decoder: every figure below is small enough to work out by hand.
DENSE = {"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 10, "num_attention_heads": 2,
         "num_key_value_heads": 2, "intermediate_size": 12, "tie_word_embeddings": False}
# A tiny DeepSeek-shaped one: MLA without a q low-rank, one dense layer then one MoE layer with a
# shared expert.
DEEPSEEK = {"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 10, "num_attention_heads": 2,
            "kv_lora_rank": 4, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 2,
            "intermediate_size": 12, "n_routed_experts": 4, "moe_intermediate_size": 6,
            "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
            "tie_word_embeddings": False}


def shapes(cfg: dict) -> dict[str, tuple[int, int, int]]:
    return {t.name: (t.rows, t.cols, t.count) for t in model_tensors(cfg)}


# ---- geometry: exact per-token figures and the default dtype -----------------------------------------

def test_bytes_per_token_is_an_int_when_the_block_divides_evenly() -> None:
    """bf16, 1 layer, 1 KV head of 64: K and V are 2 * 64 * 2 = 256 bytes per token, an int (a report
    prints 256, not 256.0)."""
    spec = KVSpec(layers=1, kv_heads=1, head_dim=64)
    assert spec.bytes_per_token == 256 and type(spec.bytes_per_token) is int
    assert spec.layer_bytes_per_token == 256 and type(spec.layer_bytes_per_token) is int


def test_bytes_per_token_keeps_the_fraction_when_the_block_does_not_divide() -> None:
    """int4 (KIVI), block of 3 tokens, 1 head of 4: codes 2 * 3 * 2 = 12 bytes, K scale+min per channel
    2 * 4 * 2 = 16, V scale+min per token 2 * 3 * 2 = 12: 40 bytes per block, 40 / 3 per token (a
    remainder of 1 must not be floored to 13)."""
    spec = KVSpec(layers=1, kv_heads=1, head_dim=4, kv_dtype="int4", block_size=3)
    assert spec.block_bytes == 40
    assert spec.bytes_per_token == 40 / 3
    assert spec.layer_bytes_per_token == 40 / 3


def test_an_unknown_torch_dtype_defaults_to_bf16() -> None:
    """A config whose torch_dtype kvledger does not know (float64) is served as bf16."""
    assert default_dtype({"torch_dtype": "float64"}) == "bf16"
    assert weight_plan({**DENSE, "torch_dtype": "float64"}).base == "bf16"


# ---- kv_formats: part names a layout report shows -----------------------------------------------------

def test_fp8_and_int8_layouts_name_their_codes_and_scales() -> None:
    """`kv_layout` (the report of one block's parts) names fp8/int8 values `codes`, each with a `scale`."""
    for dtype in ("fp8", "int8"):
        layout = kv_layout(KVSpec(layers=1, kv_heads=2, head_dim=8, kv_dtype=dtype, block_size=4))
        assert [(p["kv"], p["part"], p["shape"]) for p in layout] == [
            ("k", "codes", [4, 2, 8]), ("k", "scale", [4, 2]), ("v", "codes", [4, 2, 8]), ("v", "scale", [4, 2])]


# ---- quantization_config: which format and why --------------------------------------------------------

def test_compressed_tensors_float8_is_fp8_not_int8() -> None:
    """compressed-tensors 8-bit `type: float` weights are fp8 (int8 costs the same bytes, so only the
    format name and its reason tell them apart)."""
    cfg = {**DENSE, "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"num_bits": 8, "type": "float"}}}}}
    plan = weight_plan(cfg)
    assert plan.linear.name == "fp8"
    assert plan.source == "quantization_config compressed-tensors float8"


def test_compressed_tensors_without_a_type_reads_as_int() -> None:
    cfg = {**DENSE, "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"num_bits": 8}}}}}
    plan = weight_plan(cfg)
    assert plan.linear.name == "int8"
    assert plan.source == "quantization_config compressed-tensors int8"


def test_gptq_bits_8_is_int8() -> None:
    """A GPTQ checkpoint with `bits: 8` is sized as int8, not the 4-bit default."""
    plan = weight_plan({**DENSE, "quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": 128}})
    assert plan.linear.name == "int8"
    assert plan.source == "quantization_config gptq 8-bit"


def test_awq_w_bit_8_is_int8() -> None:
    """AutoAWQ's own spelling `w_bit: 8` is read like `bits: 8`."""
    plan = weight_plan({**DENSE, "quantization_config": {"quant_method": "awq", "w_bit": 8, "q_group_size": 128}})
    assert plan.linear.name == "int8"
    assert plan.source == "quantization_config awq 8-bit"


def test_a_multimodal_configs_top_level_quantization_config_is_used() -> None:
    """A multimodal config nests the decoder in `text_config` but keeps `quantization_config` at the top:
    its fp8 weights must still be found."""
    cfg = {"model_type": "gemma3", "text_config": dict(DENSE),
           "quantization_config": {"quant_method": "fp8"}}
    plan = weight_plan(cfg)
    assert plan.linear.name == "fp8"
    assert plan.source == "quantization_config fp8"


# ---- --weight-dtype fp32 --------------------------------------------------------------------------------

def test_weight_dtype_fp32_keeps_everything_in_fp32() -> None:
    """`--weight-dtype fp32` stores every weight in 4 bytes, embeddings and norms too.

    Parameters of DENSE: embedding 10 * 8 + lm_head 8 * 10 = 160; per layer q/k/v/o 4 * 8 * 8 = 256,
    norms 2 * 8 = 16, MLP 3 * 8 * 12 = 288, so 2 * 560 = 1120; final norm 8: 1288 in all, * 4 bytes."""
    plan = weight_plan(DENSE, "fp32")
    assert plan.base == "fp32" and plan.name == "fp32"
    assert weights_bytes_per_rank(DENSE, 1, "fp32") == 1288 * 4


# ---- tensor names (what a per-tensor breakdown lists) ---------------------------------------------------

def test_dense_tensors_are_named_as_in_the_checkpoint() -> None:
    """DENSE tensor by tensor; each layer's MLP is gate and up (hidden 8 -> intermediate 12) and down
    (12 -> 8)."""
    assert shapes(DENSE) == {
        "embed_tokens": (10, 8, 1), "lm_head": (8, 10, 1),
        "q_proj": (8, 8, 2), "k_proj": (8, 8, 2), "v_proj": (8, 8, 2), "o_proj": (8, 8, 2),
        "layer_norms": (2, 8, 2),
        "gate_proj": (8, 12, 2), "up_proj": (8, 12, 2), "down_proj": (12, 8, 2),
        "norm": (1, 8, 1),
    }


def test_deepseek_tensors_are_named_as_in_the_checkpoint() -> None:
    """MLA (no q low rank) plus one dense and one MoE layer with a shared expert, tensor by tensor:
    kv_a maps hidden 8 -> latent 4 + rope 2; kv_b maps 4 -> 2 heads * (nope 2 + v 2); experts are
    counted 4 per MoE layer, 2 of them active."""
    assert shapes(DEEPSEEK) == {
        "embed_tokens": (10, 8, 1), "lm_head": (8, 10, 1),
        "q_proj": (8, 8, 2), "kv_a_proj_with_mqa": (8, 6, 2), "kv_b_proj": (4, 8, 2), "o_proj": (4, 8, 2),
        "layer_norms": (2, 8, 2), "kv_a_layernorm": (1, 4, 2),
        "gate_proj": (8, 12, 1), "up_proj": (8, 12, 1), "down_proj": (12, 8, 1),
        "experts.gate": (8, 6, 4), "experts.up": (8, 6, 4), "experts.down": (6, 8, 4), "router": (8, 4, 1),
        "shared_experts.gate": (8, 6, 1), "shared_experts.up": (8, 6, 1), "shared_experts.down": (6, 8, 1),
        "norm": (1, 8, 1),
    }
