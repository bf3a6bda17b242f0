"""Per-rank inventory: parameters, weight split, workspace and the KV pool that is left."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvledger.core.sizing.engines import MeasuredPeak, load_measured_peaks, vllm_terms, workspace_peak_bytes
from kvledger.core.sizing.geometry import KVSpec
from kvledger.core.sizing.inventory import (
    GPUS,
    build_inventory,
    count_parameters,
    count_parameters_per_rank,
    get_gpu,
    weights_bytes_per_rank,
)
from kvledger.core.sizing.models import load_model_config
from kvledger.core.sizing.params import weight_plan
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
    from kvledger.core.sizing.models import list_models

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
        # the driver reports 0.3-0.8 GiB less than nvidia-smi's total (where both figures are published)
        if gpu.nvidia_smi_total_mib is not None and not gpu.memory_from_datasheet:
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


# ---- each term's figure, label and reason: vLLM's terms, workspaces, hand-given parts -----------

def vllm_term(cfg: dict, key: str, tokens: int = 1, seqs: int = 1):
    terms = vllm_terms(cfg, KVSpec.from_hf_config(cfg), tp=1, max_num_batched_tokens=tokens,
                       max_num_seqs=seqs)
    return {t.key: t for t in terms}[key]


def terms_by_key(inv):
    return {t.key: t for t in inv.terms}


HAND = KVSpec(layers=32, kv_heads=8, head_dim=128)  # Llama-3-8B-like geometry given by hand (2 MiB blocks)


def hand_inventory(**kwargs):
    """A plan from geometry given by hand (no model config): 2 layers, 1 KV head of 4, an 8 GiB device."""
    return build_inventory(KVSpec(2, 1, 4), device_bytes="8GiB", params=1000, **kwargs)


MLA_NO_ROPE = {  # a small DeepSeek-style MLA model whose q/k carry no rotary part (qk_rope_head_dim 0)
    "model_type": "deepseek_v3", "torch_dtype": "bfloat16", "hidden_size": 1024, "num_attention_heads": 16,
    "num_hidden_layers": 2, "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 0,
    "v_head_dim": 64, "intermediate_size": 512, "vocab_size": 1000,
}


def test_vllm_max_seqs_out_of_range_names_max_seqs() -> None:
    cfg = load_model_config("smollm2-135m")
    with pytest.raises(ConfigError, match=r"^max_seqs must be an integer in \[1, "):
        build_inventory(KVSpec.from_hf_config(cfg), cfg, device_bytes="8GiB", engine="vllm", max_seqs=0)


def test_vllm_forward_width_of_a_dense_model(tiny_dense: dict) -> None:
    """tiny_dense with intermediate 2: attention width 2 * q 8 + 2 * 2 kv heads * 4 = 32 beats the MLP's
    3 * 2 = 6; forward = T 1 x (2 x 8 + 32) x 2 B = 96."""
    term = vllm_term({**tiny_dense, "intermediate_size": 2}, "activation")
    assert "widest attention width 32) x 2 B = 96;" in term.formula


def test_vllm_forward_width_of_a_moe_model_uses_the_experts(tiny_dense: dict) -> None:
    """A Qwen-MoE-shaped tiny_dense (2 experts of 20, top 1): fused MoE width 1 x (3 x 20 + 8) + 2 experts = 70
    beats attention 32; forward = 1 x (16 + 70) x 2 B = 172."""
    cfg = {**tiny_dense, "intermediate_size": 2, "num_experts": 2, "moe_intermediate_size": 20,
           "num_experts_per_tok": 1}
    term = vllm_term(cfg, "activation")
    assert "widest mlp width 70) x 2 B = 172;" in term.formula


def test_vllm_non_torch_and_cuda_context_terms_explain_themselves(tiny_dense: dict) -> None:
    assert vllm_term(tiny_dense, "non_torch").source == (
        "llm-d's vLLM logs (tp 1, 2) and public vLLM logs (tp 4, 8); NCCL and custom all-reduce buffers")
    assert vllm_term(tiny_dense, "cuda_context").formula == (
        "memory in use before vLLM starts: 79.18 - 78.57 GiB free on an idle H100")


def test_workspace_of_a_qwen_moe_ignores_the_dense_intermediate_size(tiny_dense: dict) -> None:
    """Qwen-MoE: every layer is MoE, so the dense intermediate_size (100) is not a width; the MLP width
    is top-1 x 2 = 2. attention = 1 x (8 + 8 + 8 + 8) = 32 beats mlp 1 x (2 x 2 + 8) = 12;
    32 x 2 B + logits 1 x 10 x 4 B = 104."""
    cfg = {**tiny_dense, "intermediate_size": 100, "num_experts": 2, "moe_intermediate_size": 2,
           "num_experts_per_tok": 1}
    assert workspace_peak_bytes(cfg, 1, 1, 1) == 104


def test_workspace_refuses_a_bad_tp_naming_tp(tiny_dense: dict) -> None:
    with pytest.raises(ConfigError, match=r"^tp must be a positive integer, got 0$"):
        workspace_peak_bytes(tiny_dense, 0)


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


def test_a_peaks_file_over_4_mib_is_refused(tmp_path: Path) -> None:
    """A peaks file one byte past 4 MiB is refused as too large, even when it is valid JSON."""
    head = b'{"peaks": []}'
    path = tmp_path / "peaks.json"
    path.write_bytes(head + b" " * (4 * 2**20 + 1 - len(head)))
    with pytest.raises(ConfigError, match="larger than 4 MiB"):
        load_measured_peaks(path)


def test_hand_geometry_workspace_is_sequences_times_vocab_times_bytes() -> None:
    """Without a model config the workspace is the sampler's logits: min(4 seqs, 16 tokens) = 4 x vocab
    1,000 x 4 B (kvledger) = 16,000 B; with vLLM and no --vocab, 4 x 128,256 x 38 B = 19,494,912 B."""
    terms = {t.key: t for t in hand_inventory(vocab=1000, max_batched_tokens=16, max_seqs=4).terms}
    assert terms["workspace"].bytes == 16_000
    terms = {t.key: t for t in hand_inventory(max_batched_tokens=16, max_seqs=4, engine="vllm").terms}
    assert terms["workspace"].bytes == 19_494_912


def test_blocks_per_request_refuses_a_prompt_past_2_to_the_40() -> None:
    """2**40 tokens is the largest prompt accepted (2**40 / 16 = 2**36 blocks); one more is refused."""
    inv = hand_inventory()
    assert inv.blocks_per_request(2**40, 0) == 2**36
    with pytest.raises(ConfigError, match=r"prompt must be an integer in \[0, 2\*\*40\]"):
        inv.blocks_per_request(2**40 + 1, 0)


def test_a_given_workspace_is_labelled_activation_workspace() -> None:
    """--workspace with a model config: the report's workspace line reads 'activation workspace', with
    the given bytes and where they came from."""
    cfg = load_model_config("llama-3.1-8b")
    inv = build_inventory(KVSpec.from_hf_config(cfg), cfg, device_bytes="80GiB", engine="vllm",
                          workspace_bytes=3 * GiB)
    term = next(t for t in inv.terms if t.key == "workspace")
    assert (term.label, term.bytes, term.formula) == ("activation workspace", 3 * GiB, "given (--workspace)")


def test_a_request_of_no_tokens_is_refused_with_its_message() -> None:
    """prompt 0 and max_new 0: the error says exactly that a request needs at least one token."""
    inv = build_inventory(KVSpec(layers=32, kv_heads=8, head_dim=128), pool_bytes="1GiB")
    with pytest.raises(ConfigError, match=r"^a request needs at least one token \(prompt \+ max_new > 0\)$"):
        inv.blocks_per_request(0, 0)


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


def test_kvtc_kv_charges_its_cache_of_first_rows_once_in_a_pool_and_in_a_device_budget() -> None:
    """kvtc keeps 32 first tokens' rows (K and V, every layer, fp32) beside its blocks: a term of its own, taken out
    of a given pool before its blocks and out of a device's budget like the residual pages (SmolLM2: 1.41 MiB)."""
    spec = KVSpec(layers=30, kv_heads=3, head_dim=64, kv_dtype="kvtc")
    cache = 32 * 30 * 2 * 3 * 64 * 4
    inv = build_inventory(spec, pool_bytes="512MiB", residual_slots=8)
    term = terms_by_key(inv)["first_rows"]
    assert term.bytes == cache and term.formula == "32 first tokens x K and V of 30 layers, fp32"
    assert inv.pool_blocks == (512 * MiB - 8 * spec.residual_page_bytes - cache) // spec.block_bytes
    assert inv.slack_bytes < spec.block_bytes  # the cache is not reported as slack
    cfg = load_model_config("smollm2-135m")
    on_gpu = build_inventory(spec, cfg, gpu="L4", engine="kvledger", max_seqs=8)
    bare = build_inventory(KVSpec(layers=30, kv_heads=3, head_dim=64, kv_dtype="int4"), cfg, gpu="L4",
                           engine="kvledger", max_seqs=8)
    assert terms_by_key(on_gpu)["first_rows"].in_budget
    assert on_gpu.kv_budget_bytes == bare.kv_budget_bytes - cache  # int4's residual pages are as large as kvtc's


def test_int4_kv_charges_one_residual_page_per_running_sequence() -> None:
    """int4 KV keeps an unquantised bf16 page per running sequence: 32 layers x 2 (K, V) x 16 tokens x 8
    heads x 128 x 2 B = 2 MiB per page; 4 slots cost 8 MiB, and the term says so."""
    spec = KVSpec(layers=32, kv_heads=8, head_dim=128, kv_dtype="int4")
    inv = build_inventory(spec, pool_bytes="1GiB", residual_slots=4)
    residual = terms_by_key(inv)["residual"]
    assert residual.bytes == inv.residual_bytes == 8 * MiB
    assert residual.formula == ("4 running sequences x one unquantised page of 16 tokens "
                                "(2,097,152 B, bf16)")
