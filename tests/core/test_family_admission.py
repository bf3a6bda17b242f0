"""Admitting a family of branches at once: all or nothing, its figures and pending hits, refusals that name
the family, its blocks or its quota, and the layout of its branches' paths. Block size 4."""

from __future__ import annotations

import pytest

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Outcome, Request
from kvledger.errors import ConfigError

BS = 4


def toks(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def _family_under_quota() -> tuple[KVLedger, list[Request]]:
    """A 64-block pool whose prefix index holds two full blocks of acme's (tokens 0..7), a running acme
    request "x" (1 block held + 1 promised = 2 charged), and a two-branch family "f" whose 10-token prompts
    share those two blocks and end in different 2-token tails, 4 new tokens each."""
    led = KVLedger(64, BS)
    assert led.admit(Request("w", [*range(8), 99], 1, ACME)).admitted
    led.mark_computed("w", 9)
    led.release("w")  # its two full blocks stay in the prefix index
    assert led.admit(Request("x", [7] * 4, 4, ACME)).admitted
    family = [Request("f", [*range(8), 50, 51], 4, ACME),
              Request("f/1", [*range(8), 60, 61], 4, ACME, family="f")]
    return led, family


ACME = CacheContext(trust_group="acme")


def test_cancelling_a_family_drops_the_members_admitted_under_its_name() -> None:
    led = KVLedger(16, BS)
    assert led.admit(Request("f/1", toks(6, 1), 2, family="f")).admitted
    assert led.admit(Request("g", toks(6, 20), 2, branches=2)).admitted
    assert sorted(led.sequences()) == ["f/1", "g", "g/1"]
    assert led.cancel("f") is True and led.cancel("g") is True
    assert led.sequences() == [] and led.usage().free == 16
    led.check()


def test_as_many_branches_as_the_pool_has_blocks_can_be_admitted() -> None:
    led = KVLedger(4, BS)
    d = led.admit(Request("w", toks(4, 1), 0, branches=4))  # one full block, shared by all four
    assert d.admitted and sorted(led.sequences()) == ["w", "w/1", "w/2", "w/3"]
    too_many = led.admit(Request("v", toks(16, 9), 0, branches=5))  # needs exactly the 4 blocks, but 5 branches
    assert too_many.reason == "asks for 5 branches but the whole pool has 4 blocks"
    led.check()


def test_family_with_more_branches_than_blocks_is_never_with_its_branch_count_and_no_new_blocks() -> None:
    """Three branches cannot fit a 2-block pool: NEVER, ``blocks_total`` is the branch count (3) and the
    refusal charges nothing (``blocks_new`` 0, so ``blocks_charged`` 0)."""
    led = KVLedger(2, BS)
    reqs = [Request(f"f{i}", toks(3, 10), 1, family="f0") for i in range(3)]
    d = led.admit_family(reqs)
    assert d.outcome is Outcome.NEVER and "3 branches" in d.reason
    assert (d.blocks_total, d.blocks_new, d.blocks_charged) == (3, 0, 0)


def test_single_branch_family_over_its_quota_is_never_and_over_quota() -> None:
    """A one-branch family needing 2 blocks (4 prompt + 4 new tokens, BS 4) against a quota of 1 is
    refused as NEVER by the quota."""
    led = KVLedger(16, BS)
    led.set_quota("t", 1)
    d = led.admit_family([Request("a", toks(4, 10), 4, CacheContext(trust_group="t"))])
    assert d.outcome is Outcome.NEVER and d.over_quota and "quota is 1" in d.reason


def test_an_admitted_family_reports_its_pending_hits_and_what_its_extra_branch_adds() -> None:
    """P's 8-token prompt (2 blocks) is admitted but not computed yet. A family of two branches, P's
    prompt plus one token each (1 and 2: different tails), comes back. By hand: both full blocks are
    hits, both still pending; 2 new tail blocks; each branch reserves 9 + 4 = 13 tokens = 4 blocks, 1
    beyond its 3, so 2 promised, of which the second branch adds 1; total 2 + 2 + 2 = 6."""
    led = KVLedger(16, BS)
    led.admit(Request("P", toks(8, 100), 1)).raise_for_outcome()
    family = [Request("F", toks(8, 100) + [1], 4, family="F"), Request("F/1", toks(8, 100) + [2], 4, family="F")]
    d = led.admit_family(family)
    assert d.admitted
    assert (d.blocks_total, d.blocks_hit, d.blocks_hit_pending, d.blocks_new, d.blocks_promised,
            d.blocks_branches) == (6, 2, 2, 2, 2, 1)
    assert d.reason == "family of 2 branches: 2 shared + 2 new + 2 promised = 6 blocks"
    led.check()


def test_a_family_member_asking_for_several_branches_is_refused_with_its_message() -> None:
    led = KVLedger(16, BS)
    with pytest.raises(ConfigError, match=r"^request 'F': a family member is one branch \(branches=1\)$"):
        led.admit_family([Request("F", toks(5, 0), 2, branches=2)])


def test_a_family_refused_by_its_quota_now_names_the_family_and_its_shared_hits() -> None:
    """The not-now decision a quota gives a family names the family and counts its prefix hits, as the
    pool's own refusals do: 2 shared hits; 2 new tail blocks + 1 promised block per branch = 4, so 6
    blocks in all; the quota needs 2 tails + 2 unheld hits + 1 growth block per branch = 6 on top of x's
    2, past the cap of 6."""
    led, family = _family_under_quota()
    led.set_quota("acme", 6)
    refused = led.admit_family(family)
    assert refused.outcome is Outcome.NOT_NOW and refused.over_quota
    assert refused.request_id == "f"
    assert (refused.blocks_total, refused.blocks_hit, refused.blocks_new, refused.blocks_promised) == (6, 2, 2, 2)
    assert refused.reason == ("needs 6 blocks of its trust group's quota of 6 blocks, of which 2 are held or "
                              "committed to its running requests now")


def test_a_family_larger_than_its_quota_is_never_and_says_the_quota_refused_it() -> None:
    """A family that could not fit its group's cap even alone is ``never`` *because of the quota*: the
    decision says so (``over_quota``) and the group's quota refusals count it. At their longest the
    branches need 2 shared blocks + 2 x (14 tokens = 4 blocks, less the 2 shared) = 6 > the cap of 4."""
    led, family = _family_under_quota()
    led.set_quota("acme", 4)
    never = led.admit_family(family)
    assert never.outcome is Outcome.NEVER
    assert never.over_quota is True
    assert never.reason == "needs 6 blocks for 2 branches at their longest but its trust group's quota is 4 blocks"
    assert led.counters.quota_refusals == {"acme": 1}
    assert led.counters.rejected_never == 1


def test_admit_family_names_keep_free_when_it_is_bad() -> None:
    led, family = _family_under_quota()
    with pytest.raises(ConfigError, match=r"^keep_free must be >= 0, got -1$"):
        led.admit_family(family, keep_free=-1)


def test_a_family_with_as_many_branches_as_the_pool_has_blocks_can_be_readmitted() -> None:
    """Two branches sharing one full block of 4 tokens, nothing more to generate: 1 block in a pool of 2.
    Only *more* branches than blocks is refused up front."""
    led = KVLedger(2, BS)
    reqs = [Request(rid, toks(4, 1), 0, family="F", readmission=True) for rid in ("F", "F/1")]
    d = led.admit_family(reqs)
    assert d.outcome is Outcome.ADMITTED and sorted(led.sequences()) == ["F", "F/1"]
    assert led.usage().free == 1  # the one shared block is the family's
    led.check()


def test_a_family_that_needs_more_than_the_pool_names_its_blocks_not_its_branches() -> None:
    """Two branches of 3 prompt + 4 new tokens in a pool of 2: each needs blocks_for(7) = 2 of its own,
    4 in all; the reason gives that figure (two branches do not exceed two blocks)."""
    led = KVLedger(2, BS)
    reqs = [Request(rid, toks(3, 1), 4, family="F", readmission=True) for rid in ("F", "F/1")]
    d = led.admit_family(reqs)
    assert d.outcome is Outcome.NEVER
    assert d.reason.startswith("needs 4 blocks for 2 branches") and "asks for" not in d.reason


def test_family_layout_marks_the_first_block_of_each_path_with_parent_minus_one() -> None:
    """``FamilyLayout.parents`` is documented as "-1 for the first block": two branches whose 8 tokens
    differ in the second block form nodes 0 (root), 1 and 2 (both children of 0)."""
    led = KVLedger(8, BS, prefix_caching=False)  # without caching the digests are not read
    reqs = [Request("F", toks(8, 1), 0, family="F"), Request("F/1", toks(4, 1) + toks(4, 50), 0, family="F")]
    layout = led.family_layout(reqs, [[], []])
    assert layout.parents == [-1, 0, 0]
    assert layout.paths == [[0, 1], [0, 2]] and layout.nodes == 3
