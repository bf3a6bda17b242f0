"""The ledger's answer to "how many output tokens could this request ever be promised here?".

``KVLedger.largest_allowance`` replaces the server's binary search over the yes/no "never" check: it must
be exactly the boundary of that check -- asking for it is never refused as "never", one token more is --
for any prompt length, block size, pool, branch count, speculative slots and trust-group quota. The
fleet's ingress answers the same question with the same arithmetic, and the server's default
``max_tokens`` is that answer cut by the model's length.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger
from kvledger.core.promises import declared_blocks, largest_allowance
from kvledger.core.types import Outcome, Request
from kvledger.errors import ConfigError
from kvledger.placement.score import request_blocks


def _never(ledger: KVLedger, prompt_len: int, max_new: int, branches: int, lookahead: int, group: str) -> bool:
    ctx = CacheContext(trust_group=group)
    request = Request("r", [1] * prompt_len, max_new, ctx, branches=branches, lookahead=lookahead)
    return ledger.can_admit(request).outcome is Outcome.NEVER


@settings(max_examples=300, deadline=None)
@given(prompt_len=st.integers(1, 200), block_size=st.integers(1, 32), blocks=st.integers(1, 64),
       branches=st.integers(1, 6), lookahead=st.integers(0, 5), quota=st.none() | st.integers(1, 64))
def test_the_allowance_is_exactly_the_boundary_of_never(prompt_len: int, block_size: int, blocks: int,
                                                        branches: int, lookahead: int, quota: int | None) -> None:
    ledger = KVLedger(num_blocks=blocks, block_size=block_size)
    if quota is not None:
        ledger.set_quota("acme", quota)
    request = Request("r", [1] * prompt_len, 1, CacheContext(trust_group="acme"), branches=branches,
                      lookahead=lookahead)
    most = ledger.largest_allowance(request)
    assert most >= 0
    if most:
        assert not _never(ledger, prompt_len, most, branches, lookahead, "acme")
    else:
        assert _never(ledger, prompt_len, 1, branches, lookahead, "acme")
    assert _never(ledger, prompt_len, most + 1, branches, lookahead, "acme")
    # another tenant has no cap: its answer is the pool's alone
    other = ledger.largest_allowance(Request("r", [1] * prompt_len, 1, CacheContext(trust_group="globex"),
                                             branches=branches, lookahead=lookahead))
    assert other >= most
    assert other == largest_allowance(prompt_len, blocks, block_size, branches, lookahead)
    ledger.check()


def test_a_worked_example() -> None:
    """100-token prompt, 16-token blocks, 2 branches, 20 blocks: the longest branch may cover
    (20 + 6) // 2 = 13 blocks = 208 tokens, so 108 new tokens; 109 would need 14 + 8 = 22 blocks."""
    assert largest_allowance(100, 20, 16, 2) == 108
    assert declared_blocks(100, 108, 16, 2) == 20
    assert declared_blocks(100, 109, 16, 2) == 22
    assert largest_allowance(100, 6, 16, 1) == 0  # the prompt alone needs 7 blocks
    assert largest_allowance(100, 7, 16, 1) == 12
    assert largest_allowance(100, 7, 16, 1, lookahead=4) == 8


@given(prompt_len=st.integers(1, 300), max_new=st.integers(1, 300), block_size=st.integers(1, 64),
       n=st.integers(1, 8))
def test_the_fleet_charges_what_the_ledger_declares(prompt_len: int, max_new: int, block_size: int, n: int) -> None:
    prompt_blocks, decode, charge = request_blocks(prompt_len, max_new, block_size, n)
    assert charge == declared_blocks(prompt_len, max_new, block_size, n) == prompt_blocks + decode
    assert prompt_blocks == -(-prompt_len // block_size)


def test_the_question_takes_a_request() -> None:
    ledger = KVLedger(num_blocks=4, block_size=4)
    with pytest.raises(ConfigError):
        ledger.largest_allowance("prompt")  # type: ignore[arg-type]
