"""Appending tokens and marking them computed: which blocks a decode step opens, that a refused append
confirms nothing, integer-like token ids, and readiness of every token of a block marked at once."""

from __future__ import annotations

import pytest

from kvledger.core.ledger import KVLedger, Request
from kvledger.errors import OutOfBlocksError

BS = 4


def toks(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


class TokenId:
    """An integer-like token id (as a numpy or torch scalar is): it has ``__index__``, it is not an int."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def test_marking_two_full_blocks_at_once_makes_all_their_tokens_ready() -> None:
    """``mark_computed`` of a whole 8-token prompt (two full blocks, BS 4) in one call: 8 tokens ready."""
    led = KVLedger(8, BS, prefix_caching=True)
    led.admit(Request("a", toks(8, 0), 1)).raise_for_outcome()
    led.mark_computed("a", 8)
    assert led.ready_tokens("a") == 8


def test_append_tokens_that_cannot_open_its_first_new_block_confirms_nothing() -> None:
    """A pool of 4 blocks: a's 8-token prompt (no output reserved, not computed yet) holds 2, b's
    7-token prompt plus its 1 reserved token the other 2. Five tokens for a: the first opens a's block
    3, which no block is left for, so nothing is appended and the call raises -- and the failed call
    did not confirm a's prompt KV as written either (a later token that also opens a block must not
    move the cut past the first)."""
    led = KVLedger(4, BS)
    led.admit(Request("a", toks(8, 1), 8, reserve_new_tokens=0)).raise_for_outcome()
    led.admit(Request("b", toks(7, 30), 1)).raise_for_outcome()
    assert led.usage().available == 0
    with pytest.raises(OutOfBlocksError, match="grew past its reservation"):
        led.append_tokens("a", toks(5, 50))
    assert led.sequence("a").num_tokens == 8
    assert led.ready_tokens("a") == 0  # nothing was computed: no block is readable
    led.check()


def test_two_tokens_for_one_sequence_in_one_decode_step_open_one_block() -> None:
    """a: 8-token prompt (2 blocks) with 8 tokens reserved, i.e. 2 promised blocks. One decode step
    carrying two tokens for a: the first opens block 3 from the promise, the second lands inside it.
    So 3 blocks and 1 promise left, not 4 and 0."""
    led = KVLedger(8, BS)
    led.admit(Request("a", toks(8, 1), 8)).raise_for_outcome()
    led.mark_computed("a", 8)
    led.decode_step([("a", 70), ("a", 71)])
    seq = led.sequence("a")
    assert seq.tokens[-2:] == [70, 71]
    assert len(seq.table.blocks) == 3
    assert seq.promised == 1 and led.usage().promised == 1
    led.check()


def test_token_id_zero_given_as_an_integer_like_is_appended() -> None:
    """Token id 0 is a valid id ([0, 2**32)), also when the engine hands it over as an integer-like."""
    led = KVLedger(8, BS)
    led.admit(Request("a", [5, 6, 7], 4)).raise_for_outcome()
    led.mark_computed("a", 3)
    assert led.append_token("a", TokenId(0)) == []  # type: ignore[arg-type]
    assert led.sequence("a").tokens == [5, 6, 7, 0]
    led.decode_step([("a", TokenId(0))])  # type: ignore[list-item]
    assert led.sequence("a").tokens == [5, 6, 7, 0, 0]
    led.check()


def test_decode_step_takes_any_iterable_of_pairs() -> None:
    """``decode_step`` documents ``Iterable[tuple[str, int]]``: a tuple or a generator of pairs appends
    exactly as a list does."""
    led = KVLedger(8, BS)
    for rid in "ab":
        led.admit(Request(rid, toks(3, 10), 4)).raise_for_outcome()
        led.mark_computed(rid, 3)
    led.decode_step((("a", 1), ("b", 2)))
    led.decode_step((rid, 5) for rid in "ab")
    assert led.sequence("a").tokens[-2:] == [1, 5] and led.sequence("b").tokens[-2:] == [2, 5]
    led.check()
