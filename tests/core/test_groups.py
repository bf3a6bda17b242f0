"""The hybrid KV cache group ledger: one block table per group, sliding groups bounded by their window, atomic
admission across groups, the longest prefix hit every group serves, each group's conservation law."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import pytest

from kvledger.core.groups import NULL_BLOCK, GroupLedger, KVCacheGroup, MMItem
from kvledger.core.sizing.geometry import KVSpec
from kvledger.core.sizing.hybrid import hybrid_plan
from kvledger.core.types import Outcome
from kvledger.errors import ConfigError, InvariantError, LedgerError

ROOT = Path(__file__).resolve().parents[2]
FULL = KVCacheGroup("full", layers=2, layer_block_bytes=100)
SLIDE = KVCacheGroup("sliding", layers=2, window=8, layer_block_bytes=100)  # 8-token window


def _ledger(blocks: int = 64, step: int = 4, groups: tuple[KVCacheGroup, ...] = (FULL, SLIDE), **kw) -> GroupLedger:
    return GroupLedger(blocks, 4, groups, step_tokens=step, **kw)


def _run(led: GroupLedger, rid: str, chunk: int, steps: int | None = None, sample: int = 7) -> None:
    """Prefill in chunks, then decode one token per step, confirming each step; check after every step."""
    req = led.requests[rid]
    done = 0
    while req.computed < req.max_tokens - 1 and (steps is None or done < steps):
        n = min(chunk, len(req.tokens) - req.computed)
        led.schedule(rid, n)
        led.confirm(rid, sample if req.computed + n == len(req.tokens) else None)
        led.check()
        done += 1


def test_reservation_by_group_sliding_bounded_by_window() -> None:
    led = _ledger()
    d = led.admit("a", list(range(40)), 20)  # 60 tokens: 15 blocks in the full group
    assert d.admitted and d.blocks_reserved == (15, 4)  # sliding: ceil((8 - 1 + 4) / 4) + 1 = 4
    assert led.available() == 64 - 19
    led.check()


def test_sliding_group_releases_blocks_out_of_the_window_and_keeps_them_as_cache() -> None:
    led = _ledger()
    led.admit("a", list(range(40)), 20)
    _run(led, "a", chunk=4)
    full, slide = led.block_tables("a")
    assert NULL_BLOCK not in full and len(full) == 15
    live = [b for b in slide if b != NULL_BLOCK]
    assert len(live) <= 4 and slide[:10] == [NULL_BLOCK] * 10  # positions < 59 - 8 + 1 left the window
    usage = led.usage()
    assert usage["held_by_group"] == [15, len(live)]
    assert usage["bytes_held_by_group"] == [15 * 2 * 100, len(live) * 2 * 100]
    # The dropped prompt blocks were full and written: retained for prefix hits, not freed.
    assert usage["retained"] >= 9
    led.release("a")
    led.check()
    assert led.promised == 0 and led.pool.num_active == 0


def test_admission_is_atomic_across_groups() -> None:
    led = _ledger(blocks=20)
    assert led.admit("a", list(range(40)), 20).admitted  # 15 + 4 = 19 of 20
    before = (led.pool.num_free, led.promised, dict(led.usage()))
    d = led.admit("b", list(range(100, 104)), 0)  # 1 + 1 blocks: the full group would fit, the pair does not
    assert d.outcome is Outcome.NOT_NOW and "b" not in led.requests
    assert (led.pool.num_free, led.promised, dict(led.usage())) == before
    assert led.admit("c", list(range(100)), 100).outcome is Outcome.NEVER  # 50 + 4 > 20 blocks
    led.check()


def test_prefix_hit_is_the_longest_length_every_group_serves() -> None:
    led = _ledger()
    prompt = list(range(41))
    led.admit("a", prompt, 1)
    _run(led, "a", chunk=4)
    led.release("a")
    d = led.admit("b", prompt, 1)
    # 10 full blocks cached; the last prompt token is always computed: the hit is 40 tokens.
    assert d.hit_tokens == 40
    full, slide = led.block_tables("b")
    assert len(full) == 10 and NULL_BLOCK not in full
    # The sliding group takes only the blocks the window reaches from position 40: [33, 40) -> blocks 8, 9.
    assert slide == [NULL_BLOCK] * 8 + slide[8:] and len([b for b in slide if b != NULL_BLOCK]) == 2
    assert d.blocks_hit == (10, 2)
    led.check()
    _run(led, "b", chunk=4)
    led.release("b")
    led.check()


def test_prefix_hit_shortened_where_the_window_blocks_were_evicted() -> None:
    led = _ledger()
    prompt = list(range(41))
    led.admit("a", prompt, 1)
    _run(led, "a", chunk=4)
    led.release("a")
    # Evict the sliding group's cached block 9 (its digest is keyed by group 1): a hit at 40 tokens needs it.
    digests = led.requests.get("a") or None
    assert digests is None
    from kvledger.core.identity import prompt_digests

    d9 = prompt_digests(b"", prompt, 4)[9] + bytes((1,))
    led.pool.evict(led.pool.index[d9])
    d = led.admit("b", prompt, 1)
    # The longest length whose window blocks the sliding group still has: 36 tokens (blocks 7, 8).
    assert d.hit_tokens == 36 and d.blocks_hit == (9, 2)
    led.check()


def test_state_group_holds_one_block_and_disables_hits() -> None:
    state = KVCacheGroup("state", layers=3, layer_block_bytes=100)
    led = _ledger(groups=(FULL, state))
    assert led.admit("a", list(range(12)), 4).blocks_reserved == (4, 1)
    _run(led, "a", chunk=4)
    assert len(led.block_tables("a")[1]) == 1
    led.release("a")
    assert led.admit("b", list(range(12)), 4).hit_tokens == 0
    led.check()


def test_check_states_the_state_groups_law() -> None:
    """A state group holds its one block from the first step to release: one handed back early (a bug that keeps
    every other count balanced, the block turned back into a promise) is caught."""
    state = KVCacheGroup("state", layers=3, layer_block_bytes=100)
    led = _ledger(groups=(FULL, state))
    led.admit("a", list(range(12)), 4)
    _run(led, "a", chunk=4)
    led.check()
    req = led.requests["a"]
    led.pool.release(req.tables[1].pop())
    req.held[1] -= 1
    req.own[1] -= 1
    req.promised[1] += 1
    led.promised += 1
    with pytest.raises(InvariantError, match="state group holds 0 of its 1 blocks"):
        led.check()


def test_bad_input_is_refused_without_a_change() -> None:
    with pytest.raises(ConfigError):
        KVCacheGroup("sliding", layers=2)
    with pytest.raises(ConfigError):
        KVCacheGroup("full", window=4)
    led = _ledger()
    led.admit("a", [1, 2, 3, 4, 5], 3)
    with pytest.raises(LedgerError):
        led.admit("a", [1], 1)
    with pytest.raises(ConfigError):
        led.schedule("a", 5)  # more than one step's tokens
    with pytest.raises(LedgerError):
        led.schedule("zzz", 1)
    led.schedule("a", 4)
    with pytest.raises(LedgerError):
        led.schedule("a", 1)  # the step is not confirmed yet
    led.check()


@pytest.mark.parametrize("seed", [7, 8, 9, 10])
def test_random_operations_keep_every_groups_law(seed: int) -> None:
    rng = random.Random(seed)
    groups = (KVCacheGroup("sliding", 2, 6, 10), FULL, KVCacheGroup("sliding", 2, 6, 10))
    led = GroupLedger(48, 4, groups, step_tokens=5)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 30))] for _ in range(4)]
    for i in range(400):
        live = list(led.requests)
        op = rng.random()
        if op < 0.3 or not live:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
            led.admit(f"r{i}", prompt, rng.randrange(0, 12))
        elif op < 0.85:
            rid = rng.choice(live)
            req = led.requests[rid]
            if req.computed < req.max_tokens - 1:
                n = min(rng.randrange(1, 6), len(req.tokens) - req.computed)
                led.schedule(rid, n)
                led.confirm(rid, rng.randrange(50) if req.computed + n == len(req.tokens) else None)
            else:
                led.release(rid)
        else:
            led.release(rng.choice(live))
        led.check()


def test_threads_never_overcommit() -> None:
    led = _ledger(blocks=200)
    outcomes: list[bool] = []

    def worker(k: int) -> None:
        for j in range(20):
            outcomes.append(led.admit(f"t{k}-{j}", [k, j, 1, 2, 3, 4, 5, 6, 7], 12).admitted)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    led.check()
    assert sum(outcomes) == 200 // (6 + 4)  # ceil(21 / 4) = 6 full + 4 sliding blocks each


def test_gemma3_pool_admits_what_the_planner_says() -> None:
    """The ledger's admissions at 32k tokens equal `plan`'s hybrid concurrency (floored): 5 against 2 uniform."""
    spec = KVSpec.from_hf_config(json.loads((ROOT / "examples" / "configs" / "gemma-3-27b.json").read_text()))
    plan = hybrid_plan(spec, 40_000_000_000, 32768, 8192)
    groups = [KVCacheGroup(g.kind, g.layers, g.window, g.layer_block_bytes) for g in plan.groups]
    led = GroupLedger(plan.pool_blocks, 16, groups, step_tokens=8192)
    uniform = GroupLedger(plan.uniform_pool_blocks, 16, [KVCacheGroup("full", 62, None, spec.layer_block_bytes)])
    assert led.block_bytes == plan.block_bytes and uniform.block_bytes == spec.block_bytes
    admitted = [led.admit(f"r{i}", [i] * 32767, 1).admitted for i in range(7)]
    admitted_uniform = [uniform.admit(f"r{i}", [i] * 32767, 1).admitted for i in range(7)]
    assert sum(admitted) == int(plan.max_concurrency) == 5
    assert sum(admitted_uniform) == int(plan.uniform_max_concurrency) == 2
    assert led.reserved_blocks(32768) == tuple(g.blocks_per_request for g in plan.groups)
    led.check()
    uniform.check()


def test_a_shared_window_block_passes_to_its_other_holder() -> None:
    """B hits A's window blocks while A runs; A then drops them: B carries them, the promises stay covered."""
    led = _ledger(blocks=40)
    prompt = list(range(21))
    led.admit("a", prompt, 30)
    _run(led, "a", chunk=4, steps=6)  # 21 prompt tokens + 3 decoded: blocks 0-4 full and indexed
    d = led.admit("b", prompt, 1)
    assert d.hit_tokens == 20 and d.blocks_hit == (5, 2)
    shared = [b for b in led.block_tables("b")[1] if b != NULL_BLOCK]
    assert all(led._owner[b] == "a" for b in shared)
    _run(led, "a", chunk=4)  # A's window moves past them
    assert all(led._owner[b] == "b" for b in shared)
    led.check()
    _run(led, "b", chunk=4)
    led.release("a")
    led.release("b")
    led.check()
    assert led.promised == 0 and led.pool.num_active == 0


def test_past_the_prompt_the_window_bound_shrinks_to_the_decode_step() -> None:
    """A prefill chunk of 16 tokens needs ceil((8 - 1 + 16) / 4) + 1 = 7 window blocks; decoding ceil(8 / 4) + 1 = 3:
    the other 4 go back to the pool's promisable capacity once the prompt is computed."""
    led = _ledger(blocks=64, step=16)
    assert led.admit("a", list(range(40)), 40).blocks_reserved == (20, 7)
    _run(led, "a", chunk=16, steps=3)  # 16 + 16 + 8: the prompt is computed
    before = led.available()
    led.schedule("a", 1)
    assert led.requests["a"].reserved == [20, 3] and led.available() == before + 4
    led.confirm("a", 5)
    with pytest.raises(ConfigError):
        led.schedule("a", 2)  # decoding: one token a step
    led.check()


def _served(led: GroupLedger, rid: str, prompt: list[int], **kw) -> None:
    led.admit(rid, prompt, 1, **kw)
    _run(led, rid, chunk=4)
    led.release(rid)


def test_draft_aware_hit_drops_the_last_matched_block() -> None:
    led = _ledger()
    prompt = list(range(41))
    _served(led, "a", prompt)
    assert led.admit("b", prompt, 1).hit_tokens == 40
    d = led.admit("c", prompt, 1, drop_last_hit_block=True)
    assert d.hit_tokens == 36 and d.blocks_hit == (9, 2)  # the window at 36 reaches back to block 7
    led.check()


def test_image_keys_scope_to_the_blocks_an_image_covers() -> None:
    """Two requests with the same text and different images at position 20: the 5 text blocks before the image are
    shared, the image's blocks are not; the same image again hits through the image."""
    led = _ledger(groups=(FULL,))
    prompt = list(range(41))  # tokens 20-27 are the image's placeholders
    _served(led, "a", prompt, mm_items=[MMItem("cat", 20, 8)])
    assert led.admit("b", prompt, 1, mm_items=[MMItem("dog", 20, 8)]).hit_tokens == 20
    assert led.admit("c", prompt, 1, mm_items=[MMItem("cat", 20, 8)]).hit_tokens == 40
    # The same image at 24: block 5 (20-23) is text here but was the image's in "a", so the hit ends before it.
    assert led.admit("d", prompt, 1, mm_items=[MMItem("cat", 24, 4)]).hit_tokens == 20
    assert led.admit("e", prompt, 1).hit_tokens == 20
    with pytest.raises(ConfigError):
        led.admit("f", prompt, 1, mm_items=[MMItem("cat", 40, 8)])  # past the prompt
    led.check()


def test_sub_block_hit_ends_inside_a_block_and_copies_its_head() -> None:
    """Hash blocks of 2 tokens in blocks of 4: a prompt that leaves a cached prompt in the middle of block 5 hits
    22 tokens; each group gets a fresh block 5 into which the cached one's first 2 slots are copied."""
    led = _ledger(hash_block_size=2)
    prompt = list(range(41))
    _served(led, "a", prompt)
    other = prompt[:22] + [99] * 19
    d = led.admit("b", other, 1)
    assert d.hit_tokens == 22 and d.blocks_hit == (5, 2)
    copies = led.take_copies()
    tables = led.block_tables("b")
    assert [c[2] for c in copies] == [2, 2]
    assert [c[1] for c in copies] == [tables[0][5], tables[1][5]]
    led.check()
    assert led.take_copies() == []
    _run(led, "b", chunk=4)
    led.release("b")
    led.check()
    whole = _ledger(hash_block_size=4)  # hashing by whole blocks: the hit stops at 20
    _served(whole, "a", prompt)
    assert whole.admit("b", other, 1).hit_tokens == 20
    with pytest.raises(ConfigError):
        _ledger(hash_block_size=3)


def test_sub_block_hits_under_random_operations() -> None:
    rng = random.Random(3)
    led = GroupLedger(40, 4, (FULL, KVCacheGroup("sliding", 2, 6, 10)), step_tokens=5, hash_block_size=1)
    base = [rng.randrange(20) for _ in range(30)]
    copies = 0
    for i in range(300):
        live = list(led.requests)
        if rng.random() < 0.3 or not live:
            cut = rng.randrange(1, 30)
            led.admit(f"r{i}", base[:cut] + [rng.randrange(20) for _ in range(rng.randrange(1, 5))],
                      rng.randrange(0, 6))
        else:
            rid = rng.choice(live)
            req = led.requests[rid]
            if rng.random() < 0.8 and req.computed < req.max_tokens - 1:
                copies += len(led.take_copies())
                n = min(rng.randrange(1, 6), len(req.tokens) - req.computed)
                if req.computed >= req.prompt_len:
                    n = 1
                led.schedule(rid, n)
                led.confirm(rid, rng.randrange(20) if req.computed + n == len(req.tokens) else None)
            else:
                led.release(rid)
        led.check()
    assert copies > 20  # hits ended inside blocks, and every one was taken or released with its request
