"""The GPU catalogue: memory as the driver reports it, beside the datasheet figure, with sources.

The data lives in `kvledger/data/gpus.json` (read through `importlib.resources`). Plans use
`memory_bytes`, the total the CUDA driver reports (`torch.cuda.mem_get_info()[1]`): that is the figure
vLLM multiplies by `gpu_memory_utilization`, and it is 1-8% below the datasheet capacity (an L4 sold as
24 GB reports 22.03 GiB; an H200 sold as 141 GB reports 139.81 GiB). Where no driver-reported figure is
published, the entry says so (`memory_from_datasheet`): its memory is the datasheet capacity, a little too
high, and `plan` and `gpus` print that beside it.
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
    """One accelerator. memory_bytes: what the driver reports as total (plans use this), or the datasheet
    capacity where `memory_from_datasheet` (no driver figure is published); datasheet_bytes: the marketing
    capacity; nvidia_smi_total_mib: nvidia-smi's total, None where none is published; aliases: extra short
    names `--gpu` takes for this entry (``h100`` is the SXM part though a PCIe and an NVL exist)."""

    name: str
    label: str
    memory_bytes: int
    datasheet_bytes: int
    datasheet_memory: str
    driver_source: str
    nvidia_smi_total_mib: int | None
    nvidia_smi_source: str
    hbm_bandwidth_Bps: float  # noqa: N815 -- unit suffix kept readable
    bf16_dense_flops: float  # dense (no sparsity) bf16 tensor-core peak
    host_link_Bps: float  # noqa: N815 -- PCIe, one direction
    source: str
    memory_from_datasheet: bool = False
    aliases: tuple[str, ...] = ()

    @property
    def memory_note(self) -> str | None:
        """One line saying the memory figure is the datasheet's, not the driver's; None when it is the driver's."""
        if not self.memory_from_datasheet:
            return None
        return (f"{self.name}: memory is the datasheet's {self.datasheet_memory}, not driver-reported (none is "
                f"published; drivers report 1-8% less)")

    def to_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self.__slots__}


def _positive(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"GPU catalogue: {what} must be a positive number, got {value!r}")
    return value


def _flag(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"GPU catalogue: {what} must be true or false, got {value!r}")
    return value


def _key(name: str) -> str:
    """A GPU name as the lookup compares it: lower case, words joined by '-', no vendor or 'tesla' prefix."""
    key = re.sub(r"[\s_]+", "-", name.strip().lower())
    for prefix in ("nvidia-", "tesla-"):
        key = key.removeprefix(prefix)
    return key


def _alias(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"GPU catalogue: an alias must be a non-empty string, got {value!r}")
    return _key(value)


def _gpu(row: dict[str, Any]) -> GPU:
    try:
        return GPU(
            name=str(row["name"]), label=str(row["label"]),
            memory_bytes=parse_bytes(row["driver_total"]),
            datasheet_bytes=parse_bytes(row["datasheet_memory"]), datasheet_memory=str(row["datasheet_memory"]),
            driver_source=str(row["driver_source"]),
            nvidia_smi_total_mib=(None if row["nvidia_smi_total_mib"] is None
                                  else int(_positive(row["nvidia_smi_total_mib"], "nvidia_smi_total_mib"))),
            nvidia_smi_source=str(row["nvidia_smi_source"]),
            hbm_bandwidth_Bps=float(_positive(row["hbm_bandwidth_Bps"], "hbm_bandwidth_Bps")),
            bf16_dense_flops=float(_positive(row["bf16_dense_flops"], "bf16_dense_flops")),
            host_link_Bps=float(_positive(row["host_link_Bps"], "host_link_Bps")),
            source=str(row["source"]),
            memory_from_datasheet=_flag(row.get("memory_from_datasheet", False), "memory_from_datasheet"),
            aliases=tuple(_alias(a) for a in row.get("aliases", ())),
        )
    except KeyError as exc:
        raise ConfigError(f"GPU catalogue entry {row.get('name', '?')!r} lacks {exc.args[0]!r}") from None


def _catalogue() -> dict[str, GPU]:
    text = resources.files("kvledger").joinpath("data", "gpus.json").read_text(encoding="utf-8")
    rows = json.loads(text)["gpus"]
    gpus = {gpu.name: gpu for gpu in map(_gpu, rows)}
    seen: dict[str, str] = {}
    for gpu in gpus.values():
        for alias in gpu.aliases:
            other = seen.setdefault(alias, gpu.name)
            if alias in gpus or other != gpu.name:  # one short name, one GPU: never two meanings
                raise ConfigError(f"GPU catalogue: alias {alias!r} of {gpu.name} is taken by "
                                  f"{alias if alias in gpus else other}")
    return gpus


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
    key = _key(text)
    if key in gpus:
        return key
    named = [g.name for g in gpus.values() if key in g.aliases]
    if len(named) == 1:
        return named[0]
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
