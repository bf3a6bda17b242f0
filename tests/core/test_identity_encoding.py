"""The cache identity's value encoding and its error messages, pinned down where mutation testing of
``core/identity.py`` showed the suite would not notice a change (docs/testing.md)."""

from __future__ import annotations

import struct

import pytest

from kvledger.core.identity import CacheContext, _encode_value, token_bytes
from kvledger.errors import ConfigError


def root(**extra: object) -> bytes:
    return CacheContext(extra=tuple(extra.items())).root_digest()


def test_false_and_true_are_different_identities() -> None:
    assert root(flag=False) != root(flag=True)
    assert root(flag=False) != root(flag=0) and root(flag=True) != root(flag=1)


def test_every_nan_is_one_identity_and_none_is_another() -> None:
    quiet = float("nan")
    payload = struct.unpack("<d", b"\x01\x00\x00\x00\x00\x00\xf8\x7f")[0]  # a NaN with another payload
    assert root(x=quiet) == root(x=payload)
    assert root(x=quiet) != root(x=None)


@pytest.mark.parametrize(("value", "data"), [
    (0, b"\x00"), (127, b"\x7f"), (128, b"\x80\x00"), (-128, b"\x80\xff"), (-129, b"\x7f\xff"),
    (255, b"\xff\x00"), (2**63 - 1, b"\xff" * 7 + b"\x7f"),
])
def test_integers_take_bit_length_plus_a_sign_bit_in_bytes(value: int, data: bytes) -> None:
    # The layout: tag, u64 length, little-endian two's complement in (bit_length + 8) // 8 bytes (a
    # fixed rule, so one value has one encoding; -128 takes two bytes under it).
    assert _encode_value(value, "v") == b"i" + struct.pack("<Q", len(data)) + data


def test_a_string_is_not_a_sequence_of_pairs() -> None:
    with pytest.raises(ConfigError, match=r"^CacheContext\.extra must be \(key, value\) pairs, got 'ab'$"):
        CacheContext(extra="ab")  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "shown"), [
    ([1, 2], "list"),
    ({1}, "set"),
])
def test_a_bad_extra_value_names_its_key_and_type(value: object, shown: str) -> None:
    with pytest.raises(ConfigError) as err:
        CacheContext(extra=(("image", value),))  # type: ignore[arg-type]
    assert str(err.value) == f"CacheContext.extra['image'] must be None, bool, int, float, str or bytes, got {shown}"


def test_bad_values_are_shown_short() -> None:
    with pytest.raises(ConfigError) as err:
        CacheContext(model=2**64)  # type: ignore[arg-type]
    assert str(err.value) == "CacheContext.model must be a string, got an integer of 65 bits"
    with pytest.raises(ConfigError) as err:
        CacheContext(model=2**63)  # type: ignore[arg-type]
    assert str(err.value) == f"CacheContext.model must be a string, got {2**63!r}"  # 64 bits: shown whole
    with pytest.raises(ConfigError) as err:
        CacheContext(model=True)  # type: ignore[arg-type]
    assert str(err.value) == "CacheContext.model must be a string, got True"
    long = b"x" * 100
    with pytest.raises(ConfigError) as err:
        CacheContext(model=long)  # type: ignore[arg-type]
    shown = str(err.value).removeprefix("CacheContext.model must be a string, got ")
    assert shown == repr(long)[:57] + "..." and len(shown) == 60
    exact = "y" * 58  # its repr is 60 characters: shown whole
    with pytest.raises(ConfigError) as err:
        CacheContext(adapter=exact.encode())  # type: ignore[arg-type]
    assert str(err.value).endswith(repr(exact.encode())[:57] + "...")  # b'...' is 61: cut
    with pytest.raises(ConfigError) as err:
        CacheContext(extra=((exact, [0]),))  # type: ignore[arg-type]
    assert f"CacheContext.extra[{exact!r}]" in str(err.value)


def test_false_has_its_one_byte_encoding() -> None:
    assert _encode_value(False, "v") == b"b" + struct.pack("<Q", 1) + b"\x00"
    assert _encode_value(True, "v") == b"b" + struct.pack("<Q", 1) + b"\x01"


def test_lone_surrogates_in_keys_and_values_are_identities_of_their_own() -> None:
    # "surrogatepass" keeps the encoding injective for strings Python allows but UTF-8 does not.
    a = CacheContext(extra=(("\ud800", "\udfff"),))
    b = CacheContext(extra=(("\ud801", "\udfff"),))
    c = CacheContext(extra=(("\ud800", "\udffe"),))
    assert len({a.root_digest(), b.root_digest(), c.root_digest()}) == 3


def test_malformed_extra_entries_and_repeated_keys_are_named_in_the_message() -> None:
    with pytest.raises(ConfigError) as err:
        CacheContext(extra=(("a", 1, 2),))  # type: ignore[arg-type]
    assert str(err.value) == "CacheContext.extra entries must be (str key, value) pairs, got tuple"
    with pytest.raises(ConfigError) as err:
        CacheContext(extra=(("a", 1), ("a", 2)))
    assert str(err.value) == "CacheContext.extra names a key twice"


def test_a_bad_token_id_says_what_token_ids_must_be() -> None:
    with pytest.raises(ConfigError, match=r"^token ids must be integers in \[0, 2\*\*32\): "):
        token_bytes([1, -1])
    with pytest.raises(ConfigError, match=r"^token ids must be integers in \[0, 2\*\*32\): "):
        token_bytes([2**32])
