"""Known answers for cache identity: fixed contexts and tokens give fixed digests.

A change to the encoding, the field order, a length prefix, a type tag, the personalisation or the
chaining changes these values; if it is deliberate, it is a new identity version (``ROOT_PERSON``) and
these answers are updated with it. The first test spells the encoding out byte by byte and hashes it
with :mod:`hashlib` directly, so the answers do not rest on the code under test alone.
"""

from __future__ import annotations

import hashlib
import struct

import pytest

from kvledger.core.identity import ROOT_PERSON, CacheContext, block_digest, chain_digests, token_bytes
from kvledger.core.ledger import KVLedger, Request


def field(name: str, tag: bytes, value: bytes) -> bytes:
    return struct.pack("<I", len(name)) + name.encode() + tag + struct.pack("<Q", len(value)) + value


def test_the_default_context_encoding_and_root_spelled_out() -> None:
    encoding = (field("trust_group", b"s", b"default") + field("model", b"s", b"") + field("revision", b"s", b"")
                + field("adapter", b"n", b"") + field("kv_dtype", b"s", b"bf16") + struct.pack("<I", 0))
    assert CacheContext().encoding == encoding
    assert ROOT_PERSON == b"kvledger.ctx.v2"
    root = hashlib.blake2b(encoding, digest_size=64, person=b"kvledger.ctx.v2").digest()
    assert CacheContext().root_digest() == root
    # The personalisation matters: without it the root would be another value.
    assert root != hashlib.blake2b(encoding, digest_size=64).digest()
    # Block i chains the previous digest (the root for block 0) with the block's uint32 tokens.
    d0 = hashlib.blake2b(root + struct.pack("<4I", 0, 1, 2, 3)).digest()
    d1 = hashlib.blake2b(d0 + struct.pack("<4I", 4, 5, 6, 7)).digest()
    assert chain_digests(root, token_bytes(list(range(8))), 4) == [d0, d1]
    assert block_digest(root, [0, 1, 2, 3]) == d0


def test_typed_extra_values_spelled_out() -> None:
    ctx = CacheContext(trust_group="g", extra=(("n", None), ("b", True), ("i", -300), ("f", 1.5), ("s", "é"),
                                              ("y", b"\x00")))
    tail = (struct.pack("<I", 6) + field("n", b"n", b"") + field("b", b"b", b"\x01")
            + field("i", b"i", (-300).to_bytes(2, "little", signed=True)) + field("f", b"f", struct.pack("<d", 1.5))
            + field("s", b"s", "é".encode()) + field("y", b"y", b"\x00"))
    assert ctx.encoding.endswith(tail)
    assert ctx.encoding.startswith(field("trust_group", b"s", b"g"))


KNOWN_ROOTS = {  # first 128 bits of each root, hex
    "default": (CacheContext(), "ec3be3c315804fa92241ef6c6a6f8673"),
    "base": (CacheContext(trust_group="tenant-a", model="llama", revision="r1", adapter=None, kv_dtype="bf16"),
             "27ffa1daa50d745f7063465b94ba9389"),
    "tg-ab/model-c": (CacheContext(trust_group="ab", model="c"), "803397c96e3c3de74ea3b74b15b0c4be"),
    "tg-a/model-bc": (CacheContext(trust_group="a", model="bc"), "7f7106c806da826fdb131b222037c639"),
    "adapter-None": (CacheContext(adapter=None), "ec3be3c315804fa92241ef6c6a6f8673"),
    "adapter-empty": (CacheContext(adapter=""), "d7233abc8bf78a0d913252568f2a961c"),
    "extra-int-1": (CacheContext(extra=(("k", 1),)), "5ca4cc30e9646c03aaa2106703414dc2"),
    "extra-bool-True": (CacheContext(extra=(("k", True),)), "f778bde8383b7f7ee8796cde38fde696"),
    "extra-str-1": (CacheContext(extra=(("k", "1"),)), "c80d89e41fe5624e81109990bb8459b7"),
    "extra-None": (CacheContext(extra=(("k", None),)), "e872f1191fc1037729606ebab754942c"),
    "extra-float": (CacheContext(extra=(("k", 1.5),)), "46f976897f96b946e9a6612d79645222"),
    "extra-bytes": (CacheContext(extra=(("k", b"\x00"),)), "a1e9ff3503ae96f695479e01db971aa3"),
    "extra-negative-int": (CacheContext(extra=(("k", -300),)), "a1e1514c788347a839bf4b35681e1965"),
}


@pytest.mark.parametrize("name", sorted(KNOWN_ROOTS))
def test_known_roots(name: str) -> None:
    ctx, expected = KNOWN_ROOTS[name]
    assert ctx.root_digest().hex()[:32] == expected


def test_known_roots_are_distinct_except_the_two_spellings_of_the_default() -> None:
    roots = {name: ctx.root_digest() for name, (ctx, _) in KNOWN_ROOTS.items()}
    assert roots["default"] == roots["adapter-None"]
    assert len(set(roots.values())) == len(roots) - 1


def test_known_block_chain() -> None:
    root = CacheContext().root_digest()
    chain = chain_digests(root, token_bytes(list(range(8))), 4)
    assert [d.hex()[:32] for d in chain] == ["c14b50c699854eb168d871cb8fcc9da7", "ccbddeee6cb13b348597c3f7cf149088"]


def test_trust_groups_built_to_collide_without_length_prefixes_never_share() -> None:
    """Without the value length, a field's value could absorb the next field's header: trust group
    "a" + <model header> + "b" with model "c" would encode like trust group "a" with model
    "b" + <model header> + "c". Two tenants built that way must get different roots and no hits."""
    header = struct.pack("<I", 5).decode() + "model" + "s"  # u32 name length, name, str type tag
    one = CacheContext(trust_group="a" + header + "b", model="c")
    two = CacheContext(trust_group="a", model="b" + header + "c")
    assert one.root_digest() != two.root_digest()
    ledger = KVLedger(16, 4)
    ledger.admit(Request("victim", list(range(12)), 0, one)).raise_for_outcome()
    ledger.mark_computed("victim", 12)
    ledger.release("victim")
    assert ledger.admit(Request("attacker", list(range(12)), 0, two)).blocks_hit == 0
    ledger.check()
