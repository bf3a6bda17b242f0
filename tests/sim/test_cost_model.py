"""Step-time cost model: hand-worked roofline examples, MoE, sliding windows, swaps, profiles."""

from __future__ import annotations

import json

import pytest

from kvledger.core.sizing.geometry import KVSpec
from kvledger.core.sizing.inventory import GPUS
from kvledger.core.sizing.models import load_model_config
from kvledger.errors import ConfigError
from kvledger.sim.cost_model import (
    CACHE_ENV,
    DEFAULT_BW_EFFICIENCY,
    DEFAULT_FLOPS_EFFICIENCY,
    DEFAULT_STEP_OVERHEAD_S,
    DEFAULT_TRANSFER_OVERHEAD_S,
    CostModel,
    DeviceProfile,
    cpu_profile_path,
    get_profile,
    list_profiles,
    load_cpu_profile,
)

# Datasheet numbers, written out here rather than read from the catalogue.
H100_BF16_DENSE_FLOPS = 989e12  # NVIDIA H100 SXM datasheet: 1,979 TFLOPS bf16 with sparsity, half dense
H100_HBM_Bps = 3.35e12  # NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3
PCIE5_X16_Bps = 64e9  # PCIe Gen5 x16, one direction

# Llama-3.1-8B, by hand from its config.json (hidden 4096, 32 layers, 32 heads of 128, 8 KV heads,
# intermediate 14336, vocab 128256, untied lm_head).
L8_LAYERS, L8_HEADS, L8_HEAD_DIM = 32, 32, 128
L8_ATTN = 32 * (2 * 4096 * 4096 + 2 * 4096 * 8 * 128)  # q, o and k, v projections
L8_MLP = 32 * 3 * 4096 * 14336  # gate, up, down
L8_LM_HEAD = 128256 * 4096
L8_NORMS = (2 * 32 + 1) * 4096
L8_KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # layers x (K and V) x heads x dim x bf16


@pytest.fixture(scope="module")
def llama_h100():
    return CostModel.for_model("llama-3.1-8b", "h100-80gb")


def _roofline(flops, nbytes, peak=H100_BF16_DENSE_FLOPS, bw=H100_HBM_Bps):
    compute_s = flops / (peak * DEFAULT_FLOPS_EFFICIENCY)
    memory_s = nbytes / (bw * DEFAULT_BW_EFFICIENCY)
    return compute_s, memory_s, max(compute_s, memory_s) + DEFAULT_STEP_OVERHEAD_S


def test_default_assumptions_are_what_the_docs_say():
    assert (DEFAULT_FLOPS_EFFICIENCY, DEFAULT_BW_EFFICIENCY) == (0.7, 0.85)
    assert (DEFAULT_STEP_OVERHEAD_S, DEFAULT_TRANSFER_OVERHEAD_S) == (1e-3, 10e-6)


def test_llama8b_decode_at_context_1000_on_h100_is_memory_bound(llama_h100):
    b = llama_h100.breakdown([], [1000])
    linear = 2 * (L8_ATTN + L8_MLP) * 1 + 2 * L8_LM_HEAD * 1  # one token, one logit row
    attention = 4 * L8_LAYERS * L8_HEADS * L8_HEAD_DIM * 1000
    weights = 2 * (L8_ATTN + L8_MLP + L8_NORMS + L8_LM_HEAD)  # bf16, every weight read once
    kv = 1000 * L8_KV_BYTES_PER_TOKEN
    assert (b.linear_flops, b.attention_flops, b.weight_bytes, b.kv_bytes) == (linear, attention, weights, kv)
    assert linear == 15_009_316_864 and weights == 15_009_849_344 and kv == 131_072_000
    compute_s, memory_s, time_s = _roofline(linear + attention, weights + kv)
    assert b.compute_s == pytest.approx(compute_s, rel=1e-12)
    assert b.memory_s == pytest.approx(memory_s, rel=1e-12)
    assert b.bound == "memory" and memory_s > 100 * compute_s
    assert llama_h100.step_time([], [1000]) == pytest.approx(time_s, rel=1e-12)
    # ~15.14 GB at 0.85 x 3.35 TB/s = 5.317 ms, plus 1 ms overhead
    assert time_s == pytest.approx(6.317e-3, rel=1e-3)
    assert (b.prefill_tokens, b.decode_tokens, b.logit_rows) == (0, 1, 1)


def test_llama8b_prefill_of_8192_tokens_on_h100_is_compute_bound(llama_h100):
    b = llama_h100.breakdown([(8192, 0)], [])
    linear = 2 * (L8_ATTN + L8_MLP) * 8192 + 2 * L8_LM_HEAD * 1  # logits for the last token only
    pairs = 8192 * 8193 // 2  # token i attends to i + 1 positions (causal, itself included)
    attention = 4 * L8_LAYERS * L8_HEADS * L8_HEAD_DIM * pairs
    weights = 2 * (L8_ATTN + L8_MLP + L8_NORMS + L8_LM_HEAD)
    kv = 8192 * L8_KV_BYTES_PER_TOKEN  # the chunk's KV written once (nothing cached before)
    assert (b.linear_flops, b.attention_flops, b.weight_bytes, b.kv_bytes) == (linear, attention, weights, kv)
    compute_s, memory_s, time_s = _roofline(linear + attention, weights + kv)
    assert b.bound == "compute" and compute_s > 30 * memory_s
    assert b.time_s == pytest.approx(time_s, rel=1e-12)
    assert time_s == pytest.approx(0.19159, rel=1e-3)  # ~131.9 TFLOP at 692 TFLOP/s + 1 ms
    assert llama_h100.recompute_time(8192) == b.time_s


def test_chunked_prefill_attends_to_the_cached_context(llama_h100):
    b = llama_h100.breakdown([(512, 3000)], [])
    pairs = 512 * 3000 + 512 * 513 // 2
    assert b.attention_flops == 4 * L8_LAYERS * L8_HEADS * L8_HEAD_DIM * pairs
    assert b.kv_bytes == (3000 + 512) * L8_KV_BYTES_PER_TOKEN
    # A decode at context c is the same work as a one-token prefill after c - 1 cached tokens.
    dec, pre = llama_h100.breakdown([], [777]), llama_h100.breakdown([(1, 776)], [])
    assert (dec.flops, dec.bytes_moved, dec.time_s) == (pre.flops, pre.bytes_moved, pre.time_s)
    assert (dec.decode_tokens, dec.prefill_tokens, pre.decode_tokens, pre.prefill_tokens) == (1, 0, 0, 1)


def test_batches_add_up_and_empty_steps_are_free(llama_h100):
    single = llama_h100.breakdown([], [1000])
    batch = llama_h100.breakdown([(100, 0), (50, 20)], [1000] * 64)
    assert batch.decode_tokens == 64 and batch.prefill_tokens == 150 and batch.logit_rows == 66
    assert batch.weight_bytes == single.weight_bytes  # weights are read once per step, not per sequence
    assert batch.kv_bytes == 64 * single.kv_bytes + (100 + 70) * L8_KV_BYTES_PER_TOKEN
    assert single.time_s < batch.time_s < 64 * single.time_s
    empty = llama_h100.breakdown()
    assert empty.time_s == 0.0 and empty.bound == "idle" and llama_h100.step_time([], []) == 0.0
    assert llama_h100.recompute_time(0) == 0.0


def test_tensor_parallelism_splits_work_per_rank():
    cfg = load_model_config("llama-3.1-8b")
    tp2 = CostModel(cfg, KVSpec.from_hf_config(cfg, tp=2), get_profile("h100-80gb"))
    b = tp2.breakdown([], [1000])
    attn = 32 * (2 * 4096 * 2048 + 2 * 4096 * 4 * 128)  # 16 query heads, 4 KV heads per rank
    mlp = 32 * 3 * 4096 * 7168
    lm_head = 64128 * 4096
    assert b.linear_flops == 2 * (attn + mlp) + 2 * lm_head
    assert b.attention_flops == 4 * 32 * 16 * 128 * 1000
    assert b.weight_bytes == 2 * (attn + mlp + L8_NORMS + lm_head)
    assert b.kv_bytes == 1000 * L8_KV_BYTES_PER_TOKEN // 2


def test_moe_counts_active_experts_for_flops_but_all_experts_for_bytes():
    model = CostModel.for_model("deepseek-v3", "h200-141gb")
    p = model.params
    # 61 layers, the first 3 dense: 58 MoE layers with 256 routed experts, 8 active per token.
    idle = 58 * (256 - 8) * 3 * 7168 * 2048
    assert model.active_mlp_params == p.mlp - idle == p.mlp_active
    b = model.breakdown([], [1])
    assert b.linear_flops == 2 * (p.attention + p.mlp - idle) + 2 * p.embedding
    # fp8 matmul weights (one byte each) with fp32 scales per 128 x 128 block; the lm_head, norms and routers
    # are bf16, and the untied input embedding is not read by a decode step.
    from kvledger.core.sizing.params import weights_bytes_per_rank

    assert b.weight_bytes == weights_bytes_per_rank(model.cfg, 1) - 2 * p.embedding
    assert p.attention + p.mlp < b.weight_bytes < 1.01 * (p.attention + p.mlp + 2 * (p.norms + p.embedding))
    # DeepSeek-V3 publishes 37B activated parameters per token (embedding included).
    assert model.linear_params_per_token + model.lm_head_params + p.embedding == pytest.approx(37e9, rel=0.03)
    # MLA: decode attends in the absorbed latent space (512 + 64 for QK, 512 for V), prefill in
    # the decompressed heads (128 + 64, 128); the cache holds one 576-wide latent per token.
    assert model.breakdown([], [4001]).attention_flops - b.attention_flops == \
        2 * (576 + 512) * 128 * 61 * 4000
    assert model.breakdown([(1, 0)], []).attention_flops == 2 * (192 + 128) * 128 * 61
    assert model.breakdown([], [4001]).kv_bytes == 4001 * 61 * 576 * 2


def _brute_sliding(new, before, window):
    pairs = sum(min(p, window) for p in range(before + 1, before + new + 1))
    positions = range(before + 1, before + new + 1)
    touched = len({q for p in positions for q in range(max(1, p - window + 1), p + 1)})
    return pairs, touched


def test_sliding_window_layers_attend_to_at_most_the_window():
    model = CostModel.for_model("gemma-2-9b", "l4")  # 42 layers, 21 sliding with window 4096
    assert (model.full_layers, model.sliding_layers, model.window) == (21, 21, 4096)
    b = model.breakdown([], [10_000])
    per_pair = 2 * (256 + 256) * 16  # head_dim 256, 16 query heads
    assert b.attention_flops == per_pair * (21 * 10_000 + 21 * 4096)
    assert b.kv_bytes == (21 * 10_000 + 21 * 4096) * 2 * 8 * 256 * 2
    small = CostModel(load_model_config("gemma-2-9b"),
                      KVSpec(42, 8, 256, attention="hybrid", sliding_window=7, sliding_layers=21),
                      get_profile("l4"))
    for new, before in [(1, 0), (3, 2), (5, 10), (10, 0), (10, 3), (4, 6), (20, 30), (1, 6), (1, 7)]:
        pairs, touched = _brute_sliding(new, before, 7)
        full_pairs = new * before + new * (new + 1) // 2
        want = (21 * full_pairs + 21 * pairs, 21 * (before + new) + 21 * touched)
        assert small._attended(new, before) == want, (new, before)
    for c in (1, 6, 7, 8, 20):  # the decode fast path agrees with a one-token prefill
        dec, pre = small.breakdown([], [c]), small.breakdown([(1, c - 1)], [])
        assert (dec.attention_flops, dec.kv_bytes) == (pre.attention_flops, pre.kv_bytes)
    batch = small.breakdown([], [3, 9, 100])
    assert batch.attention_flops == 2 * (256 + 256) * 16 * (21 * (3 + 9 + 100) + 21 * (3 + 7 + 7))


def test_swap_and_recompute_times(llama_h100):
    gib = 2**30
    assert llama_h100.swap_time(gib, 4) == pytest.approx(4 * 10e-6 + gib / PCIE5_X16_Bps)
    assert llama_h100.swap_time(0, 0) == 0.0
    seq = llama_h100.kv_bytes_for_tokens(1000)
    assert seq == 63 * 16 * L8_KV_BYTES_PER_TOKEN  # 1000 tokens occupy 63 blocks of 16
    assert llama_h100.recompute_time(1000) == llama_h100.step_time([(1000, 0)], [])
    assert llama_h100.recompute_time(100, 900) == llama_h100.step_time([(100, 900)], [])
    for bad in ((-1, 1), (10, 0), (1.5, 1)):
        with pytest.raises(ConfigError):
            llama_h100.swap_time(*bad)


def test_bad_step_inputs_are_config_errors(llama_h100):
    for prefill, decode in [([(0, 5)], []), ([(5, -1)], []), ([5], []), ([(True, 0)], []), ([], [0]),
                            ([], [2.5]), ([], [5, True]), ([], ["7"])]:
        with pytest.raises(ConfigError):
            llama_h100.breakdown(prefill, decode)
    cfg = load_model_config("llama-3.1-8b")
    with pytest.raises(ConfigError, match="layers"):
        CostModel(cfg, KVSpec(16, 8, 128), get_profile("h100-80gb"))
    with pytest.raises(ConfigError, match="MLA"):
        CostModel(cfg, KVSpec(32, 1, 576, attention="mla", kv_lora_rank=512, rope_dim=64), get_profile("l4"))


# ---- device profiles ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a100-80gb", "h100-80gb", "h200-141gb", "l4"])
def test_gpu_profiles_come_from_the_datasheet_catalogue(name):
    profile, gpu = get_profile(name), GPUS[name]
    assert profile.name == name
    assert (profile.peak_flops, profile.mem_bandwidth_Bps, profile.host_link_Bps) == \
        (gpu.bf16_dense_flops, gpu.hbm_bandwidth_Bps, gpu.host_link_Bps)
    assert "datasheet" in profile.source and gpu.source in profile.source
    assert get_profile(name.upper()) == profile


def test_h100_profile_matches_the_datasheet():
    p = get_profile("h100-80gb")
    assert (p.peak_flops, p.mem_bandwidth_Bps, p.host_link_Bps) == (H100_BF16_DENSE_FLOPS, H100_HBM_Bps,
                                                                    PCIE5_X16_Bps)
    assert p.effective_flops == pytest.approx(989e12 * 0.7)
    assert p.effective_bandwidth_Bps == pytest.approx(3.35e12 * 0.85)


def test_cpu_local_profile_needs_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert cpu_profile_path() == tmp_path / "cpu-local.json"
    assert "cpu-local" in list_profiles()
    with pytest.raises(ConfigError, match="not calibrated yet"):
        get_profile("cpu-local")
    values = dict(peak_flops=2e11, mem_bandwidth_Bps=4e10, flops_efficiency=1.0, bw_efficiency=1.0,
                  step_overhead_s=2e-4, host_link_Bps=1e10, transfer_overhead_s=1e-6)
    (tmp_path / "cpu-local.json").write_text(json.dumps(values))
    profile = get_profile("cpu-local")
    assert profile.name == "cpu-local" and profile.peak_flops == 2e11 and str(tmp_path) in profile.source
    assert DeviceProfile.from_dict(profile.to_dict()) == profile
    model = CostModel.for_model("smollm2-135m", profile)
    assert model.step_time([], [10]) > 2e-4
    (tmp_path / "cpu-local.json").write_text(json.dumps(values | {"bw_efficiency": 1.5}))
    with pytest.raises(ConfigError, match="bw_efficiency"):
        load_cpu_profile()
    (tmp_path / "cpu-local.json").write_text(json.dumps(values | {"turbo": True}))
    with pytest.raises(ConfigError, match="unknown key"):
        load_cpu_profile()
    (tmp_path / "cpu-local.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_cpu_profile()
    with pytest.raises(ConfigError, match="unknown device profile"):
        get_profile("tpu-v5")


def test_attention_efficiency_prices_only_the_attention_flops(llama_h100):
    """A profile whose attention kernels run at a fraction of the projections' rate (a CPU's paged
    attention) makes attention FLOPs cost 1 / attention_efficiency times as much and nothing else; 1, the
    default and what every datasheet profile has, leaves the roofline unchanged; old profile files
    (no such key) read as 1."""
    base = llama_h100.profile
    assert base.attention_efficiency == 1.0
    slow = DeviceProfile(**{**base.to_dict(), "attention_efficiency": 0.1})
    slow_model = CostModel.for_model("llama-3.1-8b", slow)
    entries = [(2048, 6144)]
    fast_b, slow_b = llama_h100.breakdown(entries), slow_model.breakdown(entries)
    flops_rate = base.effective_flops
    assert fast_b.compute_s == pytest.approx((fast_b.linear_flops + fast_b.attention_flops) / flops_rate)
    assert slow_b.compute_s == pytest.approx((fast_b.linear_flops + 10 * fast_b.attention_flops) / flops_rate)
    assert slow_b.memory_s == fast_b.memory_s and slow_b.overhead_s == fast_b.overhead_s
    no_key = {k: v for k, v in base.to_dict().items() if k != "attention_efficiency"}
    assert DeviceProfile.from_dict(no_key).attention_efficiency == 1.0
    for bad in (0, -0.5, 1.5, float("nan"), "0.1", True):
        with pytest.raises(ConfigError, match="attention_efficiency"):
            DeviceProfile(**{**base.to_dict(), "attention_efficiency": bad})
