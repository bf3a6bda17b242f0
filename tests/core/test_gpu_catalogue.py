"""The GPU catalogue (src/kvledger/data/gpus.json): every entry carries the figures a plan reads and says
where its memory figure comes from -- a cited driver-reported total, or the datasheet's capacity, marked --
and the short names people type for the GPUs they rent find their entries."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from kvledger.core.sizing.gpus import GPUS, resolve_gpu_name
from kvledger.errors import ConfigError
from kvledger.units import parse_bytes

REQUIRED = ("name", "label", "datasheet_memory", "driver_total", "driver_source", "nvidia_smi_total_mib",
            "nvidia_smi_source", "hbm_bandwidth_Bps", "bf16_dense_flops", "host_link_Bps", "source")
RENTED = ("l40s", "a10g", "h100-pcie", "h100-nvl", "h20", "b200", "mi300x", "rtx4090")


def _rows() -> list[dict]:
    text = resources.files("kvledger").joinpath("data", "gpus.json").read_text(encoding="utf-8")
    return json.loads(text)["gpus"]


def test_the_gpus_people_rent_are_catalogued() -> None:
    assert set(RENTED) <= set(GPUS)


@pytest.mark.parametrize("row", _rows(), ids=lambda r: r["name"])
def test_every_entry_has_its_figures_and_says_where_its_memory_comes_from(row: dict) -> None:
    assert all(key in row for key in REQUIRED), [k for k in REQUIRED if k not in row]
    gpu = GPUS[row["name"]]
    assert 0 < gpu.memory_bytes <= parse_bytes(row["driver_total"])
    for rate in (gpu.hbm_bandwidth_Bps, gpu.bf16_dense_flops, gpu.host_link_Bps):
        assert rate > 0
    assert gpu.source.strip() and gpu.driver_source.strip() and gpu.nvidia_smi_source.strip()
    if gpu.memory_from_datasheet:
        # No driver figure is published: the plan uses the datasheet's capacity and says so in one line.
        assert row["driver_source"].startswith("datasheet")
        assert gpu.memory_bytes == gpu.datasheet_bytes
        assert gpu.memory_note and "\n" not in gpu.memory_note and "datasheet" in gpu.memory_note
    else:
        # A cited driver-reported total: the quoted figure is the one the catalogue holds, below the datasheet's.
        assert not row["driver_source"].startswith("datasheet") and gpu.memory_note is None
        assert row["driver_total"].removesuffix("GiB") in row["driver_source"], row["driver_source"]
        assert gpu.memory_bytes < max(gpu.datasheet_bytes, parse_bytes(row["datasheet_memory"].replace("GB", "GiB")))
        if gpu.nvidia_smi_total_mib is not None:  # nvidia-smi counts 0.3-0.8 GiB the driver does not hand out
            assert 0.3 * 2**30 < gpu.nvidia_smi_total_mib * 2**20 - gpu.memory_bytes < 2**30


@pytest.mark.parametrize("short, name", [
    ("l40s", "l40s"), ("NVIDIA L40S", "l40s"), ("a10g", "a10g"), ("NVIDIA A10G", "a10g"), ("A10", "a10"),
    ("h100-pcie", "h100-pcie"), ("NVIDIA H100 PCIe", "h100-pcie"), ("h100-nvl", "h100-nvl"),
    ("NVIDIA H100 NVL", "h100-nvl"), ("h20", "h20"), ("NVIDIA H20", "h20"), ("b200", "b200"), ("B200", "b200"),
    ("mi300x", "mi300x"), ("MI300X", "mi300x"), ("AMD Instinct MI300X", "mi300x"), ("rtx4090", "rtx4090"),
    ("4090", "rtx4090"), ("RTX 4090", "rtx4090"), ("NVIDIA GeForce RTX 4090", "rtx4090"),
    # h100 still means the SXM part, as it did before the PCIe and the NVL were catalogued
    ("h100", "h100-80gb"), ("H100", "h100-80gb"), ("h100-sxm", "h100-80gb"), ("NVIDIA H100 80GB HBM3", "h100-80gb"),
])
def test_short_names_find_their_entries(short: str, name: str) -> None:
    assert resolve_gpu_name(short) == name


def test_an_alias_never_means_two_gpus() -> None:
    seen: dict[str, str] = {}
    for gpu in GPUS.values():
        for alias in gpu.aliases:
            assert alias not in GPUS and seen.setdefault(alias, gpu.name) == gpu.name
    with pytest.raises(ConfigError, match="ambiguous: give one of h100-80gb, h100-pcie"):
        resolve_gpu_name("h100-80")
