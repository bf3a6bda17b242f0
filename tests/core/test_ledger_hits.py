"""The scheduler's pool (`KVLedger`) on two prefix-hit rules that vLLM applies: draft-aware hits (a request's hit
gives up its last block, which an EAGLE drafter computes again) and image-scoped keys (an image keys only the
blocks its tokens cover, so text blocks before it are shared across requests with different images). Block size
4, counted by hand; ``check()`` after every operation."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.core.identity import CacheContext, MMItem, mm_prompt_digests, prompt_digests
from kvledger.core.ledger import KVLedger, Request
from kvledger.errors import ConfigError

BS = 4
CAT, DOG = MMItem("cat", 8, 4), MMItem("dog", 8, 4)


def toks(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def hits(led: KVLedger, rid: str, prompt: list[int], **kw: object) -> int:
    """The prefix hit (in blocks) the request is admitted with; it is then computed and released."""
    d = led.admit(Request(rid, prompt, 0, **kw))  # type: ignore[arg-type]
    assert d.admitted
    led.check()
    led.mark_computed(rid, len(prompt))
    led.release(rid)
    led.check()
    return d.blocks_hit


# ---- draft-aware hits ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("length", "plain", "drafted"), [
    (13, 3, 2),  # three cached blocks, the last token past them: the drafter recomputes block 3
    (12, 3, 1),  # the whole prompt cached: the hit first stops before the last token (2 blocks), then gives one up
    (5, 1, 0),  # one cached block: nothing left to share
])
def test_a_drafter_gives_up_the_last_block_of_its_hit(run_once: Callable[..., None], length: int, plain: int,
                                                      drafted: int) -> None:
    led = KVLedger(16, BS)
    run_once(led, "a", toks(12))
    prompt = [*toks(12), 99][:length]
    assert hits(led, "b", prompt) == plain
    assert hits(led, "c", prompt, drop_last_hit_block=True) == drafted
    # the tokens it gave up are computed again: the sequence starts there
    d = led.admit(Request("d", prompt, 1, drop_last_hit_block=True))
    assert led.sequence("d").num_computed == drafted * BS and d.blocks_new == -(-length // BS) - drafted
    led.check()


def test_draft_aware_hits_hold_for_every_branch_and_a_family(run_once: Callable[..., None]) -> None:
    led = KVLedger(32, BS)
    run_once(led, "a", toks(12))
    assert led.admit(Request("n2", [*toks(12), 99], 4, branches=2, drop_last_hit_block=True)).blocks_hit == 2
    led.check()
    fam = [Request(f"f/{i}", [*toks(12), 90 + i], 4, family="f", drop_last_hit_block=True) for i in range(2)]
    assert led.admit_family(fam).blocks_hit == 2  # blocks 1-2, held by both branches
    led.check()
    with pytest.raises(ConfigError, match="drop_last_hit_block is per family"):
        led.admit_family([Request("g/0", toks(8), 1, family="g"),
                          Request("g/1", toks(8), 1, family="g", drop_last_hit_block=True)])
    with pytest.raises(ConfigError, match="drop_last_hit_block"):
        Request("x", toks(4), 1, drop_last_hit_block=1)  # type: ignore[arg-type]


# ---- image-scoped keys ----------------------------------------------------------------------------------
def test_text_blocks_before_an_image_are_shared_across_images(run_once: Callable[..., None]) -> None:
    """17 tokens, an image on positions 8-11 (block 2): blocks 0-1 are text, blocks 2-3 the image's."""
    led = KVLedger(32, BS)
    prompt = toks(17)
    run_once(led, "a", prompt, mm_items=[CAT])
    assert hits(led, "b", prompt, mm_items=[DOG]) == 2  # the text before the image, not the image's blocks
    assert hits(led, "c", prompt, mm_items=[CAT]) == 4  # the same image: everything
    assert hits(led, "d", prompt) == 2  # no image (the placeholder tokens alone): the text
    assert hits(led, "e", prompt, mm_items=[MMItem("cat", 9, 3)]) == 2  # the image elsewhere in its block
    assert hits(led, "f", prompt, mm_items=[MMItem("cat", 0, 2)]) == 0  # an image in block 0 keys the chain


def test_an_image_in_the_prompts_partial_tail_keys_the_block_when_it_fills() -> None:
    """10 tokens, an image on positions 8-9: block 2 is filled by decode; its digest must still be the image's."""
    for fork in (False, True):
        led = KVLedger(32, BS)
        prompt = toks(10)
        assert led.admit(Request("a", prompt, 4, mm_items=[MMItem("cat", 8, 2)])).admitted
        owner = "a"
        if fork:  # a fork's tail carries its parent's images
            led.mark_computed("a", 10)
            led.fork("a", "a2")
            led.release("a")
            owner = "a2"
        for t in (50, 51, 52):
            led.append_token(owner, t)
            led.check()
        led.release(owner)
        led.check()
        grown = [*prompt, 50, 51, 52]
        assert hits(led, "b", grown, mm_items=[MMItem("dog", 8, 2)]) == 2, fork
        assert hits(led, "c", grown) == 2, fork
        assert hits(led, "d", grown, mm_items=[MMItem("cat", 8, 2)]) == 3, fork


def test_a_remembered_prompt_is_hashed_again_for_other_images(run_once: Callable[..., None]) -> None:
    led = KVLedger(32, BS)
    prompt = tuple(toks(17))
    run_once(led, "a", list(prompt), mm_items=[CAT])
    assert led.can_admit(Request("x", prompt, 0, mm_items=[DOG])).blocks_hit == 2  # remembered under "x"
    assert led.admit(Request("x", prompt, 0, mm_items=[CAT])).blocks_hit == 4
    led.check()


def test_images_must_lie_in_the_sequence() -> None:
    with pytest.raises(ConfigError, match="within the first 6 positions"):
        Request("x", toks(4), 2, mm_items=[MMItem("cat", 4, 3)])
    with pytest.raises(ConfigError, match="mm_items must be MMItem values"):
        Request("x", toks(4), 2, mm_items=[("cat", 0, 2)])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="mm_items must be MMItem values"):
        Request("x", toks(4), 2, mm_items="cat")  # type: ignore[arg-type]
    assert Request("x", toks(4), 2, mm_items=[MMItem("cat", 4, 2)]).mm_items == (MMItem("cat", 4, 2),)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 24), offset=st.integers(0, 23), length=st.integers(1, 8))
def test_an_images_keys_start_at_its_first_block(n: int, offset: int, length: int) -> None:
    """The blocks before the image's first block keep the plain digests; that block and every later one differ
    from the plain chain and from another image's."""
    if offset + length > n:
        return
    root = CacheContext().root_digest()
    plain = prompt_digests(root, toks(n), BS)
    cat = mm_prompt_digests(root, toks(n), BS, (MMItem("cat", offset, length),))
    dog = mm_prompt_digests(root, toks(n), BS, (MMItem("dog", offset, length),))
    first = offset // BS
    assert len(cat) == len(plain) and cat[:first] == plain[:first]
    assert all(c != p and c != d for c, p, d in zip(cat[first:], plain[first:], dog[first:], strict=True))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 20), st.booleans(), st.sampled_from(["", "cat", "dog"]),
                          st.integers(0, 19), st.integers(0, 3)), min_size=1, max_size=12))
def test_hits_under_both_rules_keep_the_books(ops: list[tuple[int, int, bool, str, int, int]]) -> None:
    """Random prompts over a few shared prefixes, with and without images and the drafter's rule, grown and
    released: ``check()`` holds after every operation, and a drafter's hit is the plain one stopped before the
    last token, less one block."""
    led = KVLedger(24, BS)
    for i, (base, n, drop, image, offset, grow) in enumerate(ops):
        prompt = toks(n, 1 + 100 * base)
        items = (MMItem(image, min(offset, n - 1), 1),) if image else ()
        rid = f"r{i}"
        plain = led.can_admit(Request(rid, prompt, grow, mm_items=items)).blocks_hit
        d = led.admit(Request(rid, prompt, grow, mm_items=items, drop_last_hit_block=drop))
        led.check()
        if not d.admitted:
            continue
        assert d.blocks_hit == (max(0, min(plain, (n - 1) // BS) - 1) if drop else plain)
        led.mark_computed(rid, n)
        for t in range(grow):
            led.append_token(rid, 7 + t)
            led.check()
        led.release(rid)
        led.check()
