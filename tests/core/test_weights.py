"""Checkpoint weights (``core/sizing/params``): the tensors a model config names, the weight format read from its
quantization_config, and the bytes each format charges per rank."""

from __future__ import annotations

import pytest

from kvledger.core.sizing.geometry import default_dtype
from kvledger.core.sizing.params import (
    WeightFormat,
    get_weight_format,
    model_tensors,
    moe_layout,
    weight_plan,
    weights_bytes_per_rank,
)
from kvledger.errors import ConfigError


def shapes(cfg: dict) -> dict[str, tuple[int, int, int]]:
    return {t.name: (t.rows, t.cols, t.count) for t in model_tensors(cfg)}


# A tiny DeepSeek-shaped one: MLA without a q low-rank, one dense layer then one MoE layer with a
# shared expert.
DEEPSEEK = {"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 10, "num_attention_heads": 2,
            "kv_lora_rank": 4, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 2,
            "intermediate_size": 12, "n_routed_experts": 4, "moe_intermediate_size": 6,
            "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
            "tie_word_embeddings": False}


def test_an_unknown_torch_dtype_defaults_to_bf16(tiny_dense: dict) -> None:
    """A config whose torch_dtype kvledger does not know (float64) is served as bf16."""
    assert default_dtype({"torch_dtype": "float64"}) == "bf16"
    assert weight_plan({**tiny_dense, "torch_dtype": "float64"}).base == "bf16"


def test_compressed_tensors_float8_is_fp8_not_int8(tiny_dense: dict) -> None:
    """compressed-tensors 8-bit `type: float` weights are fp8 (int8 costs the same bytes, so only the
    format name and its reason tell them apart)."""
    cfg = {**tiny_dense, "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"num_bits": 8, "type": "float"}}}}}
    plan = weight_plan(cfg)
    assert plan.linear.name == "fp8"
    assert plan.source == "quantization_config compressed-tensors float8"


def test_compressed_tensors_without_a_type_reads_as_int(tiny_dense: dict) -> None:
    cfg = {**tiny_dense, "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"num_bits": 8}}}}}
    plan = weight_plan(cfg)
    assert plan.linear.name == "int8"
    assert plan.source == "quantization_config compressed-tensors int8"


def test_gptq_bits_8_is_int8(tiny_dense: dict) -> None:
    """A GPTQ checkpoint with `bits: 8` is sized as int8, not the 4-bit default."""
    plan = weight_plan({**tiny_dense, "quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": 128}})
    assert plan.linear.name == "int8"
    assert plan.source == "quantization_config gptq 8-bit"


def test_awq_w_bit_8_is_int8(tiny_dense: dict) -> None:
    """AutoAWQ's own spelling `w_bit: 8` is read like `bits: 8`."""
    plan = weight_plan({**tiny_dense, "quantization_config": {"quant_method": "awq", "w_bit": 8, "q_group_size": 128}})
    assert plan.linear.name == "int8"
    assert plan.source == "quantization_config awq 8-bit"


def test_a_multimodal_configs_top_level_quantization_config_is_used(tiny_dense: dict) -> None:
    """A multimodal config nests the decoder in `text_config` but keeps `quantization_config` at the top:
    its fp8 weights must still be found."""
    cfg = {"model_type": "gemma3", "text_config": dict(tiny_dense),
           "quantization_config": {"quant_method": "fp8"}}
    plan = weight_plan(cfg)
    assert plan.linear.name == "fp8"
    assert plan.source == "quantization_config fp8"


def test_weight_dtype_fp32_keeps_everything_in_fp32(tiny_dense: dict) -> None:
    """`--weight-dtype fp32` stores every weight in 4 bytes, embeddings and norms too.

    Parameters of tiny_dense: embedding 10 * 8 + lm_head 8 * 10 = 160; per layer q/k/v/o 4 * 8 * 8 = 256,
    norms 2 * 8 = 16, MLP 3 * 8 * 12 = 288, so 2 * 560 = 1120; final norm 8: 1288 in all, * 4 bytes."""
    plan = weight_plan(tiny_dense, "fp32")
    assert plan.base == "fp32" and plan.name == "fp32"
    assert weights_bytes_per_rank(tiny_dense, 1, "fp32") == 1288 * 4


def test_dense_tensors_are_named_as_in_the_checkpoint(tiny_dense: dict) -> None:
    """tiny_dense tensor by tensor; each layer's MLP is gate and up (hidden 8 -> intermediate 12) and down
    (12 -> 8)."""
    assert shapes(tiny_dense) == {
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


def test_attention_bias_adds_qkv_and_o_biases(tiny_dense: dict) -> None:
    """`attention_bias: true` gives a q/k/v bias (8 + 2 * 8 = 24 wide) and an o_proj bias (8 wide)
    per layer; a per-tensor breakdown lists both."""
    got = shapes({**tiny_dense, "attention_bias": True})
    assert got["qkv_bias"] == (1, 24, 2)
    assert got["o_bias"] == (1, 8, 2)


def test_mla_with_q_low_rank_has_a_q_a_proj_of_hidden_by_rank() -> None:
    """DeepSeek-V3-style MLA with q_lora_rank 3: q_a_proj maps hidden 8 -> 3, one per layer."""
    cfg = {"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 10, "num_attention_heads": 2,
           "kv_lora_rank": 4, "q_lora_rank": 3, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2,
           "v_head_dim": 2, "intermediate_size": 12, "tie_word_embeddings": False}
    got = shapes(cfg)
    assert got["q_a_proj"] == (8, 3, 2)
    assert got["q_b_proj"] == (3, 8, 2)  # 3 -> 2 heads * (nope 2 + rope 2)


def test_compressed_tensors_skips_a_group_without_weights(tiny_dense: dict) -> None:
    """A compressed-tensors config whose first group quantizes only activations (no `weights`) is
    read from the next group that has them, not refused."""
    cfg = {**tiny_dense, "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"input_activations": {"num_bits": 8}},
        "group_1": {"weights": {"num_bits": 8, "type": "float"}}}}}
    plan = weight_plan(cfg)
    assert plan.linear.name == "fp8"
    assert plan.source == "quantization_config compressed-tensors float8"


def test_bitsandbytes_4bit_is_nf4(tiny_dense: dict) -> None:
    plan = weight_plan({**tiny_dense, "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}})
    assert plan.linear.name == "nf4"
    assert plan.source == "quantization_config bitsandbytes 4-bit"


def test_awq_without_bits_defaults_to_4_bit(tiny_dense: dict) -> None:
    """An AWQ config that gives neither `bits` nor `w_bit` is 4-bit (group 128 by default)."""
    plan = weight_plan({**tiny_dense, "quantization_config": {"quant_method": "awq"}})
    assert plan.linear.name == "int4"
    assert plan.source == "quantization_config awq int4, group 128"


def test_torch_float8_spelling_is_the_fp8_weight_format() -> None:
    """`--weight-dtype float8_e5m2` (a torch spelling) is accepted as fp8."""
    assert get_weight_format("float8_e5m2").name == "fp8"
    assert get_weight_format("torch.float8_e4m3fn").name == "fp8"


def test_zero_points_take_whole_bytes_apart_from_fractional_scales() -> None:
    """A format with one 4-bit scale (0.5 B) and one 4-bit zero point per tensor: a 1 x 1 weight takes
    1 byte of data, 0.5 B of scale and a whole byte of zero point: ceil(1 + 0.5 + 1) = 3 bytes."""
    fmt = WeightFormat("q4-tiny-scale", 4, -1, 0.5, zero_bits=4)
    assert fmt.linear_bytes(1, 1) == 3


def test_weight_dtype_bf16_keeps_embeddings_in_bf16_on_an_fp16_checkpoint() -> None:
    """--weight-dtype bf16 on an fp16 checkpoint serves everything in bf16: the plan's base dtype is bf16
    (not the config's fp16), so the plan is named plain 'bf16'."""
    plan = weight_plan({"torch_dtype": "float16"}, "bf16")
    assert plan.base == "bf16"
    assert plan.name == "bf16"
    assert plan.source == "--weight-dtype bf16"


def test_compressed_tensors_int4_uses_the_checkpoints_group_size(tiny_dense: dict) -> None:
    """A compressed-tensors 4-bit int checkpoint with `group_size: 64` is sized with groups of 64, and the
    reason says so.

    A 128 x 4 weight: 128 * 4 * 4 bits = 256 bytes of codes; 128 / 64 = 2 groups per column, 8 scales:
    8 fp16 scales = 16 bytes and 8 4-bit zeros = 4 bytes: 276 (one group per column would be 266)."""
    cfg = {**tiny_dense, "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"num_bits": 4, "type": "int", "group_size": 64}}}}}
    plan = weight_plan(cfg)
    assert plan.linear.name == "int4"
    assert plan.source == "quantization_config compressed-tensors int4, group 64"
    assert plan.group_override == 64
    assert plan.linear_bytes(128, 4) == 276


def test_gemma_without_a_tie_key_has_no_lm_head(tiny_dense: dict) -> None:
    """A Gemma config that omits `tie_word_embeddings` shares its embedding with the output (no lm_head
    tensor); a Llama config that omits it has its own lm_head."""
    gemma = [t.name for t in model_tensors({**tiny_dense, "model_type": "gemma"})]
    llama = [t.name for t in model_tensors({**tiny_dense, "model_type": "llama"})]
    assert "embed_tokens" in gemma and "lm_head" not in gemma
    assert "lm_head" in llama


def test_num_experts_without_moe_intermediate_size_uses_intermediate_size(tiny_dense: dict) -> None:
    """An OLMoE-style config (num_experts, no moe_intermediate_size) sizes each expert by
    intermediate_size (12); both layers are MoE layers (decoder_sparse_step defaults to 1)."""
    cfg = {**tiny_dense, "num_experts": 4, "num_experts_per_tok": 2}
    assert moe_layout(cfg) == {"experts": 4, "top_k": 2, "expert_inter": 12, "shared_inter": 0,
                               "shared_gate": False, "moe_layers": [0, 1], "style": "qwen"}


def test_mlp_only_layers_that_is_not_a_list_is_refused_with_its_message(tiny_dense: dict) -> None:
    """`mlp_only_layers: "0"` is refused with a message naming the key and what it must be."""
    cfg = {**tiny_dense, "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": "0"}
    with pytest.raises(ConfigError, match=r"model config key 'mlp_only_layers' must be a list of layer indices"):
        moe_layout(cfg)
