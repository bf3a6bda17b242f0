"""The weight plan counts Mamba-2 and gated-delta-net mixers (`core.sizing.params`), so `plan` sizes a hybrid
state-layer model from its config alone. Each figure is computed here by hand from HF's module formulas and equals
what transformers 5.24 counts for the same config (``AutoModelForCausalLM.from_config`` on the meta device)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvledger.core.sizing.params import count_parameters, count_parameters_per_rank, model_tensors
from kvledger.errors import ConfigError

GRANITE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "granite-4-h-small-style.json"

# Qwen3-Next style, small: 6 gated-delta-net : 2 gated full-attention layers, a routed + shared-expert MoE.
QWEN3_NEXT = dict(model_type="qwen3_next", hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, intermediate_size=1024, moe_intermediate_size=128,
                  shared_expert_intermediate_size=128, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                  linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
                  linear_conv_kernel_dim=4, vocab_size=1000, tie_word_embeddings=False, torch_dtype="bfloat16",
                  layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)


def _mixers(cfg: dict, prefix: str, tp: int = 1) -> int:
    return sum(t.params for t in model_tensors(cfg, tp) if t.name.startswith(prefix))


def test_mamba2_mixers_by_hand() -> None:
    """Granite-4.0-H style (hidden 1,024, 32 heads x 64, d_state 128, 1 group, conv 4, expand 2): per layer
    in_proj 1,024 x (2 x 2,048 + 2 x 128 + 32), conv 4 x 2,304 + bias 2,304, A_log / D / dt_bias 3 x 32, gated norm
    2,048, out_proj 2,048 x 1,024; ten such layers. transformers: 66,000,320 in the mamba modules, 249,526,720 in all
    (with its shared MLP as wide as this config's intermediate_size)."""
    cfg = json.loads(GRANITE.read_text())
    layer = 1024 * (2 * 2048 + 2 * 128 + 32) + 4 * 2304 + 2304 + 3 * 32 + 2048 * 1024
    assert _mixers(cfg, "mamba.") == 10 * (layer + 2048) == 66_000_320  # with the gated norm
    attention = 2 * (1024 * 1024 * 2 + 2 * 1024 * 256)  # q, o and k, v of the 2 attention layers
    mlp = 12 * 3 * 1024 * 2048
    norms = 12 * 2 * 1024 + 1024 + 10 * 2048
    assert count_parameters(cfg).total == 100352 * 1024 + attention + 10 * layer + mlp + norms == 249_526_720
    # tp=2: heads and the inner width split, the one B/C group replicated on both ranks.
    half = 1024 * (2048 + 2 * 128 + 16) + 4 * (1024 + 256) + (1024 + 256) + 3 * 16 + 1024 * 1024
    assert _mixers(cfg, "mamba.", 2) == 10 * (half + 1024)
    assert count_parameters_per_rank(cfg, 2).attention < count_parameters(cfg).attention


def test_gated_delta_net_mixers_by_hand() -> None:
    """Qwen3-Next style: per layer in_proj_qkvz 512 x (2 x 128 + 2 x 256), in_proj_ba 512 x 16, conv 4 x 512,
    A_log / dt_bias 2 x 8, norm 32, out_proj 256 x 512; the full-attention q_proj doubled for the output gate.
    transformers: 3,207,456 in the linear_attn modules, 20,268,064 in all."""
    layer = 512 * (2 * 128 + 2 * 256) + 512 * 16 + 4 * 512 + 2 * 8 + 32 + 256 * 512
    assert _mixers(QWEN3_NEXT, "linear_attn.") == 6 * layer == 3_207_456
    q = next(t for t in model_tensors(QWEN3_NEXT) if t.name == "q_proj")
    assert (q.cols, q.count) == (2 * 8 * 64, 2)
    assert count_parameters(QWEN3_NEXT).total == 20_268_064


def test_qwen3_next_80b_a3b_geometry_counts_80b() -> None:
    """Qwen3-Next-80B-A3B's geometry (hidden 2,048; 48 layers, 3 gated-delta-net : 1 gated attention; 512 experts of
    512, top 10, a shared expert; vocab 151,936, untied): 79,674,391,296 parameters, what transformers 5.24 counts
    for the same config and the model card's '80B in total'."""
    cfg = {**QWEN3_NEXT, "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 16,
           "num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 5120, "moe_intermediate_size": 512,
           "shared_expert_intermediate_size": 512, "num_experts": 512, "num_experts_per_tok": 10,
           "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
           "linear_value_head_dim": 128, "vocab_size": 151936,
           "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 12}
    assert count_parameters(cfg).total == 79_674_391_296


def test_state_layers_without_their_geometry_are_still_refused() -> None:
    cfg = json.loads(GRANITE.read_text())
    del cfg["mamba_n_heads"]
    with pytest.raises(ConfigError, match="non-attention layers"):
        count_parameters(cfg)
