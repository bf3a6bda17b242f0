"""The tier ledger below the device pool: slots by state, demotion on eviction, promotion on a prefix hit,
trust-group isolation across tiers, and the conservation laws ``check()`` asserts (each shown to fail)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Request
from kvledger.core.tiers import CACHED, DRAINING, FREE, HELD, TierLedger, TierOp, TierSpec
from kvledger.errors import ConfigError, InvariantError, LedgerError
from kvledger.scheduler import (
    Scheduler,
    SchedulerConfig,
)

BS = 4


def req(rid: str, tokens: list[int], new: int = 1, group: str = "default") -> Request:
    return Request(rid, tokens, new, CacheContext(trust_group=group))


def run_and_cache(led: KVLedger, rid: str, tokens: list[int], group: str = "default") -> list[int]:
    """Admit, compute and release: the prompt's full blocks become retained cache."""
    led.admit(req(rid, tokens, group=group)).raise_for_outcome()
    blocks = list(led.sequence(rid).table.blocks)
    led.mark_computed(rid, len(tokens))
    led.release(rid)
    return blocks


def offloading(pool: int = 5, host: int = 4, disk: int = 4) -> tuple[KVLedger, TierLedger]:
    tiers = TierLedger([("host", host), ("disk", disk)])
    led = KVLedger(pool, BS)
    led.attach_tiers(tiers)
    return led, tiers


# ---- demotion and promotion ------------------------------------------------------------------------


def test_evicted_prefix_blocks_are_demoted_deepest_first_and_promoted_back_for_the_same_prompt() -> None:
    led, tiers = offloading()
    a = run_and_cache(led, "a", list(range(16)))  # 4 full blocks retained, released tail first
    run_and_cache(led, "b", list(range(100, 116)))  # needs 4 blocks: 1 free + 3 of a's evicted
    ops = tiers.take_ops()
    assert [op.kind for op in ops] == ["demote"] * 3
    assert [op.src for op in ops] == [a[3], a[2], a[1]]  # LRU: a's deepest block first
    assert all(tiers.tier_name(op.dst) == "host" for op in ops)
    tiers.complete()
    led.check()
    # The same prompt again: block 0 is still on the device, blocks 1-3 come back from the host tier.
    again = req("c", list(range(16)) + [7])
    pairs, lease = led.promote_from_tiers(again, owner="promote-1")
    assert [s for s, _ in pairs] == [ops[2].dst, ops[1].dst, ops[0].dst]  # prompt order
    assert lease is not None and led.leases()[lease] == "promote-1"
    assert led.pool.deferred == 3  # leased, ref 0: nobody may reuse them before the bytes arrive
    led.check()
    d = led.admit(again)
    assert d.admitted and d.blocks_hit == 4 and d.blocks_new == 1  # the promoted blocks are prefix hits
    assert led.ready_tokens("c") == 16
    led.end_lease(lease)
    tiers.complete()
    assert led.counters.promoted_blocks == 3
    a_digests = led._admission.prepare(req("q", list(range(16))))
    assert tiers.flow["promoted"] == 3 and not set(a_digests) & set(tiers.index)  # they left the tiers
    assert len(tiers.index) == 4  # b's blocks evicted by the promotion (3) and the admission (1) went down
    led.check()


def test_a_demoted_block_is_not_readable_until_its_transfer_completes() -> None:
    led, tiers = offloading()
    run_and_cache(led, "a", list(range(16)))
    run_and_cache(led, "b", list(range(100, 116)))
    pairs, lease = led.promote_from_tiers(req("c", list(range(16)) + [1]), owner="x")
    assert (pairs, lease) == ([], None)  # in flight: the copy out has not happened yet
    tiers.complete()
    pairs, lease = led.promote_from_tiers(req("c", list(range(16)) + [1]), owner="x")
    assert len(pairs) == 3


def test_a_write_back_into_a_full_host_tier_moves_its_coldest_entry_to_disk_and_the_last_tier_drops() -> None:
    tiers = TierLedger([("host", 1), ("disk", 1)])
    assert tiers.demote(10, b"d1", "g", urgent=False) == 0
    tiers.complete()
    assert tiers.demote(11, b"d2", "g", urgent=False) == 0  # d1 moves host -> disk, d2 takes the host slot
    assert tiers.take_ops() == [TierOp("writeback", 10, 0), TierOp("move", 0, 1), TierOp("writeback", 11, 0)]
    assert tiers.index == {b"d1": 1, b"d2": 0}
    tiers.complete()
    assert tiers.demote(12, b"d3", "g", urgent=False) == 0  # d2 moves to disk, d1 falls off the last tier
    assert tiers.index == {b"d2": 1, b"d3": 0} and tiers.flow["dropped"] == 1
    tiers.complete()
    tiers.check()
    # Already cached below: no second copy.
    assert tiers.demote(13, b"d3", "g") is None and tiers.flow["demote_skipped"] == 1
    tiers.check()


def test_an_urgent_demotion_never_moves_it_takes_a_free_slot_or_drops_the_slowest_tiers_coldest() -> None:
    tiers = TierLedger([("host", 1), ("disk", 1)])
    assert tiers.demote(10, b"d1", "g") == 0  # free host slot
    assert tiers.demote(11, b"d2", "g") == 1  # free disk slot: kept rather than dropping the host's entry
    tiers.complete()
    assert tiers.demote(12, b"d3", "g") == 1  # the disk's entry, the coldest, is dropped: no move on the critical path
    assert tiers.index == {b"d1": 0, b"d3": 1} and tiers.flow["dropped"] == 1
    assert [op.kind for op in tiers.take_ops()] == ["demote"] * 3
    tiers.complete()
    tiers.check()


def test_in_flight_entries_are_never_moved_or_dropped() -> None:
    tiers = TierLedger([("host", 1)])
    assert tiers.demote(1, b"a", "g") == 0
    assert tiers.demote(2, b"b", "g") is None  # the only slot is still being written: dropped instead
    assert tiers.index == {b"a": 0}
    tiers.complete()
    tiers.check()


def test_holds_take_free_slots_fastest_first_then_drop_cache_slowest_first() -> None:
    tiers = TierLedger([("host", 2), ("disk", 2)])
    for i, d in enumerate((b"h1", b"h2", b"k1")):
        tiers.demote(i, d, "g")
    tiers.complete()
    assert tiers.index == {b"h1": 0, b"h2": 1, b"k1": 2}
    assert tiers.holdable == 4
    assert tiers.hold(1) == [3]  # the one free slot (disk)
    assert tiers.hold(2) == [2, 0]  # then the disk entry, then the host's least recently used
    assert tiers.index == {b"h2": 1}
    with pytest.raises(LedgerError, match="cannot hold 2 blocks"):
        tiers.hold(2)
    assert tiers.index == {b"h2": 1}  # refused: nothing changed
    tiers.complete()
    tiers.free([3, 2, 0])
    tiers.check()
    assert tiers.flow["held_total"] == 3 and tiers.flow["freed"] == 3


def test_promotion_takes_only_unpromised_capacity_and_keeps_the_requests_own_hits() -> None:
    tiers = TierLedger([("host", 8)])
    led = KVLedger(8, BS)
    led.attach_tiers(tiers)
    a = run_and_cache(led, "a", list(range(16)))  # a0..a3 retained, 4 free
    run_and_cache(led, "b", list(range(100, 128)))  # 7 blocks: the 4 free ones, then a3, a2, a1 demoted
    run_and_cache(led, "t", list(range(4)) + [99])  # hits a0 (now the most recently used), evicts b's tail
    tiers.complete()
    assert [led.pool.index.get(d) for d in led._admission.prepare(req("q", list(range(16))))][:1] == [a[0]]
    # A running request: 2 blocks held, 4 promised. Unpromised capacity: 0 free + 6 evictable - 4 = 2.
    led.admit(Request("r", list(range(200, 208)), 16)).raise_for_outcome()
    u = led.usage()
    assert (u.free, u.evictable, u.promised) == (0, 6, 4)
    pairs, lease = led.promote_from_tiers(req("c", list(range(16)) + [1]), owner="x")
    # a0 is the request's own retained hit: taking it costs one more, so only one block comes back.
    assert len(pairs) == 1 and tiers.flow["promoted"] == 1
    first = led._admission.prepare(req("q", list(range(16))))[0]
    assert led.pool.index[first] == a[0]  # never evicted by its promotion
    u = led.usage()
    assert u.promised <= u.free + u.evictable
    led.check()
    led.end_lease(lease)
    tiers.complete()
    led.release("r")
    led.check()


def test_reset_and_clear_do_not_demote() -> None:
    led, tiers = offloading()
    run_and_cache(led, "a", list(range(16)))
    led.clear_cache()
    assert tiers.take_ops() == [] and tiers.index == {}
    run_and_cache(led, "a", list(range(16)))
    assert led.reset_prefix_cache()
    assert tiers.take_ops() == []
    led.check()


def test_attach_needs_prefix_caching_and_a_tier_ledger() -> None:
    with pytest.raises(ConfigError, match="needs prefix caching"):
        KVLedger(4, BS, prefix_caching=False).attach_tiers(TierLedger([("host", 2)]))
    with pytest.raises(ConfigError, match="takes a TierLedger"):
        KVLedger(4, BS).attach_tiers({"host": 2})  # type: ignore[arg-type]
    for bad in ([], [("host", 1), ("host", 2)], [("", 1)], [("host", -1)], [("host", True)], "host"):
        with pytest.raises(ConfigError):
            TierLedger(bad)  # type: ignore[arg-type]


# ---- trust groups ------------------------------------------------------------------------------------


def test_a_tier_never_serves_a_block_to_another_trust_group() -> None:
    led, tiers = offloading()
    run_and_cache(led, "a", list(range(16)), group="tenant-a")
    run_and_cache(led, "b", list(range(100, 116)), group="tenant-a")
    tiers.complete()
    assert len(tiers.index) == 3
    # The very same tokens from another tenant: different digests, nothing found below the device.
    pairs, lease = led.promote_from_tiers(req("x", list(range(16)) + [1], group="tenant-b"), owner="x")
    assert (pairs, lease) == ([], None)
    # Even a forged entry under the other tenant's own digest is refused by the explicit group check.
    b_digests = led._admission.prepare(req("y", list(range(16)) + [1], group="tenant-b"))
    slot = tiers.demote(99, b_digests[0], "tenant-a")
    tiers.complete()
    assert tiers.lookup(b_digests, 0, "tenant-b") == []
    assert tiers.lookup(b_digests, 0, "tenant-a") == [slot]
    # The owner's own request finds its blocks, and promoted blocks keep their group on the device.
    pairs, lease = led.promote_from_tiers(req("a2", list(range(16)) + [1], group="tenant-a"), owner="x")
    assert len(pairs) == 3 and all(led.pool.group[b] == "tenant-a" for _, b in pairs)
    led.end_lease(lease)
    tiers.complete()
    led.check()


# ---- conservation under random operations -----------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_conservation_holds_across_device_and_tiers_under_random_operations(seed: int) -> None:
    rng = random.Random(seed)
    tiers = TierLedger([("host", rng.randint(0, 6)), ("disk", rng.randint(1, 6))])
    led = KVLedger(rng.randint(6, 12), BS)
    led.attach_tiers(tiers)
    prompts = [list(range(k * 100, k * 100 + rng.randint(4, 20))) for k in range(6)]
    groups = ["g0", "g1"]
    held: list[list[int]] = []
    leases: list[int] = []
    n = 0
    for _ in range(300):
        op = rng.random()
        n += 1
        rid = f"r{n}"
        tokens = rng.choice(prompts) + [rng.randint(0, 9)]
        r = req(rid, tokens, rng.randint(1, 4), rng.choice(groups))
        if op < 0.45:
            if rng.random() < 0.7:
                pairs, lease = led.promote_from_tiers(r, owner=f"p{n}")
                if lease is not None:
                    leases.append(lease)
            d = led.admit(r)
            if d.admitted:
                led.mark_computed(rid, len(tokens))
                led.release(rid)
        elif op < 0.6 and tiers.holdable:
            held.append(tiers.hold(rng.randint(1, tiers.holdable)))
        elif op < 0.7 and held:
            tiers.free(held.pop(rng.randrange(len(held))))
        elif op < 0.75:
            tiers.discard(rng.sample(range(tiers.num_blocks), k=min(2, tiers.num_blocks)))
        else:
            tiers.take_ops()
            for lease in leases:
                led.end_lease(lease)
            leases.clear()
            tiers.complete()
        led.check()
        u = tiers.usage()
        for name, size in zip(tiers.names, tiers.sizes, strict=True):
            t = u[name]
            assert t["free"] + t["held"] + t["cached"] + t["draining"] == size
        assert led.promised <= led.pool.num_free + led.pool.num_evictable
    assert tiers.flow["demoted"] > 0


def test_the_index_below_the_device_reports_every_entry_that_joins_or_leaves_it() -> None:
    tiers = TierLedger([("host", 2), ("disk", 2)])
    seen: list[tuple[str, bytes]] = []
    tiers.on_event = lambda kind, digest: seen.append((kind, digest))
    tiers.demote(0, b"a", "g")
    tiers.demote(1, b"b", "g")
    assert seen == [("stored", b"a"), ("stored", b"b")]
    assert tiers.demote(2, b"a", "g") is None and len(seen) == 2  # already below: no news
    tiers.complete()
    seen.clear()
    tiers.spill(0, 1)  # a move one tier down: out of the index and back in under a new slot
    assert seen == [("removed", b"a"), ("stored", b"a")] and tiers.tier_name(tiers.index[b"a"]) == "disk"
    tiers.complete()
    seen.clear()
    tiers.take([tiers.index[b"b"]])  # promoted: it is the device's now
    tiers.complete()
    tiers.discard([tiers.index[b"a"]])
    assert seen == [("removed", b"b"), ("removed", b"a")] and not tiers.index
    tiers.demote(3, b"c", "g")
    tiers.complete()
    seen.clear()
    assert tiers.clear_cache() == 1 and seen == [("removed", b"c")]
    tiers.check()


# ---- the audit can fail: one corruption per check() branch -------------------------------------------


def healthy() -> TierLedger:
    """Every slot state: free, held (one in flight), cached (readable and in flight), draining."""
    tiers = TierLedger([("host", 4), ("disk", 4)])
    tiers.demote(0, b"c1", "g")
    tiers.demote(1, b"c2", "g")
    tiers.demote(2, b"c3", "g")
    tiers.complete()
    tiers.take([tiers.index[b"c3"]])  # draining
    tiers.hold(1)  # held, in flight
    tiers.demote(3, b"c4", "g")  # cached, in flight
    tiers.check()
    states = set(tiers.state)
    assert states == {FREE, HELD, CACHED, DRAINING}
    return tiers


def _free_list(tiers: TierLedger) -> list[int]:
    return next(f for f in tiers._free if f)


def _first(tiers: TierLedger, state: int, in_flight: bool | None = None) -> int:
    return next(s for s in range(tiers.num_blocks) if tiers.state[s] == state
                and (in_flight is None or tiers.in_flight[s] == in_flight))


TIER_CORRUPTIONS: dict[str, tuple[Callable[[TierLedger], object], str]] = {
    "free-twice": (lambda t: _free_list(t).append(_free_list(t)[0]), "on the free list twice"),
    "free-list-foreign": (lambda t: t._free[t.tier_of(s := _first(t, CACHED, False))].append(s),
                          "not a free slot of it"),
    "free-list-short": (lambda t: _free_list(t).pop(), "slots on the free list but"),
    "lru-not-cached": (lambda t: t._lru[t.tier_of(s := _first(t, HELD))].__setitem__(s, None),
                       "evictable but not a readable"),
    "cached-not-indexed": (lambda t: t.index.pop(t.digest[_first(t, CACHED, False)]), "not its digest's index entry"),
    "cached-no-group": (lambda t: t.group.__setitem__(_first(t, CACHED, False), None), "carries no trust group"),
    "readable-not-in-lru": (lambda t: t._lru[t.tier_of(s := _first(t, CACHED, False))].pop(s),
                            "missing from its LRU order"),
    "free-with-identity": (lambda t: t.digest.__setitem__(_free_list(t)[0], b"zz"), "still carries an identity"),
    "flight-flag": (lambda t: t._pending.discard(_first(t, HELD)), "in-flight flag and pending"),
    "draining-in-flight": (lambda t: (t.in_flight.__setitem__(s := _first(t, DRAINING), True), t._pending.add(s)),
                           "in flight but draining"),
    "index-stale": (lambda t: t.index.__setitem__(b"ghost", 7), "index entry for slot 7 disagrees"),
    "drain-list": (lambda t: t._draining.clear(), "draining slots and the drain list"),
    "counters": (lambda t: t.counts.__setitem__("held", 5), "tier counters"),
    "cached-flow": (lambda t: t.flow.__setitem__("promoted", 0), "cached-entry flow broken"),
    "held-flow": (lambda t: t.flow.__setitem__("freed", 3), "held-slot flow broken"),
    "conservation": (lambda t: t.state.__setitem__(_first(t, HELD), 9), "conservation broken"),
}


@pytest.mark.parametrize("name", list(TIER_CORRUPTIONS))
def test_every_tier_check_branch_notices_its_corruption(name: str) -> None:
    corrupt, message = TIER_CORRUPTIONS[name]
    tiers = healthy()
    corrupt(tiers)
    with pytest.raises(InvariantError, match=message):
        tiers.check()


def test_the_ledger_check_covers_its_tiers_and_their_hook() -> None:
    led, tiers = offloading()
    run_and_cache(led, "a", list(range(16)))
    run_and_cache(led, "b", list(range(100, 116)))
    led.check()
    tiers.counts["cached"] += 1
    with pytest.raises(InvariantError, match="tier counters"):
        led.check()
    tiers.counts["cached"] -= 1
    led.pool.on_evict = None
    with pytest.raises(InvariantError, match="evictions are not demoted"):
        led.check()


def test_invalidate_takes_the_identity_of_blocks_whose_transfer_failed() -> None:
    led, tiers = offloading()
    run_and_cache(led, "a", list(range(16)))
    run_and_cache(led, "b", list(range(100, 116)))
    tiers.complete()
    pairs, lease = led.promote_from_tiers(req("c", list(range(16)) + [1]), owner="x")
    blocks = [b for _, b in pairs]
    led.invalidate(blocks)
    assert all(led.pool.digest[b] is None and not led.pool.written[b] for b in blocks)
    led.end_lease(lease)  # nobody holds them: they go to the free list, not the cache
    tiers.complete()
    assert all(b in led.pool.free_blocks() for b in blocks)
    d = led.admit(req("c", list(range(16)) + [1]))
    assert d.blocks_hit == 1  # only the block that never left the device
    led.check()
    with pytest.raises(ConfigError):
        led.invalidate([10**6])


# ---- the tier ledger's public calls refuse bad arguments before changing anything --------------------

def _tiers_with_entries() -> TierLedger:
    t = TierLedger([("host", 3), ("disk", 4)])
    t.hold(2)
    t.demote(5, b"d1" * 8, "g1")
    t.complete()
    return t


def _state(t: TierLedger) -> tuple:
    return (t.usage(), t.stats(), list(t.state), [list(f) for f in t._free])


def test_freeing_a_slot_twice_in_one_call_is_refused_and_changes_nothing() -> None:
    """free([s, s]) put the slot on the free list twice (check() then failed, and two later holds got the
    same slot); take([s, s]) drained one slot twice."""
    t = _tiers_with_entries()
    held = [s for s in range(t.num_blocks) if t.state[s] == HELD]
    before = _state(t)
    with pytest.raises(LedgerError, match="named twice"):
        t.free([held[0], held[0]])
    cached = t.lookup([b"d1" * 8], 0, "g1")
    with pytest.raises(LedgerError, match="named twice"):
        t.take(cached * 2)
    assert _state(t) == before
    t.check()


@pytest.mark.parametrize("call", [
    lambda t: t.demote(9, b"d9" * 8, None),  # an entry without a trust group could be served to anyone
    lambda t: t.demote(9, b"d9" * 8, 7),
    lambda t: t.spill(2, 1), lambda t: t.spill(-1, 1), lambda t: t.spill(0, -1), lambda t: t.spill(True, 1),
    lambda t: t.free_in(2), lambda t: t.free_in(-1),
    lambda t: t.lookup([b"d1" * 8], -1, "g1"),
    lambda t: t.free(5), lambda t: t.take(5), lambda t: t.discard(5), lambda t: t.free("ab"),
])
def test_bad_tier_arguments_are_typed_errors(call) -> None:
    t = _tiers_with_entries()
    before = _state(t)
    with pytest.raises(ConfigError):
        call(t)
    assert _state(t) == before
    t.check()


def test_blocks_for_takes_token_counts_only() -> None:
    from kvledger.core.ledger import KVLedger

    led = KVLedger(8, 4)
    assert [led.blocks_for(n) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]
    for bad in ("4", 1.5, None, True, -1):
        with pytest.raises(ConfigError):
            led.blocks_for(bad)


@pytest.mark.parametrize("slot", [2, 99, -1, "0", None])
def test_freeing_a_slot_not_held_is_the_callers_mistake_not_a_broken_law(slot) -> None:
    """free() of a slot the caller does not hold (a cached one, out of range, not an integer) raised
    InvariantError, the type that says kvledger broke its own conservation law; it is a broken rule of the
    caller's (LedgerError), refused with nothing changed."""
    t = _tiers_with_entries()
    before = _state(t)
    with pytest.raises(LedgerError, match="freed but not held") as raised:
        t.free([slot])
    assert not isinstance(raised.value, InvariantError)
    assert _state(t) == before
    t.check()


def toks(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def _tiers_with_cached(n: int) -> tuple[TierLedger, list[int]]:
    tiers = TierLedger([("host", 8)])
    slots = [tiers.demote(i, bytes([i + 1]) * 32, "g") for i in range(n)]
    tiers.complete()
    return tiers, slots  # type: ignore[return-value]


def test_a_block_evicted_by_decode_growth_is_demoted_to_the_attached_tier(
    run_once: Callable[..., None], grow_into_a_full_pool: Callable[[KVLedger], None],
) -> None:
    from kvledger.core.tiers import TierLedger

    led = KVLedger(4, BS)
    tiers = TierLedger([("host", 8)])
    led.attach_tiers(tiers)
    run_once(led, "a", toks(8, 100))
    grow_into_a_full_pool(led)
    assert led.pool.evictions == 2
    assert tiers.flow["demoted"] == 2 and tiers.num_used == 2  # both of a's blocks, one per decode block
    led.check()


def test_check_reports_tiers_without_demotion_in_exact_words() -> None:
    """With tiers attached but the pool's eviction hook gone, ``check`` names exactly that fault."""
    from kvledger.core.tiers import TierLedger  # noqa: PLC0415
    from kvledger.errors import InvariantError  # noqa: PLC0415
    led = KVLedger(8, BS, prefix_caching=True)
    led.attach_tiers(TierLedger([("host", 8)]))
    led.check()
    led.pool.on_evict = None
    with pytest.raises(InvariantError, match=r"^tiers are attached but the pool's evictions are not demoted$"):
        led.check()


def test_write_back_copies_only_what_the_free_list_is_short_of() -> None:
    """``writeback_blocks=7`` with 5 free blocks and 3 retained prefix blocks: only 7 - 5 = 2 retained
    blocks (the two coldest) are written back, not all 3."""
    from kvledger.core.tiers import TierLedger  # noqa: PLC0415
    led = KVLedger(8, BS, prefix_caching=True)
    for k, rid in enumerate("abc"):  # each leaves one full, indexed block retained; 8 - 3 = 5 free
        led.admit(Request(rid, toks(4, 100 * (k + 1)), 1)).raise_for_outcome()
        led.mark_computed(rid, 4)
        led.release(rid)
    assert (led.pool.num_free, led.pool.num_retained) == (5, 3)
    s = Scheduler(led, SchedulerConfig(offload_prefixes=True, writeback_blocks=7), host=TierLedger([("host", 8)]))
    plan = s.schedule()
    assert len(plan.writeback) == 2


def test_two_tiers_of_one_name_are_refused_with_its_message() -> None:
    with pytest.raises(ConfigError, match="^tier names must be distinct$"):
        TierLedger([("host", 2), ("host", 4)])


def test_tier_usage_counts_the_slots_in_flight() -> None:
    """Two slots held for a swap-out are in flight until the transfer completes."""
    tiers = TierLedger([("host", 4)])
    tiers.hold(2)
    assert tiers.usage()["host"]["in_flight"] == 2
    tiers.complete()
    assert tiers.usage()["host"]["in_flight"] == 0


def test_spill_counts_the_entries_it_moved_down() -> None:
    """Two cached host entries spilled to the disk tier: two moves in the tier ledger's flow."""
    tiers = TierLedger([("host", 2), ("disk", 3)])
    for i in range(2):
        tiers.demote(i, bytes([i + 1]), "g")
    tiers.complete()
    assert tiers.spill(0, 2) == 2
    assert tiers.flow["moved"] == 2


def test_tier_usage_reports_each_tiers_size_under_slots() -> None:
    tiers = TierLedger([("host", 2), ("disk", 3)])
    tiers.demote(0, b"\x01", "g")
    usage = tiers.usage()
    assert usage["host"]["slots"] == 2 and usage["disk"]["slots"] == 3
    assert usage["host"] == {"slots": 2, "free": 1, "held": 0, "cached": 1, "draining": 0, "in_flight": 1}


@pytest.mark.parametrize("name", ["a-b", "1st", "host disk"])
def test_a_tier_name_that_is_not_an_identifier_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="a tier name is an identifier such as 'host' or 'disk'"):
        TierSpec(name, 3)


def test_demote_quotes_the_trust_group_it_refuses() -> None:
    """The error shows the value that was given as the trust group, not some other value."""
    tiers = TierLedger([("host", 8)])
    with pytest.raises(ConfigError, match=r"^demote: the trust group must be a string, got 5$"):
        tiers.demote(0, b"d" * 32, 5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"got b'g'$"):
        tiers.demote(0, b"d" * 32, b"g")  # type: ignore[arg-type]


def test_two_takes_in_one_step_count_both_slots_as_draining() -> None:
    """Promoting one entry, then another before ``complete``: 2 slots drain, the counter says 2 and the
    tier ledger still checks; after ``complete`` none drains."""
    tiers, slots = _tiers_with_cached(2)
    tiers.take([slots[0]])
    tiers.take([slots[1]])
    assert tiers.counts["draining"] == 2 and tiers.usage()["host"]["draining"] == 2
    tiers.check()
    tiers.complete()
    assert tiers.counts["draining"] == 0
    tiers.check()


def test_the_drain_list_check_says_exactly_what_disagrees() -> None:
    """The InvariantError of a lost drain list reads "draining slots and the drain list disagree"."""
    tiers, slots = _tiers_with_cached(1)
    tiers.take(slots)
    tiers._draining.clear()  # the corruption this check exists for (as in tests/core/test_tiers.py)
    with pytest.raises(InvariantError, match=r"^draining slots and the drain list disagree$"):
        tiers.check()


def test_a_write_only_request_promotes_nothing_from_the_tiers(run_in_group: Callable[..., None]) -> None:
    """A request that writes the prefix cache but does not read it (vLLM's prompt-logprobs case) must
    not pull its prefix back from the host tier: it would not use it."""
    tiers = TierLedger([("host", 8)])
    led = KVLedger(5, BS)
    led.attach_tiers(tiers)
    run_in_group(led, "a", toks(16, 0))
    run_in_group(led, "b", toks(16, 100))  # evicts three of a's blocks down to the host tier
    tiers.complete()
    assert len(tiers.index) == 3
    write_only = Request("c", toks(16, 0) + [7], 1, read_prefix_cache=False)
    assert led.promote_from_tiers(write_only, owner="x") == ([], None)
    assert tiers.flow["promoted"] == 0
    pairs, lease = led.promote_from_tiers(Request("d", toks(16, 0) + [7], 1), owner="x")
    assert len(pairs) == 3  # the same prompt read normally does come back
    led.end_lease(lease)
    led.check()


def test_spill_moves_to_the_next_tier_with_room_not_the_last() -> None:
    tiers = TierLedger([("host", 1), ("disk", 1), ("cold", 1)])
    slot = tiers.demote(0, b"d" * 32, "g")
    assert slot is not None and tiers.tier_name(slot) == "host"
    tiers.complete()
    assert tiers.spill(0, 1) == 1
    moves = [op for op in tiers.take_ops() if op.kind == "move"]
    assert [tiers.tier_name(op.dst) for op in moves] == ["disk"]
    tiers.complete()
    assert tiers.free_in(0) == 1 and tiers.free_in(1) == 0 and tiers.free_in(2) == 1
    tiers.check()


def test_a_tier_spec_with_bad_slots_quotes_them() -> None:
    with pytest.raises(ConfigError, match=r"slots must be an integer in .*, got -3"):
        TierSpec("host", -3)
