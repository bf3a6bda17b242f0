"""KV cache formats: how one block of K and V is laid out in bytes, metadata included.

A format says, for one layer of one block (``B`` tokens, ``H`` KV heads of width ``D`` on one rank),
exactly which arrays hold K and which hold V, in order, with their element types. Every byte figure in
kvledger -- bytes per token, block bytes, the pool the planner sizes, the tensor the runtime allocates --
is a sum over :meth:`KVFormat.parts`, so the planner and the store cannot disagree.

Formats (the registry :data:`KV_FORMATS`; ``--kv-cache-dtype`` takes its names and vLLM's, :data:`VLLM_NAMES`):

``fp32``, ``bf16``, ``fp16``
    Plain storage of the values. Not quantised.
``fp8_e4m3`` (vLLM's ``fp8``), ``fp8_e5m2``
    A plain cast to 8-bit floats with no scale (vLLM's layout with its default per-tensor scale of 1.0):
    1 byte per value, no metadata. Values outside the format's range saturate; small values lose
    precision. Quantised.
``fp8-scaled``
    kvledger's e4m3 codes with one fp16 scale per token and KV head: ``code = e4m3(x / s)``,
    ``s = amax / 448``. Not vLLM's ``fp8`` (which is unscaled): the scales cost 2 bytes per token and head.
``int8``
    KIVI/KVQuant-style int8: keys asymmetric per channel over the block's tokens (uint8 codes, one fp16
    scale and minimum per block, head and channel: an outlier channel gets its own grid, and a channel
    with a large steady offset spends its 256 codes on its spread); values turned by the Walsh-Hadamard
    matrix per head (readers turn them back), then symmetric int8 with one fp16 scale per token and head.
    Like ``int4`` a block that is not yet full keeps its rows unquantised in a residual page. On
    SmolLM2-135M it moves the next-token distribution no further than a bf16 cache does
    (``benchmarks/kv_quality.py``; docs/kv_formats.md has the figures). Called ``int8-channel`` before; that
    name is still read as ``int8`` (:data:`RENAMED`).
``int8-token``
    Symmetric int8 with one fp16 scale per token and KV head: ``code = round(x / s)``, ``s = amax / 127``.
    What ``int8`` meant before: one scale per token cannot follow keys with outlier channels (SmolLM2's
    reach 4.85x the row's RMS), so it fails the int8 contract there; kept selectable for comparison.
``int8-hadamard``
    ``int8-token`` whose keys are first turned by a fixed orthogonal rotation per head (the normalised
    Walsh-Hadamard matrix ``H``, ``H @ H.T = I``; head_dim a power of two): an outlier channel's energy is
    spread over all channels, so one scale per token fits every channel. Scores are unchanged in exact
    arithmetic (``(q H) . (k H) = q . k``): readers de-rotate the keys or rotate the queries alike. Same
    bytes as ``int8-token``.
``int4-hadamard``
    4-bit with keys and values both turned per head by the Walsh-Hadamard matrix (an outlier channel's
    energy spread over every channel, so one grid per token fits the row), then asymmetric per token and
    head: two codes per byte, one fp16 scale and minimum per token and head (KIVI's value scheme), no
    residual page. ``4 / (1 + 4/D)`` fewer bytes than bf16 at any block size: 3.56x at ``D = 64``.
``int4-smooth``
    ``int4-hadamard`` whose keys are first smoothed by static constants calibrated once per model (not
    per token, so no bytes per token): ``(k - mu) / s`` per layer, KV head and channel, then turned and
    quantised as ``int4-hadamard``. Subtracting ``mu`` shifts every score of a query by the same
    ``q . mu`` (softmax unchanged), and dividing a channel by ``s`` is undone by multiplying the query's
    channel by ``s``, so scores are unchanged in exact arithmetic; the rotation then no longer spreads a
    channel's large steady offset over the row. Same bytes as ``int4-hadamard``.
``kvtc``
    Transform coding (``runtime.kv_transform``), 3.5x fewer bytes than bf16: per layer and KV head, keys turned
    back to before RoPE and values are taken into a calibrated basis whitened by what an error costs there (the
    model's own tables, fitted once per weights revision like ``int4-smooth``'s constants), and each head's block
    of rows is entropy-coded at the smallest step whose words fit a slot of fixed bytes. A layer's parts are its
    share of the block's page (:data:`CODED_KEY_BYTES` and :data:`CODED_VALUE_BYTES` a head-row per 64 channels);
    the store lays every layer-head's slot, each as wide as its table gives it, over the block's whole page, the
    block's first position in front. A block that is not yet full keeps its rows unquantised in a residual page,
    as ``int4``. A sequence's first row is kept at bf16 inside its first block's bytes.
``int4``
    KIVI-style asymmetric 4-bit, two values per byte. Keys per channel within the block (the block is
    the quantisation group: ``B`` tokens share a scale and minimum per channel), values per token (one
    scale and minimum per token and head over its ``D`` channels). Scales and minimums are fp16. A
    block that is not yet full keeps its rows unquantised in a residual page (``residual_dtype``); it is
    quantised when its last row is written. The residual is charged per running sequence, not per
    block: see :meth:`KVFormat.residual_page_bytes`.

Why per token and head for fp8-scaled and int8-token (not per block and head): a block is written one token at a
time during decode, so a block-wide scale is not known until the block is full; a per-token scale is
fixed when the token is written, needs no requantisation and leaves copy-on-write a byte copy. It costs
2 bytes per token and head (3% at ``D = 64``, 1.6% at ``D = 128``).

Pure standard library: the core stays embeddable.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from ..registry import Registry

# Bytes per element of the element types a part may hold.
ELEMENT_BYTES: dict[str, int] = {
    "fp32": 4, "bf16": 2, "fp16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1, "uint8": 1,
}
RESIDUAL_DTYPES = ("fp32", "bf16", "fp16")  # what an unquantised residual page may be stored as
# kvtc's page, a head-row's share per 64 channels: 33 bytes of keys and 40 of values (4.125 and 5 bits a value),
# 73 a head and token, 3.507x fewer than bf16's 256. Keys take less: before RoPE they are the more predictable.
CODED_KEY_BYTES = 33
CODED_VALUE_BYTES = 40
# kvtc keeps a sequence's first row out of its page: a store caches the rows of this many first tokens (K and V of
# every layer, fp32), whatever its number of blocks, and the pool it is sized in pays for them (1.5 MB for SmolLM2).
FIRST_ROW_CACHE_TOKENS = 32


@dataclass(frozen=True, slots=True)
class Part:
    """One array of a block's layout (per layer, per rank): ``shape`` of ``element``, ``kv`` 'k' or 'v'."""

    kv: str
    name: str
    shape: tuple[int, ...]
    element: str

    @property
    def count(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.count * ELEMENT_BYTES[self.element]


# The format of the same bytes per value that turns nothing, named when a head_dim rules out the rotation.
UNTURNED: dict[str, str] = {"int8": "int8-token", "int8-hadamard": "int8-token", "int4-hadamard": "int4"}


@dataclass(frozen=True, slots=True)
class KVFormat:
    """A KV representation. ``scales``: ``none`` (plain), ``token-head`` (fp8-scaled/int8-token), ``channel``
    (int8: K asymmetric per channel per block, V per token), ``kivi`` (int4) or ``token4`` (int4-hadamard:
    K and V asymmetric 4-bit per token and head). ``rotation``: which of K and V
    are turned per head by the normalised Walsh-Hadamard matrix before quantisation (``""``, ``k``, ``v``,
    ``kv``). ``smooth``: which of K and V are stored smoothed by static calibrated per-channel constants
    (``(x - mu) / s``, the model's own, see ``runtime.kv_smoothing``): ``""`` or ``k``. ``coded`` (kvtc): every
    layer-head's block in an entropy-coded slot of the page (``runtime.kv_transform``)."""

    name: str
    summary: str
    value_bits: int
    quantized: bool
    scales: str
    element: str  # element type of the stored values (int4 codes are packed into uint8)
    rotation: str = ""
    smooth: str = ""

    def rotates(self, kv: str) -> bool:
        """Whether ``kv`` ('k' or 'v') is stored turned by the Walsh-Hadamard matrix."""
        return kv in self.rotation

    @property
    def plain(self) -> bool:
        return self.scales == "none"

    @property
    def has_residual(self) -> bool:
        """A block that is not yet full keeps its rows unquantised in a per-sequence residual page."""
        return self.scales in ("kivi", "channel", "coded")

    def check(self, block_size: int, heads: int, head_dim: int, *, mla: bool = False) -> None:
        if self.scales in ("kivi", "token4"):
            if mla and self.scales == "kivi":
                raise ConfigError("the int4 format quantises K per channel and V per token; an MLA latent "
                                  "cache is neither (use fp8-scaled or int8-token)")
            if head_dim % 2:
                raise ConfigError(f"int4 packs two values per byte: head_dim must be even, got {head_dim}")
        if self.scales == "coded":
            if mla:
                raise ConfigError(f"{self.name} codes K before RoPE and V per KV head; an MLA latent cache is neither")
            if head_dim % 64:
                raise ConfigError(f"{self.name} gives a head-row its page share per 64 channels: head_dim must be a "
                                  f"multiple of 64, got {head_dim}")
        if self.smooth and mla:
            raise ConfigError(f"{self.name} smooths keys per KV head and channel; an MLA latent cache has neither")
        if self.scales == "channel" and mla:
            raise ConfigError(f"{self.name} quantises K per channel and V per token; an MLA latent cache is "
                              "neither (use int8-token)")
        if self.rotation and (head_dim <= 0 or head_dim & (head_dim - 1)):
            turned = " and ".join(w for kv, w in (("k", "keys"), ("v", "values")) if self.rotates(kv))
            other = UNTURNED.get(self.name)
            raise ConfigError(f"{self.name} turns its {turned} by a Walsh-Hadamard matrix: head_dim must be a power "
                              f"of two, got {head_dim}" + (f" (use {other})" if other else ""))

    def parts(self, block_size: int, heads: int, head_dim: int) -> tuple[Part, ...]:
        """The arrays of one layer of one block, K first, in storage order."""
        B, H, D = block_size, heads, head_dim
        if self.scales == "none":
            return (Part("k", "values", (B, H, D), self.element), Part("v", "values", (B, H, D), self.element))
        if self.scales == "token-head":
            return tuple(p for kv in "kv" for p in (Part(kv, "codes", (B, H, D), self.element),
                                                    Part(kv, "scale", (B, H), "fp16")))
        if self.scales == "token4":
            return tuple(p for kv in "kv" for p in (Part(kv, "codes", (B, H, D // 2), "uint8"),
                                                    Part(kv, "scale", (B, H), "fp16"), Part(kv, "min", (B, H), "fp16")))
        if self.scales == "coded":
            return (Part("k", "slots", (B, H, coded_row_bytes("k", D)), "uint8"),
                    Part("v", "slots", (B, H, coded_row_bytes("v", D)), "uint8"))
        if self.scales == "channel":
            return (Part("k", "codes", (B, H, D), "uint8"), Part("k", "scale", (H, D), "fp16"),
                    Part("k", "min", (H, D), "fp16"),
                    Part("v", "codes", (B, H, D), self.element), Part("v", "scale", (B, H), "fp16"))
        # KIVI: keys per channel over the block's tokens, values per token over the head's channels.
        return (Part("k", "codes", (B, H, D // 2), "uint8"), Part("k", "scale", (H, D), "fp16"),
                Part("k", "min", (H, D), "fp16"),
                Part("v", "codes", (B, H, D // 2), "uint8"), Part("v", "scale", (B, H), "fp16"),
                Part("v", "min", (B, H), "fp16"))

    def layer_block_bytes(self, block_size: int, heads: int, head_dim: int) -> int:
        """Bytes of K and V of one layer of one block on one rank, metadata included."""
        return sum(p.nbytes for p in self.parts(block_size, heads, head_dim))

    def residual_page_bytes(self, block_size: int, heads: int, head_dim: int, layers: int,
                            residual_dtype: str) -> int:
        """Bytes of one unquantised residual page: a whole block of K and V in ``residual_dtype``.

        One page per running sequence (its partly written tail block) is enough, so a pool serving at
        most ``S`` sequences at once charges ``S`` pages beside its blocks; a format without a residual
        charges nothing."""
        if not self.has_residual:
            return 0
        return layers * 2 * block_size * heads * head_dim * ELEMENT_BYTES[residual_dtype]

    def store_constant_bytes(self, heads: int, head_dim: int, layers: int) -> int:
        """Bytes a store of this format keeps beside its blocks and residual pages whatever their number: kvtc's
        cache of first rows (:data:`FIRST_ROW_CACHE_TOKENS` tokens' K and V, every layer, fp32); 0 for the others.
        A model's constant tables (kvtc's bases, int4-smooth's constants) are the model's, not the pool's."""
        if self.scales != "coded":
            return 0
        return FIRST_ROW_CACHE_TOKENS * layers * 2 * heads * head_dim * ELEMENT_BYTES["fp32"]

    def identity(self, block_size: int, residual_dtype: str | None) -> str:
        """The exact format and its parameters, as the prefix-cache identity records it."""
        if self.scales == "none":
            return self.name
        if self.scales == "token-head":
            kind = "e4m3" if self.name == "fp8-scaled" else "sym"
            rot = f",rot=hadamard/{self.rotation}" if self.rotation else ""
            return f"{self.name}:{kind}{rot},scale=fp16/token-head"
        if self.scales == "token4":
            smooth = f",smooth={self.smooth}:(x-mu)/s,static/channel,calib=v1" if self.smooth else ""
            return f"{self.name}:k=v=asym4/token-head,rot=hadamard/{self.rotation or '-'}{smooth},meta=fp16"
        if self.scales == "coded":
            return (f"{self.name}:k=pre-rope,v;klt/whitened,rans/{CODED_KEY_BYTES}+{CODED_VALUE_BYTES}B-per-64,"
                    f"tables=weights-revision,sink=exact/first-token,else-held=1,"
                    f"residual={residual_dtype}/{block_size}")
        if self.scales == "channel":
            rot = f",rot=hadamard/{self.rotation}" if self.rotation else ""
            return (f"{self.name}:k=asym/channel/group{block_size},v=sym/token-head{rot},meta=fp16,"
                    f"residual={residual_dtype}/{block_size}")
        return (f"int4:kivi,k=asym/channel/group{block_size},v=asym/token,meta=fp16,"
                f"residual={residual_dtype}/{block_size}")


def coded_row_bytes(kv: str, head_dim: int) -> int:
    """kvtc's page share of one head-row of ``kv`` ('k' or 'v'), in bytes (``head_dim`` a multiple of 64)."""
    return (CODED_KEY_BYTES if kv == "k" else CODED_VALUE_BYTES) * head_dim // 64


def _fmt(name: str, summary: str, bits: int, quantized: bool, scales: str, element: str,
         rotation: str = "", smooth: str = "") -> KVFormat:
    return KVFormat(name, summary, bits, quantized, scales, element, rotation, smooth)


KV_FORMATS: Registry[KVFormat] = Registry("KV format")
for _format in (
    _fmt("fp32", "plain fp32", 32, False, "none", "fp32"),
    _fmt("bf16", "plain bf16", 16, False, "none", "bf16"),
    _fmt("fp16", "plain fp16", 16, False, "none", "fp16"),
    _fmt("fp8_e4m3", "plain e4m3 cast, no scale (vLLM's layout, scale 1.0)", 8, True, "none", "fp8_e4m3"),
    _fmt("fp8_e5m2", "plain e5m2 cast, no scale (vLLM's layout, scale 1.0)", 8, True, "none", "fp8_e5m2"),
    _fmt("fp8-scaled", "e4m3 with an fp16 scale per token and KV head (kvledger's; vLLM's fp8 is unscaled)", 8, True,
         "token-head", "fp8_e4m3"),
    _fmt("int8", "int8 with keys asymmetric per channel per block (KIVI-style), values turned by a "
         "Walsh-Hadamard matrix then per token, fp16 scales and minimums, unquantised residual for the partly "
         "written block", 8, True, "channel", "int8", "v"),
    _fmt("int8-token", "symmetric int8 with an fp16 scale per token and KV head (int8's meaning before; fails the "
         "int8 contract on models whose keys have outlier channels)", 8, True, "token-head", "int8"),
    _fmt("int8-hadamard", "int8-token with keys turned by a normalised Walsh-Hadamard matrix per head before "
         "quantising", 8, True, "token-head", "int8", "k"),
    _fmt("int4-hadamard", "4-bit with K and V turned by a Walsh-Hadamard matrix per head, then asymmetric per token "
         "and head (fp16 scale and minimum), no residual page", 4, True, "token4", "uint8", "kv"),
    _fmt("int4-smooth", "int4-hadamard with keys first smoothed by the model's calibrated per-channel mean and scale "
         "(static, scores unchanged)", 4, True, "token4", "uint8", "kv", "k"),
    _fmt("kvtc", "transform-coded: keys before RoPE and values in the model's calibrated whitened bases, entropy-coded "
         "into fixed slots (3.5x fewer bytes than bf16, tables per weights revision), unquantised residual for the "
         "partly written block", 4, True, "coded", "uint8"),
    _fmt("int4", "KIVI-style 4-bit: K per channel per block, V per token, fp16 scale and minimum, "
         "unquantised residual for the partly written block", 4, True, "kivi", "uint8"),
):
    KV_FORMATS.register(_format.name, _format, _format.summary)


# vLLM's --kv-cache-dtype values that name one of these formats under another name ("auto" is the model's
# dtype, resolved by the caller). vLLM's "fp8" is e4m3 with no scale beside the values: our fp8_e4m3.
VLLM_NAMES: dict[str, str] = {"fp8": "fp8_e4m3", "bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


# Names a format had before and is still read by: a script written against the old name keeps working, and
# means what the format means now (the identity, records and cached blocks all carry the new name).
RENAMED: dict[str, str] = {"int8-channel": "int8"}


def vllm_serves(fmt: KVFormat) -> bool:
    """Whether vLLM stores this format: plain values only (its fp8 caches keep at most a per-tensor scale,
    never a scale per token or a 4-bit code)."""
    return fmt.plain


def get_kv_format(name: str) -> KVFormat:
    """A format by its name, vLLM's (``fp8`` is ``fp8_e4m3``) or a former one (:data:`RENAMED`)."""
    if isinstance(name, str):
        name = RENAMED.get(name, VLLM_NAMES.get(name, name))
    found = KV_FORMATS.get(name)
    if found is None:
        raise ConfigError(f"unknown KV format {name!r} (known: {', '.join(KV_FORMATS)})")
    return found


def quantized_formats() -> list[str]:
    """Names of the lossy formats (the ones that need a passing quality record to be served)."""
    return [name for name, f in KV_FORMATS.items() if f.quantized]


__all__ = ["CODED_KEY_BYTES", "CODED_VALUE_BYTES", "ELEMENT_BYTES", "FIRST_ROW_CACHE_TOKENS", "KV_FORMATS", "RENAMED",
           "RESIDUAL_DTYPES", "UNTURNED", "VLLM_NAMES", "KVFormat", "Part", "coded_row_bytes", "get_kv_format",
           "quantized_formats", "vllm_serves"]
