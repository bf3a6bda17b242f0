"""Tests written because mutants of the memory planner (``core/params``, ``core/inventory``,
``core/engines``, ``core/geometry``, ``core/models``) drawn by ``tests/mutation.py sample`` (seed 6)
survived the suite. Each pins down something a caller of the planner can see -- a byte figure, a
default, a size limit, an error and its message -- that no other test checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvledger.core.engines import load_measured_peaks
from kvledger.core.geometry import KVSpec
from kvledger.core.inventory import build_inventory
from kvledger.core.models import load_model_config
from kvledger.core.params import WeightFormat
from kvledger.errors import ConfigError


def hand_inventory(**kwargs):
    """A plan from geometry given by hand (no model config): 2 layers, 1 KV head of 4, an 8 GiB device."""
    return build_inventory(KVSpec(2, 1, 4), device_bytes="8GiB", params=1000, **kwargs)


# ---- core.engines ------------------------------------------------------------------------------------


def test_a_peaks_file_over_4_mib_is_refused(tmp_path: Path) -> None:
    """A peaks file one byte past 4 MiB is refused as too large, even when it is valid JSON."""
    head = b'{"peaks": []}'
    path = tmp_path / "peaks.json"
    path.write_bytes(head + b" " * (4 * 2**20 + 1 - len(head)))
    with pytest.raises(ConfigError, match="larger than 4 MiB"):
        load_measured_peaks(path)


# ---- core.geometry -----------------------------------------------------------------------------------


@pytest.mark.parametrize("rope_dim", [2.0, True])
def test_mla_rope_dim_must_be_an_integer(rope_dim: object) -> None:
    """An MLA spec with a float or boolean rope_dim is refused with a message naming rope_dim."""
    with pytest.raises(ConfigError, match="rope_dim must be a non-negative integer"):
        KVSpec(2, 1, 6, attention="mla", kv_lora_rank=4, rope_dim=rope_dim)  # type: ignore[arg-type]


def test_hybrid_attention_defaults_to_every_other_layer_sliding() -> None:
    """attention='hybrid' without sliding_layers slides layers 0, 2, 4 of 5: (5 + 1) // 2 = 3."""
    spec = KVSpec(5, 2, 4, attention="hybrid", sliding_window=8)
    assert spec.sliding_layers == 3


# ---- core.inventory ----------------------------------------------------------------------------------


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


# ---- core.models -------------------------------------------------------------------------------------


def test_a_deeply_nested_model_config_says_so(tmp_path: Path) -> None:
    """A config.json nested 100,000 deep is refused with a message naming the file and the nesting."""
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match="config.json is nested too deeply to be a model config"):
        load_model_config(path)


# ---- core.params -------------------------------------------------------------------------------------


def test_zero_points_take_whole_bytes_apart_from_fractional_scales() -> None:
    """A format with one 4-bit scale (0.5 B) and one 4-bit zero point per tensor: a 1 x 1 weight takes
    1 byte of data, 0.5 B of scale and a whole byte of zero point: ceil(1 + 0.5 + 1) = 3 bytes."""
    fmt = WeightFormat("q4-tiny-scale", 4, -1, 0.5, zero_bits=4)
    assert fmt.linear_bytes(1, 1) == 3
