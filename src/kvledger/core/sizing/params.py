"""Weights of a Hugging Face text decoder: every tensor on one tensor-parallel rank, counted and sized.

`model_tensors(cfg, tp)` lists the weights of one rank as `Tensor` groups (shape per rank x how many);
parameter counts and weight bytes are both sums over that one list, so they can never disagree.

Families: Llama-style dense decoders (Llama, Mistral, Qwen2/Qwen3, Gemma 1/2/3, SmolLM, ...), mixtures
of experts (Mixtral's `num_local_experts`, Qwen-MoE's `num_experts` with an optional shared expert,
DeepSeek's `n_routed_experts` with shared experts and leading dense layers), and DeepSeek-V2/V3 MLA.
Sliding-window and hybrid (sliding + global) attention change the KV cache, not the weights.
Mamba-2 (Granite-4.0-H / Nemotron-H style, ``mamba_*`` keys) and gated-delta-net (Qwen3-Next, ``linear_*`` keys)
layers named in ``layer_types`` / ``layers_block_type`` are counted by their mixers' tensors (HF's ``Mamba2Mixer``
and ``Qwen3NextGatedDeltaNet``, split as vLLM's ``MambaMixer2`` / ``Qwen3NextGatedDeltaNet`` shard them), in the
``attention`` group (the token mixer); other non-attention layers, or these without their geometry, are refused.

Weight formats (`WEIGHT_FORMATS`) size each quantizable matmul weight; embeddings, the LM head, norms,
biases and MoE routers stay at the checkpoint's own precision, as every quantization method leaves them.
`weight_format_for(cfg, override)` reads `quantization_config` (fp8, fp8 block, AWQ/GPTQ int4 with group
scales and zeros, compressed-tensors, ModelOpt FP8/NVFP4, MXFP4, bitsandbytes) or takes `--weight-dtype`.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from ...errors import ConfigError
from .geometry import KVSpec, canonical_dtype, config_int, default_dtype, dtype_bytes, text_config

# ---- tensors ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tensor:
    """`count` identical weights of `rows x cols` on one rank (rows = input features for a matmul).

    group: embedding | lm_head | attention | mlp | norms. linear: a matmul weight that quantization
    methods quantize. active: how many of the `count` one token uses (MoE experts: top-k of them).
    """

    name: str
    group: str
    rows: int
    cols: int
    count: int = 1
    linear: bool = False
    active: int | None = None

    @property
    def params(self) -> int:
        return self.rows * self.cols * self.count

    @property
    def active_params(self) -> int:
        used = self.count if self.active is None else self.active
        return self.rows * self.cols * used


GROUPS = ("embedding", "lm_head", "attention", "mlp", "norms")
_NON_ATTENTION_LAYERS = ("mamba", "linear_attention", "conv", "recurrent", "ssm")


def _split(n: int, tp: int) -> int:
    # Column/row-parallel shards; an uneven dimension costs the largest shard (rounded up).
    return -(-n // tp)


def _heads_per_rank(heads: int, tp: int) -> int:
    if heads % tp:
        raise ConfigError(f"tp={tp} must divide num_attention_heads ({heads})")
    return heads // tp


def _check_tp(tp: Any) -> int:
    if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= 1024:
        raise ConfigError(f"tp must be an integer in [1, 1024], got {tp!r}")
    return tp


def _is_mla(cfg: dict[str, Any]) -> bool:
    return cfg.get("kv_lora_rank") is not None


# The state-layer kinds whose mixers are counted, and the key a config must give for their geometry.
_STATE_LAYER_KEYS = {"mamba": "mamba_n_heads", "linear_attention": "linear_num_value_heads"}


def _check_layer_types(cfg: dict[str, Any]) -> None:
    for key in ("layer_types", "layers_block_type", "hybrid_override_pattern"):
        kinds = cfg.get(key)
        if isinstance(kinds, list | str):
            odd = sorted({str(k) for k in kinds if any(w in str(k).lower() for w in _NON_ATTENTION_LAYERS)})
            if isinstance(kinds, list):
                odd = [k for k in odd if _STATE_LAYER_KEYS.get(k) not in cfg]
            if odd:
                raise ConfigError(f"model config key {key!r} has non-attention layers ({', '.join(odd)}); "
                                  "kvledger plans KV caches of attention layers only")


def model_tensors(cfg: dict[str, Any], tp: int = 1, *, vocab_pad: int = 1) -> list[Tensor]:
    """Every weight of one rank under tensor parallelism `tp` (tp=1: the whole model).

    Split rules, as Megatron-style tensor parallelism lays weights out (and vLLM serves them):
    - embedding and lm_head are vocab-parallel: each rank holds ceil(vocab / tp) rows (`vocab_pad`
      first rounds the vocabulary up, as vLLM pads it to a multiple of 64);
    - q/o (and MLA's q_b/kv_b/o) are split by attention heads (column- then row-parallel);
    - k/v are split by KV heads; when tp > kv_heads every rank holds its one KV head's projection;
    - MLP gate/up are column-parallel and down is row-parallel: intermediate / tp each; MoE experts
      are split the same way inside every expert (tensor parallelism, no expert parallelism);
    - low-rank MLA down-projections (q_a, kv_a), routers, norms and row-parallel output biases are
      small and replicated on every rank.
    """
    cfg = text_config(cfg)
    tp = _check_tp(tp)
    _check_layer_types(cfg)
    hidden = config_int(cfg, "hidden_size")
    layers = config_int(cfg, "num_hidden_layers")
    vocab = config_int(cfg, "vocab_size")
    if vocab_pad > 1:
        vocab = -(-vocab // vocab_pad) * vocab_pad
    model_type = str(cfg.get("model_type") or "")
    # HF's base default is tied, but most causal-LM configs override it; Gemma keeps it tied.
    tied = cfg.get("tie_word_embeddings")
    if tied is None:
        tied = model_type.startswith("gemma")
    rows = _split(vocab, tp)
    out = [Tensor("embed_tokens", "embedding", rows, hidden)]
    if not tied:
        out.append(Tensor("lm_head", "lm_head", hidden, rows, linear=False))
    kind, state_layers = _state_layers(cfg)
    if _is_mla(cfg):
        out += _mla_attention(cfg, tp, hidden, layers)
    else:
        out += _dense_attention(cfg, tp, hidden, layers - state_layers, model_type)
    if state_layers:
        out += (_mamba_mixer if kind == "mamba" else _gated_delta_net)(cfg, tp, hidden, state_layers)
        out.append(Tensor("layer_norms", "norms", 2, hidden, state_layers))
    out += _mlp(cfg, tp, hidden, layers, model_type)
    out.append(Tensor("norm", "norms", 1, hidden))  # the final norm
    return [t for t in out if t.count and t.rows and t.cols]


def _dense_attention(cfg: dict[str, Any], tp: int, hidden: int, layers: int, model_type: str) -> list[Tensor]:
    heads = config_int(cfg, "num_attention_heads")
    kv_heads = config_int(cfg, "num_key_value_heads", default=heads)
    head_dim = config_int(cfg, "head_dim", default=None) or hidden // heads
    q_heads = _heads_per_rank(heads, tp)
    # KVSpec owns the "split, or replicate one head per rank" rule; reuse it.
    kv_per_rank = KVSpec(layers=1, kv_heads=kv_heads, head_dim=head_dim, tp=tp).kv_heads_per_rank
    q, kv = q_heads * head_dim, kv_per_rank * head_dim
    gate = 2 if model_type == "qwen3_next" else 1  # Qwen3-Next's q_proj also yields the output gate
    out = [
        Tensor("q_proj", "attention", hidden, gate * q, layers, linear=True),
        Tensor("k_proj", "attention", hidden, kv, layers, linear=True),
        Tensor("v_proj", "attention", hidden, kv, layers, linear=True),
        Tensor("o_proj", "attention", q, hidden, layers, linear=True),
    ]
    bias = bool(cfg.get("attention_bias"))
    if bias or model_type.startswith("qwen2"):  # Qwen2 has q/k/v biases without the flag
        out.append(Tensor("qkv_bias", "attention", 1, q + 2 * kv, layers))
    if bias:
        out.append(Tensor("o_bias", "attention", 1, hidden, layers))  # added after the all-reduce
    norms = 4 if model_type.startswith("gemma") and model_type != "gemma" else 2
    out.append(Tensor("layer_norms", "norms", norms, hidden, layers))
    if model_type.startswith(("qwen3", "gemma3")):
        out.append(Tensor("qk_norms", "norms", 2, head_dim, layers))  # per-head q_norm and k_norm
    return out


def _state_layers(cfg: dict[str, Any]) -> tuple[str, int]:
    """(kind, count) of the Mamba-2 / gated-delta-net layers `_check_layer_types` let through; ("", 0) for none."""
    kinds = cfg.get("layer_types")
    if not isinstance(kinds, list):
        kinds = cfg.get("layers_block_type")
    if not isinstance(kinds, list):
        return "", 0
    found = {str(k) for k in kinds if str(k) in _STATE_LAYER_KEYS}
    if len(found) > 1:
        raise ConfigError("a config with both Mamba and linear-attention layers is not planned")
    return (found.pop(), sum(1 for k in kinds if str(k) in _STATE_LAYER_KEYS)) if found else ("", 0)


def _mamba_mixer(cfg: dict[str, Any], tp: int, hidden: int, layers: int) -> list[Tensor]:
    """Mamba-2 mixers per rank (HF ``Mamba2Mixer`` / ``GraniteMoeHybridMambaLayer``): in_proj to the gate, x, B, C and
    dt; a depthwise conv over x, B, C; A_log, D and dt_bias per head; a gated RMSNorm; out_proj. vLLM's
    ``MambaMixer2`` splits heads and the inner width by ``tp`` and replicates the B/C groups up to ``tp``."""
    heads = config_int(cfg, "mamba_n_heads")
    d_state = config_int(cfg, "mamba_d_state")
    groups = config_int(cfg, "mamba_n_groups", default=1)
    d_conv = config_int(cfg, "mamba_d_conv", default=4)
    inner = config_int(cfg, "mamba_expand", default=2) * hidden
    if heads % tp or inner % tp:
        raise ConfigError(f"tp={tp} must divide mamba_n_heads ({heads}) and the Mamba inner width ({inner})")
    if groups % tp:
        groups = tp
    h, i, bc = heads // tp, inner // tp, 2 * (groups // tp) * d_state
    proj_bias = bool(cfg.get("mamba_proj_bias", False))
    out = [Tensor("mamba.in_proj", "attention", hidden, 2 * i + bc + h, layers, linear=True),
           Tensor("mamba.conv1d", "attention", d_conv, i + bc, layers),
           Tensor("mamba.A_log,D,dt_bias", "attention", 3, h, layers),
           Tensor("mamba.norm", "norms", 1, i, layers),
           Tensor("mamba.out_proj", "attention", i, hidden, layers, linear=True)]
    if cfg.get("mamba_conv_bias", True):
        out.append(Tensor("mamba.conv1d.bias", "attention", 1, i + bc, layers))
    if proj_bias:
        out.append(Tensor("mamba.proj_bias", "attention", 1, 2 * i + bc + h + hidden, layers))
    return out


def _gated_delta_net(cfg: dict[str, Any], tp: int, hidden: int, layers: int) -> list[Tensor]:
    """Qwen3-Next's gated delta net per rank (HF ``Qwen3NextGatedDeltaNet``): in_proj_qkvz and in_proj_ba, a depthwise
    conv over q, k, v, A_log and dt_bias per value head, a gated RMSNorm over one head, out_proj; heads split by
    ``tp``."""
    k_heads = config_int(cfg, "linear_num_key_heads")
    v_heads = config_int(cfg, "linear_num_value_heads")
    k_dim = config_int(cfg, "linear_key_head_dim")
    v_dim = config_int(cfg, "linear_value_head_dim")
    d_conv = config_int(cfg, "linear_conv_kernel_dim", default=4)
    if k_heads % tp or v_heads % tp:
        raise ConfigError(f"tp={tp} must divide linear_num_key_heads ({k_heads}) and linear_num_value_heads "
                          f"({v_heads})")
    key, value, vh = k_heads // tp * k_dim, v_heads // tp * v_dim, v_heads // tp
    return [Tensor("linear_attn.in_proj_qkvz", "attention", hidden, 2 * key + 2 * value, layers, linear=True),
            Tensor("linear_attn.in_proj_ba", "attention", hidden, 2 * vh, layers, linear=True),
            Tensor("linear_attn.conv1d", "attention", d_conv, 2 * key + value, layers),
            Tensor("linear_attn.A_log,dt_bias", "attention", 2, vh, layers),
            Tensor("linear_attn.norm", "norms", 1, v_dim, layers),
            Tensor("linear_attn.out_proj", "attention", value, hidden, layers, linear=True)]


def _mla_attention(cfg: dict[str, Any], tp: int, hidden: int, layers: int) -> list[Tensor]:
    """DeepSeek-V2/V3 multi-head latent attention, per rank."""
    heads = _heads_per_rank(config_int(cfg, "num_attention_heads"), tp)
    kv_rank = config_int(cfg, "kv_lora_rank")
    nope = config_int(cfg, "qk_nope_head_dim")
    rope = config_int(cfg, "qk_rope_head_dim", minimum=0)
    v_dim = config_int(cfg, "v_head_dim")
    q_rank = config_int(cfg, "q_lora_rank", default=0, minimum=0)
    out = []
    if q_rank:
        out.append(Tensor("q_a_proj", "attention", hidden, q_rank, layers, linear=True))  # replicated
        out.append(Tensor("q_b_proj", "attention", q_rank, heads * (nope + rope), layers, linear=True))
        out.append(Tensor("q_a_layernorm", "norms", 1, q_rank, layers))
    else:  # DeepSeek-V2-Lite: a plain q projection
        out.append(Tensor("q_proj", "attention", hidden, heads * (nope + rope), layers, linear=True))
    # kv_a: the latent and the shared RoPE key (replicated); kv_b decompresses K(nope) and V per head.
    out.append(Tensor("kv_a_proj_with_mqa", "attention", hidden, kv_rank + rope, layers, linear=True))
    out.append(Tensor("kv_b_proj", "attention", kv_rank, heads * (nope + v_dim), layers, linear=True))
    out.append(Tensor("o_proj", "attention", heads * v_dim, hidden, layers, linear=True))
    out.append(Tensor("layer_norms", "norms", 2, hidden, layers))
    out.append(Tensor("kv_a_layernorm", "norms", 1, kv_rank, layers))
    return out


def moe_layout(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The mixture-of-experts layout of a config, or None for a dense model.

    Keys: experts, top_k, expert_inter (per expert), shared_inter (all shared experts as one MLP),
    shared_gate (Qwen2-MoE's sigmoid gate on the shared expert), moe_layers (indices), style.
    """
    cfg = text_config(cfg)
    layers = config_int(cfg, "num_hidden_layers")
    if cfg.get("n_routed_experts"):  # DeepSeek V2/V3 (and DeepSeek-MoE)
        experts = config_int(cfg, "n_routed_experts")
        inter = config_int(cfg, "moe_intermediate_size")
        shared = config_int(cfg, "n_shared_experts", default=0, minimum=0) * inter
        first = config_int(cfg, "first_k_dense_replace", default=0, minimum=0)
        freq = config_int(cfg, "moe_layer_freq", default=1)
        moe = [i for i in range(layers) if i >= first and i % freq == 0]
        style, gate = "deepseek", False
    elif cfg.get("num_local_experts"):  # Mixtral (and Mixtral-shaped MoEs)
        experts = config_int(cfg, "num_local_experts")
        inter = config_int(cfg, "intermediate_size")
        shared, moe, style, gate = 0, list(range(layers)), "mixtral", False
    elif cfg.get("num_experts"):  # Qwen2-MoE / Qwen3-MoE / OLMoE
        experts = config_int(cfg, "num_experts")
        inter = config_int(cfg, "moe_intermediate_size", default=None) or config_int(cfg, "intermediate_size")
        shared = config_int(cfg, "shared_expert_intermediate_size", default=0, minimum=0)
        step = config_int(cfg, "decoder_sparse_step", default=1)
        dense_only = cfg.get("mlp_only_layers") or []
        if not isinstance(dense_only, list) or not all(isinstance(i, int) for i in dense_only):
            raise ConfigError("model config key 'mlp_only_layers' must be a list of layer indices")
        moe = [i for i in range(layers) if i not in dense_only and (i + 1) % step == 0]
        style, gate = "qwen", shared > 0
    else:
        return None
    top_k = config_int(cfg, "num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(f"num_experts_per_tok ({top_k}) exceeds the {experts} experts")
    return {"experts": experts, "top_k": top_k, "expert_inter": inter, "shared_inter": shared,
            "shared_gate": gate, "moe_layers": moe, "style": style}


def _mlp(cfg: dict[str, Any], tp: int, hidden: int, layers: int, model_type: str) -> list[Tensor]:
    moe = moe_layout(cfg)
    n_moe = len(moe["moe_layers"]) if moe else 0
    n_dense = layers - n_moe
    out = []
    if n_dense:
        inter = _split(config_int(cfg, "intermediate_size"), tp)
        out += [Tensor("gate_proj", "mlp", hidden, inter, n_dense, linear=True),
                Tensor("up_proj", "mlp", hidden, inter, n_dense, linear=True),
                Tensor("down_proj", "mlp", inter, hidden, n_dense, linear=True)]
        if cfg.get("mlp_bias"):
            out.append(Tensor("mlp_bias", "mlp", 1, 2 * inter + hidden, n_dense))
    if moe:
        e, k = moe["experts"], moe["top_k"]
        inter = _split(moe["expert_inter"], tp)
        out += [Tensor("experts.gate", "mlp", hidden, inter, n_moe * e, linear=True, active=n_moe * k),
                Tensor("experts.up", "mlp", hidden, inter, n_moe * e, linear=True, active=n_moe * k),
                Tensor("experts.down", "mlp", inter, hidden, n_moe * e, linear=True, active=n_moe * k),
                Tensor("router", "mlp", hidden, e, n_moe)]  # replicated, kept at full precision
        if moe["shared_inter"]:
            shared = _split(moe["shared_inter"], tp)  # shared experts act as one wide MLP
            out += [Tensor("shared_experts.gate", "mlp", hidden, shared, n_moe, linear=True),
                    Tensor("shared_experts.up", "mlp", hidden, shared, n_moe, linear=True),
                    Tensor("shared_experts.down", "mlp", shared, hidden, n_moe, linear=True)]
        if moe["shared_gate"]:
            out.append(Tensor("shared_expert_gate", "mlp", hidden, 1, n_moe))
        if cfg.get("topk_method") == "noaux_tc":
            out.append(Tensor("e_score_correction_bias", "mlp", 1, e, n_moe))  # V3's per-expert routing bias
    return out


# ---- parameter counts -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ParamCount:
    """Parameters by component, for the whole model (`tp == 1`) or for one rank of `tp`.

    `mlp_active` is the part of `mlp` one token uses (all of it for a dense model; shared experts,
    routers and the top-k routed experts for a mixture of experts).
    """

    embedding: int
    lm_head: int  # 0 when tied to the embedding: the same tensor serves both
    attention: int  # projections and their biases
    mlp: int  # dense MLPs, experts, shared experts and routers
    norms: int  # every RMSNorm weight, including the final one
    tp: int = 1
    mlp_active: int | None = None

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.attention + self.mlp + self.norms

    @property
    def active(self) -> int:
        """Parameters one token touches (what MoE model cards call 'active')."""
        mlp = self.mlp if self.mlp_active is None else self.mlp_active
        return self.embedding + self.lm_head + self.attention + mlp + self.norms


def count_parameters(cfg: dict[str, Any]) -> ParamCount:
    """Count the parameters of a Hugging Face decoder config (see `model_tensors` for the families).

    DeepSeek's multi-token-prediction layers (`num_nextn_predict_layers`) are excluded: they only
    serve speculative decoding and are not loaded for plain serving, which is how the published
    671B figure for DeepSeek-V3 is counted too.
    """
    return count_parameters_per_rank(cfg, 1)


def count_parameters_per_rank(cfg: dict[str, Any], tp: int) -> ParamCount:
    """Parameters one rank holds under tensor parallelism `tp` (tp=1 gives the whole model)."""
    tensors = model_tensors(cfg, tp)
    sums = dict.fromkeys(GROUPS, 0)
    for t in tensors:
        sums[t.group] += t.params
    active = sum(t.active_params for t in tensors if t.group == "mlp")
    return ParamCount(sums["embedding"], sums["lm_head"], sums["attention"], sums["mlp"], sums["norms"], tp,
                      active)


# ---- weight formats ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """How one quantizable matmul weight of `rows x cols` (rows = input features) is stored.

    bits: bits per weight element. group: elements of one row-group that share a scale (None: one scale
    per output channel; -1: one scale per tensor). scale_bytes: bytes per scale. zero_bits: bits per
    zero point (one per scale; AWQ/GPTQ pack 4-bit zeros). block: 2-D scale blocks (rows, cols), as
    DeepSeek's fp8 checkpoints. index_bytes: bytes per input row of a permutation index (GPTQ g_idx).
    """

    name: str
    bits: int
    group: int | None = None
    scale_bytes: float = 0.0
    zero_bits: int = 0
    block: tuple[int, int] | None = None
    index_bytes: int = 0
    describe: str = ""

    def linear_bytes(self, rows: int, cols: int) -> int:
        data = -(-rows * cols * self.bits // 8)
        if self.block is not None:
            scales = _split(rows, self.block[0]) * _split(cols, self.block[1])
        elif self.group is None:
            scales = cols if self.scale_bytes else 0
        elif self.group == -1:
            scales = 1
        else:
            scales = _split(rows, self.group) * cols
        extra = scales * self.scale_bytes + -(-scales * self.zero_bits // 8) + rows * self.index_bytes
        return data + int(-(-extra // 1))


def _plain(name: str) -> WeightFormat:
    return WeightFormat(name, 8 * dtype_bytes(name), describe=f"{name}: {dtype_bytes(name)} bytes per weight")


WEIGHT_FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    _plain("bf16"), _plain("fp16"), _plain("fp32"),
    WeightFormat("fp8", 8, None, 4.0, describe="fp8 e4m3 weights, one fp32 scale per output channel"),
    WeightFormat("fp8-block", 8, None, 4.0, block=(128, 128),
                 describe="fp8 e4m3 weights, one fp32 scale per 128 x 128 block (DeepSeek-V3)"),
    WeightFormat("int8", 8, None, 4.0, describe="int8 weights, one fp32 scale per output channel (W8A8)"),
    WeightFormat("int4", 4, 128, 2.0, zero_bits=4,
                 describe="int4 weights in groups of 128 with an fp16 scale and a 4-bit zero point (AWQ)"),
    WeightFormat("gptq-int4", 4, 128, 2.0, zero_bits=4, index_bytes=4,
                 describe="int4 weights in groups of 128, fp16 scales, 4-bit zeros and an int32 g_idx (GPTQ)"),
    WeightFormat("fp4", 4, 16, 1.0, describe="NVFP4: fp4 e2m1 weights, one fp8 scale per 16 elements"),
    WeightFormat("mxfp4", 4, 32, 1.0, describe="MXFP4: fp4 e2m1 weights, one e8m0 scale per 32 elements"),
    WeightFormat("nf4", 4, 64, 4.0, describe="bitsandbytes NF4: 4-bit weights, one fp32 absmax per 64"),
)}
_ALIASES = {"awq": "int4", "w4a16": "int4", "gptq": "gptq-int4", "nvfp4": "fp4", "w8a8": "int8",
            "fp8_e4m3": "fp8", "float8": "fp8"}


def get_weight_format(name: str) -> WeightFormat:
    """A weight format by name (`bf16`, `fp8`, `int4`, `fp4`, ... or a torch dtype spelling)."""
    if not isinstance(name, str):
        raise ConfigError(f"weight dtype must be a string, got {name!r}")
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in WEIGHT_FORMATS:
        try:
            key = canonical_dtype(key)
        except ConfigError:
            pass
        key = {"fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}.get(key, key)
    if key not in WEIGHT_FORMATS:
        raise ConfigError(f"unknown weight dtype {name!r} (known: {', '.join(WEIGHT_FORMATS)})")
    return WEIGHT_FORMATS[key]


@dataclass(frozen=True, slots=True)
class WeightPlan:
    """Which format the matmul weights use and which dtype everything else keeps, with the reason."""

    linear: WeightFormat
    base: str  # dtype of embeddings, lm_head, norms, biases and routers
    source: str  # where the choice came from
    group_override: int | None = None  # a checkpoint's own group size

    def linear_bytes(self, rows: int, cols: int) -> int:
        fmt = self.linear
        if self.group_override is not None and fmt.group is not None and fmt.group > 0:
            group = rows if self.group_override == -1 else self.group_override
            fmt = WeightFormat(fmt.name, fmt.bits, group, fmt.scale_bytes, fmt.zero_bits, fmt.block,
                               fmt.index_bytes, fmt.describe)
        return fmt.linear_bytes(rows, cols)

    @property
    def name(self) -> str:
        if self.linear.name == self.base:
            return self.base
        return f"{self.linear.name} (embeddings, lm_head and norms {self.base})"


def _from_quantization_config(quant: dict[str, Any]) -> tuple[str, int | None, str]:
    """(format name, group size override, description) for a `quantization_config`."""
    method = str(quant.get("quant_method") or "").lower()
    if method == "fp8":
        block = quant.get("weight_block_size")
        return ("fp8-block" if block else "fp8"), None, "quantization_config fp8" + (" (block scales)" if block else "")
    if method in ("awq", "gptq"):
        bits = quant.get("bits", quant.get("w_bit", 4))
        group = quant.get("group_size", quant.get("q_group_size", 128))
        if bits not in (4, 8) or isinstance(bits, bool):
            raise ConfigError(f"quantization_config: {method} with bits={bits!r} is not supported (4 or 8)")
        if isinstance(group, bool) or not isinstance(group, int) or not (group == -1 or 1 <= group <= 2**20):
            raise ConfigError(f"quantization_config: group_size must be -1 or a positive integer, got {group!r}")
        if bits == 8:
            return "int8", None, f"quantization_config {method} 8-bit"
        return ("gptq-int4" if method == "gptq" else "int4"), group, f"quantization_config {method} int4, group {group}"
    if method == "compressed-tensors":
        groups = quant.get("config_groups") or {}
        weights = next((g.get("weights") for g in groups.values() if isinstance(g, dict)
                        and isinstance(g.get("weights"), dict)), None) if isinstance(groups, dict) else None
        if not weights:
            raise ConfigError("quantization_config: compressed-tensors without config_groups.*.weights")
        bits, kind = weights.get("num_bits"), str(weights.get("type") or "int")
        group = weights.get("group_size")
        if bits == 8:
            return ("fp8" if kind == "float" else "int8"), None, f"quantization_config compressed-tensors {kind}8"
        if bits == 4 and kind == "float":
            return "fp4", None, "quantization_config compressed-tensors fp4"
        if bits == 4:
            grp = group if isinstance(group, int) and not isinstance(group, bool) and group > 0 else -1
            return "int4", grp, f"quantization_config compressed-tensors int4, group {group}"
        raise ConfigError(f"quantization_config: compressed-tensors with {bits}-bit {kind} weights is not supported")
    if method == "modelopt":
        algo = str(quant.get("quant_algo") or (quant.get("quantization") or {}).get("quant_algo") or "").upper()
        if "FP4" in algo:
            return "fp4", None, "quantization_config modelopt NVFP4"
        if "FP8" in algo:
            return "fp8", None, "quantization_config modelopt FP8"
        raise ConfigError(f"quantization_config: modelopt quant_algo {algo or '?'} is not supported")
    if method == "mxfp4":
        return "mxfp4", None, "quantization_config mxfp4"
    if method == "bitsandbytes":
        if quant.get("load_in_4bit"):
            return "nf4", None, "quantization_config bitsandbytes 4-bit"
        return "int8", None, "quantization_config bitsandbytes 8-bit"
    raise ConfigError(f"quantization_config: quant_method {method or '(missing)'!r} is not supported; "
                      "give --weight-dtype")


def weight_plan(cfg: dict[str, Any], weight_dtype: str | None = None) -> WeightPlan:
    """The weight formats of a config: `weight_dtype` if given, else its `quantization_config`, else
    its dtype (fp32 checkpoints served as bf16)."""
    cfg_text = text_config(cfg)
    base = default_dtype(cfg_text)
    if weight_dtype is not None:
        fmt = get_weight_format(weight_dtype)
        if fmt.name in ("bf16", "fp16", "fp32"):
            return WeightPlan(fmt, fmt.name, f"--weight-dtype {weight_dtype}")
        return WeightPlan(fmt, base, f"--weight-dtype {weight_dtype}")
    quant = cfg_text.get("quantization_config") or (cfg.get("quantization_config") if isinstance(cfg, dict) else None)
    if isinstance(quant, dict) and quant:
        name, group, why = _from_quantization_config(quant)
        return WeightPlan(WEIGHT_FORMATS[name], base, why, group)
    given = cfg_text.get("torch_dtype") or cfg_text.get("dtype") or "bf16 (default)"
    return WeightPlan(WEIGHT_FORMATS[base], base, f"config dtype {given}")


def default_weight_dtype(cfg: dict[str, Any]) -> str:
    """The format matmul weights are served in: the checkpoint's quantization, else its dtype."""
    return weight_plan(cfg).linear.name


def weights_bytes_per_rank(cfg: dict[str, Any], tp: int = 1, weight_dtype: str | None = None, *,
                           vocab_pad: int = 1) -> int:
    """Bytes of weights on one rank: quantizable matmul weights in the plan's format (with their scales,
    zero points and indices), everything else (embeddings, lm_head, norms, biases, routers) in the base
    dtype."""
    plan = weight_plan(cfg, weight_dtype)
    base = dtype_bytes(plan.base)
    total = 0
    for t in model_tensors(cfg, tp, vocab_pad=vocab_pad):
        if t.linear:
            total += plan.linear_bytes(t.rows, t.cols) * t.count
        else:
            total += t.params * base
    return total


def parse_param_count(text: str | int) -> int:
    """`8.03B`, `70e9`, `135M` or an integer -> a parameter count (bounded to 10^15)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        raw = str(text).strip()
        if not raw or len(raw) > 24:
            raise ConfigError(f"not a parameter count: {raw[:24]!r} (use e.g. 8.03B, 135M or 70e9)")
        scale = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}.get(raw[-1].lower(), 1)
        number = raw[:-1] if scale != 1 else raw
        try:
            exact = Decimal(number) * scale
            if not exact.is_finite():
                raise InvalidOperation
            value = int(exact)
        except (InvalidOperation, ValueError, OverflowError):
            raise ConfigError(f"not a parameter count: {raw!r} (use e.g. 8.03B, 135M or 70e9)") from None
    if not 1 <= value <= 10**15:
        raise ConfigError(f"parameter count must be between 1 and 10^15, got {text!r}")
    return value



__all__ = [
    "GROUPS", "WEIGHT_FORMATS", "ParamCount", "Tensor", "WeightFormat", "WeightPlan", "count_parameters",
    "count_parameters_per_rank", "default_weight_dtype", "get_weight_format", "model_tensors", "moe_layout",
    "parse_param_count", "weight_plan", "weights_bytes_per_rank",
]
