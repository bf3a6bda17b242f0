"""Cache identity: what a block's KV state depends on, as a chained cryptographic digest.

A block's KV values depend on every token before it (attention mixes them in), on the weights that
produced them (model, revision, adapter), on how they are stored (KV dtype), and -- for safety rather
than numerics -- on who may read them (the trust group). Two blocks may share physical memory only when
all of that is identical, so the digest of block *i* covers:

    root   = BLAKE2b[person="kvledger.ctx.v2"]( field_1 || field_2 || ... )   # the context, once
    d_0    = BLAKE2b( root  || tokens[0 : B] )
    d_i    = BLAKE2b( d_i-1 || tokens[i*B : (i+1)*B] )

Domain separation, so that different inputs can never encode to the same bytes:
- each context field is written as ``name-length, name, type-tag, value-length, value`` -- a value can
  never spill into the next field (the failure of naive ``a + b`` concatenation, cf. vLLM #44701), and
  values of different types never meet (``None``, ``""``, ``"None"``, ``1``, ``True`` and ``1.0`` are
  six different identities);
- the root uses a BLAKE2b personalisation string, which makes it a different hash function from the
  block chain, so a root can never equal a block digest by construction of the input;
- block inputs have a fixed length (64-byte parent + B tokens x 4 bytes, little-endian uint32), so the
  boundary between parent and tokens is never ambiguous.
Only full blocks get a digest: a partial tail changes as the sequence grows and is never shared.

A context's canonical encoding is computed once, when it is built (bad field types are a
:class:`ConfigError` there), and *is* its identity: two contexts are equal exactly when their encodings
are, so a memo keyed by context can never hand one context the root of another that merely compares
equal in Python (``1 == True == 1.0``).
"""

from __future__ import annotations

import hashlib
import math
import struct
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType

from ..errors import ConfigError
from . import checks, native
from .checks import show

DIGEST_BYTES = 64  # BLAKE2b's native 512-bit output: no truncation step on the hot path
# <= 16 bytes (BLAKE2b's personalisation limit). v2: extra values are encoded with their type.
ROOT_PERSON = b"kvledger.ctx.v2"
_blake2b = hashlib.blake2b
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")
_NATIVE_MAX_BLOCK = 2**16  # the C chain's block-size bound (the ledger's MAX_BLOCK_SIZE)

# Value types an ``extra`` entry may hold, with their one-byte tags (bool before int: it is one).
ExtraValue = None | bool | int | float | str | bytes


def _encode_value(value: ExtraValue, what: str) -> bytes:
    """``type-tag, value-length (u64), value``: values of different types never share an encoding."""
    if value is None:
        return b"n" + _U64.pack(0)
    if isinstance(value, bool):  # before int: True is an int, but not the identity 1
        return b"b" + _U64.pack(1) + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
        return b"i" + _U64.pack(len(data)) + data
    if isinstance(value, float):
        if math.isnan(value):  # one NaN: a NaN payload is not part of anyone's meaning
            value = math.nan
        return b"f" + _U64.pack(8) + _F64.pack(value)
    if isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")  # injective even for lone surrogates
        return b"s" + _U64.pack(len(data)) + data
    if isinstance(value, bytes):
        return b"y" + _U64.pack(len(value)) + value
    raise ConfigError(f"{what} must be None, bool, int, float, str or bytes, got {show(value)}")


def _encode_field(name: str, value: ExtraValue, what: str) -> bytes:
    key = name.encode("utf-8", "surrogatepass")
    return _U32.pack(len(key)) + key + _encode_value(value, what)


@dataclass(frozen=True, slots=True, eq=False)
class CacheContext:
    """Everything besides the token ids that decides whether two KV blocks are interchangeable.

    ``trust_group`` is the tenant (or any isolation domain): blocks are never shared across groups, so
    one tenant can neither read another's cached prefix nor learn from hit timing that it exists.
    ``extra`` holds further (key, value) pairs that change the KV state, e.g. multimodal input hashes
    or a RoPE scaling override; keys are strings, values None, bool, int, float, str or bytes, each
    encoded with its type (a mapping is accepted and kept in its order). Field types are checked here:
    a wrong type is a :class:`ConfigError`, never a silent ``str()``.
    """

    trust_group: str = "default"
    model: str = ""
    revision: str = ""
    adapter: str | None = None
    kv_dtype: str = "bf16"
    extra: tuple[tuple[str, ExtraValue], ...] = ()
    _encoding: bytes = field(default=b"", init=False, repr=False)
    _root: bytes = field(default=b"", init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("trust_group", "model", "revision", "kv_dtype"):
            if type(getattr(self, name)) is not str:
                raise ConfigError(f"CacheContext.{name} must be a string, got {show(getattr(self, name))}")
        if self.adapter is not None and type(self.adapter) is not str:
            raise ConfigError(f"CacheContext.adapter must be a string or None, got {show(self.adapter)}")
        extra = self.extra
        if isinstance(extra, Mapping):
            extra = tuple(extra.items())
        elif isinstance(extra, (str, bytes)) or not hasattr(extra, "__iter__"):
            raise ConfigError(f"CacheContext.extra must be (key, value) pairs, got {show(extra)}")
        pairs: list[tuple[str, ExtraValue]] = []
        for pair in extra:
            if not isinstance(pair, tuple) or len(pair) != 2 or type(pair[0]) is not str:
                raise ConfigError(f"CacheContext.extra entries must be (str key, value) pairs, got {show(pair)}")
            pairs.append(pair)
        if len({k for k, _ in pairs}) != len(pairs):
            raise ConfigError("CacheContext.extra names a key twice")
        object.__setattr__(self, "extra", tuple(pairs))
        parts = [
            _encode_field("trust_group", self.trust_group, "CacheContext.trust_group"),
            _encode_field("model", self.model, "CacheContext.model"),
            _encode_field("revision", self.revision, "CacheContext.revision"),
            _encode_field("adapter", self.adapter, "CacheContext.adapter"),
            _encode_field("kv_dtype", self.kv_dtype, "CacheContext.kv_dtype"),
            _U32.pack(len(pairs)),
        ]
        for key, value in pairs:
            parts.append(_encode_field(key, value, f"CacheContext.extra[{show(key)}]"))
        object.__setattr__(self, "_encoding", b"".join(parts))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CacheContext):
            return NotImplemented
        return self._encoding == other._encoding

    def __hash__(self) -> int:
        return hash(self._encoding)

    @property
    def encoding(self) -> bytes:
        """The canonical bytes the root digest is computed from (equal contexts, equal bytes)."""
        return self._encoding

    def root_digest(self) -> bytes:
        """The chain's root: BLAKE2b of the encoding under the root personalisation (memoised here,
        per instance, so no other context can ever stand in for this one)."""
        root = self._root
        if not root:
            root = _blake2b(self._encoding, digest_size=DIGEST_BYTES, person=ROOT_PERSON).digest()
            object.__setattr__(self, "_root", root)
        return root


def request_context(trust_group: str = "default", model: str = "", kv_format_id: str = "bf16",
                    cache_salt: str | None = None) -> CacheContext:
    """A request's cache identity: the one builder every assembly uses (the engine and the simulators
    through ``KVSpec.cache_context``, which passes its exact KV format id; the admission lab, the web lab
    and the diagnostics, whose pools have no KV format, with the default), so digests built anywhere for
    the same request agree. A request's ``cache_salt`` (vLLM's name) joins the identity: only requests
    with the same salt share blocks."""
    return CacheContext(trust_group=trust_group, model=model, kv_dtype=kv_format_id,
                        extra=(("cache_salt", cache_salt),) if cache_salt is not None else ())


def token_bytes(tokens: list[int] | tuple[int, ...]) -> bytes:
    """Encode token ids as little-endian uint32 (fixed width keeps block inputs unambiguous)."""
    try:
        return array("I", tokens).tobytes()
    except (OverflowError, TypeError) as exc:
        raise ConfigError(f"token ids must be integers in [0, 2**32): {exc}") from None


def chain_digests(parent: bytes, data: bytes, block_size: int) -> list[bytes]:
    """Digests of every *full* block in ``data`` (uint32 token bytes), chained from ``parent``."""
    fast = native.MODULE
    if (fast is not None and type(parent) is bytes and type(data) is bytes and type(block_size) is int
            and 0 < block_size <= _NATIVE_MAX_BLOCK):
        return fast.chain_bytes(parent, data, block_size)  # the same chain, in one C call
    return _chain(parent, data, block_size)


def _chain(parent: bytes, data: bytes, block_size: int) -> list[bytes]:
    step = block_size * 4
    out: list[bytes] = []
    append = out.append
    for start in range(0, len(data) - step + 1, step):
        # 64-byte parent + 64 bytes of tokens (block size 16) is exactly one BLAKE2b compression.
        parent = _blake2b(parent + data[start : start + step]).digest()
        append(parent)
    return out


def prompt_digests(root: bytes, tokens: Sequence[int], block_size: int, fast: ModuleType | None = None) -> list[bytes]:
    """Check every token id of a prompt (``token_bytes``' rule and error) and return the digests of its
    full blocks chained from ``root``: ``chain_digests(root, token_bytes(tokens), block_size)``, in one
    C call when ``fast`` (the native core a ledger was built with) is given."""
    if fast is not None and type(root) is bytes and 0 < block_size <= _NATIVE_MAX_BLOCK:
        digests = fast.prompt_digests(root, tokens, block_size)
        if digests is not None:
            return digests
    data = token_bytes(tokens)  # also what the C call declines: an integer-like or a bad id
    if fast is not None and type(root) is bytes and 0 < block_size <= _NATIVE_MAX_BLOCK:
        return fast.chain_bytes(root, data, block_size)
    return _chain(root, data, block_size)


def check_tokens(tokens: Sequence[int], fast: ModuleType | None = None) -> None:
    """Check every token id as :func:`token_bytes` does (its error), without keeping the bytes."""
    if fast is None or not fast.check_tokens(tokens):
        token_bytes(tokens)


def block_digest(parent: bytes, tokens: list[int]) -> bytes:
    """Digest of one full block of ``tokens`` whose predecessor's digest is ``parent``."""
    return _blake2b(parent + token_bytes(tokens)).digest()


def block_digest_at(parent: bytes, tokens: list[int], start: int, block_size: int,
                    fast: ModuleType | None = None) -> bytes:
    """``block_digest(parent, tokens[start : start + block_size])`` without the slice (a growing
    sequence's newest full block)."""
    if fast is not None and type(parent) is bytes and 0 < block_size <= _NATIVE_MAX_BLOCK:
        digest = fast.block_digest(parent, tokens, start, block_size)
        if digest is not None:
            return digest
    return _blake2b(parent + token_bytes(tokens[start : start + block_size])).digest()


@dataclass(frozen=True, slots=True)
class MMItem:
    """A multimodal input (an image) whose placeholder tokens cover prompt positions ``[offset, offset + length)``.
    Its hash is an extra key of exactly the blocks it covers, with the item's offset relative to each block (vLLM's
    per-block ``(mm hash, offset)``): text blocks before the image keep their plain digests and are shared across
    requests with different images; the blocks it covers, and every block after them (the chain), are the image's
    own."""

    mm_hash: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.mm_hash, str) or not self.mm_hash:
            raise ConfigError("MMItem.mm_hash must be a non-empty string")
        checks.count(self.offset, "MMItem.offset")
        checks.positive(self.length, "MMItem.length")


def mm_items_of(items: object, limit: int, what: str) -> tuple[MMItem, ...]:
    """``items`` as a tuple of `MMItem` values within the first ``limit`` positions (else a ConfigError)."""
    if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
        raise ConfigError(f"{what}: mm_items must be MMItem values, got {show(items)}")
    out = tuple(items)  # type: ignore[arg-type]
    if not all(isinstance(m, MMItem) and m.offset + m.length <= limit for m in out):
        raise ConfigError(f"{what}: mm_items must be MMItem values within the first {limit} positions")
    return out


def block_key(parent: bytes, tokens: list[int], start: int, mm_items: tuple[MMItem, ...] = ()) -> bytes:
    """The digest of the block of ``tokens`` at prompt position ``start``: the chain (`block_digest`), and for a
    block an image covers, the image's hash and offset folded in (a block no image covers: `block_digest`)."""
    digest = block_digest(parent, tokens)
    end = start + len(tokens)
    extra = [f"{m.mm_hash}@{m.offset - start}".encode() for m in mm_items
             if m.offset < end and start < m.offset + m.length]
    if extra:
        digest = block_digest(digest + b"\x00mm\x00" + b"\x00".join(extra), [])
    return digest


def mm_prompt_digests(root: bytes, tokens: Sequence[int], block_size: int, mm_items: tuple[MMItem, ...],
                      fast: ModuleType | None = None) -> list[bytes]:
    """`prompt_digests` with images: the full blocks' digests, each block an image covers keyed by it
    (`block_key`). The blocks before the first image are `prompt_digests`' own (computed by it)."""
    if not mm_items:
        return prompt_digests(root, tokens, block_size, fast)
    first = min(m.offset for m in mm_items) // block_size  # blocks before it: plain
    out = prompt_digests(root, tokens[:first * block_size], block_size, fast)
    check_tokens(tokens[first * block_size:], fast)
    parent = out[-1] if out else root
    tokens = list(tokens)
    for j in range(first, len(tokens) // block_size):
        parent = block_key(parent, tokens[j * block_size:(j + 1) * block_size], j * block_size, mm_items)
        out.append(parent)
    return out
