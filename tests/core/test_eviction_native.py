"""The heap-ordered eviction policies (``priority`` and the prefix-tree ones) keep their state in the C part's
``PolicyCore`` when it is loaded; the Python classes are the reference. These run both on the same random
operation sequences -- as the pool drives a policy: identities linked under parents, releases, hits,
victims, forgotten identities, priorities with expiry, ghost hits -- and require the same answer to every
call, victims first; then whole ledgers on both cores must evict the same blocks and hit the same prefixes."""

from __future__ import annotations

import random

import pytest

from fuzzing import core  # build ledgers with a given core (None: pure Python); one owner
from kvledger.core import native
from kvledger.core.eviction import make_policy
from kvledger.core.eviction_tree import GHOST_KEY_BYTES, ARCPolicy, S3FIFOPolicy
from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Request

NATIVE = native.MODULE
pytestmark = pytest.mark.skipif(NATIVE is None, reason=f"the native core is not in use: {native.REASON}")
HEAP_POLICIES = ["priority", "lfu", "gdsf", "arc", "s3fifo", "sglang-priority"]




class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pair(name: str) -> tuple[object, object, Clock, Clock]:
    """The same policy twice: pure Python, then on the C part (each with its own clock)."""
    clocks = Clock(), Clock()
    with core(None):
        ref = make_policy(name, clocks[0])
    with core(NATIVE):
        fast = make_policy(name, clocks[1])
    assert getattr(ref, "native_core", None) is None and fast.native_core is not None
    return ref, fast, clocks[0], clocks[1]


def outcome(call):
    try:
        return ("ok", call())
    except Exception as exc:  # noqa: BLE001 -- the error and its words must match too
        return (type(exc).__name__, str(exc))


def drive(name: str, seed: int, steps: int) -> int:
    """One random sequence on both; returns how many victims were compared."""
    rng = random.Random(seed)
    ref, fast, clock_a, clock_b = pair(name)
    tree = name != "priority"
    n_blocks = rng.choice([6, 12, 40])
    if tree:
        capacity = rng.choice([4, n_blocks, 64])
        for p in (ref, fast):
            p.configure(capacity, 16)
        if rng.random() < 0.5:
            cost = (lambda d: 1.0 + (d % 7) * 0.3) if rng.random() < 0.5 else None
            for p in (ref, fast):
                p.set_block_cost(cost)
    retained: set[int] = set()
    linked: set[int] = set()
    # few names: identities come back (ghost hits); half of them 64 bytes, as the pool's digests are
    names = [f"d{i}".encode().ljust(64 if i % 2 else 0, b"#") for i in range(n_blocks * 2)]
    compared = 0

    def both(method: str, *args):
        a = outcome(lambda: getattr(ref, method)(*args))
        b = outcome(lambda: getattr(fast, method)(*args))
        assert a == b, f"{name} seed {seed}: {method}{args} -> python {a}, native {b}"
        return a

    for _ in range(steps):
        r = rng.random()
        block = rng.randrange(n_blocks)
        if r < 0.22 and tree and block not in retained:  # a new identity (a freed or evicted block reused)
            both("forget", block)
            linked.discard(block)
            parents = [b for b in linked if b != block]
            parent = rng.choice(parents) if parents and rng.random() < 0.8 else None
            both("link", block, rng.choice(names), parent, rng.randrange(0, 40))
            linked.add(block)
        elif r < 0.5 and block not in retained:
            both("add_many", [block])
            retained.add(block)
        elif r < 0.62 and retained:
            b = rng.choice(sorted(retained))
            both("remove", b)
            retained.discard(b)
        elif r < 0.78:
            k = rng.randrange(0, 4) if rng.random() < 0.95 else len(retained) + 1  # sometimes too many
            core = getattr(fast, "native_core", None)
            if core is not None and rng.random() < 0.5:  # the pool's call: victims forgotten as they are taken
                got = outcome(lambda k=k: ref.pop_victims(k))
                if got[0] == "ok":
                    for b in got[1]:
                        ref.forget(b)
                taken = outcome(lambda k=k, core=core: core.take_victims(k))
                assert got == taken, f"{name} seed {seed}: take_victims({k}) -> python {got}, native {taken}"
                forgotten = True
            else:
                got = both("pop_victims", k)
                forgotten = False
            if got[0] == "ok":
                retained.difference_update(got[1])
                compared += len(got[1])
                for b in got[1]:  # the pool forgets a victim's identity
                    if not forgotten:
                        both("forget", b)
                    linked.discard(b)
            else:
                retained = set(fast.blocks())
        elif r < 0.86:
            expires = None if rng.random() < 0.5 else clock_a.now + rng.choice([0.5, 1.0, 3.0])
            both("set_priority", block, rng.randrange(0, 101), expires)
        elif r < 0.9:
            step = rng.choice([0.5, 1.0, 2.0])
            clock_a.now += step
            clock_b.now += step
        elif r < 0.93 and block not in retained:
            both("forget", block)
            linked.discard(block)
        elif r < 0.95:
            both("add", rng.choice(sorted(retained)) if retained else block)  # twice: refused alike
            retained.add(block) if not retained else None
        else:
            both("peek", rng.randrange(0, 5))
        assert len(ref) == len(fast) and ref.blocks() == fast.blocks(), f"{name} seed {seed}"
        if tree:
            b = rng.randrange(n_blocks)
            assert ref.depth(b) == fast.depth(b) and ref.digest(b) == fast.digest(b)
            assert ref._parent_of(b) == fast._parent_of(b)
            assert ref.block_cost(b) == fast.block_cost(b)
    if name == "arc":
        assert ref.target_size == fast.target_size
    if name == "priority":
        assert ref.is_empty() == fast.is_empty()
    both("clear")
    assert len(fast) == 0 and fast.blocks() == []
    return compared


@pytest.mark.parametrize("name", HEAP_POLICIES)
def test_the_c_part_picks_the_same_victims_as_the_python_reference(name: str) -> None:
    compared = sum(drive(name, seed, 400) for seed in range(40))
    assert compared > 800


def _workload(name: str, fast: object, seed: int) -> tuple:
    rng = random.Random(seed)
    with core(fast):
        ledger = KVLedger(rng.choice([24, 48, 96]), 4, prefix_caching=True, policy=name)
    ctx = CacheContext(model="m", trust_group="g")
    heads = [[rng.randrange(999) for _ in range(4 * rng.randrange(1, 6))] for _ in range(6)]
    running: list[str] = []
    trace = []
    for i in range(250):
        prompt = heads[rng.randrange(6)] + [rng.randrange(999) for _ in range(rng.randrange(0, 20))]
        decision = ledger.admit(Request(f"r{i}", prompt, 6, ctx))
        if decision.admitted:
            ledger.mark_computed(f"r{i}", len(prompt))
            for t in range(rng.randrange(0, 6)):
                ledger.append_token(f"r{i}", 7 + t)
            running.append(f"r{i}")
        while running and (len(running) > 3 or not decision.admitted or rng.random() < 0.4):
            ledger.release(running.pop(rng.randrange(len(running))))
            if not decision.admitted:
                break
        trace.append((decision.admitted, decision.blocks_hit, ledger.pool.evictions))
    ledger.check()
    return trace, ledger.pool.retained.blocks()


@pytest.mark.parametrize("name", HEAP_POLICIES)
def test_ledgers_on_either_core_evict_and_hit_alike(name: str) -> None:
    for seed in range(4):
        ref, got = _workload(name, None, seed), _workload(name, NATIVE, seed)
        assert got == ref, f"{name} seed {seed}"
        assert ref[0][-1][2] > 20  # evictions happened


def _ghosts(policy: object) -> list[list[bytes]]:
    core = getattr(policy, "native_core", None)
    if core is not None:
        state = core.state()
        return [state["ghost0"], state["ghost1"]] if policy.name == "arc" else [state["ghost0"]]
    return [list(policy._b1), list(policy._b2)] if policy.name == "arc" else [list(policy._ghost)]


@pytest.mark.parametrize("name", ["arc", "s3fifo"])
def test_ghost_lists_keep_the_python_order_through_growth_and_takes(name: str) -> None:
    """Ghost lists of hundreds of keys -- grown, emptied from the front when over the bound, keys taken out of
    the middle when their identity comes back -- hold the same keys (a digest's first GHOST_KEY_BYTES) in
    the same order on both; two digests alike in those bytes are one ghost on both."""
    for seed in range(3):
        rng = random.Random(seed)
        ref, fast, _, _ = pair(name)
        n_blocks = 400
        for p in (ref, fast):
            p.configure(rng.choice([150, 300]), 16)
        # pairs of digests alike in their first GHOST_KEY_BYTES and different after them
        names = [f"g{i // 2}".encode().ljust(GHOST_KEY_BYTES, b"#") + f"{i}".encode().ljust(48, b"#")
                 for i in range(1500)]
        retained: set[int] = set()
        for step in range(6000):
            block = rng.randrange(n_blocks)
            r = rng.random()
            if r < 0.45 and block not in retained:
                digest = rng.choice(names[: 300 + step // 6])  # old identities come back, new ones keep coming
                for p in (ref, fast):
                    p.forget(block)
                    p.link(block, digest, None, 0)
                    p.add(block)
                retained.add(block)
            elif r < 0.55 and retained:
                b = rng.choice(sorted(retained))
                for p in (ref, fast):
                    p.remove(b)
                retained.discard(b)
            elif retained:
                k = min(len(retained), rng.randrange(1, 6))
                got = ref.pop_victims(k)
                assert fast.pop_victims(k) == got, f"{name} seed {seed} step {step}"
                for b in got:
                    for p in (ref, fast):
                        p.forget(b)
                retained.difference_update(got)
            if step % 97 == 0:
                assert _ghosts(fast) == _ghosts(ref), f"{name} seed {seed} step {step}"
        assert _ghosts(fast) == _ghosts(ref) and max(map(len, _ghosts(ref))) > 100
        assert {len(key) for ghosts in _ghosts(fast) for key in ghosts} == {GHOST_KEY_BYTES}


@pytest.mark.parametrize("kind", [ARCPolicy._native_kind, S3FIFOPolicy._native_kind])
def test_the_c_part_refuses_a_ghost_key_width_it_was_not_built_for(kind: int) -> None:
    """The ghost key's width has one owner (eviction_tree.GHOST_KEY_BYTES): a C part built for another
    refuses to start rather than answer differently from the Python reference."""
    assert NATIVE.PolicyCore(kind, ValueError, None, None, GHOST_KEY_BYTES) is not None
    for width in (GHOST_KEY_BYTES * 2, 64):
        with pytest.raises(ValueError, match="ghosts by"):
            NATIVE.PolicyCore(kind, ValueError, None, None, width)
    with pytest.raises(ValueError, match="ghosts by"):
        NATIVE.PolicyCore(kind, ValueError)
