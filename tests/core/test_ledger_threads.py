"""Concurrent admission: 16 threads admitting, growing and releasing against one ledger never overcommit
the pool, and every admitted full-reservation request can always reach its max_new_tokens."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Outcome, Request
from kvledger.errors import OutOfBlocksError

THREADS = 16
BS = 4


@pytest.fixture(autouse=True)
def _fast_switching():
    """Switch threads often so that admissions really interleave."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


class Sampler(threading.Thread):
    """Samples the ledger while the workers run: usage must never show an overcommitted pool."""

    def __init__(self, ledger: KVLedger) -> None:
        super().__init__(daemon=True)
        self.ledger = ledger
        self.stop = threading.Event()
        self.samples = 0
        self.peak = 0
        self.errors: list[BaseException] = []

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                u = self.ledger.usage()
                assert u.free + u.active + u.retained == u.total, u
                assert u.promised <= u.free + u.evictable, u
                assert u.promised + u.active <= u.total, u
                self.peak = max(self.peak, u.promised + u.active)
                if self.samples % 8 == 0:
                    self.ledger.check()
                self.samples += 1
                time.sleep(0)
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)


def run_threads(target, n: int = THREADS, timeout: float = 20.0) -> list[BaseException]:
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def wrapped(i: int) -> None:
        try:
            barrier.wait()
            target(i)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=wrapped, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a worker thread hung"
    return errors


def test_simultaneous_admissions_admit_exactly_what_fits() -> None:
    # 16 distinct tenants, each needing 6 blocks (8 prompt tokens + 16 output tokens, block size 4),
    # race for a 48-block pool: exactly 8 fit, whatever the interleaving.
    ledger = KVLedger(48, BS)
    outcomes: list[Outcome | None] = [None] * THREADS

    def worker(i: int) -> None:
        req = Request(f"r{i}", list(range(100 * i, 100 * i + 8)), 16, CacheContext(trust_group=f"t{i}"))
        outcomes[i] = ledger.admit(req).outcome

    sampler = Sampler(ledger)
    sampler.start()
    errors = run_threads(worker)
    sampler.stop.set()
    sampler.join(5)
    assert errors == [] and sampler.errors == []
    assert outcomes.count(Outcome.ADMITTED) == 8
    assert outcomes.count(Outcome.NOT_NOW) == 8
    ledger.check()
    u = ledger.usage()
    assert (u.active, u.promised, u.available, u.sequences) == (16, 32, 0, 8)

    # every admitted request reaches max_new without running out of blocks
    admitted = [f"r{i}" for i in range(THREADS) if outcomes[i] is Outcome.ADMITTED]
    errors = run_threads(lambda i: ledger.append_tokens(admitted[i], range(16)), n=len(admitted))
    assert errors == []
    ledger.check()
    assert ledger.usage().promised == 0
    assert ledger.usage().free == 0


def test_concurrent_admit_grow_release_never_overcommits() -> None:
    ledger = KVLedger(40, BS)
    prefixes = [list(range(1, 13)), list(range(50, 58)), list(range(200, 216))]
    groups = [CacheContext(trust_group="a"), CacheContext(trust_group="b")]
    rounds = 25
    stats = [{"admitted": 0, "not_now": 0, "finished": 0, "abandoned": 0} for _ in range(THREADS)]

    def worker(i: int) -> None:
        st = stats[i]
        for k in range(rounds):
            rid = f"t{i}-{k}"
            prefix = prefixes[(i + k) % len(prefixes)]
            prompt = prefix + [i, k][: (i + k) % 3]
            max_new = 1 + (i * 7 + k * 3) % 12
            req = Request(rid, prompt, max_new, groups[(i // 2 + k) % 2])
            decision = ledger.admit(req)
            if not decision.admitted:
                assert decision.outcome is Outcome.NOT_NOW, decision
                st["not_now"] += 1
                time.sleep(0.0005)
                continue
            st["admitted"] += 1
            if k % 4 == 3:
                ledger.release(rid)  # abandoned right after admission
                st["abandoned"] += 1
                continue
            if k % 2:
                ledger.mark_computed(rid, len(prompt))
            for t in range(max_new):
                try:
                    ledger.append_token(rid, t)
                except OutOfBlocksError as exc:  # a full reservation was overcommitted
                    raise AssertionError(f"{rid} ran out of blocks at token {t}: {exc}") from exc
                if t % 5 == 0:
                    time.sleep(0)
            seq = ledger.sequence(rid)
            assert seq.num_generated == max_new
            assert seq.promised == 0
            ledger.release(rid)
            st["finished"] += 1

    sampler = Sampler(ledger)
    sampler.start()
    started = time.monotonic()
    errors = run_threads(worker)
    sampler.stop.set()
    sampler.join(5)
    elapsed = time.monotonic() - started
    assert errors == [], errors[:3]
    assert sampler.errors == [], sampler.errors
    assert sampler.samples > 0
    assert sampler.peak <= ledger.num_blocks
    assert elapsed < 10

    ledger.check()
    u = ledger.usage()
    assert (u.active, u.promised, u.sequences) == (0, 0, 0)
    assert u.free + u.retained == u.total
    total = {key: sum(s[key] for s in stats) for key in stats[0]}
    assert total["admitted"] + total["not_now"] == THREADS * rounds
    assert total["admitted"] == total["finished"] + total["abandoned"]
    assert total["admitted"] > 0


def test_concurrent_same_prompt_shares_and_charges_once() -> None:
    # 16 threads admit the same prompt at once: one of them allocates it, the others hit it; the
    # prompt is charged exactly once however the admissions interleave.
    ledger = KVLedger(64, BS)
    prompt = list(range(16))  # 4 blocks
    decisions = [None] * THREADS

    def worker(i: int) -> None:
        decisions[i] = ledger.admit(Request(f"r{i}", prompt, 3))  # 1 promised block each

    errors = run_threads(worker)
    assert errors == []
    assert all(d.admitted for d in decisions)
    assert sorted(d.blocks_new for d in decisions) == [0] * (THREADS - 1) + [4]
    assert sum(d.blocks_hit for d in decisions) == 4 * (THREADS - 1)
    u = ledger.usage()
    assert (u.active, u.promised) == (4, THREADS)
    assert len({tuple(ledger.sequence(f"r{i}").table.blocks) for i in range(THREADS)}) == 1
    ledger.check()
    errors = run_threads(lambda i: ledger.release(f"r{i}"))
    assert errors == []
    ledger.check()
    u = ledger.usage()
    assert (u.active, u.promised, u.free) == (0, 0, 64)  # nothing was written: nothing retained
