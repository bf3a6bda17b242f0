"""A catalogue GPU's device profile, as `--gpu NAME` and `profile_from_gpu` build it, and one step priced on it.

The profile is the datasheet's dense bf16 peak, HBM bandwidth and host link plus kvledger's default
efficiencies and overheads; overrides replace single fields (a user's own efficiency, a slower link). A
profile that lost its bandwidth or peak would price every step wrongly or not build at all, so both the
catalogue's profiles and a profile built afresh from a GPU are pinned here, and a step priced on it must not
depend on the container the decode contexts come in (a list, a tuple or a generator).
"""

from __future__ import annotations

import dataclasses

import pytest

from kvledger.core.sizing.gpus import GPUS
from kvledger.errors import ConfigError
from kvledger.sim.cost_model import (
    DEFAULT_BW_EFFICIENCY,
    DEFAULT_FLOPS_EFFICIENCY,
    DEFAULT_STEP_OVERHEAD_S,
    DEFAULT_TRANSFER_OVERHEAD_S,
    GPU_PROFILES,
    CostModel,
    DeviceProfile,
    get_profile,
    profile_from_gpu,
)

# The datasheet figures (FLOP/s, HBM B/s, host link B/s one way) each profile must carry: docs/cost_model.md.
DATASHEET = {
    "a100-40gb": (312e12, 1555e9, 32e9),
    "a100-80gb": (312e12, 2039e9, 32e9),
    "a10": (125e12, 600e9, 32e9),
    "h100-80gb": (989e12, 3350e9, 64e9),
    "h200-141gb": (989e12, 4800e9, 64e9),
    "l4": (121e12, 300e9, 32e9),
    "l40s": (362e12, 864e9, 32e9),
    "a10g": (125e12, 600e9, 32e9),  # the A10's: NVIDIA publishes no A10G datasheet
    "h100-pcie": (756e12, 2000e9, 64e9),
    "h100-nvl": (835e12, 3900e9, 64e9),
    "h20": (148e12, 4000e9, 64e9),
    "b200": (2250e12, 8000e9, 64e9),
    "mi300x": (1307e12, 5300e9, 64e9),
    "rtx4090": (165.2e12, 1008e9, 32e9),
}


@pytest.mark.parametrize("name", sorted(DATASHEET))
def test_a_profile_built_from_a_catalogue_gpu_carries_its_datasheet(name: str) -> None:
    """profile_from_gpu: the GPU's name, peak, bandwidth and link, kvledger's default efficiencies and overheads,
    and a source naming the datasheet -- the same profile `get_profile(name)` hands the simulator."""
    gpu = GPUS[name]
    profile = profile_from_gpu(gpu)
    assert isinstance(profile, DeviceProfile)
    peak, bandwidth, link = DATASHEET[name]
    assert (profile.name, profile.peak_flops, profile.mem_bandwidth_Bps, profile.host_link_Bps) == (
        name, peak, bandwidth, link)
    assert (profile.flops_efficiency, profile.bw_efficiency) == (DEFAULT_FLOPS_EFFICIENCY, DEFAULT_BW_EFFICIENCY)
    assert profile.step_overhead_s == DEFAULT_STEP_OVERHEAD_S
    assert profile.transfer_overhead_s == DEFAULT_TRANSFER_OVERHEAD_S
    assert (profile.seq_overhead_s, profile.attention_efficiency, profile.links) == (0.0, 1.0, {})
    assert profile.source.startswith(f"{gpu.source}: dense bf16 peak, memory bandwidth and host link")
    assert profile == GPU_PROFILES[name] == get_profile(name.upper())
    # What the simulator prices with: 70% of the peak, 85% of the bandwidth.
    assert profile.effective_flops == pytest.approx(peak * 0.7)
    assert profile.effective_bandwidth_Bps == pytest.approx(bandwidth * 0.85)


def test_overrides_replace_single_fields_of_a_gpu_profile() -> None:
    """A user's own efficiency or a slower host link replaces that field only; a bad override is refused."""
    h100 = GPUS["h100-80gb"]
    base = profile_from_gpu(h100)
    tuned = profile_from_gpu(h100, bw_efficiency=0.6, host_link_Bps=25e9, name="h100-pcie4")
    assert tuned == dataclasses.replace(base, bw_efficiency=0.6, host_link_Bps=25e9, name="h100-pcie4")
    assert (tuned.peak_flops, tuned.mem_bandwidth_Bps) == (989e12, 3350e9)
    with pytest.raises(ConfigError, match="bw_efficiency must be in"):
        profile_from_gpu(h100, bw_efficiency=1.5)


def test_a_decode_batch_is_priced_the_same_whatever_holds_its_contexts() -> None:
    """breakdown() takes the decode contexts as any iterable: a generator prices the same step as a list."""
    cost = CostModel.for_model("smollm2-135m", profile_from_gpu(GPUS["l4"]))
    contexts = [5, 70, 700, 4000]
    listed = cost.breakdown([(16, 32)], contexts)
    assert cost.breakdown([(16, 32)], tuple(contexts)) == listed
    assert cost.breakdown([(16, 32)], (c for c in contexts)) == listed
    assert cost.breakdown((), iter(contexts)) == cost.breakdown((), contexts)
    assert cost.step_time((), (c for c in contexts)) == cost.step_time((), contexts) > 0
    assert (listed.prefill_tokens, listed.decode_tokens, listed.logit_rows) == (16, 4, 5)
    with pytest.raises(ConfigError, match="decode context must be a positive integer"):
        cost.breakdown((), (c for c in (3, 0)))
