"""Step-time cost model: how long one batched forward step takes on one tensor-parallel rank.

A roofline: a step moves `bytes` through HBM and executes `flops` on the tensor cores; it takes

    time_s = max(flops / (peak_flops * flops_efficiency),
                 bytes / (mem_bandwidth_Bps * bw_efficiency)) + step_overhead_s

i.e. compute and memory traffic are assumed to overlap perfectly, and whichever is slower sets the
pace. All quantities are per rank: every rank of the TP group does the same share in parallel.
Formulas, units and assumptions: docs/cost_model.md.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..core import checks
from ..core.sizing.geometry import KVSpec, config_int, dtype_bytes, state_geometry, text_config
from ..core.sizing.gpus import GPU, GPUS
from ..core.sizing.models import load_model_config
from ..core.sizing.params import count_parameters_per_rank, default_weight_dtype, weight_plan, weights_bytes_per_rank
from ..errors import ConfigError
from ..scheduler.host import TransferModel

# Defaults for the GPU profiles. These are assumptions, not datasheet numbers: large bf16 GEMMs
# typically reach ~70% of the dense tensor-core peak and streaming kernels ~85% of HBM bandwidth.
# Calibration replaces them (see the cpu-local profile).
DEFAULT_FLOPS_EFFICIENCY = 0.7
DEFAULT_BW_EFFICIENCY = 0.85
DEFAULT_STEP_OVERHEAD_S = 1e-3  # scheduling, sampling and launch cost of one step
DEFAULT_TRANSFER_OVERHEAD_S = 10e-6  # fixed cost of one host<->device copy (launch + sync)
# A disk tier behind the host on a GPU server: an NVMe drive's sequential rates and a file call's cost.
# Assumptions (no calibration on the GPUs): `kvledger calibrate` measures the link of this machine.
DEFAULT_DISK_WRITE_BPS = 3e9
DEFAULT_DISK_READ_BPS = 6e9
DEFAULT_DISK_OVERHEAD_S = 50e-6
DEFAULT_STAGING_BLOCKS = 32
LINK_KEYS = ("out_Bps", "out_overhead_s", "in_Bps", "in_overhead_s")

CPU_LOCAL = "cpu-local"
CPU_LOCAL_FILE = "cpu-local.json"
CACHE_ENV = "KVLEDGER_CACHE"


def _positive(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value <= 0:
        raise ConfigError(f"{what} must be a positive number, got {value!r}")
    return float(value)


def _non_negative(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{what} must be a non-negative number, got {value!r}")
    return float(value)


# ---- device profiles -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """What the cost model needs to know about one device (one rank).

    peak_flops: dense bf16 peak, FLOP/s. mem_bandwidth_Bps: device-memory bandwidth, bytes/s.
    flops_efficiency / bw_efficiency: the fraction of each peak a real step achieves, in (0, 1].
    step_overhead_s: fixed time added to every non-empty step. host_link_Bps: host<->device
    bandwidth in one direction (bytes/s); transfer_overhead_s: fixed time per swap transfer.
    seq_overhead_s: time added per sequence in a step (per-sequence launch, gather and sampling work
    that neither FLOPs nor bytes capture; large on a CPU, ~0 on a GPU with batched kernels).
    attention_efficiency: the attention kernels' FLOP rate as a fraction of the projections' (0, 1]: paged
    attention gathers its context block by block and runs small per-head products, far from a GEMM's rate
    on a CPU (``kvledger calibrate`` fits about 0.08 on an AVX2 core); 1 (the default) prices attention
    FLOPs like every other FLOP.
    links: per tier below the device (``host``, ``disk``), the link measured by ``kvledger calibrate``:
    ``out_Bps`` / ``out_overhead_s`` (device -> tier) and ``in_Bps`` / ``in_overhead_s`` (tier -> device),
    plus whatever the fit reports (``fit_rms_error_pct``...). A tier not listed falls back to the host link
    above (``host``) or to the assumed NVMe defaults (``disk``); see :meth:`link`.
    """

    name: str
    peak_flops: float
    mem_bandwidth_Bps: float  # noqa: N815 -- unit suffix kept readable
    flops_efficiency: float
    bw_efficiency: float
    step_overhead_s: float
    host_link_Bps: float  # noqa: N815
    transfer_overhead_s: float
    source: str
    seq_overhead_s: float = 0.0
    links: dict[str, dict[str, Any]] = field(default_factory=dict)
    attention_efficiency: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("device profile name must be a non-empty string")
        for key in ("peak_flops", "mem_bandwidth_Bps", "host_link_Bps"):
            object.__setattr__(self, key, _positive(getattr(self, key), f"{self.name}: {key}"))
        for key in ("flops_efficiency", "bw_efficiency", "attention_efficiency"):
            value = _positive(getattr(self, key), f"{self.name}: {key}")
            if value > 1:
                raise ConfigError(f"{self.name}: {key} must be in (0, 1], got {value!r}")
            object.__setattr__(self, key, value)
        for key in ("step_overhead_s", "transfer_overhead_s", "seq_overhead_s"):
            object.__setattr__(self, key, _non_negative(getattr(self, key), f"{self.name}: {key}"))
        if not isinstance(self.source, str):
            raise ConfigError(f"{self.name}: source must be a string")
        if not isinstance(self.links, dict):
            raise ConfigError(f"{self.name}: links must map tier names to link figures")
        links = {}
        for tier, figures in self.links.items():
            if not isinstance(tier, str) or not tier.isidentifier() or not isinstance(figures, dict):
                raise ConfigError(f"{self.name}: links[{tier!r}] must be an object of link figures")
            missing = [k for k in LINK_KEYS if k not in figures]
            if missing:
                raise ConfigError(f"{self.name}: link {tier!r} lacks {', '.join(missing)}")
            checked = dict(figures)
            for k in LINK_KEYS:
                check = _positive if k.endswith("Bps") else _non_negative
                checked[k] = check(figures[k], f"{self.name}: links.{tier}.{k}")
            links[tier] = checked
        object.__setattr__(self, "links", links)

    @property
    def effective_flops(self) -> float:
        """FLOP/s a step really gets: peak_flops x flops_efficiency."""
        return self.peak_flops * self.flops_efficiency

    @property
    def effective_bandwidth_Bps(self) -> float:  # noqa: N802
        """Bytes/s a step really gets: mem_bandwidth_Bps x bw_efficiency."""
        return self.mem_bandwidth_Bps * self.bw_efficiency

    def swap_time(self, nbytes: int, transfers: int = 1) -> float:
        """Seconds to move `nbytes` over the host link in `transfers` copies (one direction):
        transfers x transfer_overhead_s + nbytes / host_link_Bps. Zero bytes in zero transfers is 0."""
        checks.non_negative(nbytes, "swap bytes")
        checks.non_negative(transfers, "transfers")
        if nbytes and not transfers:
            raise ConfigError(f"moving {nbytes} bytes takes at least one transfer")
        return transfers * self.transfer_overhead_s + nbytes / self.host_link_Bps

    def link(self, tier: str, *, staging_blocks: int = DEFAULT_STAGING_BLOCKS, overlap: bool = True) -> TransferModel:
        """The link between the device and tier ``tier`` as a :class:`TransferModel` (per direction)."""
        figures = self.links.get(tier)
        if figures is not None:
            return TransferModel(link_Bps=figures["out_Bps"], overhead_s=figures["out_overhead_s"],
                                 in_link_Bps=figures["in_Bps"], in_overhead_s=figures["in_overhead_s"],
                                 staging_blocks=staging_blocks, overlap=overlap)
        if tier == "disk":
            return TransferModel(link_Bps=DEFAULT_DISK_WRITE_BPS, overhead_s=DEFAULT_DISK_OVERHEAD_S,
                                 in_link_Bps=DEFAULT_DISK_READ_BPS, staging_blocks=staging_blocks, overlap=overlap)
        return TransferModel(link_Bps=self.host_link_Bps, overhead_s=self.transfer_overhead_s,
                             staging_blocks=staging_blocks, overlap=overlap)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, origin: str = "device profile") -> DeviceProfile:
        """Build from a JSON object holding the field names above (name and source optional)."""
        if not isinstance(data, dict):
            raise ConfigError(f"{origin} must hold a JSON object, got {type(data).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ConfigError(f"{origin}: unknown key(s) {', '.join(unknown)} (known: {', '.join(names)})")
        values = {"name": CPU_LOCAL, "source": origin, "seq_overhead_s": 0.0, "links": {}, "attention_efficiency": 1.0,
                  **data}  # optional keys
        missing = [n for n in names if n not in values]
        if missing:
            raise ConfigError(f"{origin}: missing key(s) {', '.join(missing)}")
        try:
            return cls(**values)
        except ConfigError as exc:
            raise ConfigError(f"{origin}: {exc}") from None


def profile_from_gpu(gpu: GPU, **overrides: Any) -> DeviceProfile:
    """A profile from a catalogue GPU's datasheet numbers plus the default efficiencies/overheads."""
    values: dict[str, Any] = dict(
        name=gpu.name, peak_flops=gpu.bf16_dense_flops, mem_bandwidth_Bps=gpu.hbm_bandwidth_Bps,
        flops_efficiency=DEFAULT_FLOPS_EFFICIENCY, bw_efficiency=DEFAULT_BW_EFFICIENCY,
        step_overhead_s=DEFAULT_STEP_OVERHEAD_S, host_link_Bps=gpu.host_link_Bps,
        transfer_overhead_s=DEFAULT_TRANSFER_OVERHEAD_S,
        source=(f"{gpu.source}: dense bf16 peak, memory bandwidth and host link (one direction); "
                f"efficiencies and overheads are kvledger defaults (assumed, not measured)"),
    )
    values.update(overrides)
    return DeviceProfile(**values)


GPU_PROFILES: dict[str, DeviceProfile] = {name: profile_from_gpu(gpu) for name, gpu in GPUS.items()}


def cpu_profile_path() -> Path:
    """Where the calibrated cpu-local profile lives: $KVLEDGER_CACHE/cpu-local.json, else
    ~/.cache/kvledger/cpu-local.json."""
    base = os.environ.get(CACHE_ENV)
    folder = Path(base).expanduser() if base else Path.home() / ".cache" / "kvledger"
    return folder / CPU_LOCAL_FILE


def load_cpu_profile(path: str | Path | None = None) -> DeviceProfile:
    """The calibrated cpu-local profile; a clear `ConfigError` when it has not been calibrated yet."""
    path = Path(path) if path is not None else cpu_profile_path()
    if not path.is_file():
        raise ConfigError(
            f"device profile {CPU_LOCAL!r} is not calibrated yet: no file at {path} "
            f"(run the calibration first, or point ${CACHE_ENV} at the folder holding {CPU_LOCAL_FILE})"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read device profile {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}, "
                          f"column {exc.colno}") from None
    return DeviceProfile.from_dict(data, origin=str(path))


def list_profiles() -> list[str]:
    """Names `get_profile` knows (cpu-local only works once calibrated)."""
    return [*GPU_PROFILES, CPU_LOCAL]


def get_profile(name: str) -> DeviceProfile:
    """A device profile by name: a catalogue GPU (a100-80gb, h100-80gb, h200-141gb, l4) or cpu-local."""
    key = str(name).strip().lower()
    if key == CPU_LOCAL:
        return load_cpu_profile()
    profile = GPU_PROFILES.get(key)
    if profile is None:
        raise ConfigError(f"unknown device profile {name!r}; known: {', '.join(list_profiles())}")
    return profile


# ---- the step cost model ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepBreakdown:
    """Components of one step on one rank. FLOPs and bytes are exact integers; times are seconds."""

    prefill_tokens: int  # new prompt tokens computed this step (all prefill entries)
    decode_tokens: int  # one per decoding sequence
    logit_rows: int  # tokens whose logits are computed (one per prefill entry and per decode)
    linear_flops: int  # projections, MLP (active experts only) and lm_head
    attention_flops: int  # QK^T and AV over each token's context
    weight_bytes: int  # every weight on the rank, read once per step
    kv_bytes: int  # KV cache read for context, plus the new tokens' KV written (state layers: each state in, out)
    compute_s: float
    memory_s: float
    overhead_s: float

    @property
    def flops(self) -> int:
        return self.linear_flops + self.attention_flops

    @property
    def bytes_moved(self) -> int:
        return self.weight_bytes + self.kv_bytes

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.overhead_s

    @property
    def bound(self) -> str:
        """'compute' or 'memory' (which roofline term sets the time), 'idle' for an empty step."""
        if not self.prefill_tokens and not self.decode_tokens:
            return "idle"
        return "compute" if self.compute_s >= self.memory_s else "memory"


PrefillEntry = tuple[int, int]  # (new_tokens, context_before)


class CostModel:
    """Step time of a model with KV geometry `spec` (whose `tp` is the tensor-parallel degree) on
    `profile`. `weight_dtype` defaults to the checkpoint's serving dtype (fp8 for DeepSeek-V3)."""

    def __init__(self, model_cfg: dict[str, Any], spec: KVSpec, profile: DeviceProfile, *,
                 weight_dtype: str | None = None) -> None:
        if not isinstance(spec, KVSpec):
            raise ConfigError(f"spec must be a KVSpec, got {type(spec).__name__}")
        if not isinstance(profile, DeviceProfile):
            raise ConfigError(f"profile must be a DeviceProfile, got {type(profile).__name__}")
        cfg = text_config(model_cfg)
        self.cfg, self.spec, self.profile = cfg, spec, profile
        tp = spec.tp
        layers = config_int(cfg, "num_hidden_layers")
        if layers != spec.layers:
            raise ConfigError(f"spec has {spec.layers} layers but the model config has {layers}")
        mla = cfg.get("kv_lora_rank") is not None
        if mla != (spec.attention == "mla"):
            raise ConfigError(f"spec attention {spec.attention!r} does not match the model config "
                              f"({'MLA' if mla else 'no MLA'})")
        heads = config_int(cfg, "num_attention_heads")
        if heads % tp:
            raise ConfigError(f"tp={tp} must divide num_attention_heads ({heads})")
        self.heads_per_rank = heads // tp
        hidden = config_int(cfg, "hidden_size")

        params = count_parameters_per_rank(cfg, tp)
        self.params = params
        # Routed experts a token does not use do no FLOPs (Mixtral, Qwen-MoE, DeepSeek alike).
        self.active_mlp_params = params.mlp if params.mlp_active is None else params.mlp_active
        # Per-token matmul weights (embedding lookup is not a matmul); lm_head counted per logit row.
        self.linear_params_per_token = params.attention + self.active_mlp_params
        self.lm_head_params = params.embedding  # ceil(vocab / tp) x hidden, tied or not
        self.weight_dtype = weight_dtype or default_weight_dtype(cfg)
        # Read per step: every layer weight (all experts, in their stored format with scales), norms and
        # the lm_head matrix. The input embedding is only gathered row by row (negligible), so an untied
        # table is not counted.
        unread = params.embedding * dtype_bytes(weight_plan(cfg, weight_dtype).base) if params.lm_head else 0
        self.weight_bytes_per_step = weights_bytes_per_rank(cfg, tp, weight_dtype) - unread

        # Attention widths per head: FLOPs per (query token, context token) pair = 2*(qk + v).
        if mla:
            rope = config_int(cfg, "qk_rope_head_dim", minimum=0)
            # Prefill: decompressed K/V (nope+rope, v_head_dim). Decode: absorbed form over the latent.
            self.prefill_dims = (config_int(cfg, "qk_nope_head_dim") + rope, config_int(cfg, "v_head_dim"))
            self.decode_dims = (spec.kv_lora_rank + rope, spec.kv_lora_rank)
        else:
            head_dim = config_int(cfg, "head_dim", default=None) or hidden // heads
            self.prefill_dims = self.decode_dims = (head_dim, head_dim)
        # Mamba-2 / gated-delta-net layers attend to nothing: each sequence in a step reads and writes its fixed
        # state once per layer (`geometry.state_geometry`), and each token updates it (a multiply-add per state
        # element, then the output's read of it: 4 FLOPs per element).
        state = state_geometry(cfg, tp)
        self.state_layers = state.layers if state is not None else 0
        self.state_layer_bytes = state.layer_state_bytes if state is not None else 0
        self.state_flops_per_token = 4 * math.prod(state.ssm_shape) * self.state_layers if state is not None else 0
        self.full_layers = spec.layers - spec.sliding_layers - self.state_layers
        self.sliding_layers = spec.sliding_layers
        self.window = spec.sliding_window or 0
        self.kv_layer_bytes_per_token = spec.layer_bytes_per_token

    @classmethod
    def for_model(cls, model: str, device: str | DeviceProfile, *, tp: int = 1, kv_dtype: str | None = None,
                  block_size: int = 16, weight_dtype: str | None = None) -> CostModel:
        """Convenience: a bundled model name (or config path) and a profile name."""
        cfg = load_model_config(model)
        spec = KVSpec.from_hf_config(cfg, kv_dtype=kv_dtype, tp=tp, block_size=block_size, name=str(model))
        profile = device if isinstance(device, DeviceProfile) else get_profile(device)
        return cls(cfg, spec, profile, weight_dtype=weight_dtype)

    # -- per-entry counts --

    def _attended(self, new: int, before: int) -> tuple[int, int]:
        """(sum over the new tokens of positions attended, KV tokens touched) summed over layers.

        Token i (0-based) of a chunk attends to before + i + 1 positions on a full layer and to at
        most `window` on a sliding one. KV touched: the context read plus the chunk written, i.e.
        before + new on full layers and min(before + new, window - 1 + new) on sliding ones.
        """
        end = before + new
        pairs = self.full_layers * (new * before + new * (new + 1) // 2)
        kv = self.full_layers * end
        if self.sliding_layers:
            w = self.window
            first = before + 1
            if end <= w:
                s = new * (first + end) // 2
            elif first >= w:
                s = new * w
            else:
                s = (w - first + 1) * (first + w) // 2 + (end - w) * w
            pairs += self.sliding_layers * s
            kv += self.sliding_layers * min(end, w - 1 + new)
        return pairs, kv

    def breakdown(self, prefill_tokens: Sequence[PrefillEntry] = (), decode_contexts: Sequence[int] = ()
                  ) -> StepBreakdown:
        """Components of one step.

        prefill_tokens: (new_tokens >= 1, context_before >= 0) per prefilling sequence (a chunk of
        `new_tokens` computed on top of `context_before` cached tokens).
        decode_contexts: per decoding sequence, the context length c >= 1 its one new token attends
        to, itself included (the same work as a prefill entry (1, c - 1)).
        """
        pre_pairs = pre_kv = pre_tokens = n_prefill = 0
        for entry in prefill_tokens:
            try:
                new, before = entry
            except (TypeError, ValueError):
                raise ConfigError(f"prefill entries are (new_tokens, context_before), "
                                  f"got {entry!r}") from None
            checks.positive(new, "prefill new_tokens")
            checks.non_negative(before, "prefill context_before")
            pairs, kv = self._attended(new, before)
            pre_pairs += pairs
            pre_kv += kv
            pre_tokens += new
            n_prefill += 1
        # Decodes are the hot path (hundreds per step): sums instead of a call per sequence.
        # One token at context c: c pairs and c KV tokens on a full layer, min(c, window) on a sliding one.
        contexts = decode_contexts if isinstance(decode_contexts, list | tuple) else list(decode_contexts)
        n_decode = len(contexts)
        dec_pairs = 0
        if n_decode:
            if not all(type(c) is int for c in contexts):
                for c in contexts:
                    if isinstance(c, bool) or not isinstance(c, int):
                        raise ConfigError(f"decode context must be a positive integer, got {c!r}")
            if min(contexts) < 1:
                raise ConfigError(f"decode context must be a positive integer, got {min(contexts)!r}")
            dec_pairs = self.full_layers * sum(contexts)
            if self.sliding_layers:
                w = self.window
                dec_pairs += self.sliding_layers * sum(c if c < w else w for c in contexts)
        dec_kv = dec_pairs
        tokens = pre_tokens + n_decode
        if tokens == 0:
            return StepBreakdown(0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0)
        logit_rows = n_prefill + n_decode
        linear = 2 * self.linear_params_per_token * tokens + 2 * self.lm_head_params * logit_rows
        linear += self.state_flops_per_token * tokens
        qk, v = self.prefill_dims
        attention = 2 * (qk + v) * self.heads_per_rank * pre_pairs
        qk, v = self.decode_dims
        attention += 2 * (qk + v) * self.heads_per_rank * dec_pairs
        kv_bytes = (pre_kv + dec_kv) * self.kv_layer_bytes_per_token
        kv_bytes += 2 * self.state_layers * self.state_layer_bytes * logit_rows  # each sequence's states, in and out
        weight_bytes = self.weight_bytes_per_step
        profile = self.profile
        return StepBreakdown(
            prefill_tokens=pre_tokens, decode_tokens=n_decode, logit_rows=logit_rows,
            linear_flops=linear, attention_flops=attention, weight_bytes=weight_bytes, kv_bytes=kv_bytes,
            compute_s=(linear + attention / profile.attention_efficiency) / profile.effective_flops,
            memory_s=(weight_bytes + kv_bytes) / profile.effective_bandwidth_Bps,
            overhead_s=profile.step_overhead_s + profile.seq_overhead_s * (n_prefill + n_decode),
        )

    def step_time(self, prefill_tokens: Sequence[PrefillEntry] = (), decode_contexts: Sequence[int] = ()
                  ) -> float:
        """Seconds one step takes: max(compute_s, memory_s) + step_overhead_s + seq_overhead_s x sequences
        (0 for an empty step)."""
        return self.breakdown(prefill_tokens, decode_contexts).time_s

    def recompute_time(self, n_tokens: int, context_before: int = 0) -> float:
        """Seconds to recompute the KV of `n_tokens` (after `context_before` cached ones) as a step
        of its own; 0 for no tokens. Batched with other work its marginal cost is lower."""
        checks.non_negative(n_tokens, "n_tokens")
        return self.step_time([(n_tokens, context_before)], []) if n_tokens else 0.0

    def swap_time(self, nbytes: int, transfers: int = 1) -> float:
        """Seconds to copy `nbytes` between host and device in `transfers` copies (see DeviceProfile)."""
        return self.profile.swap_time(nbytes, transfers)

    def kv_bytes_for_tokens(self, n_tokens: int) -> int:
        """KV bytes of `n_tokens` on one rank as the block pool stores them (every layer, whole blocks);
        what a swap of that sequence moves."""
        return self.spec.pool_bytes_for_sequence(n_tokens)


__all__ = [
    "CACHE_ENV", "CPU_LOCAL", "DEFAULT_BW_EFFICIENCY", "DEFAULT_STAGING_BLOCKS", "LINK_KEYS",
    "DEFAULT_FLOPS_EFFICIENCY", "DEFAULT_STEP_OVERHEAD_S",
    "DEFAULT_TRANSFER_OVERHEAD_S", "GPU_PROFILES", "CostModel", "DeviceProfile", "StepBreakdown",
    "cpu_profile_path", "get_profile", "list_profiles", "load_cpu_profile", "profile_from_gpu",
]
