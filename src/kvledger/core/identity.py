"""Cache identity: what a block's KV state depends on, as a chained cryptographic digest.

A block's KV values depend on every token before it (attention mixes them in), on the weights that
produced them (model, revision, adapter), on how they are stored (KV dtype), and -- for safety rather
than numerics -- on who may read them (the trust group). Two blocks may share physical memory only when
all of that is identical, so the digest of block *i* covers:

    root   = BLAKE2b[person="kvledger.ctx.v1"]( field_1 || field_2 || ... )   # the context, once
    d_0    = BLAKE2b( root  || tokens[0 : B] )
    d_i    = BLAKE2b( d_i-1 || tokens[i*B : (i+1)*B] )

Domain separation, so that different inputs can never encode to the same bytes:
- each context field is written as ``name-length, name, present-flag, value-length, value`` -- a value
  can never spill into the next field (the failure of naive ``a + b`` concatenation, cf. vLLM #44701);
- the root uses a BLAKE2 personalisation string, which makes it a different hash function from the
  block chain, so a root can never equal a block digest by construction of the input;
- block inputs have a fixed length (64-byte parent + B tokens x 4 bytes, little-endian uint32), so the
  boundary between parent and tokens is never ambiguous.
Only full blocks get a digest: a partial tail changes as the sequence grows and is never shared.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from dataclasses import dataclass
from functools import lru_cache

from ..errors import ConfigError

DIGEST_BYTES = 64  # BLAKE2b's native 512-bit output: no truncation step on the hot path
_ROOT_PERSON = b"kvledger.ctx.v1"  # <= 16 bytes, BLAKE2b's personalisation limit
_blake2b = hashlib.blake2b


@dataclass(frozen=True, slots=True)
class CacheContext:
    """Everything besides the token ids that decides whether two KV blocks are interchangeable.

    ``trust_group`` is the tenant (or any isolation domain): blocks are never shared across groups, so
    one tenant can neither read another's cached prefix nor learn from hit timing that it exists.
    ``extra`` holds further (key, value) pairs that change the KV state, e.g. multimodal input hashes
    or a RoPE scaling override; they are encoded with the same domain separation.
    """

    trust_group: str = "default"
    model: str = ""
    revision: str = ""
    adapter: str | None = None
    kv_dtype: str = "bf16"
    extra: tuple[tuple[str, str], ...] = ()

    def root_digest(self) -> bytes:
        return _root_digest(self)


def _field(name: str, value: str | None) -> bytes:
    key = name.encode()
    if value is None:
        return struct.pack("<I", len(key)) + key + b"\x00"
    data = value.encode("utf-8")
    return struct.pack("<I", len(key)) + key + b"\x01" + struct.pack("<Q", len(data)) + data


@lru_cache(maxsize=65536)
def _root_digest(ctx: CacheContext) -> bytes:
    parts = [
        _field("trust_group", ctx.trust_group),
        _field("model", ctx.model),
        _field("revision", ctx.revision),
        _field("adapter", ctx.adapter),
        _field("kv_dtype", ctx.kv_dtype),
        struct.pack("<I", len(ctx.extra)),
    ]
    for key, value in ctx.extra:
        parts.append(_field(str(key), str(value)))
    return _blake2b(b"".join(parts), digest_size=DIGEST_BYTES, person=_ROOT_PERSON).digest()


def token_bytes(tokens: list[int] | tuple[int, ...]) -> bytes:
    """Encode token ids as little-endian uint32 (fixed width keeps block inputs unambiguous)."""
    try:
        return array("I", tokens).tobytes()
    except (OverflowError, TypeError) as exc:
        raise ConfigError(f"token ids must be integers in [0, 2**32): {exc}") from None


def chain_digests(parent: bytes, data: bytes, block_size: int) -> list[bytes]:
    """Digests of every *full* block in ``data`` (uint32 token bytes), chained from ``parent``."""
    step = block_size * 4
    out: list[bytes] = []
    append = out.append
    for start in range(0, len(data) - step + 1, step):
        # 64-byte parent + 64 bytes of tokens (block size 16) is exactly one BLAKE2b compression.
        parent = _blake2b(parent + data[start : start + step]).digest()
        append(parent)
    return out


def block_digest(parent: bytes, tokens: list[int]) -> bytes:
    """Digest of one full block of ``tokens`` whose predecessor's digest is ``parent``."""
    return _blake2b(parent + token_bytes(tokens)).digest()
