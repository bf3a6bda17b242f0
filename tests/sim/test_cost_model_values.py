"""The cost model's formulas against values worked out by hand (docs/cost_model.md).

One step's FLOPs, bytes and seconds follow from a handful of figures of the model (parameters per token,
the lm_head, heads, head widths, KV bytes per token and layer) and of the profile (peaks, efficiencies,
overheads). Each test below writes the arithmetic out for a small case -- chunked prefill over a cached
context, decodes, sliding-window layers in all three regimes, the overheads per step and per sequence,
the attention efficiency, swaps over each tier's link -- so a changed factor, bound or term is a wrong number.
"""

from __future__ import annotations

import pytest

from kvledger.errors import ConfigError
from kvledger.scheduler.host import TransferModel
from kvledger.sim.cost_model import (
    DEFAULT_DISK_OVERHEAD_S,
    DEFAULT_DISK_READ_BPS,
    DEFAULT_DISK_WRITE_BPS,
    CostModel,
    DeviceProfile,
)

# Round figures: 1e12 FLOP/s at 50%, 1e11 B/s at 80%, 2 ms per step, 0.1 ms per sequence, attention at 25%.
PROFILE = DeviceProfile(name="round", peak_flops=1e12, mem_bandwidth_Bps=1e11, flops_efficiency=0.5,
                        bw_efficiency=0.8, step_overhead_s=2e-3, seq_overhead_s=1e-4, host_link_Bps=1e9,
                        transfer_overhead_s=5e-6, attention_efficiency=0.25, source="by hand")

# SmolLM2-135M (30 layers, 9 query heads of 64, 3 KV heads, no sliding window): per token 26,542,080 attention
# and 79,626,240 MLP parameters, a tied 49,152 x 576 = 28,311,552 lm_head; KV 2 x 3 x 64 x 2 B = 768 B per
# token and layer; 269,030,016 weight bytes read per step.
LAYERS, HEADS, HEAD_DIM = 30, 9, 64
PER_TOKEN, LM_HEAD, KV_PER_TOKEN_LAYER, WEIGHT_BYTES = 26_542_080 + 79_626_240, 28_311_552, 768, 269_030_016


@pytest.fixture(scope="module")
def smol() -> CostModel:
    return CostModel.for_model("smollm2-135m", PROFILE)


def test_the_model_figures_the_formulas_use(smol: CostModel) -> None:
    assert (smol.full_layers, smol.sliding_layers, smol.heads_per_rank) == (LAYERS, 0, HEADS)
    assert smol.prefill_dims == smol.decode_dims == (HEAD_DIM, HEAD_DIM)
    assert (smol.linear_params_per_token, smol.lm_head_params) == (PER_TOKEN, LM_HEAD)
    assert (smol.kv_layer_bytes_per_token, smol.weight_bytes_per_step) == (KV_PER_TOKEN_LAYER, WEIGHT_BYTES)


def test_a_mixed_step_by_hand(smol: CostModel) -> None:
    """A 3-token chunk over 2 cached tokens, and decodes at contexts 5 and 7."""
    b = smol.breakdown([(3, 2)], [5, 7])
    # The chunk's tokens attend to 3, 4 and 5 positions (12 pairs) and touch 5 KV tokens, per layer;
    # the decodes 5 + 7 = 12 pairs and 12 KV tokens per layer.
    pairs = LAYERS * 12 + LAYERS * 12
    kv_tokens = LAYERS * 5 + LAYERS * 12
    tokens, rows = 3 + 2, 1 + 2
    linear = 2 * PER_TOKEN * tokens + 2 * LM_HEAD * rows
    attention = 2 * (HEAD_DIM + HEAD_DIM) * HEADS * pairs
    assert (b.prefill_tokens, b.decode_tokens, b.logit_rows) == (3, 2, 3)
    assert (b.linear_flops, b.attention_flops) == (linear, attention) == (1_231_552_512, 1_658_880)
    assert (b.weight_bytes, b.kv_bytes) == (WEIGHT_BYTES, kv_tokens * KV_PER_TOKEN_LAYER)
    assert b.flops == linear + attention and b.bytes_moved == WEIGHT_BYTES + 391_680
    compute = (linear + attention / 0.25) / (1e12 * 0.5)
    memory = (WEIGHT_BYTES + 391_680) / (1e11 * 0.8)
    assert b.compute_s == pytest.approx(compute, rel=1e-15) and b.memory_s == pytest.approx(memory, rel=1e-15)
    assert b.overhead_s == pytest.approx(2e-3 + 3 * 1e-4, rel=1e-15)
    assert b.compute_s == pytest.approx(0.002476376064, rel=1e-9)  # 1,238,188,032 / 5e11
    assert b.memory_s == pytest.approx(0.0033677712, rel=1e-9)  # 269,421,696 / 8e10
    assert b.bound == "memory"
    assert b.time_s == smol.step_time([(3, 2)], [5, 7]) == pytest.approx(memory + 2.3e-3, rel=1e-15)


def test_a_long_prefill_is_compute_bound_and_recompute_prices_it_alone(smol: CostModel) -> None:
    b = smol.breakdown([(4096, 0)], [])
    assert b.attention_flops == 2 * 128 * HEADS * LAYERS * (4096 * 4097 // 2)
    assert b.linear_flops == 2 * PER_TOKEN * 4096 + 2 * LM_HEAD
    assert b.bound == "compute" and b.time_s == pytest.approx(b.compute_s + 2e-3 + 1e-4, rel=1e-15)
    assert smol.recompute_time(4096) == b.time_s
    assert smol.recompute_time(100, 50) == smol.step_time([(100, 50)], [])
    assert smol.recompute_time(0, 50) == 0.0


def test_an_empty_step_costs_nothing(smol: CostModel) -> None:
    b = smol.breakdown([], [])
    assert b.bound == "idle" and b.time_s == 0.0 and smol.step_time() == 0.0
    assert (b.flops, b.bytes_moved, b.overhead_s) == (0, 0, 0.0)


def test_equal_compute_and_memory_is_called_compute_bound() -> None:
    """The bound is compute when the two terms tie (>=), as the docs define it."""
    flat = DeviceProfile(name="flat", peak_flops=1.0, mem_bandwidth_Bps=1.0, flops_efficiency=1.0,
                         bw_efficiency=1.0, step_overhead_s=0.0, host_link_Bps=1.0, transfer_overhead_s=0.0,
                         source="by hand")
    cost = CostModel.for_model("smollm2-135m", flat)
    b = cost.breakdown([], [1])
    cost.weight_bytes_per_step = b.flops - b.kv_bytes  # memory_s == compute_s
    assert cost.breakdown([], [1]).bound == "compute"
    cost.weight_bytes_per_step += 1
    assert cost.breakdown([], [1]).bound == "memory"


@pytest.mark.parametrize(("new", "before", "pairs", "kv"), [
    (3, 0, 1 + 2 + 3, 3),  # inside the window: positions 1, 2, 3
    (3, 2, 3 + 4 + 4, 5),  # across its edge: 3, then capped at 4 twice; KV min(5, 4 - 1 + 3)
    (2, 10, 4 + 4, 5),  # past it: every token sees 4; KV the window less one plus the chunk
    (1, 3, 4, 4),  # a token landing on the window's last position
])
def test_sliding_window_layers_by_hand(smol: CostModel, new: int, before: int, pairs: int, kv: int) -> None:
    """One full and one sliding layer of window 4: the full layer's pairs and KV plus the sliding one's."""
    cost = CostModel.for_model("smollm2-135m", PROFILE)
    cost.full_layers, cost.sliding_layers, cost.window = 1, 1, 4
    full_pairs = new * before + new * (new + 1) // 2
    assert cost._attended(new, before) == (full_pairs + pairs, before + new + kv)


def test_sliding_window_decodes_by_hand() -> None:
    cost = CostModel.for_model("smollm2-135m", PROFILE)
    cost.full_layers, cost.sliding_layers, cost.window = 2, 3, 4
    b = cost.breakdown([], [3, 4, 9])
    pairs = 2 * (3 + 4 + 9) + 3 * (3 + 4 + 4)
    assert b.attention_flops == 2 * 128 * HEADS * pairs
    assert b.kv_bytes == pairs * KV_PER_TOKEN_LAYER


def test_gemma2_alternates_full_and_sliding_layers() -> None:
    cost = CostModel.for_model("gemma-2-9b", PROFILE)
    assert (cost.full_layers, cost.sliding_layers, cost.window) == (21, 21, 4096)
    short, long = cost.breakdown([], [100]), cost.breakdown([], [10_000])
    per_pair = short.attention_flops // (42 * 100)
    assert long.attention_flops == per_pair * (21 * 10_000 + 21 * 4096)


def test_swaps_and_links_by_hand(smol: CostModel) -> None:
    assert PROFILE.swap_time(10**6, 4) == pytest.approx(4 * 5e-6 + 10**6 / 1e9, rel=1e-15)
    assert smol.swap_time(0, 0) == 0.0 and smol.swap_time(2**20) == pytest.approx(5e-6 + 2**20 / 1e9, rel=1e-15)
    for args, message in (((-1,), "swap bytes must be a non-negative integer, got -1"),
                          ((10, -1), "transfers must be a non-negative integer, got -1"),
                          ((10, 0), "moving 10 bytes takes at least one transfer"),
                          ((1.5,), "swap bytes must be a non-negative integer, got 1.5")):
        with pytest.raises(ConfigError) as err:
            PROFILE.swap_time(*args)
        assert str(err.value) == message
    assert smol.kv_bytes_for_tokens(17) == 2 * 16 * LAYERS * KV_PER_TOKEN_LAYER  # two whole 16-token blocks
    assert PROFILE.effective_flops == 5e11 and PROFILE.effective_bandwidth_Bps == 8e10
    host = PROFILE.link("host", staging_blocks=8, overlap=False)
    assert host == TransferModel(link_Bps=1e9, overhead_s=5e-6, staging_blocks=8, overlap=False)
    assert PROFILE.link("disk") == TransferModel(link_Bps=DEFAULT_DISK_WRITE_BPS, overhead_s=DEFAULT_DISK_OVERHEAD_S,
                                                 in_link_Bps=DEFAULT_DISK_READ_BPS, staging_blocks=32, overlap=True)
    assert (DEFAULT_DISK_WRITE_BPS, DEFAULT_DISK_READ_BPS, DEFAULT_DISK_OVERHEAD_S) == (3e9, 6e9, 50e-6)
    measured = DeviceProfile.from_dict({
        "peak_flops": 1e12, "mem_bandwidth_Bps": 1e11, "flops_efficiency": 1, "bw_efficiency": 1,
        "step_overhead_s": 0, "host_link_Bps": 1e9, "transfer_overhead_s": 0,
        "links": {"disk": {"out_Bps": 1e8, "out_overhead_s": 1e-3, "in_Bps": 2e8, "in_overhead_s": 2e-3,
                           "fit_rms_error_pct": 3.0}}})
    assert measured.link("disk", staging_blocks=4) == TransferModel(link_Bps=1e8, overhead_s=1e-3, in_link_Bps=2e8,
                                                                    in_overhead_s=2e-3, staging_blocks=4,
                                                                    overlap=True)
    assert measured.links["disk"]["fit_rms_error_pct"] == 3.0 and measured.name == "cpu-local"
    assert measured.link("host") == TransferModel(link_Bps=1e9, overhead_s=0.0, staging_blocks=32, overlap=True)


@pytest.mark.parametrize(("change", "message"), [
    ({"peak_flops": 0}, "round: peak_flops must be a positive number, got 0"),
    ({"mem_bandwidth_Bps": float("inf")}, "round: mem_bandwidth_Bps must be a positive number, got inf"),
    ({"host_link_Bps": True}, "round: host_link_Bps must be a positive number, got True"),
    ({"flops_efficiency": 1.01}, "round: flops_efficiency must be in (0, 1], got 1.01"),
    ({"bw_efficiency": 0}, "round: bw_efficiency must be a positive number, got 0"),
    ({"attention_efficiency": 2}, "round: attention_efficiency must be in (0, 1], got 2.0"),
    ({"step_overhead_s": -1e-9}, "round: step_overhead_s must be a non-negative number, got -1e-09"),
    ({"seq_overhead_s": float("nan")}, "round: seq_overhead_s must be a non-negative number, got nan"),
    ({"transfer_overhead_s": "1"}, "round: transfer_overhead_s must be a non-negative number, got '1'"),
    ({"name": ""}, "device profile name must be a non-empty string"),
    ({"source": 3}, "round: source must be a string"),
    ({"links": []}, "round: links must map tier names to link figures"),
    ({"links": {"nv me": {}}}, "round: links['nv me'] must be an object of link figures"),
    ({"links": {"disk": {"out_Bps": 1}}}, "round: link 'disk' lacks out_overhead_s, in_Bps, in_overhead_s"),
    ({"links": {"disk": {"out_Bps": 1, "out_overhead_s": 0, "in_Bps": 0, "in_overhead_s": 0}}},
     "round: links.disk.in_Bps must be a positive number, got 0"),
    ({"links": {"disk": {"out_Bps": 1, "out_overhead_s": -1, "in_Bps": 1, "in_overhead_s": 0}}},
     "round: links.disk.out_overhead_s must be a non-negative number, got -1"),
])
def test_a_bad_profile_figure_is_named(change: dict, message: str) -> None:
    values = {**PROFILE.to_dict(), **change}
    with pytest.raises(ConfigError) as err:
        DeviceProfile(**values)
    assert str(err.value) == message


def test_profile_files_name_their_origin() -> None:
    with pytest.raises(ConfigError) as err:
        DeviceProfile.from_dict([1], origin="p.json")
    assert str(err.value) == "p.json must hold a JSON object, got list"
    with pytest.raises(ConfigError) as err:
        DeviceProfile.from_dict({"peak_flops": 1, "colour": 2, "alpha": 3}, origin="p.json")
    assert str(err.value).startswith("p.json: unknown key(s) alpha, colour (known: name, peak_flops, ")
    with pytest.raises(ConfigError) as err:
        DeviceProfile.from_dict({"peak_flops": 1}, origin="p.json")
    assert str(err.value) == ("p.json: missing key(s) mem_bandwidth_Bps, flops_efficiency, bw_efficiency, "
                              "step_overhead_s, host_link_Bps, transfer_overhead_s")
    good = {k: v for k, v in PROFILE.to_dict().items() if k not in ("name", "source")}
    with pytest.raises(ConfigError) as err:
        DeviceProfile.from_dict({**good, "peak_flops": -1}, origin="p.json")
    assert str(err.value) == "p.json: cpu-local: peak_flops must be a positive number, got -1"
    assert DeviceProfile.from_dict(good, origin="p.json").source == "p.json"
