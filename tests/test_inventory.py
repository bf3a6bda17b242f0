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
    "mistral-7b": 7.24e9,
    "gemma-2-9b": 9.24e9,
    "smollm2-135m": 134.5e6,
    "deepseek-v3": 671e9,  # without the multi-token-prediction layer
}


@pytest.mark.parametrize(("name", "published"), sorted(PUBLISHED_PARAMS.items()))
def test_parameter_counts_match_published_sizes(name, published):
    count = count_parameters(load_model_config(name))
    assert count.total == pytest.approx(published, rel=0.01)
    assert count.total == count.embedding + count.lm_head + count.attention + count.mlp + count.norms


def test_tied_embeddings_have_no_separate_lm_head():
    assert count_parameters(load_model_config("smollm2-135m")).lm_head == 0
    assert count_parameters(load_model_config("gemma-2-9b")).lm_head == 0
    llama = count_parameters(load_model_config("llama-3.1-8b"))
    assert llama.lm_head == llama.embedding == 128256 * 4096


def test_weights_at_tp1_are_the_parameter_count_in_weight_dtype_bytes():
    cfg = load_model_config("llama-3.1-8b")
    total = count_parameters(cfg).total
    assert weights_bytes_per_rank(cfg, 1, "bf16") == 2 * total
    assert weights_bytes_per_rank(cfg, 1, "fp8") == total
    assert weights_bytes_per_rank(cfg, 1) == 2 * total  # torch_dtype bfloat16


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


def test_deepseek_v3_weights_default_to_fp8_and_split_across_8_ranks():
    cfg = load_model_config("deepseek-v3")
    one = weights_bytes_per_rank(cfg, 1)
    assert one == count_parameters(cfg).total  # 1 byte per parameter
    # q_a/kv_a down-projections and routers are replicated: about 1 GB more than an eighth.
    assert one / 8 < weights_bytes_per_rank(cfg, 8) < one / 8 * 1.02


def test_tp_must_divide_attention_heads():
    with pytest.raises(ConfigError, match="num_attention_heads"):
        count_parameters_per_rank(load_model_config("llama-3.1-8b"), 3)


def test_unsupported_moe_counting_is_refused():
    cfg = {**load_model_config("mistral-7b"), "model_type": "mixtral", "num_local_experts": 8}
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        count_parameters(cfg)


def test_workspace_follows_the_documented_formula():
    cfg = load_model_config("llama-3.1-8b")
    tokens = 8192
    mlp = tokens * (2 * 14336 + 4096)  # larger than attention's tokens * (4096 + 1024 + 1024 + 4096)
    logits = 256 * 128256 * 4
    assert workspace_peak_bytes(cfg, 1) == mlp * 2 + logits
    assert workspace_peak_bytes(cfg, 2) < workspace_peak_bytes(cfg, 1)
    assert workspace_peak_bytes(cfg, 1, max_batched_tokens=2048) < workspace_peak_bytes(cfg, 1)


def test_gpu_catalogue():
    assert get_gpu("H100-80GB").memory_bytes == 80 * GiB
    assert get_gpu("h200-141gb").memory_bytes == 141 * 10**9
    assert {"a100-80gb", "h100-80gb", "h200-141gb", "l4"} <= set(GPUS)
    assert all(g.source for g in GPUS.values())
    with pytest.raises(ConfigError, match="h100-80gb"):
        get_gpu("tpu-v9")


# ---- the inventory ------------------------------------------------------------------------------


def llama8b(**kwargs):
    cfg = load_model_config("llama-3.1-8b")
    return build_inventory(KVSpec.from_hf_config(cfg), cfg, **kwargs)


def test_llama_8b_on_h100_has_a_positive_pool_of_whole_blocks():
    inv = llama8b(gpu="h100-80gb")
    assert inv.block_bytes == 2 * MiB and inv.kv_bytes_per_token == 131072
    assert inv.pool_blocks > 0
    assert inv.pool_bytes == inv.pool_blocks * inv.block_bytes
    assert 0 <= inv.slack_bytes < inv.block_bytes
    assert inv.budget_bytes == int(80 * GiB * 0.9)
    # Conservation: everything in the budget is accounted for.
    spent = inv.weights_bytes_per_rank + inv.workspace_bytes + inv.reserve_bytes + inv.pool_bytes
    assert spent + inv.slack_bytes == inv.budget_bytes
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
    with pytest.raises(ConfigError, match="model does not fit"):
        build_inventory(KVSpec.from_hf_config(cfg), cfg, gpu="h100-80gb")


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
        "device_bytes",
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
    ],
)
def test_bad_inventory_options_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        llama8b(**kwargs)


def test_zero_reserve_is_allowed_and_frees_a_gibibyte():
    assert llama8b(gpu="h100-80gb", runtime_reserve_bytes=0).pool_blocks == \
        llama8b(gpu="h100-80gb").pool_blocks + GiB // (2 * MiB)
