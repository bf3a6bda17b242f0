"""What a serving engine leaves for the KV cache: one term per use of device memory, with its formula.

Two engines, chosen by name from `ENGINES`:

* `vllm` -- what vLLM's V1 engine (v0.10/v0.11) does at start-up. `Worker.determine_available_memory`
  runs a profile step and sets
      kv_cache = total x gpu_memory_utilization - weights - torch peak increase - non-torch increase
  `vllm_terms` models each of those terms from the model config (formulas and sources in each
  `Term`); CUDA graphs are captured after the KV cache is allocated, so their memory comes out of the
  (1 - utilization) headroom, not the KV budget, and is reported as such.
* `kvledger` -- our own runtime. The activation workspace is a peak *measured* on our runtime for this
  model, dtype and step shape when `data/measured_peaks.json` (or a `peaks` file) has one, else the
  `workspace_peak_bytes` formula; a 1 GiB runtime reserve covers the CUDA context and libraries.

Everything is per rank and in bytes. Pure standard library.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from .geometry import KVSpec, config_int, default_dtype, dtype_bytes, text_config
from .kv_formats import KV_FORMATS, KVFormat, vllm_serves
from .params import moe_layout, weight_plan, weights_bytes_per_rank

GiB = 2**30


@dataclass(frozen=True, slots=True)
class Term:
    """One use of device memory on one rank. `in_budget`: subtracted from the utilization budget
    (False: it must fit in the headroom outside the budget)."""

    key: str
    label: str
    bytes: int
    formula: str
    source: str
    in_budget: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self.__slots__}


# ---- vLLM -------------------------------------------------------------------------------------------

VLLM_VERSION = "vLLM V1 engine, v0.10-v0.11"
# torch's allocator peak while vLLM's sampler warms up on the profile batch, in bytes per logit element
# (max_num_seqs x vocab): bf16 logits 2 + fp32 copy 4 + sorted values 4 + int64 sort indices 8 + the
# segmented sort's scratch 20 (an int64 index input and cub's double buffers for keys and values).
SAMPLER_BYTES_PER_LOGIT = 38
# Non-torch memory (NCCL and custom all-reduce buffers, cuBLAS workspaces) that vLLM measures during
# the profile run, by TP degree: 0.13 GiB (tp=1) and 0.54-0.55 GiB (tp=2) in llm-d's H100 logs; 0.95 GiB
# at tp=4 (a public B200 vLLM log); 1.63 GiB is the largest figure we found for tp=8, rounded up.
NON_TORCH_BY_TP = ((1, int(0.13 * GiB)), (2, int(0.55 * GiB)), (4, int(0.95 * GiB)), (8, int(1.7 * GiB)))
# CUDA graphs: llm-d measured -0.88 .. +1.03 GiB on H100; captured after the KV cache, from the headroom.
CUDAGRAPH_ALLOWANCE = int(1.03 * GiB)
# Used before vLLM starts (CUDA context, driver): 79.18 - 78.57 GiB free on an idle H100 in llm-d's logs.
CUDA_CONTEXT = int(0.61 * GiB)
VLLM_VOCAB_PAD = 64  # VocabParallelEmbedding pads the vocabulary to a multiple of 64
LLMD_SOURCE = ("llm-d config explorer, empirical vLLM v0.11 memory logs on H100 (79.18 GiB): Llama-3.1-8B "
               "4.76 GiB, Qwen3-0.6B 5.56, Qwen3-32B 5.64 (tp 1 and 2), Llama-3.3-70B tp2 4.84, gpt-oss-20b 7.38")


@dataclass(frozen=True, slots=True)
class BatchDefaults:
    max_num_batched_tokens: int
    max_num_seqs: int
    reason: str


def vllm_batch_defaults(device_bytes: int | None, device_name: str = "", *, offline: bool = False
                        ) -> BatchDefaults:
    """vLLM's default `max_num_batched_tokens` / `max_num_seqs` for a GPU (EngineArgs batch defaults):
    at least 70 GiB and not an A100 -> 8192 tokens (16384 for the offline `LLM` class) and 1024 sequences;
    otherwise 2048 tokens (8192 offline) and 256 sequences."""
    large = device_bytes is not None and device_bytes >= 70 * GiB and "a100" not in device_name.lower()
    if large:
        tokens = 16384 if offline else 8192
        return BatchDefaults(tokens, 1024, "vLLM default for GPUs of >= 70 GiB other than the A100")
    tokens = 8192 if offline else 2048
    return BatchDefaults(tokens, 256, "vLLM default for GPUs under 70 GiB and the A100")


def non_torch_bytes(tp: int) -> int:
    """vLLM's measured non-torch increase for a TP degree (the next tabulated degree up)."""
    for degree, nbytes in NON_TORCH_BY_TP:
        if tp <= degree:
            return nbytes
    return NON_TORCH_BY_TP[-1][1]


def _rotary_cache_bytes(cfg: dict[str, Any], act: int) -> int:
    """vLLM's shared rotary cos/sin cache: max_position_embeddings x rotary_dim in the model dtype."""
    max_pos = config_int(cfg, "max_position_embeddings", default=0, minimum=0)
    if cfg.get("kv_lora_rank") is not None:
        rot = config_int(cfg, "qk_rope_head_dim", minimum=0)
    else:
        heads = config_int(cfg, "num_attention_heads")
        head_dim = config_int(cfg, "head_dim", default=None) or config_int(cfg, "hidden_size") // heads
        factor = cfg.get("partial_rotary_factor") or 1.0
        rot = int(head_dim * factor) if isinstance(factor, int | float) and 0 < factor <= 1 else head_dim
    return max_pos * rot * act


def _forward_width(cfg: dict[str, Any], tp: int) -> tuple[int, str]:
    """Per-token widths (elements) of the largest transient of one decoder layer on one rank."""
    hidden = config_int(cfg, "hidden_size")
    heads = config_int(cfg, "num_attention_heads")
    if cfg.get("kv_lora_rank") is not None:
        qk = config_int(cfg, "qk_nope_head_dim") + config_int(cfg, "qk_rope_head_dim", minimum=0)
        per = heads // tp if heads % tp == 0 else -(-heads // tp)
        attention = per * (2 * qk + 2 * config_int(cfg, "v_head_dim"))
    else:
        spec = KVSpec.from_hf_config(cfg, tp=tp)
        q = (heads // tp if heads % tp == 0 else -(-heads // tp)) * spec.head_dim
        attention = 2 * q + 2 * spec.kv_heads_per_rank * spec.head_dim  # q, k, v and the attention output
    moe = moe_layout(cfg)
    if moe:
        inter = -(-moe["expert_inter"] // tp)
        # fused MoE: gate_up, activation and down outputs for each of the top-k copies of a token
        mlp = moe["top_k"] * (3 * inter + hidden) + moe["experts"]
        if moe["shared_inter"]:
            mlp += 3 * -(-moe["shared_inter"] // tp)
    else:
        mlp = 3 * -(-config_int(cfg, "intermediate_size") // tp)  # gate_up (2I) and the activation (I)
    return max(attention, mlp), ("attention" if attention >= mlp else "mlp")


def vllm_terms(cfg: dict[str, Any], spec: KVSpec, *, tp: int, weight_dtype: str | None = None,
               max_num_batched_tokens: int, max_num_seqs: int, batch_reason: str = "") -> list[Term]:
    """The terms vLLM subtracts from `total x utilization` before the KV cache (see the module doc)."""
    cfg = text_config(cfg)
    act = dtype_bytes(default_dtype(cfg))
    T, hidden = max_num_batched_tokens, config_int(cfg, "hidden_size")
    N = min(max_num_seqs, T)
    vocab = config_int(cfg, "vocab_size")
    plan = weight_plan(cfg, weight_dtype)
    weights = weights_bytes_per_rank(cfg, tp, weight_dtype, vocab_pad=VLLM_VOCAB_PAD)
    rope = _rotary_cache_bytes(cfg, act)
    sampler = SAMPLER_BYTES_PER_LOGIT * N * vocab
    resident = 2 * T * hidden * act
    width, where = _forward_width(cfg, tp)
    forward = T * (2 * hidden + width) * act
    peak = max(forward, sampler + resident)
    which = "sampler warm-up" if sampler + resident >= forward else f"forward ({where})"
    shape = f"T = max_num_batched_tokens {T:,}, N = min(max_num_seqs, T) = {N:,}" + \
        (f" ({batch_reason})" if batch_reason else "")
    return [
        Term("weights", "weights (model loading)", weights + rope,
             f"every weight on this rank in {plan.name} (vocabulary padded to a multiple of 64) + the rotary "
             f"cos/sin cache max_position x rotary_dim x {act} B = {rope:,} B",
             "vLLM gpu_model_runner.load_model: model_memory_usage is the memory the loaded model takes"),
        Term("activation", "peak activation (profile run)", peak,
             f"max(forward, sampler + resident) = {which}; sampler = N x vocab x {SAMPLER_BYTES_PER_LOGIT} B = "
             f"{sampler:,}; resident = 2 x T x hidden x {act} B = {resident:,}; forward = T x (2 x hidden + "
             f"widest {where} width {width:,}) x {act} B = {forward:,}; {shape}",
             "vLLM Worker.determine_available_memory / GPUModelRunner.profile_run and _dummy_sampler_run (top-k "
             "and top-p sampling of N dummy requests, PyTorch-native sampler); checked against " + LLMD_SOURCE),
        Term("non_torch", "non-torch memory", non_torch_bytes(tp),
             f"measured increase by TP degree: {', '.join(f'tp<={d}: {b / GiB:.2f} GiB' for d, b in NON_TORCH_BY_TP)}",
             "llm-d's vLLM logs (tp 1, 2) and public vLLM logs (tp 4, 8); NCCL and custom all-reduce buffers"),
        Term("cuda_graphs", "CUDA graphs (from the headroom)", CUDAGRAPH_ALLOWANCE,
             "captured after the KV cache is allocated, so not subtracted from it; allowance = the largest "
             "published figure, 1.03 GiB",
             "vLLM Worker.compile_or_warm_up_model; llm-d measured -0.88 to +1.03 GiB on H100", in_budget=False),
        Term("cuda_context", "CUDA context (from the headroom)", CUDA_CONTEXT,
             "memory in use before vLLM starts: 79.18 - 78.57 GiB free on an idle H100",
             "llm-d's vLLM logs ('Free memory on device 78.57/79.18 GiB on startup')", in_budget=False),
    ]


# ---- our own runtime: measured peaks ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MeasuredPeak:
    """A peak activation workspace measured on kvledger's runtime for one model, dtype and step shape."""

    model: str
    dtype: str
    tp: int
    max_batched_tokens: int
    max_seqs: int
    peak_bytes: int
    device: str
    source: str

    def to_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self.__slots__}


def _peak(row: Any, origin: str) -> MeasuredPeak:
    if not isinstance(row, dict):
        raise ConfigError(f"{origin}: every entry of 'peaks' must be a JSON object")
    try:
        peak = MeasuredPeak(str(row["model"]), str(row["dtype"]), int(row.get("tp", 1)),
                            int(row["max_batched_tokens"]), int(row["max_seqs"]), int(row["peak_bytes"]),
                            str(row.get("device", "?")), str(row.get("source", origin)))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{origin}: a peak entry lacks or mistypes {exc}") from None
    for name in ("tp", "max_batched_tokens", "max_seqs", "peak_bytes"):
        value = getattr(peak, name)
        if not 1 <= value <= 2**60:
            raise ConfigError(f"{origin}: {name} must be in [1, 2**60], got {value}")
    return peak


def load_measured_peaks(path: str | Path | None = None) -> list[MeasuredPeak]:
    """The measured peaks: `kvledger/data/measured_peaks.json`, or a file of the same schema:
    `{"peaks": [{"model", "dtype", "tp", "max_batched_tokens", "max_seqs", "peak_bytes", "device",
    "source"}, ...]}`."""
    if path is None:
        text = resources.files("kvledger").joinpath("data", "measured_peaks.json").read_text(encoding="utf-8")
        origin = "measured_peaks.json"
    else:
        origin = str(path)
        try:
            raw = Path(path).read_bytes()
            if len(raw) > 4 * 2**20:
                raise ConfigError(f"{origin}: larger than 4 MiB")
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read peaks file {origin}: {exc}") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{origin} is not valid JSON: {str(exc)[:120]}") from None
    rows = data.get("peaks") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ConfigError(f"{origin} must hold a JSON object with a 'peaks' list")
    return [_peak(row, origin) for row in rows]


def find_peak(model: str, dtype: str, *, tp: int, max_batched_tokens: int, max_seqs: int,
              peaks: Sequence[MeasuredPeak] | None = None) -> MeasuredPeak | None:
    """The measured peak for this model, dtype and TP degree at this step shape: an exact shape, else the
    smallest measured shape that covers it (at least as many tokens and sequences: an upper bound), else
    None (the caller falls back to the formula)."""
    rows = load_measured_peaks() if peaks is None else peaks
    name = str(model).strip().lower()
    fits = [p for p in rows if p.model.lower() == name and p.dtype == dtype and p.tp == tp
            and p.max_batched_tokens >= max_batched_tokens and p.max_seqs >= max_seqs]
    if not fits:
        return None
    return min(fits, key=lambda p: (p.max_batched_tokens, p.max_seqs, p.peak_bytes))


def workspace_peak_bytes(
    cfg: dict[str, Any], tp: int = 1, max_batched_tokens: int = 8192, max_seqs: int = 256,
    act_dtype_bytes: int = 2,
) -> int:
    """Estimate the largest transient memory of one forward step of kvledger's runtime on one rank.

    With T = max_batched_tokens, H = hidden_size and per-rank widths:

        attention = T * (q + k + v + H)          q/k/v projection outputs plus o_proj's output
        mlp       = T * (2 * I + H)              gate and up outputs plus down's output
        peak      = max(attention, mlp) * act_dtype_bytes + max_seqs * ceil(vocab / tp) * 4

    I is intermediate_size / tp (for MoE the width the top-k routed and the shared experts of one
    token add up to, if larger). Logits are counted in fp32 because samplers upcast them. Logits and
    layer activations do not coexist, so adding them over-estimates on purpose: an estimate should
    never over-promise the KV pool.
    """
    for value, what in ((tp, "tp"), (max_batched_tokens, "max_batched_tokens"), (max_seqs, "max_seqs"),
                        (act_dtype_bytes, "act_dtype_bytes")):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**40:
            raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    cfg = text_config(cfg)
    hidden = config_int(cfg, "hidden_size")
    heads = config_int(cfg, "num_attention_heads")
    if heads % tp:
        raise ConfigError(f"tp={tp} must divide num_attention_heads ({heads})")
    heads //= tp
    if cfg.get("kv_lora_rank") is not None:
        qk = config_int(cfg, "qk_nope_head_dim") + config_int(cfg, "qk_rope_head_dim", minimum=0)
        q = k = heads * qk
        v = heads * config_int(cfg, "v_head_dim")
    else:
        spec = KVSpec.from_hf_config(cfg, tp=tp)
        q = heads * spec.head_dim
        k = v = spec.kv_heads_per_rank * spec.head_dim
    inter = config_int(cfg, "intermediate_size")
    moe = moe_layout(cfg)
    if moe:
        inter = max(inter if moe["style"] == "deepseek" else 0,
                    moe["top_k"] * moe["expert_inter"] + moe["shared_inter"])
    attention = max_batched_tokens * (q + k + v + hidden)
    mlp = max_batched_tokens * (2 * -(-inter // tp) + hidden)
    logits = max_seqs * -(-config_int(cfg, "vocab_size") // tp) * 4
    return max(attention, mlp) * act_dtype_bytes + logits


def kvledger_terms(cfg: dict[str, Any], *, tp: int, model: str | None, weight_dtype: str | None,
                   max_batched_tokens: int, max_seqs: int, reserve_bytes: int,
                   peaks: Sequence[MeasuredPeak] | None = None) -> list[Term]:
    """Weights, workspace (measured where we have it, else the formula) and the runtime reserve."""
    plan = weight_plan(cfg, weight_dtype)
    weights = weights_bytes_per_rank(cfg, tp, weight_dtype)
    act = dtype_bytes(default_dtype(text_config(cfg)))
    measured = None
    if model is not None:
        measured = find_peak(model, default_dtype(text_config(cfg)), tp=tp, max_batched_tokens=max_batched_tokens,
                             max_seqs=max_seqs, peaks=peaks)
    if measured is not None:
        workspace = Term("workspace", "activation workspace (measured)", measured.peak_bytes,
                         f"peak measured on kvledger's runtime: {measured.model} {measured.dtype} tp={measured.tp}, "
                         f"{measured.max_batched_tokens} tokens / {measured.max_seqs} sequences per step, "
                         f"on {measured.device}", f"measured: {measured.source}")
    else:
        workspace = Term("workspace", "activation workspace (formula)",
                         workspace_peak_bytes(cfg, tp, max_batched_tokens, max_seqs, act),
                         f"max(attention, mlp) x {act} B + max_seqs x ceil(vocab / tp) x 4 B with "
                         f"{max_batched_tokens:,} tokens and {max_seqs:,} sequences per step",
                         "formula: kvledger workspace_peak_bytes (no measured peak for this model, dtype and shape)")
    return [
        Term("weights", "weights", weights, f"every weight on this rank in {plan.name}", plan.source),
        workspace,
        Term("reserve", "runtime reserve", reserve_bytes, "CUDA context, libraries and allocator slack",
             "kvledger default (--reserve)"),
    ]


ENGINES = ("vllm", "kvledger")


def check_engine(name: Any) -> str:
    if name not in ENGINES:
        raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {name!r}")
    return name


def check_engine_kv_format(engine: str, fmt: KVFormat) -> None:
    """Refuse to plan a KV format for an engine that cannot store it: vLLM keeps plain values (its fp8 is an
    unscaled cast), so kvledger's scaled formats have no vLLM equivalent to plan for."""
    if engine == "vllm" and not vllm_serves(fmt):
        plain = [n for n, f in KV_FORMATS.items() if vllm_serves(f) and f.value_bits > 8]
        raise ConfigError(f"vLLM cannot serve the KV format {fmt.name} (kvledger's own); vLLM serves auto (the "
                          f"model's dtype: {', '.join(plain)}), fp8 (= fp8_e4m3) and fp8_e5m2: give one of those, "
                          f"or plan {fmt.name} with --engine kvledger")


def budget_bytes(device_bytes: int, utilization: float) -> int:
    return math.floor(device_bytes * utilization)


__all__ = [
    "CUDAGRAPH_ALLOWANCE", "ENGINES", "NON_TORCH_BY_TP", "SAMPLER_BYTES_PER_LOGIT", "BatchDefaults",
    "MeasuredPeak", "Term", "budget_bytes", "check_engine", "check_engine_kv_format", "find_peak", "kvledger_terms",
    "load_measured_peaks", "non_torch_bytes", "vllm_batch_defaults", "vllm_terms", "workspace_peak_bytes",
]
