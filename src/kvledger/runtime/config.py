"""The decoder config the runtime understands: Llama-family models, read from a HF config.json dict.

Everything the forward pass needs is resolved here once (per-layer sliding windows, biases, RoPE
frequencies), so the model code has no model_type branches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..core.sizing.geometry import config_int, text_config
from ..errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "ministral", "qwen2")  # ministral: Mistral with layer_types
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    rope_params: tuple[tuple[str, float], ...]  # scaling parameters of rope_type, sorted by name
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    windows: tuple[int | None, ...]  # per layer: sliding window length, None for full attention

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> DecoderConfig:
        cfg = text_config(raw)
        model_type = str(cfg.get("model_type") or "")
        if any(cfg.get(k) for k in _MOE_KEYS):
            raise ConfigError(f"model_type {model_type!r} is a mixture-of-experts model, which the runtime "
                              "does not run (it runs dense Llama-family decoders)")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} is not supported by the runtime (supported: "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)})")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (Llama-family SwiGLU uses 'silu')")
        if float(cfg.get("partial_rotary_factor") or 1.0) != 1.0:
            raise ConfigError("partial_rotary_factor is not supported: the runtime rotates the whole head")
        layers = config_int(cfg, "num_hidden_layers")
        heads = config_int(cfg, "num_attention_heads")
        kv_heads = config_int(cfg, "num_key_value_heads", default=heads)
        hidden = config_int(cfg, "hidden_size")
        head_dim = config_int(cfg, "head_dim", default=hidden // heads)
        if heads % kv_heads:
            raise ConfigError(f"{heads} attention heads are not a multiple of {kv_heads} KV heads")
        theta, rope_type, rope_params = _rope(cfg)
        # Qwen2 always has q/k/v biases and none on o_proj; Llama's attention_bias covers all four.
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=config_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=config_int(cfg, "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_type=rope_type,
            rope_params=rope_params,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            windows=_windows(cfg, model_type, layers),
        )

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies ``[head_dim // 2]`` (fp32), with the configured scaling applied."""
        exps = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        inv = 1.0 / (self.rope_theta ** exps)
        p = dict(self.rope_params)
        if self.rope_type == "linear":
            return inv / p["factor"]  # same as dividing every position by the factor
        if self.rope_type == "llama3":
            return _llama3_scaling(inv, p)
        return inv


def _rope(cfg: dict[str, Any]) -> tuple[float, str, tuple[tuple[str, float], ...]]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older configs use rope_theta +
    # rope_scaling (with either "rope_type" or the legacy "type" key).
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"rope parameters must be a JSON object, got {params!r}")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in _ROPE_TYPES:
        known = ", ".join(_ROPE_TYPES)
        raise ConfigError(f"RoPE scaling {rope_type!r} is not supported (supported: {known})")
    needed = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    values = []
    for key in needed[rope_type]:
        if params.get(key) is None:
            raise ConfigError(f"RoPE scaling {rope_type!r} needs {key!r} in the config")
        values.append((key, float(params[key])))
    return theta, rope_type, tuple(values)


def _llama3_scaling(inv: torch.Tensor, p: dict[str, float]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths are slowed by ``factor``, short ones are kept,
    and the band in between is interpolated linearly in ``original_len / wavelength``."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    original = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    smooth = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    # smooth == 0 for wavelen >= original/low (fully scaled), 1 for wavelen <= original/high (kept).
    return (1 - smooth) * inv / factor + smooth * inv


def _windows(cfg: dict[str, Any], model_type: str, layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if model_type == "qwen2" and not cfg.get("use_sliding_window"):
        window = None  # Qwen2 ships a window value but keeps it off unless asked
    if window is None:
        return (None,) * layers
    window = config_int(cfg, "sliding_window")
    kinds = cfg.get("layer_types")
    if isinstance(kinds, list):
        if len(kinds) != layers:
            raise ConfigError(f"layer_types has {len(kinds)} entries for {layers} layers")
        return tuple(window if k == "sliding_attention" else None for k in kinds)
    if model_type == "qwen2":
        # Qwen2: layers from max_window_layers upward slide, the lower ones attend fully.
        first = config_int(cfg, "max_window_layers", default=0, minimum=0)
        return tuple(window if i >= first else None for i in range(layers))
    if model_type in ("mistral", "ministral"):  # Ministral spells its interleaving out in layer_types (above)
        return (window,) * layers
    return (None,) * layers  # Llama has no sliding window; ignore a stray key


__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderConfig"]
