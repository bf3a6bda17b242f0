"""Per-rank memory inventory: weights, workspace, reserve and the KV block pool left over.

The question answered here is lesson 01's: on one rank of a tensor-parallel group, how many
bytes do the weights take, how much transient workspace does a forward step need, and how many
whole KV blocks fit in what remains?
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..units import format_bytes, parse_bytes
from .geometry import KVSpec, config_int, default_dtype, dtype_bytes, text_config

GiB = 2**30

# ---- parameter counting ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ParamCount:
    """Parameters by component, for the whole model (`tp == 1`) or for one rank of `tp`."""

    embedding: int
    lm_head: int  # 0 when tied to the embedding: the same tensor serves both
    attention: int  # projections and their biases
    mlp: int  # dense MLPs, experts, shared experts and routers
    norms: int  # every RMSNorm weight, including the final one
    tp: int = 1

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.attention + self.mlp + self.norms


def _split(n: int, tp: int) -> int:
    # Column/row-parallel shards; an uneven dimension costs the largest shard (rounded up).
    return -(-n // tp)


def _heads_per_rank(heads: int, tp: int) -> int:
    if heads % tp:
        raise ConfigError(f"tp={tp} must divide num_attention_heads ({heads})")
    return heads // tp


def _is_mla(cfg: dict[str, Any]) -> bool:
    return cfg.get("kv_lora_rank") is not None


def count_parameters(cfg: dict[str, Any]) -> ParamCount:
    """Count the parameters of a Llama-family, Qwen2, Mistral, Gemma 2/3 or DeepSeek-V2/V3 config.

    DeepSeek's multi-token-prediction layers (`num_nextn_predict_layers`) are excluded: they only
    serve speculative decoding and are not loaded for plain serving, which is how the published
    671B figure for DeepSeek-V3 is counted too.
    """
    return count_parameters_per_rank(cfg, 1)


def count_parameters_per_rank(cfg: dict[str, Any], tp: int) -> ParamCount:
    """Parameters one rank holds under tensor parallelism `tp` (tp=1 gives the whole model).

    Split rules, as Megatron-style tensor parallelism lays weights out:
    - embedding and lm_head are vocab-parallel: each rank holds ceil(vocab / tp) rows;
    - q/o (and MLA's q_b/kv_b/o) are split by attention heads (column- then row-parallel);
    - k/v are split by KV heads; when tp > kv_heads every rank holds its one KV head's
      projection (hidden x head_dim each), i.e. the K/V weights are replicated;
    - MLP gate/up are column-parallel and down is row-parallel: intermediate / tp each; MoE
      experts are split the same way inside every expert (no expert parallelism);
    - low-rank MLA down-projections (q_a, kv_a), routers, norms and row-parallel output biases
      are small and replicated on every rank.
    """
    cfg = text_config(cfg)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tp must be a positive integer, got {tp!r}")
    hidden = config_int(cfg, "hidden_size")
    layers = config_int(cfg, "num_hidden_layers")
    vocab = config_int(cfg, "vocab_size")
    model_type = str(cfg.get("model_type") or "")
    # HF's base default is tied, but most causal-LM configs override it; Gemma keeps it tied.
    tied = cfg.get("tie_word_embeddings")
    if tied is None:
        tied = model_type.startswith("gemma")
    embedding = _split(vocab, tp) * hidden
    lm_head = 0 if tied else embedding
    if _is_mla(cfg):
        attention, norms, mlp = _deepseek_layers(cfg, tp, hidden, layers)
    else:
        attention, norms = _dense_attention(cfg, tp, hidden, model_type)
        attention, norms = attention * layers, norms * layers
        mlp = _dense_mlp(cfg, tp, hidden, model_type) * layers
    return ParamCount(embedding, lm_head, attention, mlp, norms + hidden, tp)  # + final norm


def _dense_attention(cfg: dict[str, Any], tp: int, hidden: int, model_type: str) -> tuple[int, int]:
    """(attention params, norm params) of one Llama-style layer on one rank."""
    heads = config_int(cfg, "num_attention_heads")
    kv_heads = config_int(cfg, "num_key_value_heads", default=heads)
    head_dim = config_int(cfg, "head_dim", default=None) or hidden // heads
    q_heads = _heads_per_rank(heads, tp)
    # KVSpec owns the "split, or replicate one head per rank" rule; reuse it.
    kv_per_rank = KVSpec(layers=1, kv_heads=kv_heads, head_dim=head_dim, tp=tp).kv_heads_per_rank
    params = 2 * hidden * q_heads * head_dim  # q and o
    params += 2 * hidden * kv_per_rank * head_dim  # k and v
    bias = bool(cfg.get("attention_bias"))
    if bias or model_type.startswith("qwen2"):  # Qwen2 has q/k/v biases without the flag
        params += (q_heads + 2 * kv_per_rank) * head_dim
    if bias:
        params += hidden  # o bias: added after the all-reduce, so replicated
    norms = (4 if model_type.startswith("gemma") and model_type != "gemma" else 2) * hidden
    if model_type.startswith(("qwen3", "gemma3")):
        norms += 2 * head_dim  # per-head q_norm and k_norm
    return params, norms


def _dense_mlp(cfg: dict[str, Any], tp: int, hidden: int, model_type: str) -> int:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if cfg.get(key):
            raise ConfigError(f"parameter counting for mixture-of-experts model_type {model_type!r} "
                              f"(key {key!r}) is not supported")
    inter = _split(config_int(cfg, "intermediate_size"), tp)
    params = 3 * hidden * inter  # gate, up, down
    if cfg.get("mlp_bias"):
        params += 2 * inter + hidden
    return params


def _deepseek_layers(cfg: dict[str, Any], tp: int, hidden: int, layers: int) -> tuple[int, int, int]:
    """(attention, norms, mlp) over all DeepSeek-V2/V3 decoder layers on one rank."""
    heads = _heads_per_rank(config_int(cfg, "num_attention_heads"), tp)
    kv_rank = config_int(cfg, "kv_lora_rank")
    nope = config_int(cfg, "qk_nope_head_dim")
    rope = config_int(cfg, "qk_rope_head_dim", minimum=0)
    v_dim = config_int(cfg, "v_head_dim")
    q_rank = config_int(cfg, "q_lora_rank", default=0, minimum=0)
    norms = 2 * hidden + kv_rank  # input/post-attention norms, kv_a_layernorm
    if q_rank:
        attn = hidden * q_rank + q_rank * heads * (nope + rope)  # q_a (replicated), q_b
        norms += q_rank  # q_a_layernorm
    else:  # DeepSeek-V2-Lite: a plain q projection
        attn = hidden * heads * (nope + rope)
    attn += hidden * (kv_rank + rope)  # kv_a: the latent and the shared RoPE key (replicated)
    attn += kv_rank * heads * (nope + v_dim)  # kv_b: decompresses K(nope) and V per head
    attn += heads * v_dim * hidden  # o
    dense = 3 * hidden * _split(config_int(cfg, "intermediate_size"), tp)
    experts = config_int(cfg, "n_routed_experts", default=0, minimum=0)
    moe_inter = config_int(cfg, "moe_intermediate_size", default=0, minimum=0)
    shared = config_int(cfg, "n_shared_experts", default=0, minimum=0)
    moe = experts * 3 * hidden * _split(moe_inter, tp)
    moe += 3 * hidden * _split(shared * moe_inter, tp)  # shared experts act as one wide MLP
    moe += experts * hidden  # router (replicated)
    if cfg.get("topk_method") == "noaux_tc":
        moe += experts  # V3's per-expert routing bias
    first_dense = config_int(cfg, "first_k_dense_replace", default=0, minimum=0)
    freq = config_int(cfg, "moe_layer_freq", default=1)
    n_moe = sum(1 for i in range(layers) if experts and i >= first_dense and i % freq == 0)
    mlp = n_moe * moe + (layers - n_moe) * dense
    return attn * layers, norms * layers, mlp


def default_weight_dtype(cfg: dict[str, Any]) -> str:
    """The dtype weights are served in: fp8 for fp8-quantised checkpoints (DeepSeek-V3), else
    the config's dtype (fp32 checkpoints served in bf16, as for the KV cache)."""
    quant = text_config(cfg).get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "fp8":
        return "fp8"
    return default_dtype(text_config(cfg))


def weights_bytes_per_rank(cfg: dict[str, Any], tp: int = 1, weight_dtype: str | None = None) -> int:
    """Bytes of weights on one rank (see `count_parameters_per_rank` for how each part splits).

    One dtype for every tensor: fp8 checkpoints really keep embeddings, norms and block scales
    in higher precision, which this undercounts by well under 1% for DeepSeek-V3.
    """
    size = dtype_bytes(weight_dtype or default_weight_dtype(cfg))
    return count_parameters_per_rank(cfg, tp).total * size


# ---- workspace -------------------------------------------------------------------------------


def workspace_peak_bytes(
    cfg: dict[str, Any], tp: int = 1, max_batched_tokens: int = 8192, max_seqs: int = 256,
    act_dtype_bytes: int = 2,
) -> int:
    """Estimate the largest transient memory of one forward step on one rank.

    With T = max_batched_tokens, H = hidden_size and per-rank widths:

        attention = T * (q + k + v + H)          q/k/v projection outputs plus o_proj's output
        mlp       = T * (2 * I + H)              gate and up outputs plus down's output
        peak      = max(attention, mlp) * act_dtype_bytes + max_seqs * ceil(vocab / tp) * 4

    I is intermediate_size / tp (for MoE the routed-plus-shared width a token activates, if
    larger). Logits are counted in fp32 because samplers upcast them. Logits and layer
    activations do not coexist, so adding them over-estimates on purpose: an estimate should
    never over-promise the KV pool. It ignores the allocator's fragmentation and CUDA graphs,
    which the runtime reserve covers.
    """
    for value, what in ((tp, "tp"), (max_batched_tokens, "max_batched_tokens"), (max_seqs, "max_seqs"),
                        (act_dtype_bytes, "act_dtype_bytes")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    cfg = text_config(cfg)
    hidden = config_int(cfg, "hidden_size")
    heads = _heads_per_rank(config_int(cfg, "num_attention_heads"), tp)
    if _is_mla(cfg):
        qk = config_int(cfg, "qk_nope_head_dim") + config_int(cfg, "qk_rope_head_dim", minimum=0)
        q = k = heads * qk
        v = heads * config_int(cfg, "v_head_dim")
    else:
        spec = KVSpec.from_hf_config(cfg, tp=tp)
        head_dim = spec.head_dim
        q = heads * head_dim
        k = v = spec.kv_heads_per_rank * head_dim
    inter = config_int(cfg, "intermediate_size")
    active = config_int(cfg, "num_experts_per_tok", default=0, minimum=0)
    active += config_int(cfg, "n_shared_experts", default=0, minimum=0)
    inter = max(inter, active * config_int(cfg, "moe_intermediate_size", default=0, minimum=0))
    tokens = max_batched_tokens
    attention = tokens * (q + k + v + hidden)
    mlp = tokens * (2 * _split(inter, tp) + hidden)
    logits = max_seqs * _split(config_int(cfg, "vocab_size"), tp) * 4
    return max(attention, mlp) * act_dtype_bytes + logits


# ---- GPU catalogue ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GPU:
    """One accelerator's datasheet numbers.

    memory_bytes convention: the datasheet's capacity. NVIDIA's "80GB" A100/H100 and "24GB" L4
    are power-of-two parts (80 GiB = five 16 GiB HBM stacks), so they are read as GiB; the
    H200's "141GB" is a decimal figure and is taken literally (141e9). The driver reports a
    little less than either; pass device_bytes from `nvidia-smi` when that matters.
    """

    name: str
    memory_bytes: int
    hbm_bandwidth_Bps: float  # noqa: N815 -- unit suffix kept readable
    bf16_dense_flops: float  # dense (no sparsity) bf16 tensor-core peak
    host_link_Bps: float  # noqa: N815 -- PCIe, one direction
    source: str


GPUS: dict[str, GPU] = {
    gpu.name: gpu
    for gpu in (
        GPU("a100-80gb", 80 * GiB, 2.039e12, 312e12, 32e9,
            "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM; PCIe Gen4 x16)"),
        GPU("h100-80gb", 80 * GiB, 3.35e12, 989e12, 64e9,
            "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM; PCIe Gen5 x16)"),
        GPU("h200-141gb", 141 * 10**9, 4.8e12, 989e12, 64e9,
            "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM; PCIe Gen5 x16)"),
        GPU("l4", 24 * GiB, 300e9, 121e12, 32e9,
            "NVIDIA L4 Tensor Core GPU datasheet (PCIe Gen4 x16)"),
    )
}


def get_gpu(name: str) -> GPU:
    """Look a GPU up by catalogue name (case-insensitive)."""
    gpu = GPUS.get(str(name).strip().lower())
    if gpu is None:
        raise ConfigError(f"unknown GPU {name!r}; known GPUs are: {', '.join(GPUS)}")
    return gpu


# ---- the inventory ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Inventory:
    """Where one rank's memory goes. All sizes are bytes on one rank.

    budget_bytes is what kvledger may plan with: device_bytes x utilization, or the pool given
    directly. slack_bytes is the part of the budget left for KV that block rounding wastes.
    """

    spec: KVSpec
    device_bytes: int | None
    budget_bytes: int
    weights_bytes_per_rank: int
    parameters: int
    workspace_bytes: int
    reserve_bytes: int
    pool_bytes: int
    pool_blocks: int
    block_bytes: int
    kv_bytes_per_token: int
    kv_heads_per_rank: int
    kv_replication: int
    slack_bytes: int

    def blocks_per_request(self, prompt: int, max_new: int) -> int:
        """Blocks one request needs at its longest (prompt plus every new token), unshared."""
        for value, what in ((prompt, "prompt"), (max_new, "max_new")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{what} must be a non-negative integer, got {value!r}")
        if prompt + max_new == 0:
            raise ConfigError("a request needs at least one token (prompt + max_new > 0)")
        return self.spec.blocks_for_tokens(prompt + max_new)

    def max_concurrent_requests(self, prompt: int, max_new: int) -> int:
        """How many such requests fit at once when none shares blocks with another."""
        return self.pool_blocks // self.blocks_per_request(prompt, max_new)

    def to_dict(self) -> dict[str, int | None]:
        keys = ("kv_bytes_per_token", "kv_heads_per_rank", "kv_replication", "block_bytes", "pool_blocks",
                "pool_bytes", "parameters", "weights_bytes_per_rank", "workspace_bytes", "reserve_bytes",
                "device_bytes")
        return {key: getattr(self, key) for key in keys}


def _size(value: int | str, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return 0  # parse_bytes insists on positive sizes; a zero reserve is legitimate
    try:
        return parse_bytes(value)
    except ConfigError as exc:
        raise ConfigError(f"{what}: {exc}") from None


def build_inventory(
    spec: KVSpec,
    cfg: dict[str, Any] | None = None,
    *,
    device_bytes: int | str | None = None,
    gpu: str | None = None,
    utilization: float = 0.9,
    pool_bytes: int | str | None = None,
    weight_dtype: str | None = None,
    runtime_reserve_bytes: int | str = GiB,
    max_batched_tokens: int = 8192,
    max_seqs: int = 256,
) -> Inventory:
    """Account for one rank's memory and size the KV block pool.

    With `pool_bytes` the pool is that size rounded down to whole blocks (weights and workspace
    are still reported when `cfg` is given). Otherwise the pool is
    `device x utilization - weights - workspace - reserve`, rounded down to whole blocks, with
    the device given as `device_bytes` or a catalogue `gpu` name.
    """
    if isinstance(utilization, bool) or not isinstance(utilization, int | float) \
            or not 0 < utilization <= 1:
        raise ConfigError(f"utilization must be in (0, 1], got {utilization!r}")
    if device_bytes is not None and gpu is not None:
        raise ConfigError("give either device_bytes or gpu, not both")
    device = get_gpu(gpu).memory_bytes if gpu is not None else (
        _size(device_bytes, "device_bytes") if device_bytes is not None else None)
    reserve = _size(runtime_reserve_bytes, "runtime_reserve_bytes")
    weights = params = workspace = 0
    if cfg is not None:
        params = count_parameters(cfg).total
        weights = weights_bytes_per_rank(cfg, spec.tp, weight_dtype)
        workspace = workspace_peak_bytes(cfg, spec.tp, max_batched_tokens, max_seqs)

    if pool_bytes is not None:
        budget = _size(pool_bytes, "pool_bytes")
        available = budget
        reserve = 0  # the pool was given directly: nothing is subtracted from it
    elif device is None:
        raise ConfigError("give device_bytes, gpu or pool_bytes to size the KV pool")
    else:
        budget = math.floor(device * utilization)
        available = budget - weights - workspace - reserve
        if available <= 0:
            raise ConfigError(
                f"model does not fit: budget {format_bytes(budget)} ({utilization:g} of "
                f"{format_bytes(device)}) - weights {format_bytes(weights)} - workspace "
                f"{format_bytes(workspace)} - reserve {format_bytes(reserve)} = {format_bytes(available)}"
            )
    blocks = spec.pool_blocks(available)
    pool = blocks * spec.block_bytes
    return Inventory(
        spec=spec, device_bytes=device, budget_bytes=budget, weights_bytes_per_rank=weights,
        parameters=params, workspace_bytes=workspace, reserve_bytes=reserve, pool_bytes=pool,
        pool_blocks=blocks, block_bytes=spec.block_bytes, kv_bytes_per_token=spec.bytes_per_token,
        kv_heads_per_rank=spec.kv_heads_per_rank, kv_replication=spec.kv_replication,
        slack_bytes=available - pool,
    )


__all__ = [
    "GPU", "GPUS", "Inventory", "ParamCount", "build_inventory", "count_parameters",
    "count_parameters_per_rank", "default_weight_dtype", "get_gpu", "weights_bytes_per_rank",
    "workspace_peak_bytes",
]
