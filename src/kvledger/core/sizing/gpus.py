"""The GPU catalogue: memory as the driver reports it, beside the datasheet figure, with sources.

The data lives in `kvledger/data/gpus.json` (read through `importlib.resources`). Plans use
`memory_bytes`, the total the CUDA driver reports (`torch.cuda.mem_get_info()[1]`): that is the figure
vLLM multiplies by `gpu_memory_utilization`, and it is 1-8% below the datasheet capacity (an L4 sold as
24 GB reports 22.03 GiB; an H200 sold as 141 GB reports 139.81 GiB).
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from ...errors import ConfigError
from ...units import parse_bytes

GiB = 2**30


@dataclass(frozen=True, slots=True)
class GPU:
    """One accelerator. memory_bytes: what the driver reports as total (plans use this);
    datasheet_bytes: the marketing capacity; nvidia_smi_total_mib: nvidia-smi's total."""

    name: str
    label: str
    memory_bytes: int
    datasheet_bytes: int
    datasheet_memory: str
    driver_source: str
    nvidia_smi_total_mib: int
    nvidia_smi_source: str
    hbm_bandwidth_Bps: float  # noqa: N815 -- unit suffix kept readable
    bf16_dense_flops: float  # dense (no sparsity) bf16 tensor-core peak
    host_link_Bps: float  # noqa: N815 -- PCIe, one direction
    source: str

    def to_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self.__slots__}


def _positive(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"GPU catalogue: {what} must be a positive number, got {value!r}")
    return value


def _gpu(row: dict[str, Any]) -> GPU:
    try:
        return GPU(
            name=str(row["name"]), label=str(row["label"]),
            memory_bytes=parse_bytes(row["driver_total"]),
            datasheet_bytes=parse_bytes(row["datasheet_memory"]), datasheet_memory=str(row["datasheet_memory"]),
            driver_source=str(row["driver_source"]),
            nvidia_smi_total_mib=int(_positive(row["nvidia_smi_total_mib"], "nvidia_smi_total_mib")),
            nvidia_smi_source=str(row["nvidia_smi_source"]),
            hbm_bandwidth_Bps=float(_positive(row["hbm_bandwidth_Bps"], "hbm_bandwidth_Bps")),
            bf16_dense_flops=float(_positive(row["bf16_dense_flops"], "bf16_dense_flops")),
            host_link_Bps=float(_positive(row["host_link_Bps"], "host_link_Bps")),
            source=str(row["source"]),
        )
    except KeyError as exc:
        raise ConfigError(f"GPU catalogue entry {row.get('name', '?')!r} lacks {exc.args[0]!r}") from None


def _catalogue() -> dict[str, GPU]:
    text = resources.files("kvledger").joinpath("data", "gpus.json").read_text(encoding="utf-8")
    rows = json.loads(text)["gpus"]
    return {gpu.name: gpu for gpu in map(_gpu, rows)}


GPUS: dict[str, GPU] = _catalogue()


_FORM_FACTORS = {"sxm", "sxm4", "sxm5", "pcie", "nvl", "hbm2e", "hbm3", "hbm3e"}


def _fits(token: str, gpu: GPU) -> bool:
    """Whether one word of a short name (``80gb``, ``80``, ``sxm5``, ``hbm3``) agrees with a catalogue entry."""
    size = re.fullmatch(r"(\d+)(gb|g|gib)?", token)
    if size:
        return f"{size.group(1)}gb" in gpu.name or f"{size.group(1)}gb" in gpu.label.lower()
    if token in _FORM_FACTORS:
        words = {"sxm" if w in ("sxm4", "sxm5") else w for w in re.split(r"[^a-z0-9]+", gpu.label.lower())}
        return ("sxm" if token in ("sxm4", "sxm5") else token) in words
    return False


def resolve_gpu_name(name: str, catalogue: dict[str, GPU] | None = None) -> str:
    """The catalogue name a GPU name means: the name itself (any case), or a usual short form -- ``h100``,
    ``H100``, ``h100-sxm``, ``NVIDIA H100 80GB HBM3``, ``a100-80g`` -- when exactly one entry has that model
    and every other word (memory size, form factor) agrees with it. An ambiguous short name (``a100``) lists
    the candidates, an unknown one the closest names, each in one ConfigError."""
    gpus = GPUS if catalogue is None else catalogue
    text = str(name)[:60]
    key = re.sub(r"[\s_]+", "-", text.strip().lower()).removeprefix("nvidia-").removeprefix("tesla-")
    if key in gpus:
        return key
    model, *rest = key.split("-") if key else [""]
    candidates = [g.name for g in gpus.values() if g.name.split("-")[0] == model and all(_fits(t, g) for t in rest)]
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        raise ConfigError(f"GPU {text!r} is ambiguous: give one of {', '.join(candidates)}")
    close = difflib.get_close_matches(key, list(gpus), n=3, cutoff=0.5)
    hint = f"closest: {', '.join(close)}; " if close else ""
    raise ConfigError(f"unknown GPU {text!r}; {hint}known GPUs are: {', '.join(gpus)}")


def get_gpu(name: str) -> GPU:
    """Look a GPU up by catalogue name or a usual short form (:func:`resolve_gpu_name`)."""
    return GPUS[resolve_gpu_name(name)]


__all__ = ["GPU", "GPUS", "get_gpu", "resolve_gpu_name"]
