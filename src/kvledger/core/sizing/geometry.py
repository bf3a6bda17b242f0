"""KV geometry: how many bytes one token, one block and one sequence cost on one rank.

Everything here is plain arithmetic over a frozen `KVSpec`; nothing allocates memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError, InvariantError
from ...units import format_bytes, parse_bytes
from .. import checks
from ..identity import CacheContext, request_context
from .kv_formats import ELEMENT_BYTES, KV_FORMATS, RENAMED, RESIDUAL_DTYPES, VLLM_NAMES, KVFormat

# Bytes per stored K/V value, by format name (int4: half a byte). Metadata is not in this figure: a
# format's bytes per token and per block come from its layout (`core.sizing.kv_formats`), which counts scales,
# zero points and residual pages too.
KV_DTYPE_BYTES: dict[str, int | float] = {
    name: (f.value_bits // 8 if f.value_bits % 8 == 0 else f.value_bits / 8) for name, f in KV_FORMATS.items()
}

# Hugging Face / torch spellings mapped onto the short names, so a config's `torch_dtype` can be
# passed straight in.
_DTYPE_ALIASES: dict[str, str] = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e4m3": "fp8_e4m3",
    "fp8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
    **VLLM_NAMES,  # vLLM's "fp8" is the unscaled e4m3 cast
    **RENAMED,  # a format's former name (int8-channel is int8)
}

ATTENTION_KINDS = ("full", "sliding", "mla", "hybrid")


def canonical_dtype(name: str) -> str:
    """Return the short name (`bf16`, `fp8_e4m3`, ...) for a dtype given in either spelling."""
    if not isinstance(name, str):
        raise ConfigError(f"dtype must be a string, got {name!r}")
    key = name.strip().lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in KV_FORMATS:
        known = ", ".join(sorted(set(KV_FORMATS) | set(_DTYPE_ALIASES)))
        raise ConfigError(f"unknown dtype {name!r} (known: {known})")
    return key


def dtype_bytes(name: str) -> int | float:
    """Bytes per stored value of a dtype or KV format: `dtype_bytes("bfloat16") == 2`,
    `dtype_bytes("fp8_e4m3") == 1`, `dtype_bytes("int4") == 0.5` (metadata not included)."""
    return KV_DTYPE_BYTES[canonical_dtype(name)]


@dataclass(frozen=True, slots=True)
class KVSpec:
    """The KV cache geometry of one model served with tensor parallelism `tp`.

    `kv_heads` is the model's total number of KV heads, across all ranks. For MLA the cache holds
    one compressed latent per token and layer (width `kv_lora_rank + rope_dim`) instead of K and V
    heads, so `kv_heads` and `head_dim` are informational there (`from_hf_config` sets them to 1
    and the latent width).

    `kv_dtype` names a KV format (`core.sizing.kv_formats.KV_FORMATS`): plain dtypes, or quantised formats
    whose bytes include their scales. `residual_dtype` is the unquantised residual page of formats
    that keep one (int4; default bf16) and is None for every other format.
    """

    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: str = "bf16"
    block_size: int = 16
    tp: int = 1
    attention: str = "full"
    sliding_window: int | None = None
    sliding_layers: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    name: str | None = None
    residual_dtype: str | None = None

    def __post_init__(self) -> None:
        for field in ("layers", "kv_heads", "head_dim", "block_size", "tp"):
            checks.positive(getattr(self, field), field)
        # Store the short dtype name so equal specs compare equal whatever spelling was used.
        object.__setattr__(self, "kv_dtype", canonical_dtype(self.kv_dtype))
        fmt = KV_FORMATS[self.kv_dtype]
        if fmt.has_residual:
            residual = canonical_dtype(self.residual_dtype or "bf16")
            if residual not in RESIDUAL_DTYPES:
                raise ConfigError(f"residual_dtype must be one of {', '.join(RESIDUAL_DTYPES)}, got {residual!r}")
            object.__setattr__(self, "residual_dtype", residual)
        else:  # no residual page: the field means nothing, so it never splits equal specs
            object.__setattr__(self, "residual_dtype", None)
        if self.attention not in ATTENTION_KINDS:
            kinds = ", ".join(ATTENTION_KINDS)
            raise ConfigError(f"attention must be one of {kinds}, got {self.attention!r}")
        self._check_window()
        self._check_mla()
        fmt.check(self.block_size, self.kv_heads, self.head_dim, mla=self.attention == "mla")
        self.kv_heads_per_rank  # noqa: B018 -- raises ConfigError now rather than on first use

    def _check_window(self) -> None:
        if self.attention in ("full", "mla"):
            if self.sliding_window is not None or self.sliding_layers:
                raise ConfigError(
                    f"sliding_window/sliding_layers given but attention is {self.attention!r}; "
                    "use attention='sliding' or 'hybrid'"
                )
            return
        checks.positive(self.sliding_window, f"sliding_window (needed by attention={self.attention!r})")
        if self.attention == "sliding":
            # Every layer slides; 0 is the "not given" default.
            if self.sliding_layers not in (0, self.layers):
                raise ConfigError(
                    f"attention='sliding' means all {self.layers} layers slide, got sliding_layers="
                    f"{self.sliding_layers}; use attention='hybrid' for a mix"
                )
            object.__setattr__(self, "sliding_layers", self.layers)
        else:  # hybrid
            if self.sliding_layers == 0:
                # Default to Gemma 2's pattern: every other layer slides (layers 0, 2, 4, ...).
                object.__setattr__(self, "sliding_layers", (self.layers + 1) // 2)
            checks.positive(self.sliding_layers, "sliding_layers")
            if self.sliding_layers > self.layers:
                raise ConfigError(
                    f"sliding_layers ({self.sliding_layers}) cannot exceed layers ({self.layers})"
                )

    def _check_mla(self) -> None:
        if self.attention == "mla":
            checks.positive(self.kv_lora_rank, "kv_lora_rank (required for attention='mla')")
            checks.non_negative(self.rope_dim, "rope_dim")
        elif self.kv_lora_rank or self.rope_dim:
            raise ConfigError("kv_lora_rank/rope_dim are only meaningful with attention='mla'")

    # ---- per-rank head layout -------------------------------------------------------------

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads each rank stores. With tp > kv_heads each rank keeps one (replicated) head."""
        if self.attention == "mla":
            # The latent is shared by all heads, so it cannot be split: every rank holds all of it.
            return 1
        if self.kv_heads % self.tp == 0:
            return self.kv_heads // self.tp
        if self.tp % self.kv_heads == 0:
            return 1
        raise ConfigError(
            f"tp={self.tp} must divide the {self.kv_heads} KV heads or be a multiple of them"
        )

    @property
    def kv_replication(self) -> int:
        """How many ranks hold a copy of each KV head (or of the MLA latent)."""
        if self.attention == "mla":
            return self.tp
        return 1 if self.kv_heads >= self.tp else self.tp // self.kv_heads

    @property
    def format(self) -> KVFormat:
        """The KV format: its byte layout, scales and residual (`core.sizing.kv_formats`)."""
        return KV_FORMATS[self.kv_dtype]

    @property
    def kv_format_id(self) -> str:
        """The exact format and its parameters (what a cache context's `kv_dtype` must name)."""
        return self.format.identity(self.block_size, self.residual_dtype)

    def cache_context(self, trust_group: str, model: str, cache_salt: str | None = None) -> CacheContext:
        """A request's cache identity on a pool of this spec (:func:`~kvledger.core.identity.request_context`,
        the one builder, which the engine, the simulators and the fleet's router reach through here):
        ``kv_dtype`` is the exact KV format id (:attr:`kv_format_id`, block size and residual dtype
        included: KV stored in one format is never read as another)."""
        return request_context(trust_group, model, self.kv_format_id, cache_salt)

    @property
    def dtype_bytes(self) -> int | float:
        """Bytes per stored value (0.5 for int4); metadata is not in it (see `layer_block_bytes`)."""
        return KV_DTYPE_BYTES[self.kv_dtype]

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one layer of one block on one rank: K and V values plus their scales and zero points."""
        fmt = self.format
        if self.attention == "mla":
            # One latent vector (compressed KV plus the decoupled RoPE key) per token; no separate K and V.
            # It is quantised like one head of one tensor: half of the K-and-V layout of one head.
            width = self.kv_lora_rank + self.rope_dim
            return fmt.layer_block_bytes(self.block_size, 1, width) // 2
        return fmt.layer_block_bytes(self.block_size, self.kv_heads_per_rank, self.head_dim)

    @property
    def layer_bytes_per_token(self) -> int | float:
        """Bytes one token costs in one layer on one rank (a fraction when per-block metadata does not
        divide evenly over the block's tokens)."""
        return _exact(self.layer_block_bytes, self.block_size)

    @property
    def bytes_per_token(self) -> int | float:
        """Bytes one token costs on one rank when every layer holds it (the block pool's view):
        `block_bytes / block_size`, metadata included."""
        return _exact(self.block_bytes, self.block_size)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: `block_size` tokens across all layers, metadata included."""
        return self.layers * self.layer_block_bytes

    @property
    def residual_page_bytes(self) -> int:
        """Bytes of one unquantised residual page (int4: one per running sequence); 0 for other formats."""
        if not self.format.has_residual:
            return 0
        if self.residual_dtype is None:  # __post_init__ gives every residual format a residual dtype
            raise InvariantError(f"KV format {self.format.name!r} keeps residual pages but has no residual dtype")
        return self.format.residual_page_bytes(self.block_size, self.kv_heads_per_rank, self.head_dim,
                                               self.layers, self.residual_dtype)

    @property
    def store_constant_bytes(self) -> int:
        """Bytes a store keeps beside its blocks and residual pages whatever their number (kvtc's cache of first
        rows, see `KVFormat.store_constant_bytes`); 0 for every other format."""
        return self.format.store_constant_bytes(self.kv_heads_per_rank, self.head_dim, self.layers)

    def pool_bytes_for(self, num_blocks: int, residual_slots: int = 0) -> int:
        """Bytes of a pool of `num_blocks` blocks and `residual_slots` residual pages (what the runtime's
        store allocates; residual pages exist only for formats that keep one), plus the store's constant bytes."""
        pages = residual_slots if self.format.has_residual else 0
        return num_blocks * self.block_bytes + pages * self.residual_page_bytes + self.store_constant_bytes

    # ---- blocks and pools -------------------------------------------------------------------

    def blocks_for_tokens(self, n_tokens: int) -> int:
        """Blocks needed for `n_tokens`; a partly filled tail block is charged whole."""
        return -(-checks.count(n_tokens, "token count") // self.block_size)

    def pool_blocks(self, pool_bytes: int | str, residual_slots: int = 0) -> int:
        """Whole blocks that fit in `pool_bytes` (floor) beside `residual_slots` residual pages (formats
        with a residual only) and the store's constant bytes; a pool below one block is an error."""
        size = parse_bytes(pool_bytes)
        residual = self.pool_bytes_for(0, residual_slots)
        blocks = (size - residual) // self.block_bytes
        if blocks < 1:
            block = format_bytes(self.block_bytes)
            constant = self.store_constant_bytes
            cache = f" and the {format_bytes(constant)} cache of first rows" if constant else ""
            if residual - constant:
                raise ConfigError(
                    f"pool of {format_bytes(size)} holds no {block} KV block beside {residual_slots} "
                    f"{self.kv_dtype} residual page(s) of {format_bytes(self.residual_page_bytes)} (one per running "
                    f"sequence, {format_bytes(residual - constant)}){cache}: give a larger pool or fewer running "
                    "sequences (--max-num-seqs)")
            if constant:
                raise ConfigError(f"pool of {format_bytes(size)} holds no {block} KV block beside the "
                                  f"{format_bytes(constant)} cache of first rows {self.kv_dtype} keeps")
            raise ConfigError(f"pool of {format_bytes(size)} is smaller than one KV block ({block})")
        return blocks

    def kv_bytes_for_sequence(self, n_tokens: int) -> int:
        """Bytes a sequence of `n_tokens` really needs when sliding layers keep only their window.

        Full layers hold all `n_tokens`; sliding layers hold `min(n_tokens, sliding_window)`; each
        layer group is rounded up to whole blocks. The block pool does NOT charge this: its block
        is a uniform page across all layers, so it charges `blocks_for_tokens(n) * block_bytes`
        (the worst case). The difference is what a per-layer-group allocator would save.

        A window that does not start on a block boundary straddles one more block than this
        counts, so a real sliding allocator may hold up to one extra block per sliding layer.
        """
        full_layers = self.layers - self.sliding_layers
        held = full_layers * self.blocks_for_tokens(n_tokens)
        if self.sliding_layers:
            if self.sliding_window is None:  # __post_init__ gives sliding layers a window
                raise InvariantError(f"{self.sliding_layers} sliding layers without a sliding window")
            held += self.sliding_layers * self.blocks_for_tokens(min(n_tokens, self.sliding_window))
        return held * self.layer_block_bytes

    def pool_bytes_for_sequence(self, n_tokens: int) -> int:
        """Bytes the block pool charges for `n_tokens` (whole blocks, every layer)."""
        return self.blocks_for_tokens(n_tokens) * self.block_bytes

    # ---- construction from a Hugging Face config -------------------------------------------

    @classmethod
    def from_hf_config(
        cls,
        cfg: dict[str, Any],
        *,
        kv_dtype: str | None = None,
        tp: int = 1,
        block_size: int = 16,
        name: str | None = None,
        residual_dtype: str | None = None,
    ) -> KVSpec:
        """Build a spec from a Hugging Face `config.json` dict.

        Handles Llama, Mistral (sliding window on every layer unless null), Qwen2 (window only
        when `use_sliding_window`), Gemma 2 (window on every other layer), Gemma 3 style
        `sliding_window_pattern` or `layer_types`, and DeepSeek-V2/V3 MLA (`kv_lora_rank`).
        The KV dtype defaults to the checkpoint's `torch_dtype` (see `default_dtype`).
        """
        cfg = text_config(cfg)
        layers = config_int(cfg, "num_hidden_layers")
        dtype = default_dtype(cfg) if kv_dtype is None else kv_dtype
        common = dict(kv_dtype=dtype, tp=tp, block_size=block_size, name=name, residual_dtype=residual_dtype)
        if cfg.get("kv_lora_rank") is not None:
            rank = config_int(cfg, "kv_lora_rank")
            rope = config_int(cfg, "qk_rope_head_dim", minimum=0)
            # One latent "head" as wide as the latent; it is what every rank caches.
            return cls(layers, 1, rank + rope, attention="mla", kv_lora_rank=rank, rope_dim=rope, **common)
        heads = config_int(cfg, "num_attention_heads")
        kv_heads = config_int(cfg, "num_key_value_heads", default=heads)
        if cfg.get("head_dim") is not None:
            head_dim = config_int(cfg, "head_dim")
        else:
            hidden = config_int(cfg, "hidden_size")
            if hidden % heads:
                raise ConfigError(
                    f"hidden_size {hidden} is not divisible by num_attention_heads {heads}; give head_dim"
                )
            head_dim = hidden // heads
        window, sliding = _sliding_layout(cfg, layers)
        if sliding == 0:
            return cls(layers, kv_heads, head_dim, **common)
        kind = "sliding" if sliding == layers else "hybrid"
        return cls(layers, kv_heads, head_dim, attention=kind, sliding_window=window,
                   sliding_layers=sliding, **common)


@dataclass(frozen=True, slots=True)
class StateGeometry:
    """The fixed-size state of a model's Mamba-2 or gated-delta-net (linear attention) layers on one rank:
    a conv state and a temporal (SSM) state per layer and request, whatever the sequence length (vLLM's
    ``MambaSpec.shapes``, ``MambaStateShapeCalculator``). ``kind`` is "mamba" or "linear_attention". `KVSpec`
    counts these layers among its ``layers`` (the uniform pool charges them per token like attention layers);
    ``core.sizing.hybrid.hybrid_plan`` gives them their own groups."""

    kind: str
    layers: int
    conv_shape: tuple[int, int]
    ssm_shape: tuple[int, int, int]
    dtype_bytes: int  # conv and temporal state in the model's dtype (vLLM's mamba_cache_dtype "auto")

    @property
    def layer_state_bytes(self) -> int:
        """One layer's state for one request (vLLM's ``MambaSpec.page_size_bytes`` before padding)."""
        (a, b), (c, d, e) = self.conv_shape, self.ssm_shape
        return (a * b + c * d * e) * self.dtype_bytes


_STATE_KINDS = {"mamba": "mamba", "linear_attention": "linear_attention"}


def state_geometry(cfg: dict[str, Any], tp: int = 1) -> StateGeometry | None:
    """The state layers a config declares in ``layer_types`` or ``layers_block_type`` ("mamba":
    Granite-4.0-H / Nemotron-H / Zamba2 style Mamba-2; "linear_attention": Qwen3-Next's gated delta net);
    None when it declares none."""
    cfg = text_config(cfg)
    kinds = cfg.get("layer_types")
    if not isinstance(kinds, list):
        kinds = cfg.get("layers_block_type")
    if not isinstance(kinds, list):
        return None
    found = {_STATE_KINDS[str(k)] for k in kinds if str(k) in _STATE_KINDS}
    if not found:
        return None
    if len(found) > 1:
        raise ConfigError("a config with both Mamba and linear-attention layers is not planned")
    kind = found.pop()
    layers = sum(1 for k in kinds if str(k) in _STATE_KINDS)
    width = _state_dtype_bytes(default_dtype(cfg))

    def split(n: int, what: str) -> int:
        if n % tp:
            raise ConfigError(f"tp={tp} must divide {what} ({n})")
        return n // tp

    if kind == "mamba":
        heads = config_int(cfg, "mamba_n_heads")
        head_dim = config_int(cfg, "mamba_d_head")
        d_state = config_int(cfg, "mamba_d_state")
        groups = config_int(cfg, "mamba_n_groups", default=1)
        d_conv = config_int(cfg, "mamba_d_conv", default=4)
        inner = config_int(cfg, "mamba_expand", default=2) * config_int(cfg, "hidden_size")
        if groups % tp:  # vLLM's extra_groups_for_head_shards: groups replicated up to tp
            groups = tp
        conv = (d_conv - 1, split(inner + 2 * groups * d_state, "the Mamba conv width"))
        ssm = (split(heads, "mamba_n_heads"), head_dim, d_state)
    else:
        k_heads = config_int(cfg, "linear_num_key_heads")
        v_heads = config_int(cfg, "linear_num_value_heads")
        k_dim = config_int(cfg, "linear_key_head_dim")
        v_dim = config_int(cfg, "linear_value_head_dim")
        d_conv = config_int(cfg, "linear_conv_kernel_dim", default=4)
        conv = (d_conv - 1, split(2 * k_heads * k_dim + v_heads * v_dim, "the linear-attention conv width"))
        ssm = (split(v_heads, "linear_num_value_heads"), v_dim, k_dim)
    return StateGeometry(kind, layers, conv, ssm, width)


def _state_dtype_bytes(kv_dtype: str) -> int:
    name = canonical_dtype(kv_dtype)
    if name not in ("bf16", "fp16", "fp32"):
        raise ConfigError(f"state layers are planned in bf16, fp16 or fp32 (the model's dtype), not {name}")
    return 4 if name == "fp32" else 2


def _exact(n: int, d: int) -> int | float:
    return n // d if n % d == 0 else n / d


# ---- helpers for reading Hugging Face config dicts (shared with inventory.py) ----------------

_MISSING = object()


def text_config(cfg: Any) -> dict[str, Any]:
    """The language-model part of a config: multimodal configs (Gemma 3) nest it in `text_config`."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"model config must be a JSON object, got {type(cfg).__name__}")
    inner = cfg.get("text_config")
    if "num_hidden_layers" not in cfg and isinstance(inner, dict):
        return {"model_type": cfg.get("model_type"), "torch_dtype": cfg.get("torch_dtype"), **inner}
    return cfg


CONFIG_INT_MAX = 2**40  # no real config value (widths, vocabulary, context) comes near it
_KEY_MAX = {"num_hidden_layers": 10_000}  # loops run over layers: keep them short


def config_int(cfg: dict[str, Any], key: str, *, default: Any = _MISSING, minimum: int = 1,
               maximum: int = CONFIG_INT_MAX) -> int:
    """Read an integer key; a missing key falls back to `default` or is an error naming the key.

    A key present with value null counts as missing (HF writes nulls for unset options). Values are
    bounded to [minimum, maximum], so a hostile config cannot make later arithmetic or loops explode.
    """
    value = cfg.get(key)
    if value is None:
        if default is _MISSING:
            raise ConfigError(f"model config is missing required key {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ConfigError(f"model config key {key!r} must be an integer, got {shown}")
    maximum = min(maximum, _KEY_MAX.get(key, maximum))
    if not minimum <= value <= maximum:
        shown = str(value) if value.bit_length() < 64 else f"a {value.bit_length()}-bit integer"
        raise ConfigError(f"model config key {key!r} must be in [{minimum}, {maximum}], got {shown}")
    return value


def default_dtype(cfg: dict[str, Any]) -> str:
    """The serving dtype implied by a config: its `torch_dtype` (or newer `dtype`), else bf16.

    fp32 checkpoints (e.g. Gemma 2) map to bf16: serving engines run them in 16-bit by default,
    and a 4-byte KV cache would double every number in the ledger for no realistic reason.
    """
    raw = cfg.get("torch_dtype") or cfg.get("dtype")
    if not isinstance(raw, str):
        return "bf16"
    try:
        name = canonical_dtype(raw)
    except ConfigError:
        return "bf16"
    return "bf16" if name == "fp32" else name


def _sliding_layout(cfg: dict[str, Any], layers: int) -> tuple[int | None, int]:
    """(window, number of sliding layers) for a non-MLA config; (None, 0) when nothing slides."""
    model_type = str(cfg.get("model_type") or "")
    key = "sliding_window" if cfg.get("sliding_window") is not None else "sliding_window_size"
    window = config_int(cfg, key, default=None)
    if window is None:
        return None, 0
    if cfg.get("use_sliding_window") is False:  # Qwen2 ships a window but turns it off
        return None, 0
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list):
        # Newer transformers configs spell the per-layer pattern out; trust it over model_type.
        if len(layer_types) != layers:
            raise ConfigError(
                f"model config key 'layer_types' has {len(layer_types)} entries for {layers} layers"
            )
        return window, sum(1 for t in layer_types if t == "sliding_attention")
    if model_type == "gemma2":
        # Gemma 2 alternates, starting with a sliding layer at index 0.
        return window, (layers + 1) // 2
    if cfg.get("sliding_window_pattern") is not None:
        # Gemma 3 style: every `pattern`-th layer is global, the rest slide.
        pattern = config_int(cfg, "sliding_window_pattern")
        return window, layers - layers // pattern
    if cfg.get("use_sliding_window") is True and cfg.get("max_window_layers") is not None:
        # Qwen2 with the window on: layers from index max_window_layers upward slide.
        first = config_int(cfg, "max_window_layers", minimum=0)
        return window, max(0, layers - first)
    return window, layers


__all__ = [
    "ATTENTION_KINDS", "ELEMENT_BYTES", "KV_DTYPE_BYTES", "KV_FORMATS", "KVSpec", "StateGeometry", "canonical_dtype",
    "config_int", "default_dtype", "state_geometry",
    "dtype_bytes", "text_config",
]
