"""Per-rank inventory: parameters, weight split, workspace and the KV pool that is left."""

from __future__ import annotations

import json

import pytest

from kvledger.core.geometry import KVSpec
from kvledger.core.inventory import (
    GPUS,
    build_inventory,
    count_parameters,
    count_parameters_per_rank,
    get_gpu,
    weights_bytes_per_rank,
    workspace_peak_bytes,
)
from kvledger.core.models import load_model_config
from kvledger.errors import ConfigError

MiB, GiB = 2**20, 2**30

PUBLISHED_PARAMS = {
    "llama-3.1-8b": 8.03e9,
    "llama-3.1-70b": 70.6e9,
    "qwen2.5-7b": 7.62e9,
    "qwen2.5-32b": 32.5e9,  # Qwen2.5 model card
    "mistral-7b": 7.24e9,
    "mixtral-8x7b": 46.7e9,  # Mistral AI, "Mixtral of experts"
    "gemma-2-9b": 9.24e9,
    "gemma-2-27b": 27.2e9,  # Gemma 2 technical report
    "smollm2-135m": 134.5e6,
    "deepseek-v3": 671e9,  # without the multi-token-prediction layer
}
PUBLISHED_ACTIVE = {"mixtral-8x7b": 12.9e9, "deepseek-v3": 37e9}


def test_every_bundled_model_has_a_published_size():
    from kvledger.core.models import list_models

    assert set(list_models()) == set(PUBLISHED_PARAMS)


@pytest.mark.parametrize(("name", "published"), sorted(PUBLISHED_PARAMS.items()))
def test_parameter_counts_match_published_sizes(name, published):
    count = count_parameters(load_model_config(name))
    assert count.total == pytest.approx(published, rel=0.01)
    assert count.total == count.embedding + count.lm_head + count.attention + count.mlp + count.norms
    if name in PUBLISHED_ACTIVE:
        assert count.active == pytest.approx(PUBLISHED_ACTIVE[name], rel=0.03)
    else:
        assert count.active == count.total


def test_tied_embeddings_have_no_separate_lm_head():
    assert count_parameters(load_model_config("smollm2-135m")).lm_head == 0
    assert count_parameters(load_model_config("gemma-2-9b")).lm_head == 0
    llama = count_parameters(load_model_config("llama-3.1-8b"))
    assert llama.lm_head == llama.embedding == 128256 * 4096


def test_weights_at_tp1_are_the_parameter_count_in_weight_dtype_bytes():
    cfg = load_model_config("llama-3.1-8b")
    total = count_parameters(cfg).total
    assert weights_bytes_per_rank(cfg, 1, "bf16") == 2 * total
    assert weights_bytes_per_rank(cfg, 1) == 2 * total  # torch_dtype bfloat16


def test_quantized_weights_keep_embeddings_and_lm_head_at_their_own_precision():
    cfg = load_model_config("llama-3.1-8b")
    p = count_parameters(cfg)
    kept = 2 * (p.embedding + p.lm_head + p.norms)  # bf16 embeddings, lm_head and norms
    linear = p.attention + p.mlp  # every matmul weight of the 32 layers (no biases in Llama)
    # fp8: one byte per weight plus one fp32 scale per output channel.
    channels = 32 * (4096 + 1024 + 1024 + 4096 + 2 * 14336 + 4096)
    assert weights_bytes_per_rank(cfg, 1, "fp8") == kept + linear + 4 * channels
    # int4 (AWQ): half a byte per weight, and per group of 128 inputs an fp16 scale and a 4-bit zero per column.
    groups = 32 * (4096 // 128 * (4096 + 1024 + 1024 + 2 * 14336) + 4096 // 128 * 4096 + 14336 // 128 * 4096)
    assert weights_bytes_per_rank(cfg, 1, "int4") == kept + linear // 2 + groups * 2 + groups // 2
    # fp4 (NVFP4): half a byte per weight and one fp8 scale per 16 weights.
    assert weights_bytes_per_rank(cfg, 1, "fp4") == kept + linear // 2 + linear // 16
    assert weights_bytes_per_rank(cfg, 1, "int4") < weights_bytes_per_rank(cfg, 1, "fp8") < 2 * p.total


def test_quantization_config_is_read():
    base = load_model_config("llama-3.1-8b")
    awq = {**base, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}}
    gptq = {**base, "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}}
    ct = {**base, "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}, "ignore": ["lm_head"]}}
    assert weights_bytes_per_rank(awq) == weights_bytes_per_rank(base, 1, "int4")
    # GPTQ also stores an int32 g_idx per input row of every matmul.
    rows = 32 * (4096 * 4 + 4096 * 2 + 14336)
    assert weights_bytes_per_rank(gptq) == weights_bytes_per_rank(base, 1, "int4") + 4 * rows
    assert weights_bytes_per_rank(ct) == weights_bytes_per_rank(base, 1, "fp8")
    from kvledger.core.params import weight_plan

    assert weight_plan(awq).source == "quantization_config awq int4, group 128"
    with pytest.raises(ConfigError, match="quant_method 'hqq'"):
        weights_bytes_per_rank({**base, "quantization_config": {"quant_method": "hqq"}})
    with pytest.raises(ConfigError, match="unknown weight dtype 'int3'"):
        weights_bytes_per_rank(base, 1, "int3")


def test_tp2_holds_about_half_and_only_replicated_parts_exceed_half():
    cfg = load_model_config("llama-3.1-8b")
    whole, half = count_parameters(cfg), count_parameters_per_rank(cfg, 2)
    assert half.norms == whole.norms  # norms replicated
    assert half.embedding * 2 == whole.embedding  # vocab-parallel
    assert whole.total / 2 <= half.total <= whole.total / 2 * 1.001
    assert weights_bytes_per_rank(cfg, 2) == pytest.approx(weights_bytes_per_rank(cfg, 1) / 2, rel=0.001)


def test_kv_projections_replicate_when_tp_exceeds_kv_heads():
    cfg = load_model_config("llama-3.1-70b")
    tp8, tp16 = count_parameters_per_rank(cfg, 8), count_parameters_per_rank(cfg, 16)
    hidden, head_dim, layers = 8192, 128, 80
    q_o_tp16 = 2 * hidden * (64 // 16) * head_dim
    assert tp16.attention == layers * (q_o_tp16 + 2 * hidden * head_dim)  # one KV head each
    assert tp16.attention > tp8.attention / 2  # k/v stopped shrinking


def test_deepseek_v3_weights_default_to_block_fp8_and_split_across_8_ranks():
    cfg = load_model_config("deepseek-v3")
    one = weights_bytes_per_rank(cfg, 1)
    p = count_parameters(cfg)
    # fp8 matmul weights plus fp32 scales per 128 x 128 block; embeddings, lm_head, norms and routers bf16.
    assert p.total < one < p.total * 1.01
    from kvledger.core.params import weight_plan

    assert weight_plan(cfg).linear.name == "fp8-block"
    # q_a/kv_a down-projections and routers are replicated: about 1 GB more than an eighth.
    assert one / 8 < weights_bytes_per_rank(cfg, 8) < one / 8 * 1.02


def test_tp_must_divide_attention_heads():
    with pytest.raises(ConfigError, match="num_attention_heads"):
        count_parameters_per_rank(load_model_config("llama-3.1-8b"), 3)


def test_mixtral_style_moe_counts_every_expert_and_activates_two():
    cfg = load_model_config("mixtral-8x7b")
    p = count_parameters(cfg)
    experts = 32 * 8 * 3 * 4096 * 14336
    router = 32 * 8 * 4096
    assert p.mlp == experts + router
    assert p.mlp_active == 32 * 2 * 3 * 4096 * 14336 + router
    tp2 = count_parameters_per_rank(cfg, 2)
    assert tp2.mlp == 32 * 8 * 3 * 4096 * 7168 + router  # experts split inside, the router replicated


QWEN_MOE = {  # Qwen1.5-MoE-A2.7B's published config.json (a shared expert with its own sigmoid gate)
    "model_type": "qwen2_moe", "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
    "num_key_value_heads": 16, "intermediate_size": 5632, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def test_qwen_moe_counts_routed_shared_experts_and_gates():
    p = count_parameters(QWEN_MOE)
    per_layer = 60 * 3 * 2048 * 1408 + 60 * 2048 + 3 * 2048 * 5632 + 2048
    assert p.mlp == 24 * per_layer
    assert p.mlp_active == 24 * (4 * 3 * 2048 * 1408 + 60 * 2048 + 3 * 2048 * 5632 + 2048)
    assert p.total == pytest.approx(14.3e9, rel=0.01)  # published: 14.3B total, 2.7B activated
    assert p.active == pytest.approx(2.7e9, rel=0.03)
    dense_first = {**QWEN_MOE, "mlp_only_layers": [0, 1]}
    q = count_parameters(dense_first)
    assert q.mlp == 22 * per_layer + 2 * 3 * 2048 * 5632


def test_non_attention_layers_are_refused():
    cfg = {**load_model_config("llama-3.1-8b"), "layer_types": ["full_attention", "mamba"] * 16}
    with pytest.raises(ConfigError, match="non-attention layers"):
        count_parameters(cfg)


def test_workspace_follows_the_documented_formula():
    cfg = load_model_config("llama-3.1-8b")
    tokens = 8192
    mlp = tokens * (2 * 14336 + 4096)  # larger than attention's tokens * (4096 + 1024 + 1024 + 4096)
    logits = 256 * 128256 * 4
    assert workspace_peak_bytes(cfg, 1) == mlp * 2 + logits
    assert workspace_peak_bytes(cfg, 2) < workspace_peak_bytes(cfg, 1)
    assert workspace_peak_bytes(cfg, 1, max_batched_tokens=2048) < workspace_peak_bytes(cfg, 1)


def test_gpu_catalogue_uses_what_the_driver_reports():
    h100 = get_gpu("H100-80GB")
    assert h100.memory_bytes == int(79.18 * GiB)  # not the datasheet's 80 GiB
    assert h100.datasheet_bytes == 80 * GiB and h100.nvidia_smi_total_mib == 81559
    assert get_gpu("l4").memory_bytes == int(22.03 * GiB)  # sold as 24 GB; nvidia-smi says 23,034 MiB
    assert get_gpu("h200-141gb").memory_bytes == int(139.81 * GiB)  # 141 GB is 131.3 GiB; the driver says 139.81
    assert get_gpu("h200-141gb").datasheet_bytes == 141 * 10**9
    assert {"a100-40gb", "a100-80gb", "a10", "h100-80gb", "h200-141gb", "l4"} <= set(GPUS)
    for gpu in GPUS.values():
        assert gpu.source and gpu.driver_source and gpu.nvidia_smi_source
        # the driver reports 0.4-0.8 GiB less than nvidia-smi's total
        assert 0.3 * GiB < gpu.nvidia_smi_total_mib * 2**20 - gpu.memory_bytes < GiB
    with pytest.raises(ConfigError, match="h100-80gb"):
        get_gpu("tpu-v9")


# ---- the inventory ------------------------------------------------------------------------------


def llama8b(**kwargs):
    cfg = load_model_config("llama-3.1-8b")
    return build_inventory(KVSpec.from_hf_config(cfg), cfg, **kwargs)


def test_llama_8b_on_h100_has_a_positive_pool_of_whole_blocks():
    inv = llama8b(gpu="h100-80gb")
    assert inv.engine == "kvledger"
    assert inv.block_bytes == 2 * MiB and inv.kv_bytes_per_token == 131072
    assert inv.pool_blocks > 0
    assert inv.pool_bytes == inv.pool_blocks * inv.block_bytes
    assert 0 <= inv.slack_bytes < inv.block_bytes
    assert inv.budget_bytes == int(int(79.18 * GiB) * 0.9)
    # Conservation: everything in the budget is accounted for.
    spent = inv.weights_bytes_per_rank + inv.workspace_bytes + inv.reserve_bytes + inv.pool_bytes
    assert spent + inv.slack_bytes == inv.budget_bytes
    assert sum(t.bytes for t in inv.terms if t.in_budget) + inv.pool_bytes + inv.slack_bytes == inv.budget_bytes
    assert 50 * GiB < inv.pool_bytes < 60 * GiB


def test_more_utilization_or_tp_means_a_bigger_pool_in_blocks():
    assert llama8b(gpu="h100-80gb", utilization=0.95).pool_blocks > llama8b(gpu="h100-80gb").pool_blocks
    cfg = load_model_config("llama-3.1-70b")
    tp8 = build_inventory(KVSpec.from_hf_config(cfg, tp=8), cfg, gpu="h100-80gb")
    assert tp8.kv_heads_per_rank == 1 and tp8.pool_blocks > 0


def test_request_capacity_without_sharing():
    inv = llama8b(pool_bytes=512 * MiB)
    assert inv.blocks_per_request(2048, 257) == 145
    assert inv.max_concurrent_requests(2048, 257) == 256 // 145
    assert inv.max_concurrent_requests(16, 0) == 256
    with pytest.raises(ConfigError):
        inv.blocks_per_request(0, 0)


def test_model_that_does_not_fit_is_a_config_error():
    cfg = load_model_config("llama-3.1-70b")
    with pytest.raises(ConfigError, match="model does not fit") as info:
        build_inventory(KVSpec.from_hf_config(cfg), cfg, gpu="h100-80gb")
    assert "weights 131.42 GiB" in str(info.value)


def test_direct_pool_bytes_round_down_and_still_report_weights():
    inv = llama8b(pool_bytes="513MiB")
    assert (inv.pool_blocks, inv.pool_bytes, inv.slack_bytes) == (256, 512 * MiB, MiB)
    assert inv.weights_bytes_per_rank == 2 * inv.parameters
    bare = build_inventory(KVSpec(layers=32, kv_heads=8, head_dim=128), pool_bytes=512 * MiB)
    assert (bare.pool_blocks, bare.parameters, bare.device_bytes) == (256, 0, None)
    with pytest.raises(ConfigError, match="smaller than one KV block"):
        build_inventory(KVSpec(layers=32, kv_heads=8, head_dim=128), pool_bytes=MiB)


def test_to_dict_has_exactly_the_documented_keys_and_is_json_ready():
    d = llama8b(device_bytes="80GiB").to_dict()
    assert set(d) == {
        "kv_bytes_per_token", "kv_heads_per_rank", "kv_replication", "block_bytes", "pool_blocks",
        "pool_bytes", "parameters", "weights_bytes_per_rank", "workspace_bytes", "reserve_bytes",
        "device_bytes", "engine", "utilization", "budget_bytes", "non_torch_bytes", "kv_budget_bytes",
        "workspace_source", "weight_format", "max_batched_tokens", "max_seqs", "capacity_tokens",
        "largest_context", "headroom_bytes", "terms", "residual_slots", "residual_bytes", "kv_format",
        "kv_format_parts",
    }
    assert json.loads(json.dumps(d)) == d
    assert d["device_bytes"] == 80 * GiB


@pytest.mark.parametrize(
    "kwargs",
    [
        {"gpu": "h100-80gb", "utilization": 0},
        {"gpu": "h100-80gb", "utilization": 1.5},
        {"gpu": "h100-80gb", "device_bytes": 80 * GiB},
        {},  # nothing to size the pool from
        {"gpu": "h100-80gb", "runtime_reserve_bytes": "lots"},
        {"gpu": "h100-80gb", "engine": "sglang"},
        {"gpu": "h100-80gb", "max_seqs": 0},
        {"gpu": "h100-80gb", "max_batched_tokens": 10**12},
    ],
)
def test_bad_inventory_options_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        llama8b(**kwargs)


def test_zero_reserve_is_allowed_and_frees_a_gibibyte():
    assert llama8b(gpu="h100-80gb", runtime_reserve_bytes=0).pool_blocks == \
        llama8b(gpu="h100-80gb").pool_blocks + GiB // (2 * MiB)
