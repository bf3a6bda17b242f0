"""Cache identity: chained, domain-separated BLAKE2b digests, and what they mean for prefix hits."""

from __future__ import annotations

import contextlib

import pytest

from kvledger.core.identity import (
    DIGEST_BYTES,
    CacheContext,
    block_digest,
    chain_digests,
    token_bytes,
)
from kvledger.core.ledger import KVLedger, Request
from kvledger.errors import ConfigError

BS = 4
PROMPT = list(range(100, 112))  # 3 full blocks of 4


def _digests(ctx: CacheContext, tokens: list[int], bs: int = BS) -> list[bytes]:
    return chain_digests(ctx.root_digest(), token_bytes(tokens), bs)


def _hit_after_warmup(first: CacheContext, second: CacheContext, prompt: list[int] = PROMPT) -> int:
    """Run ``prompt`` under ``first`` to completion (written, retained), then ask how many blocks a
    request with ``second`` would hit."""
    ledger = KVLedger(32, BS)
    ledger.admit(Request("warm", prompt, 0, first)).raise_for_outcome()
    ledger.mark_computed("warm", len(prompt))
    ledger.release("warm")
    ledger.check()
    decision = ledger.admit(Request("probe", prompt, 0, second)).raise_for_outcome()
    ledger.check()
    return decision.blocks_hit


BASE = CacheContext(trust_group="tenant-a", model="llama", revision="r1", adapter=None, kv_dtype="bf16")

VARIANTS = {
    "trust_group": CacheContext(trust_group="tenant-b", model="llama", revision="r1", kv_dtype="bf16"),
    "adapter": CacheContext(trust_group="tenant-a", model="llama", revision="r1", adapter="lora-1",
                            kv_dtype="bf16"),
    "revision": CacheContext(trust_group="tenant-a", model="llama", revision="r2", kv_dtype="bf16"),
    "model": CacheContext(trust_group="tenant-a", model="mistral", revision="r1", kv_dtype="bf16"),
    "kv_dtype": CacheContext(trust_group="tenant-a", model="llama", revision="r1", kv_dtype="fp8"),
    "extra": CacheContext(trust_group="tenant-a", model="llama", revision="r1", kv_dtype="bf16",
                          extra=(("rope_scaling", "2.0"),)),
}


@pytest.mark.parametrize("field", sorted(VARIANTS))
def test_changed_field_changes_root_and_block_digests(field: str) -> None:
    other = VARIANTS[field]
    assert other.root_digest() != BASE.root_digest()
    a, b = _digests(BASE, PROMPT), _digests(other, PROMPT)
    assert len(a) == len(b) == 3
    assert not set(a) & set(b)


@pytest.mark.parametrize("field", sorted(VARIANTS))
def test_changed_field_gives_no_hit_in_ledger(field: str) -> None:
    assert _hit_after_warmup(BASE, VARIANTS[field]) == 0


def test_identical_context_same_digest_and_hit() -> None:
    same = CacheContext(trust_group="tenant-a", model="llama", revision="r1", adapter=None, kv_dtype="bf16")
    assert same is not BASE
    assert same.root_digest() == BASE.root_digest()
    assert _digests(same, PROMPT) == _digests(BASE, PROMPT)
    assert _hit_after_warmup(BASE, same) == 3


def test_default_context_is_stable() -> None:
    assert CacheContext().root_digest() == CacheContext().root_digest()
    assert _hit_after_warmup(CacheContext(), CacheContext()) == 3


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (CacheContext(trust_group="ab", model="c"), CacheContext(trust_group="a", model="bc")),
        (CacheContext(model="ab", revision="c"), CacheContext(model="a", revision="bc")),
        (CacheContext(revision="x", adapter="y"), CacheContext(revision="xy", adapter=None)),
        (CacheContext(adapter=None), CacheContext(adapter="")),
        (CacheContext(extra=(("a", "bc"),)), CacheContext(extra=(("ab", "c"),))),
        (CacheContext(extra=(("a", "b"), ("c", "d"))), CacheContext(extra=(("a", "bcd"),))),
        (CacheContext(extra=()), CacheContext(extra=(("", ""),))),
        (CacheContext(kv_dtype="bf16", extra=(("x", "y"),)),
         CacheContext(kv_dtype="bf16x", extra=(("", "y"),))),
    ],
    ids=["tg/model", "model/revision", "revision/adapter", "adapter-None-vs-empty", "extra-kv-split",
         "extra-pair-count", "extra-empty-pair", "dtype/extra"],
)
def test_naive_concatenation_collisions_do_not_collide(a: CacheContext, b: CacheContext) -> None:
    assert a != b
    assert a.root_digest() != b.root_digest()
    assert _hit_after_warmup(a, b) == 0


def test_token_chunk_boundary_parent_matters() -> None:
    # Block 1 holds identical tokens in both prompts, but block 0 differs: block 1's digest must differ,
    # since its KV depends on every earlier token.
    ctx = CacheContext()
    p1 = [1, 2, 3, 4, 9, 9, 9, 9]
    p2 = [1, 2, 3, 5, 9, 9, 9, 9]
    d1, d2 = _digests(ctx, p1), _digests(ctx, p2)
    assert d1[0] != d2[0]
    assert d1[1] != d2[1]
    assert block_digest(ctx.root_digest(), p1[4:]) != d1[1]  # block 1 is not hashed on its own

    ledger = KVLedger(16, BS)
    ledger.admit(Request("a", p1, 0, ctx)).raise_for_outcome()
    ledger.mark_computed("a", len(p1))
    decision = ledger.admit(Request("b", p2, 0, ctx)).raise_for_outcome()
    assert decision.blocks_hit == 0
    assert not set(ledger.sequence("a").table.blocks) & set(ledger.sequence("b").table.blocks)
    ledger.check()


def test_token_boundary_between_tokens_is_unambiguous() -> None:
    # The same 8 tokens hashed as two chained blocks of 4 or as one block of 8 are different identities.
    ctx = CacheContext()
    tokens = list(range(8))
    assert _digests(ctx, tokens, 4)[-1] != _digests(ctx, tokens, 8)[-1]


def test_chain_digests_match_block_digest() -> None:
    ctx = CacheContext(trust_group="t")
    tokens = list(range(50, 62))
    chain = _digests(ctx, tokens)
    parent = ctx.root_digest()
    for i, digest in enumerate(chain):
        assert block_digest(parent, tokens[i * BS : (i + 1) * BS]) == digest
        parent = digest


def test_root_is_not_a_block_digest() -> None:
    # The root uses a personalised BLAKE2b; it differs from the block digest of the same context.
    ctx = CacheContext()
    assert ctx.root_digest() not in _digests(ctx, list(range(16)))


def test_partial_tail_block_is_never_indexed() -> None:
    ctx = CacheContext()
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    assert len(_digests(ctx, tokens)) == 2
    assert _digests(ctx, tokens[:3]) == []

    ledger = KVLedger(16, BS)
    ledger.admit(Request("a", tokens, 0, ctx)).raise_for_outcome()
    seq = ledger.sequence("a")
    tail = seq.table.blocks[-1]
    assert len(seq.table.blocks) == 3
    assert ledger.pool.digest[tail] is None
    assert tail not in ledger.pool.index.values()
    assert len(ledger.pool.index) == 2
    ledger.mark_computed("a", len(tokens))
    ledger.release("a")
    # the written full blocks are retained; the partial tail is freed, not retained
    assert tail in ledger.pool.free_blocks()
    assert ledger.usage().retained == 2
    # a prompt that extends the partial tail differently still hits only the full blocks
    decision = ledger.admit(Request("b", tokens[:8] + [77, 78, 79], 0, ctx)).raise_for_outcome()
    assert decision.blocks_hit == 2
    ledger.check()


def test_prompt_shorter_than_a_block_is_not_indexed() -> None:
    ledger = KVLedger(4, BS)
    ledger.admit(Request("a", [1, 2, 3], 0)).raise_for_outcome()
    ledger.mark_computed("a", 3)
    ledger.release("a")
    assert ledger.pool.index == {}
    assert ledger.usage().retained == 0
    assert ledger.usage().free == 4
    assert ledger.admit(Request("b", [1, 2, 3], 0)).blocks_hit == 0
    ledger.check()


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40])
def test_token_ids_outside_uint32_are_config_errors(bad: int) -> None:
    with pytest.raises(ConfigError):
        token_bytes([1, bad, 3])
    ledger = KVLedger(8, BS)
    with pytest.raises(ConfigError):
        ledger.admit(Request("a", [1, 2, bad, 4, 5], 1))
    with pytest.raises(ConfigError):
        ledger.can_admit(Request("a", [1, 2, bad, 4, 5], 1))
    assert ledger.sequences() == []
    assert ledger.usage().free == 8
    ledger.check()


def test_uint32_bounds_are_accepted() -> None:
    assert len(token_bytes([0, 2**32 - 1])) == 8
    ledger = KVLedger(8, BS)
    ledger.admit(Request("a", [0, 2**32 - 1, 0, 2**32 - 1], 1)).raise_for_outcome()
    ledger.check()


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_append_token_outside_uint32_is_config_error_and_changes_nothing(bad: int) -> None:
    # Generated tokens join the chained digests exactly like prompt tokens, so they need the same
    # validation: a bad id must be refused up front, leaving the sequence untouched.
    ledger = KVLedger(8, BS)
    ledger.admit(Request("a", [1, 2, 3], 4)).raise_for_outcome()
    with pytest.raises(ConfigError):
        ledger.append_token("a", bad)
    assert ledger.sequence("a").tokens == [1, 2, 3]
    ledger.check()


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_bad_generated_token_cannot_break_the_ledger(bad: int) -> None:
    # Whatever append_token does with a bad id, the ledger must stay consistent and the sequence must
    # stay usable: later valid tokens that complete the block must not fail or break check().
    ledger = KVLedger(8, BS)
    ledger.admit(Request("a", [1, 2, 3], 4)).raise_for_outcome()
    with contextlib.suppress(ConfigError):
        ledger.append_token("a", bad)
    ledger.check()
    n = len(ledger.sequence("a").tokens)
    ledger.append_tokens("a", [5] * (7 - n))  # up to max_new, across the block boundary at token 4
    ledger.check()
    ledger.release("a")
    ledger.check()


@pytest.mark.parametrize("ctx", [CacheContext(), BASE, *VARIANTS.values()])
def test_digests_have_one_fixed_width_of_at_least_256_bits(ctx: CacheContext) -> None:
    # Root, chained and single-block digests share one width (DIGEST_BYTES), so a parent is always the
    # same number of bytes ahead of the tokens. The seed fixed it at 32 bytes; a wider digest is fine.
    assert DIGEST_BYTES >= 32
    assert len(ctx.root_digest()) == DIGEST_BYTES
    for d in _digests(ctx, list(range(16))):
        assert isinstance(d, bytes)
        assert len(d) == DIGEST_BYTES
    assert len(block_digest(ctx.root_digest(), [1, 2, 3, 4])) == DIGEST_BYTES


def test_digests_distinct_across_positions() -> None:
    # Repeating a block's tokens gives a fresh digest at every position (the chain carries position).
    ctx = CacheContext()
    chain = _digests(ctx, [7, 7, 7, 7] * 5)
    assert len(set(chain)) == 5


def test_extra_key_and_value_are_not_interchangeable() -> None:
    a = CacheContext(trust_group="g", extra=(("k", "v"),)).root_digest()
    b = CacheContext(trust_group="g", extra=(("k", "v"),)).root_digest()
    assert a == b
    assert a != CacheContext(trust_group="g", extra=(("v", "k"),)).root_digest()
