"""Randomised fuzzing of the ledger and the scheduler: the harness behind ``tests/test_fuzz_short.py``
(a short run inside ``make test``, new seeds every run) and ``make fuzz`` (the long run).

Three parts, each a sequence of independent *episodes*; every episode is a pure function of its seed,
so a failure is replayed exactly with one command (printed with the failure)::

    .venv/bin/python tests/fuzzing.py --part ledger --seed 1234567 --episodes 1

* ``ledger`` -- random operations on one small ledger (admit / can_admit with branches, lookahead,
  retention and six deliberately confusable cache contexts; mark_computed, append_token, decode_step,
  reserve / trim lookahead, fork, beam_step, preempt, release, retract, cancel, leases, pins,
  clear_cache, reset_prefix_cache, and bad calls), with ``check()`` after every operation and an
  independent model: token lists, the full-reservation promise (a request that reserved its whole
  output reaches ``max_new_tokens`` without ever running out of blocks), all-or-nothing errors (a call
  that raises changes nothing), prefix hits only on blocks that really hold the same context and
  tokens, and no block shared across contexts. Where the C part is loaded, each episode runs on both
  cores and their traces must be identical.
* ``threads`` -- 16-32 threads admitting, growing, forking, leasing and releasing on one ledger while a
  sampler checks the conservation laws; no overcommit, every full reservation completes, nothing
  leaks. (Thread interleavings are not reproducible; the seed fixes what each thread does.)
* ``scheduler`` -- random workloads through the one step loop (``Driver``) over every admission
  policy x growth action x victim x recovery mode x eviction policy, prefix caching on and off,
  a host tier (swap), ``n > 1``, lookahead with random draft acceptance, beam search, priorities,
  stop tokens, cancellations and failing requests; in a fraction of the episodes, failing transfers
  (``TransferFaults``: demotions, moves, write-backs, promotions, swap-outs and swap-ins). The executor
  checks every KV position a step reads (``FakeEngine``); ``Scheduler.check`` runs after every step. At
  the end nothing leaked, every request ended for a reason that is true of it (an error only for its
  own fault or failed swap), and with failed transfers every request that completed produced what the
  same workload produces without them.

``KVLEDGER_NATIVE=0`` runs the pure-Python core only (``make fuzz`` runs both).
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the tests' helpers importable
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvledger.core import native
from kvledger.core.eviction import EVICTION_POLICIES, make_policy
from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Outcome, Request, Retention
from kvledger.core.tiers import TierLedger
from kvledger.errors import (
    AdmissionError,
    ConfigError,
    InvariantError,
    LedgerError,
    OutOfBlocksError,
)
from kvledger.scheduler import (
    ADMISSION_POLICIES,
    GROWTH_ACTIONS,
    RECOVERY_MODES,
    VICTIM_POLICIES,
    Driver,
    GenRequest,
    HostPool,
    RecoveryCosts,
    Scheduler,
    SchedulerConfig,
    StepOutput,
    StepPlan,
    StepResult,
    TransferModel,
)

try:  # the module name pytest gives tests/scheduler/test_scheduler.py depends on its import mode
    from tests.scheduler.test_scheduler import BS, FakeEngine, sample_token
except ImportError:  # pragma: no cover - run as a script, or pytest's importlib mode
    from scheduler.test_scheduler import BS, FakeEngine, sample_token

PARTS = ("ledger", "threads", "scheduler")

# Contexts built to be confused by a careless encoding: field boundaries ("ab" | "" vs "a" | "b"), and
# extra values of different types that compare or print alike (1, "1", True).
CONTEXTS = (
    CacheContext(trust_group="a"),
    CacheContext(trust_group="ab"),
    CacheContext(trust_group="a", model="b"),
    CacheContext(trust_group="b", extra=(("k", 1),)),
    CacheContext(trust_group="b", extra=(("k", "1"),)),
    CacheContext(trust_group="b", extra=(("k", True),)),
)
EXPECTED = (AdmissionError, ConfigError, LedgerError, OutOfBlocksError)  # typed refusals; never InvariantError


class FuzzFailure(AssertionError):
    """An episode broke a law; the message says how to replay it."""


@contextmanager
def core(fast: object) -> Iterator[None]:
    """Build ledgers with the given core: None for pure Python, or the C module."""
    saved = native.MODULE
    native.MODULE = fast  # type: ignore[assignment]
    try:
        yield
    finally:
        native.MODULE = saved


def cores() -> list[tuple[str, object]]:
    """The cores an episode runs on: both when the C part is loaded (the traces must agree)."""
    if native.MODULE is None:
        return [("python", None)]
    return [("native", native.MODULE), ("python", None)]


def require(cond: bool, message: str) -> None:
    if not cond:
        raise FuzzFailure(message)


# ==== part 1: random ledger operations ================================================================

@dataclass
class Live:
    ctx: int
    prompt_len: int
    max_new: int
    full: bool  # reserved its whole output allowance: growth must never fail
    tokens: list[int]


class LedgerEpisode:
    """One ledger, ``ops`` random operations, ``check()`` and the model after each."""

    def __init__(self, seed: int, ops: int, observe: Callable[[LedgerEpisode], None] | None = None) -> None:
        self.rng = random.Random(seed)
        self.ops = ops
        self.counts: Counter[str] = Counter()
        self.trace: list[tuple] = []
        self.observe = observe  # called after each operation has been verified (the golden transcripts)

    # ---- setup ------------------------------------------------------------------------------------
    def build(self) -> None:
        rng = self.rng
        self.bs = rng.choice([1, 2, 4, 4, 8])
        self.num_blocks = rng.randint(6, 40)
        self.caching = rng.random() < 0.85
        self.now = 0.0
        policy_name = rng.choice(sorted(EVICTION_POLICIES))
        self.priority = policy_name == "priority"
        clock = lambda: self.now  # noqa: E731 -- the episode's own clock: expiry is deterministic
        self.ledger = KVLedger(self.num_blocks, self.bs, prefix_caching=self.caching,
                               policy=make_policy(policy_name, clock), clock=clock,
                               max_pinned_fraction=rng.choice([0.0, 0.25, 0.5]))
        self.live: dict[str, Live] = {}
        self.leases: list[int] = []
        self.pins: list[str] = []
        self.content: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (context, tokens up to its end)
        self.counter = 0
        self.prefixes = [[rng.randint(0, 3) for _ in range(rng.randint(1, 4 * self.bs))] for _ in range(3)]

    # ---- helpers ----------------------------------------------------------------------------------
    def snapshot(self) -> tuple:
        led = self.ledger
        pool = led.pool
        seqs = tuple((rid, tuple(s.tokens), tuple(s.table.blocks), s.promised, s.computed_mark)
                     for rid, s in sorted((r, led.sequence(r)) for r in led.sequences()))
        return (led.usage(), seqs, tuple(pool.ref), tuple(pool.leased), tuple(pool.written),
                tuple(sorted(pool.index.values())), tuple(pool.free_blocks()), tuple(led.pins().items()),
                tuple(sorted(led.leases())), led.promised)

    def pick(self) -> str:
        return self.rng.choice(sorted(self.live))

    def pick_growing(self) -> str:
        """Mostly a sequence that may still grow; now and then one at its limit (the refusal is tested too)."""
        growing = sorted(r for r, m in self.live.items() if len(m.tokens) - m.prompt_len < m.max_new)
        return self.rng.choice(growing) if growing and self.rng.random() < 0.9 else self.pick()

    def token(self) -> int:
        return self.rng.randint(0, 3)

    def prompt(self) -> list[int]:
        rng = self.rng
        head = rng.choice(self.prefixes)
        suffix = [rng.randint(0, 3) for _ in range(rng.randint(0, 2 * self.bs))]
        return head[: rng.randint(0, len(head))] + suffix or [0]

    def remember_content(self) -> None:
        bs = self.bs
        for rid, m in self.live.items():
            blocks = self.ledger.sequence(rid).table.blocks
            for i in range(len(m.tokens) // bs):
                self.content[blocks[i]] = (m.ctx, tuple(m.tokens[: (i + 1) * bs]))

    def attempt(self, name: str, fn: Callable[[], object], atomic: bool = True) -> tuple[bool, object]:
        """Run one operation; a typed refusal is fine, but must (when ``atomic``) change nothing."""
        before = self.snapshot() if atomic else None
        try:
            result = fn()
        except InvariantError:
            raise
        except EXPECTED as exc:
            self.counts[f"{name}:refused"] += 1
            self.trace.append((name, type(exc).__name__, str(exc)))
            if atomic:
                require(self.snapshot() == before, f"{name} raised {type(exc).__name__} ({exc}) but changed the ledger")
            return False, exc
        self.counts[name] += 1
        self.trace.append((name, repr(result)))
        return True, result

    # ---- operations -------------------------------------------------------------------------------
    def op_admit(self) -> None:
        rng, led = self.rng, self.ledger
        prompt = self.prompt()
        max_new = rng.randint(0, 3 * self.bs)
        reserve = rng.choice([None, None, 0, rng.randint(0, max_new)])
        branches = rng.choice([1, 1, 1, 2, 3])
        lookahead = rng.choice([0, 0, 0, 1, 2])
        ctx = rng.randrange(len(CONTEXTS))
        retention: tuple[Retention, ...] = ()
        if self.priority and rng.random() < 0.3:
            retention = (Retention(0, rng.randint(0, len(prompt) + max_new), rng.randint(0, 100),
                                   rng.choice([None, 0.5, 5.0])),)
        self.counter += 1
        rid = f"r{self.counter}"
        req = Request(rid, prompt, max_new, CONTEXTS[ctx], reserve, branches=branches, retention=retention,
                      lookahead=lookahead, read_prefix_cache=rng.random() < 0.85, readmission=rng.random() < 0.2)
        keep_free = rng.choice([0, 0, 1, 2])
        self.remember_content()
        index_before = dict(led.pool.index)
        before = self.snapshot()
        predicted = led.can_admit(req, keep_free)
        require(self.snapshot() == before, "can_admit changed the ledger")
        decision = led.admit(req, keep_free)
        self.trace.append(("admit", decision.outcome.value, decision.reason))
        require(decision.outcome == predicted.outcome,
                f"can_admit said {predicted.outcome}, admit did {decision.outcome}")
        self.counts[f"admit:{decision.outcome.value}"] += 1
        longest = -(-(len(prompt) + max_new + lookahead) // self.bs)
        need = longest + (branches - 1) * (longest - len(prompt) // self.bs)
        group = CONTEXTS[ctx].trust_group
        cap = led.quotas().get(group)
        never = need > self.num_blocks or branches > self.num_blocks or (cap is not None and need > cap)
        require((decision.outcome is Outcome.NEVER) == never,
                f"{rid}: the declared maximum is {need} blocks of {self.num_blocks} (quota {cap}), "
                f"yet {decision.outcome.value}")
        require(not decision.over_quota or cap is not None, f"{rid}: refused over a quota its group does not have")
        if not decision.admitted:
            require(self.snapshot() == before, f"{rid}: refused ({decision.outcome.value}) but changed the ledger")
            return
        seq = led.sequence(rid)
        hits = seq.table.blocks[: decision.blocks_hit]
        for i, b in enumerate(hits):  # a hit holds this context's tokens up to there, nothing else
            want = (ctx, tuple(prompt[: (i + 1) * self.bs]))
            require(self.content.get(b) == want, f"{rid}: prefix hit on block {b} holding {self.content.get(b)}, "
                                                 f"expected {want}")
            require(b in index_before.values(), f"{rid}: hit block {b} was not in the prefix index")
        if cap is not None:  # an admission never takes a capped group's charge past its cap
            charged = led.group_usage(group)[group].charged
            require(charged <= cap, f"{rid}: admitted, and trust group {group!r} is charged {charged} > its cap {cap}")
        full = (reserve is None or reserve == max_new)
        for i in range(branches):
            sid = rid if i == 0 else f"{rid}/{i}"
            self.live[sid] = Live(ctx, len(prompt), max_new, full, list(prompt))

    def op_mark(self) -> None:
        rid = self.pick()
        n = self.rng.randint(0, len(self.live[rid].tokens))
        self.attempt("mark_computed", lambda: self.ledger.mark_computed(rid, n))

    def op_append(self) -> None:
        rid = self.pick_growing()
        m = self.live[rid]
        tok = self.token()
        ok, exc = self.attempt("append_token", lambda: self.ledger.append_token(rid, tok))
        if ok:
            m.tokens.append(tok)
            return
        done = len(m.tokens) - m.prompt_len >= m.max_new
        if isinstance(exc, OutOfBlocksError):
            require(not m.full, f"{rid} reserved its whole output but ran out of blocks after "
                                f"{len(m.tokens) - m.prompt_len} of {m.max_new} tokens: {exc}")
        else:
            require(done and isinstance(exc, LedgerError), f"{rid}: append refused unexpectedly: {exc!r}")

    def op_drive_full(self) -> None:
        """A full reservation always reaches max_new_tokens (no overcommit)."""
        full = sorted(r for r, m in self.live.items() if m.full)
        if not full:
            return
        rid = self.rng.choice(full)
        m = self.live[rid]
        while len(m.tokens) - m.prompt_len < m.max_new:
            tok = self.token()
            try:
                self.ledger.append_token(rid, tok)
            except OutOfBlocksError as exc:
                raise FuzzFailure(f"{rid} reserved its whole output but ran out of blocks after "
                                  f"{len(m.tokens) - m.prompt_len} of {m.max_new} tokens: {exc}") from None
            m.tokens.append(tok)
            self.counts["append_token"] += 1
        self.trace.append(("drive_full", rid, len(m.tokens)))

    def op_decode(self) -> None:
        rng = self.rng
        limit_ok = rng.random() < 0.9  # mostly sequences that may still grow
        rids = [r for r in sorted(self.live) if rng.random() < 0.7
                and (not limit_ok or len(self.live[r].tokens) - self.live[r].prompt_len < self.live[r].max_new)]
        steps = [(r, self.token()) for r in rids]
        if steps and rng.random() < 0.1:  # a bad pair anywhere: nothing may change
            bad = rng.choice([("ghost", 1), (steps[0][0], -1), (steps[0][0], 2**32)])
            steps.insert(rng.randint(0, len(steps)), bad)
            self.attempt("decode_step:bad", lambda: self.ledger.decode_step(steps))
            return
        if any(len(self.live[r].tokens) - self.live[r].prompt_len >= self.live[r].max_new for r in rids):
            self.attempt("decode_step:past_limit", lambda: self.ledger.decode_step(steps))
            return
        before = {r: len(self.ledger.sequence(r).tokens) for r in rids}
        ok, exc = self.attempt("decode_step", lambda: self.ledger.decode_step(steps), atomic=False)
        stopped: str | None = None
        for r, tok in steps:
            grew = len(self.ledger.sequence(r).tokens) - before[r]
            require(grew in (0, 1), f"decode_step grew {r} by {grew}")
            if grew:
                require(stopped is None, f"decode_step applied {r} after {stopped}, which could not grow")
                self.live[r].tokens.append(tok)
            elif stopped is None:
                stopped = r
                require(not ok and isinstance(exc, OutOfBlocksError) and repr(r) in str(exc),
                        f"decode_step stopped at {r}: {exc!r}")
                require(not self.live[r].full, f"{r} reserved its whole output but ran out of blocks: {exc}")
        require(ok == (stopped is None), f"decode_step raised {exc!r} yet applied every pair")

    def op_reserve_lookahead(self) -> None:
        rid = self.pick()
        k = self.rng.randint(0, 3)
        self.attempt("reserve_lookahead", lambda: self.ledger.reserve_lookahead(rid, k))

    def op_trim(self) -> None:
        rid = self.pick()
        self.attempt("trim_lookahead", lambda: self.ledger.trim_lookahead(rid))

    def op_fork(self) -> None:
        parent = self.pick()
        self.counter += 1
        child = f"f{self.counter}"
        ok, _ = self.attempt("fork", lambda: self.ledger.fork(parent, child))
        if ok:
            p = self.live[parent]
            self.live[child] = Live(p.ctx, p.prompt_len, p.max_new, p.full, list(p.tokens))

    def op_beam_step(self) -> None:
        rng = self.rng
        rids = sorted(self.live)
        drops = [r for r in rids if rng.random() < 0.3]
        keep = [r for r in rids if r not in drops]
        forks = []
        for p in keep:
            if rng.random() < 0.3:
                self.counter += 1
                forks.append((p, f"f{self.counter}"))
        ok, _ = self.attempt("beam_step", lambda: self.ledger.beam_step(forks, drops))
        if ok:
            for r in drops:
                del self.live[r]
            for p, c in forks:
                m = self.live[p]
                self.live[c] = Live(m.ctx, m.prompt_len, m.max_new, m.full, list(m.tokens))

    def _drop(self, name: str, fn: Callable[[str], object], rid: str | None = None) -> None:
        rid = self.pick() if rid is None else rid
        self.remember_content()
        ok, _ = self.attempt(name, lambda: fn(rid))
        if ok:
            del self.live[rid]

    def op_release(self) -> None:
        self._drop("release", self.ledger.release)

    def op_finish(self) -> None:
        rid = self.pick()
        self.attempt("mark_computed", lambda: self.ledger.mark_computed(rid, len(self.live[rid].tokens)))
        self._drop("release", self.ledger.release, rid)

    def op_preempt(self) -> None:
        rid = self.pick()
        self.remember_content()
        ok, tokens = self.attempt("preempt", lambda: self.ledger.preempt(rid))
        if ok:
            require(tokens == self.live[rid].tokens, f"preempt({rid}) returned other tokens")
            del self.live[rid]

    def op_retract(self) -> None:
        self._drop("retract", self.ledger.retract)

    def op_cancel(self) -> None:
        rid = self.pick()
        family = self.ledger.sequence(rid).family
        members = [r for r in self.live if r == family or self.ledger.sequence(r).family == family]
        self.remember_content()
        ok, result = self.attempt("cancel", lambda: self.ledger.cancel(family))
        require(ok and result is bool(members), f"cancel({family}) -> {result}")
        for r in members:
            del self.live[r]

    def op_lease(self) -> None:
        rng, led = self.rng, self.ledger
        rids = [r for r in sorted(self.live) if rng.random() < 0.4]
        held = sorted({b for r in self.live for b in led.sequence(r).table.blocks})
        blocks = [b for b in held if rng.random() < 0.2]
        if rng.random() < 0.05:
            blocks.append(rng.choice([-1, self.num_blocks, 10**9]))
        ok, lid = self.attempt("lease", lambda: led.lease(rids, blocks, owner=f"fuzz-{self.counter}"))
        if ok:
            self.leases.append(lid)  # type: ignore[arg-type]

    def op_end_lease(self) -> None:
        if not self.leases:
            self.attempt("end_lease:unknown", lambda: self.ledger.end_lease(10**6))
            return
        lid = self.leases.pop(self.rng.randrange(len(self.leases)))
        self.attempt("end_lease", lambda: self.ledger.end_lease(lid))

    def op_pin(self) -> None:
        self.counter += 1
        name = f"p{self.counter}"
        ctx = self.rng.randrange(len(CONTEXTS))
        ok, _ = self.attempt("pin", lambda: self.ledger.pin(name, self.prompt(), CONTEXTS[ctx]))
        if ok:
            self.pins.append(name)

    def op_unpin(self) -> None:
        if self.pins:
            name = self.pins.pop(self.rng.randrange(len(self.pins)))
            self.attempt("unpin", lambda: self.ledger.unpin(name))

    def op_clear(self) -> None:
        self.attempt("clear_cache", self.ledger.clear_cache)

    def op_reset(self) -> None:
        led = self.ledger
        ok, result = self.attempt("reset_prefix_cache", led.reset_prefix_cache)
        if result.done:  # type: ignore[union-attr]
            held = (len(self.live), sum(led.pins().values()), len(self.leases))
            require(held == (0, 0, 0), f"a reset went through while blocks were held (sequences, pins, leases): {held}")
            u = led.usage()
            require((u.free, len(led.pool.index)) == (u.total, 0), f"a reset left {u}")
            self.content.clear()

    def op_quota(self) -> None:
        """Cap a trust group (sometimes below what it holds now: its admissions wait) or lift the cap."""
        rng, led = self.rng, self.ledger
        group = rng.choice(sorted({c.trust_group for c in CONTEXTS}))
        cap = rng.choice([None, rng.randint(0, self.num_blocks), rng.randint(self.num_blocks // 2, self.num_blocks)])
        self.attempt("quota", lambda: led.set_quota(group, cap))

    def op_take_copies(self) -> None:
        self.attempt("take_copies", self.ledger.take_copies)

    def op_bad(self) -> None:
        """Wrong-typed or unknown arguments: one typed error, nothing changed."""
        rng, led = self.rng, self.ledger
        rid = self.pick() if self.live else "ghost"
        fn = rng.choice([
            lambda: led.release("ghost"),
            lambda: led.append_token(rid, rng.choice([-1, 2**32, 1.5, "3", None])),
            lambda: led.mark_computed(rid, rng.choice(["3", 1.0, -1, 10**6])),
            lambda: led.fork(rid, rid),
            lambda: led.reserve_lookahead(rid, -1),
            lambda: led.admit(Request(rid, [1], 1)) if rid in self.live else led.release(rid),
            lambda: led.lease(["ghost"]),
            lambda: led.unpin("ghost"),
        ])
        self.attempt("bad", fn)

    # ---- invariants -------------------------------------------------------------------------------
    def verify(self) -> None:
        led = self.ledger
        led.check()
        u = led.usage()
        require(u.free + u.active + u.retained == u.total == self.num_blocks, f"conservation broken: {u}")
        require(u.promised <= u.free + u.evictable, f"overcommitted: {u}")
        require(sorted(led.sequences()) == sorted(self.live), "the ledger's sequences differ from the model's")
        holders: dict[int, tuple[str, int]] = {}
        for rid, m in self.live.items():
            seq = led.sequence(rid)
            require(seq.tokens == m.tokens, f"{rid}: tokens differ from the model's")
            for i, b in enumerate(seq.table.blocks[: -(-len(m.tokens) // self.bs)]):
                other = holders.setdefault(b, (rid, i))
                if other[0] == rid:
                    continue
                o = self.live[other[0]]
                end = min((i + 1) * self.bs, len(m.tokens), len(o.tokens))
                require(other[1] == i and o.ctx == m.ctx and o.tokens[:end] == m.tokens[:end],
                        f"block {b} is shared by {other[0]} (context {o.ctx}, position {other[1]}) and "
                        f"{rid} (context {m.ctx}, position {i}) with different contents")

    def teardown(self) -> None:
        led = self.ledger
        for lid in self.leases:
            led.end_lease(lid)
        for name in self.pins:
            led.unpin(name)
        for rid in list(self.live):
            led.release(rid)
        led.check()
        u = led.usage()
        require((u.active, u.promised, u.sequences, u.deferred) == (0, 0, 0, 0), f"leaked after teardown: {u}")
        require(all(led.pool.written[b] for b in led.pool.retained.blocks()), "an unwritten block is retained")

    OPS: tuple[tuple[str, int, bool], ...] = (  # name, weight, needs a live sequence
        ("admit", 14, False), ("mark", 8, True), ("append", 14, True), ("drive_full", 2, True),
        ("decode", 8, True), ("reserve_lookahead", 4, True), ("trim", 4, True), ("fork", 4, True),
        ("beam_step", 2, True), ("release", 4, True), ("finish", 5, True), ("preempt", 2, True),
        ("retract", 1, True), ("cancel", 2, True), ("lease", 3, False), ("end_lease", 3, False),
        ("pin", 2, False), ("unpin", 1, False), ("clear", 1, False), ("reset", 1, False),
        ("take_copies", 1, False), ("quota", 1, False), ("bad", 2, False),
    )

    def run(self) -> Counter[str]:
        self.build()
        names = [n for n, _, _ in self.OPS]
        weights = [w for _, w, _ in self.OPS]
        needs = {n: live for n, _, live in self.OPS}
        for _ in range(self.ops):
            name = self.rng.choices(names, weights)[0]
            if needs[name] and not self.live:
                name = "admit"
            getattr(self, f"op_{name}")()
            self.now += self.rng.choice([0.0, 0.1, 1.0])
            self.verify()
            if self.observe is not None:
                self.observe(self)
            self.remember_content()
            self.counts["ops"] += 1
        self.teardown()
        return self.counts


def ledger_episode(seed: int, ops: int = 300) -> Counter[str]:
    """One ledger episode; on both cores when the C part is loaded (their traces must agree)."""
    traces = {}
    counts: Counter[str] = Counter()
    for name, fast in cores():
        with core(fast):
            ep = LedgerEpisode(seed, ops)
            counts.update(ep.run())
        traces[name] = ep.trace
    if len(traces) == 2:
        a, b = traces["native"], traces["python"]
        diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        require(a == b, f"the native and the Python core differ at operation {diff}: "
                        f"{a[diff] if diff < len(a) else None} vs {b[diff] if diff < len(b) else None}")
    return counts


# ==== part 2: threads ===================================================================================

def threads_episode(seed: int, ops: int = 20000) -> Counter[str]:
    """16-32 threads share one ledger; a sampler checks the laws while they run."""
    rng = random.Random(seed)
    n_threads = rng.randint(16, 32)
    bs = rng.choice([2, 4, 8])
    ledger = KVLedger(rng.randint(16, 48), bs, prefix_caching=rng.random() < 0.85)  # contended
    prefixes = [[rng.randint(0, 50) for _ in range(rng.randint(1, 4 * bs))] for _ in range(4)]
    per_thread = max(1, ops // n_threads)  # ledger calls per thread
    counts: list[Counter[str]] = [Counter() for _ in range(n_threads)]
    errors: list[BaseException] = []
    stop = threading.Event()
    peak = [0, 0]  # samples, peak promised + active

    def sampler() -> None:
        try:
            while not stop.is_set():
                u = ledger.usage()
                if u.free + u.active + u.retained != u.total or u.promised > u.free + u.evictable \
                        or u.promised + u.active > u.total:
                    raise FuzzFailure(f"overcommitted while threads ran: {u}")
                peak[1] = max(peak[1], u.promised + u.active)
                if peak[0] % 16 == 0:
                    ledger.check()
                peak[0] += 1
                time.sleep(0)
        except BaseException as exc:  # reported below
            errors.append(exc)

    def worker(i: int, barrier: threading.Barrier) -> None:
        wr = random.Random(seed * 1000 + i)
        c = counts[i]  # "ops": every ledger call this thread makes
        try:
            barrier.wait()
            for k in range(per_thread):
                if c["ops"] >= per_thread:
                    return
                rid = f"t{i}-{k}"
                prefix = wr.choice(prefixes)
                prompt = prefix[: wr.randint(1, len(prefix))] + [wr.randint(0, 50) for _ in range(wr.randint(0, bs))]
                max_new = wr.randint(1, 3 * bs)
                full = wr.random() < 0.6
                branches = wr.choice([1, 1, 2])
                req = Request(rid, prompt, max_new, CONTEXTS[wr.randrange(len(CONTEXTS))],
                              None if full else wr.randint(0, max_new), branches=branches,
                              lookahead=wr.choice([0, 0, 1]))
                d = ledger.admit(req)
                c["ops"] += 1
                c[f"admit:{d.outcome.value}"] += 1
                if not d.admitted:
                    time.sleep(0)
                    continue
                sids = [rid] + [f"{rid}/{j}" for j in range(1, branches)]
                if wr.random() < 0.2:
                    ledger.cancel(rid)
                    c["ops"] += 1
                    c["cancel"] += 1
                    continue
                lease = ledger.lease(sids, owner=f"step {rid}") if wr.random() < 0.3 else None
                ledger.mark_computed(rid, wr.randint(0, len(prompt)))
                c["ops"] += 1 + (lease is not None)
                if wr.random() < 0.2:
                    c["ops"] += 1
                    try:
                        ledger.fork(rid, f"{rid}/x")
                        sids.append(f"{rid}/x")
                        c["fork"] += 1
                    except AdmissionError:
                        c["fork:refused"] += 1
                for sid in sids:
                    for t in range(max_new):
                        c["ops"] += 1
                        try:
                            ledger.append_token(sid, wr.randint(0, 50))
                            c["append"] += 1
                        except OutOfBlocksError as exc:
                            if full:
                                raise FuzzFailure(f"{sid} reserved its whole output but ran out of blocks at "
                                                  f"token {t}: {exc}") from None
                            c["append:out_of_blocks"] += 1
                            break
                    ledger.mark_computed(sid, len(ledger.sequence(sid).tokens))
                    c["ops"] += 2
                    if wr.random() < 0.1:
                        ledger.preempt(sid)
                        c["preempt"] += 1
                    else:
                        ledger.release(sid)
                        c["release"] += 1
                if lease is not None:
                    ledger.end_lease(lease)
                    c["ops"] += 1
                    c["lease"] += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch often, so that admissions really interleave
    try:
        barrier = threading.Barrier(n_threads)
        threads = [threading.Thread(target=worker, args=(i, barrier), daemon=True) for i in range(n_threads)]
        watcher = threading.Thread(target=sampler, daemon=True)
        watcher.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
            require(not t.is_alive(), "a worker thread hung (deadlock?)")
        stop.set()
        watcher.join(30)
    finally:
        sys.setswitchinterval(old)
    if errors:
        raise errors[0]
    ledger.check()
    u = ledger.usage()
    require((u.active, u.promised, u.sequences, u.deferred) == (0, 0, 0, 0), f"threads leaked: {u}")
    require(peak[1] <= ledger.num_blocks, f"peak {peak[1]} > {ledger.num_blocks}")
    total: Counter[str] = sum(counts, Counter())
    total["threads"] = n_threads
    total["samples"] = peak[0]
    return total


# ==== part 3: scheduler episodes through the Driver ====================================================

STOP_FALLBACK = 3


def never_blocks(prompt_len: int, max_new: int, lookahead: int, n: int, bs: int = BS) -> int:
    """Blocks the whole pool must have for a request to ever fit (the ledger's never rule, by hand)."""
    longest = -(-(prompt_len + max_new + lookahead) // bs)
    return longest + (n - 1) * (longest - prompt_len // bs)


def beam_candidates(tokens: list[int], k: int) -> list[tuple[float, int]]:
    h = zlib.crc32(bytes(str(tokens), "ascii"))
    return [(-0.1 * (i + 1) - (h % 97) / 1000 - i * 0.013, 10 + (h >> (i % 16)) % 50 + 60 * i) for i in range(k)]


# Transfer kinds the fuzz can fail, by the StepPlan field that lists them. Writes of a cached entry into a
# tier slot (demotions, moves, write-backs) may only lose that entry; a failed promotion sends the request
# holding its block back to recompute; a swap is a request's only copy of its KV and fails that request.
CACHE_WRITES = ("demote", "tier_moves", "writeback")
FAULT_FIELDS = (*CACHE_WRITES, "promote", "swap_out", "swap_in")
FAULT_KINDS = {"demote": "write", "tier_moves": "write", "writeback": "write", "promote": "promote",
               "swap_out": "swap_out", "swap_in": "swap_in"}
FAULT_MODES = ("block", "part")
POISON = ("lost",)  # what a failed transfer leaves at its destination: never the KV a read expects


@dataclass(frozen=True, slots=True)
class TransferFaults:
    """Which of an episode's transfers fail: each transfer ``(step, plan field, pair)`` fails when a hash of
    it and ``seed`` falls under its kind's rate -- so the same transfer fails again when the driver runs
    the step again one part at a time, unless ``transient`` (then each attempt draws anew, and a rerun may
    succeed).

    ``mode`` is how the executor reports it. ``block``: as the torch executor does -- a failed cache
    transfer loses only its block, handed to ``Scheduler.transfers_failed`` at once (the works of the
    requests it sends back are skipped) and the step goes on; a failed swap fails the step, after handing
    over every cache entry the step wrote (a rerun could copy blocks this attempt overwrote). ``part``: as
    an executor that does not tell its transfers apart -- the plan (or the driver's part of it) raises
    whole, before anything of it ran, and the driver isolates the step."""

    seed: int
    mode: str
    transient: bool
    rates: tuple[tuple[str, float], ...]  # (write | promote | swap_out | swap_in, probability)

    def rate(self, field_name: str) -> float:
        return dict(self.rates)[FAULT_KINDS[field_name]]

    def fails(self, field_name: str, step: int, pair: tuple[int, int], attempt: int) -> bool:
        rate = self.rate(field_name)
        if rate <= 0.0:
            return False
        key = f"{self.seed}|{field_name}|{step}|{pair[0]}|{pair[1]}|{attempt if self.transient else 0}"
        return zlib.crc32(key.encode()) < rate * 2**32

    def describe(self) -> str:
        rates = ",".join(f"{k}={v:g}" for k, v in self.rates if v)
        return f"faults({self.mode}{' transient' if self.transient else ''}: {rates})"


def draw_faults(rng: random.Random) -> TransferFaults:
    rates = {k: rng.choice([0.0, 0.0, 0.05, 0.2, 0.5, 1.0]) for k in ("write", "promote", "swap_out", "swap_in")}
    if not any(rates.values()):
        rates[rng.choice(sorted(rates))] = 0.3
    return TransferFaults(rng.getrandbits(32), rng.choice(FAULT_MODES), rng.random() < 0.25, tuple(rates.items()))


class InjectedTransferError(OSError):
    """A transfer the fuzz failed on purpose (its message names the transfer)."""


class FuzzExecutor(FakeEngine):
    """FakeEngine's KV model (every read checked), beam candidates, random draft acceptance, a request
    whose part of a step always raises (the driver must fail it alone), and transfers that fail
    (``faults``): a failed transfer leaves garbage where it was to write, so a tier entry or promoted
    block the scheduler keeps trusting is caught by the next read of it."""

    def __init__(self, s: Scheduler, rng: random.Random, failing: str | None,
                 faults: TransferFaults | None = None) -> None:
        super().__init__(s, accept=lambda w: rng.randint(1, w.lookahead + 1))
        self.failing = failing
        self.rng = rng
        self.faults = faults
        self.tier_blocks: Counter[str] = Counter()  # blocks each kind of tier transfer moved
        self.injected: Counter[str] = Counter()  # transfers failed, by plan field (each transfer once)
        self.planned: Counter[str] = Counter()  # transfers the scheduler planned, by plan field
        self.swap_failed: dict[str, list[str]] = {}  # request -> the failed swaps of its own (messages)
        self.violations: list[str] = []  # what the fake KV memory caught, even where a rerun then passed
        self._failed_once: set[tuple[str, int, tuple[int, int]]] = set()
        self._attempts: Counter[tuple[str, int, tuple[int, int]]] = Counter()
        self._step = -1
        self._slot_owner: dict[int, str] = {}  # this step: swapped-out / restored tier slot -> request
        self._sent_back: set[str] = set()  # this step: requests transfers_failed sent back to recompute
        self.reported_promotions: set[tuple[int, tuple[int, int]]] = set()  # (step, pair) told as lost
        if faults is not None:  # whoever reports a failure (this executor or the driver), note what
            told = s.transfers_failed

            def transfers_failed(plan: StepPlan) -> list[str]:
                self.reported_promotions.update((plan.step, pair) for pair in plan.promote)
                return told(plan)

            s.transfers_failed = transfers_failed  # type: ignore[method-assign]

    def execute(self, plan: StepPlan) -> StepOutput:
        self.s.check()  # the in-flight state keeps every law too
        whole = plan is self.s.in_flight
        if plan.step != self._step:
            self._new_step(plan)
        for kind in ("demote", "promote", "writeback", "tier_moves"):
            self.tier_blocks[kind] += len(getattr(plan, kind))
        if whole:
            self.planned.update({f: len(getattr(plan, f)) for f in FAULT_FIELDS})
        works = [*plan.prefills, *plan.decodes]
        if self.failing is not None and any(w.request_id == self.failing for w in works):
            raise RuntimeError(f"injected fault in {self.failing}")
        try:
            if self.faults is not None:
                plan = self._transfers(plan)  # or raises
            sampled = self.run(plan)
        except AssertionError as exc:
            # The fake KV memory (or a check here) caught a wrong plan. The driver takes it for a failing
            # step and runs the plan again one request at a time, which may pass (the first attempt moved
            # the blocks the rerun reads): so it is recorded, and the episode fails at its end.
            self.violations.append(str(exc))
            raise
        works = [*plan.prefills, *plan.decodes]
        out = StepOutput(elapsed_s=0.01 + 0.001 * len(works))
        for w in works:
            if w.sample and w.request is not None and w.request.beam:
                out.candidates[w.seq_id] = beam_candidates(list(w.tokens[: w.end]), 2 * w.request.n)
                sampled.pop(w.seq_id, None)
        out.sampled = sampled
        return out

    # ---- injected transfer failures -------------------------------------------------------------------
    def _new_step(self, plan: StepPlan) -> None:
        """The first execution of a step is the whole plan: note whose swap each tier slot carries (from the
        branches' own host copies, not from the driver's attribution that the fuzz checks)."""
        self._step = plan.step
        self._sent_back = set()
        owner: dict[int, str] = {}
        for unit in (*self.s.swapped, *self.s.running.values()):
            for br in unit:
                owner.update(dict.fromkeys(br.host_blocks, br.request.request_id))
        self._slot_owner = owner

    def _failures(self, plan: StepPlan) -> dict[str, list[tuple[int, int]]]:
        """The transfers of ``plan`` that fail in this attempt, by plan field."""
        faults = self.faults
        assert faults is not None
        failed: dict[str, list[tuple[int, int]]] = {}
        for f in FAULT_FIELDS:
            for pair in getattr(plan, f):
                key = (f, plan.step, pair)
                attempt = self._attempts[key]
                self._attempts[key] += 1
                if faults.fails(f, plan.step, pair, attempt):
                    failed.setdefault(f, []).append(pair)
                    if key not in self._failed_once:
                        self._failed_once.add(key)
                        self.injected[f] += 1
        return failed

    def _transfers(self, plan: StepPlan) -> StepPlan:
        """Carry out the plan's transfers, failing the chosen ones, and report the failures the way the
        episode's executor does; returns the rest of the plan to run (its works), or raises."""
        assert self.faults is not None
        failed = self._failures(plan)
        swaps = [(f, pair) for f in ("swap_out", "swap_in") for pair in failed.get(f, ())]
        for f, (src, dst) in swaps:
            slot = dst if f == "swap_out" else src
            rid = self._slot_owner.get(slot)
            require(rid is not None, f"step {plan.step}: {f} of tier slot {slot} belongs to no swapped request")
            own = self.swap_failed.setdefault(rid, [])
            if f"{f} {src}->{dst}" not in own:
                own.append(f"{f} {src}->{dst}")
        error = InjectedTransferError(
            "injected transfer failure ({}) in step {}".format(
                "; ".join(f"{f} {src}->{dst}" for f, pairs in failed.items() for src, dst in pairs), plan.step))
        if failed and self.faults.mode == "part":
            raise error  # before anything of the plan ran
        self._move_blocks(plan, failed)
        if swaps:
            # The step fails. None of the cache entries it wrote is trusted (the driver runs its transfers
            # again, after this attempt may have overwritten what they copy), nor a promotion that failed.
            written = StepPlan(plan.step, demote=list(plan.demote), tier_moves=list(plan.tier_moves),
                               writeback=list(plan.writeback), promote=list(failed.get("promote", ())))
            if written.tier_transfers:
                self._sent_back.update(self.s.transfers_failed(written))
            raise error
        if failed:  # per block: the lost cache transfers go to the scheduler now; the rest of the step runs
            lost = StepPlan(plan.step, **{f: list(failed.get(f, ())) for f in (*CACHE_WRITES, "promote")})
            self._sent_back.update(self.s.transfers_failed(lost))
            missing = {d for _, d in lost.promote}
            for w in (*plan.prefills, *plan.decodes):
                require(w.request_id in self._sent_back or missing.isdisjoint(w.blocks),
                        f"step {plan.step}: {w.seq_id} reads promoted block(s) {sorted(missing & set(w.blocks))} "
                        "that did not arrive, and its request was not sent back to recompute")
        # The fake checks works against the ledger, which no longer holds the requests sent back to recompute:
        # their works are skipped (the torch executor skips those reading a lost block, and confirm ignores
        # the rest), in the step's later parts too.
        sent_back = self._sent_back
        return StepPlan(plan.step, prefills=[w for w in plan.prefills if w.request_id not in sent_back],
                        decodes=[w for w in plan.decodes if w.request_id not in sent_back],
                        shared_reads=list(plan.shared_reads))

    def _move_blocks(self, plan: StepPlan, failed: dict[str, list[tuple[int, int]]]) -> None:
        """FakeEngine's transfers, in its order; a failed one leaves garbage at its destination (a partial
        write), never the KV a read expects."""
        pool = self.s.ledger.pool
        unwritten = [None] * BS
        poison = [POISON] * BS

        def moves(f: str) -> list[tuple[tuple[int, int], bool]]:
            bad = failed.get(f, ())
            return [(pair, pair in bad) for pair in getattr(plan, f)]

        for (d, t), bad in moves("demote"):
            self.host[t] = list(poison if bad else self.block(d))
        for (src, dst), bad in moves("tier_moves"):
            self.host[dst] = list(poison if bad else self.host.get(src, unwritten))
        for (d, t), bad in moves("writeback"):
            self.host[t] = list(poison if bad else self.block(d))
        for c in plan.copies:
            self.block(c.dst)[: c.slots] = self.block(c.src)[: c.slots]
        for (d, h), bad in moves("swap_out"):
            assert pool.leased[d], f"step {plan.step}: device block {d} swapped out but not leased"
            self.host[h] = list(poison if bad else self.block(d))
        for (t, d), bad in moves("promote"):
            self.dev[d] = list(poison if bad else self.host.get(t, unwritten))
        for (h, d), bad in moves("swap_in"):
            assert h in self.host, f"step {plan.step}: host block {h} read back but never written"
            self.dev[d] = list(poison if bad else self.host[h])


@dataclass
class SchedulerScenario:
    config: SchedulerConfig
    eviction: str
    caching: bool
    num_blocks: int
    host_blocks: int
    link_Bps: float
    requests: list[GenRequest]
    cancels: dict[int, str] = field(default_factory=dict)  # driver step -> request id
    failing: str | None = None
    accept_seed: int = 0
    quotas: dict[str, int] = field(default_factory=dict)  # trust group -> cap (blocks)
    disk_blocks: int = 0  # a second tier below the host (a TierLedger of two tiers) when > 0
    faults: TransferFaults | None = None  # transfers the executor fails

    def undisturbed(self) -> SchedulerScenario:
        """The same workload with no transfer failing."""
        return replace(self, faults=None)

    def describe(self) -> str:
        c = self.config
        tiers = f" disk={self.disk_blocks}" if self.disk_blocks else ""
        offload = f" offload(restore_ahead={c.restore_ahead}, writeback={c.writeback_blocks})" \
            if c.offload_prefixes else ""
        return (f"{c.policy}/{c.on_growth_failure}/{c.victim}/{c.recovery}/{self.eviction} caching={self.caching} "
                f"pool={self.num_blocks} host={self.host_blocks}{tiers}{offload} requests={len(self.requests)} "
                f"quotas={self.quotas}" + (f" {self.faults.describe()}" if self.faults else ""))


FAULTS_CHOICES = ("drawn", "always", "off")  # which episodes fail transfers (the --faults option)
FAULT_EPISODES = 0.4  # the fraction of the episodes with a tier below the pool that fail transfers ("drawn")
FAULTS = "drawn"  # what the scheduler part's episodes draw (--faults)


def draw_scenario(rng: random.Random, faults: str = "off") -> SchedulerScenario:
    """One scenario from ``rng``. ``faults``: ``off`` (the golden transcripts' scenarios), ``drawn`` (in a
    fraction of the episodes with a tier below the pool, transfers fail) or ``always``."""
    cfg = SchedulerConfig(
        policy=rng.choice(ADMISSION_POLICIES.names()),
        on_growth_failure=rng.choice(GROWTH_ACTIONS.names()),
        victim=rng.choice(VICTIM_POLICIES.names()),
        recovery=rng.choice(RECOVERY_MODES.names()),
        max_running=rng.choice([1, 2, 3, 4, 6, 8, 8, 8]),
        token_budget=rng.randint(3, 24),
        prefill_chunk=rng.randint(2, 8),
        watermark=rng.choice([0.0, 0.1]),
        headroom_blocks=rng.randint(0, 2),
        predicted_quantile=rng.choice([0.5, 1.0]),
        predicted_min_samples=rng.randint(1, 3),
    )
    prefixes = [list(range(1000 * (i + 1), 1000 * (i + 1) + rng.randint(0, 9))) for i in range(2)]
    contexts = [CONTEXTS[0], CONTEXTS[1], CONTEXTS[2]]
    requests = []
    for i in range(rng.randint(1, 8)):
        head = rng.choice([[], *prefixes])
        prompt = head + list(range(100 * i, 100 * i + rng.randint(1, 7)))
        rid = f"r{i}"
        beam = rng.random() < 0.1
        stop: frozenset[int] = frozenset()
        if not beam and rng.random() < 0.2:  # stop early, on the token branch 0 samples at a drawn position
            stop = frozenset({sample_token(rid, len(prompt) + rng.randint(0, 5))})
        requests.append(GenRequest(
            rid, prompt, rng.randint(1, 24), context=rng.choice(contexts), n=rng.choice([1, 1, 2, 3]),
            priority=rng.randint(0, 2), arrival_s=rng.choice([0.0, 0.0, rng.uniform(0, 0.2)]),
            stop_token_ids=stop, lookahead=0 if beam else rng.choice([0, 0, 1, 2]), beam=beam,
            read_prefix_cache=rng.random() < 0.9))
    needs = sorted(never_blocks(len(r.prompt), r.max_new_tokens, r.lookahead, r.n) for r in requests)
    if rng.random() < 0.7:  # every request fits alone: the pressure comes from running them together
        num_blocks = rng.randint(needs[-1], needs[-1] + 4)
    else:  # a pool between the median request's need and the largest's: some never fit
        num_blocks = rng.randint(max(2, needs[len(needs) // 2]), max(2, needs[-1] + 1))
    cancels = {}
    if rng.random() < 0.3:
        cancels[rng.randint(0, 20)] = rng.choice(requests).request_id
    failing = rng.choice(requests).request_id if rng.random() < 0.1 else None
    quotas = {}
    if rng.random() < 0.25:  # one tenant capped: its requests queue behind each other, or never fit
        quotas[rng.choice(contexts).trust_group] = rng.randint(max(1, needs[0] - 1), num_blocks)
    sc = SchedulerScenario(cfg, rng.choice(sorted(EVICTION_POLICIES)), rng.random() < 0.85, num_blocks,
                           rng.choice([0, 4, 16, 64]), rng.choice([1e8, 1e12]), requests, cancels, failing,
                           rng.randint(0, 2**31), quotas)
    # Tiers below the pool: drawn last, from a generator of their own, so the draws above stay what they
    # were for every seed. A third of the scenarios with a host get a disk tier under it, and (with prefix
    # caching) evicted prefix blocks demoted to the tiers and promoted back on a hit.
    tier_rng = random.Random(rng.getrandbits(64))
    if sc.host_blocks and tier_rng.random() < 0.35:
        sc.disk_blocks = tier_rng.choice([2, 8, 32])
        if sc.caching:
            sc.config = replace(cfg, offload_prefixes=True, restore_ahead=tier_rng.random() < 0.5,
                                writeback_blocks=tier_rng.choice([0, 1, 4, 32]))
    if faults != "off" and sc.host_blocks:
        # Also drawn last, from a generator of its own: the scenario above is the one without faults.
        fault_rng = random.Random(rng.getrandbits(64))
        if faults == "always" or fault_rng.random() < FAULT_EPISODES:
            add_transfer_faults(sc, fault_rng)
    return sc


def add_transfer_faults(sc: SchedulerScenario, rng: random.Random) -> None:
    """Fail transfers in ``sc``, and make it move blocks to fail: swaps more often, prefix offload to the
    host tier too, and requests that come back later for an earlier request's prompt (promotions)."""
    cfg = sc.config
    if rng.random() < 0.5:  # preemptions, recovered by swapping
        cfg = replace(cfg, policy=rng.choice(["incremental", "incremental", "predicted"]), on_growth_failure="preempt",
                      recovery=rng.choice(["swap", "swap", "auto"]), max_running=max(cfg.max_running, 4),
                      watermark=0.0, headroom_blocks=0)
    if sc.caching and not cfg.offload_prefixes and rng.random() < 0.6:
        cfg = replace(cfg, offload_prefixes=True, restore_ahead=rng.random() < 0.5,
                      writeback_blocks=rng.choice([0, 1, 4, 32]))
    sc.config = cfg
    if cfg.offload_prefixes and rng.random() < 0.8:
        # Later waves: a request with a long prompt of its own evicts (demotes) what the pool caches, then
        # one comes back for an earlier request's prompt and finds it in the tiers.
        t = max(r.arrival_s for r in sc.requests)
        base = list(sc.requests)
        for k in range(rng.randint(1, 3)):
            t += rng.uniform(0.05, 0.5)
            if rng.random() < 0.8 and sc.num_blocks > 1:
                flush = [60_000 + 1000 * k + j for j in range(BS * (sc.num_blocks - 1))]
                sc.requests.append(GenRequest(f"f{k}", flush, 1, context=rng.choice(base).context,
                                              arrival_s=t))
                t += rng.uniform(0.2, 0.6)  # mostly after it is done
            src = max(base, key=lambda r: len(r.prompt)) if rng.random() < 0.6 else rng.choice(base)
            prompt = list(src.prompt) + [50_000 + 10 * k + j for j in range(rng.randint(0, 3))]
            sc.requests.append(GenRequest(f"e{k}", prompt, rng.randint(1, 8), context=src.context,
                                          n=rng.choice([1, 1, min(2, cfg.max_running)]), arrival_s=t))
    sc.faults = draw_faults(rng)


MAX_STEPS = 3000


def scheduler_episode(seed: int, ops: int = 0) -> Counter[str]:
    """One random workload through the Driver; ``ops`` is unused (episodes size themselves). With
    transfer faults, the requests that completed must have produced what an undisturbed run produces."""
    sc = draw_scenario(random.Random(seed), FAULTS)
    counts: Counter[str] = Counter()
    outcomes = {}
    for name, fast in cores():
        with core(fast):
            outcomes[name] = run_scenario(sc, counts)
        counts[f"core:{name}"] += 1
    if len(outcomes) == 2:
        require(outcomes["native"] == outcomes["python"],
                f"the native and the Python core ran the workload differently:\n{outcomes['native']}\n"
                f"{outcomes['python']}")
    if sc.faults is not None:
        counts["fault episodes"] += 1
        compare_undisturbed(sc, next(iter(outcomes.values())))
    return counts


COMPLETED = ("length", "stop", "pruned")


def compare_undisturbed(sc: SchedulerScenario, disturbed: list[tuple]) -> None:
    """Every request that completed despite failed transfers produced exactly the tokens (beam search:
    the hypotheses) of a run of the same workload where every transfer succeeds."""
    try:
        calm = {o[0]: o for o in run_scenario(sc.undisturbed(), Counter())}
    except FuzzFailure as exc:
        raise FuzzFailure(f"the same workload without failed transfers: {exc}") from None
    for rid, outputs, reasons, *_ in disturbed:
        if rid == "faults":
            continue
        _, calm_outputs, calm_reasons, *_ = calm[rid]
        if all(r in COMPLETED for r in reasons) and all(r in COMPLETED for r in calm_reasons):
            require((outputs, reasons) == (calm_outputs, calm_reasons),
                    f"{rid} completed with {reasons} {outputs}, but without failed transfers with {calm_reasons} "
                    f"{calm_outputs} ({sc.describe()})")


def run_scenario(sc: SchedulerScenario, counts: Counter[str],
                 observe: Callable[[Scheduler, StepResult], None] | None = None) -> list[tuple]:
    """Run one scenario to the end and check how every request ended; ``observe(scheduler, result)``
    runs after each driver step (the golden transcripts)."""
    cfg = sc.config
    led = KVLedger(sc.num_blocks, BS, prefix_caching=sc.caching, policy=sc.eviction, clock=lambda: 0.0)
    for group, cap in sc.quotas.items():
        led.set_quota(group, cap)
    host = TierLedger([("host", sc.host_blocks), ("disk", sc.disk_blocks)]) if sc.disk_blocks \
        else HostPool(sc.host_blocks)
    costs = RecoveryCosts(flops_per_token=1e9, flops_per_s=1e12, block_bytes=1_000_000,
                          transfer=TransferModel(link_Bps=sc.link_Bps, staging_blocks=2))
    s = Scheduler(led, cfg, host=host, costs=costs)
    executor = FuzzExecutor(s, random.Random(sc.accept_seed), sc.failing, sc.faults)
    driver = Driver(s, executor, check_every=1, stall_steps=200)
    for req in sc.requests:
        driver.submit(req)
    finished = {}
    steps = 0
    while driver.has_work():
        require(steps < MAX_STEPS, f"the driver did not finish in {MAX_STEPS} steps ({sc.describe()})")
        if steps in sc.cancels:
            driver.cancel(sc.cancels[steps])
        result = driver.step()
        if observe is not None:
            observe(s, result)
        for f in result.finished:
            finished[f.request.request_id] = f
        steps += 1
    counts["steps"] += steps
    counts["preemptions"] += s.preemptions
    counts[f"policy:{cfg.policy}"] += 1
    counts[f"recovery:{cfg.recovery}"] += 1
    counts["quota"] += bool(sc.quotas)
    counts["disk tier"] += bool(sc.disk_blocks)
    counts["offload"] += cfg.offload_prefixes
    counts.update({f"tier:{k}": v for k, v in executor.tier_blocks.items() if v})
    require(not executor.violations, f"the fake KV memory caught a wrong plan ({sc.describe()}): "
                                     + "; ".join(executor.violations[:3]))
    s.check()
    u = led.usage()
    require((u.active, u.promised, u.deferred, u.sequences) == (0, 0, 0, 0), f"leaked: {u} ({sc.describe()})")
    require(led.outstanding_leases() == 0, "a lease outlived the run")
    # Demoted prefix blocks may stay cached below the pool (retained, like the pool's); nothing may stay
    # held for a request or in flight.
    left = {name: (u["held"], u["draining"], u["in_flight"]) for name, u in host.usage().items()
            if u["held"] or u["draining"] or u["in_flight"]}
    require(not left, f"tier slots leaked (held, draining, in flight): {left} ({sc.describe()})")
    host.check()
    if not cfg.offload_prefixes:
        require(host.num_free == host.num_blocks, f"host blocks leaked: {host.num_used} in use")
    require(not (s.running or s.waiting or s.swapped), "the scheduler still holds requests")
    if cfg.exact:
        require(s.preemptions == 0, "a request was preempted under full reservation")
    outcome = []
    for req in sc.requests:
        rid = req.request_id
        f = finished.get(rid)
        require(f is not None, f"{rid} never finished ({sc.describe()})")
        cancelled = rid in sc.cancels.values()
        cap = sc.quotas.get(req.context.trust_group, sc.num_blocks)
        for i, (out, reason) in enumerate(zip(f.outputs, f.finish_reasons, strict=True)):
            counts[f"finish:{reason.split(':')[0]}"] += 1
            where = f"{rid} branch {i} ({reason}; {sc.describe()})"
            if not req.beam:
                sid = rid if i == 0 else f"{rid}/{i}"
                require(out == [sample_token(sid, len(req.prompt) + j) for j in range(len(out))],
                        f"{where}: the tokens are not the model's")
            if reason == "length":
                require(len(out) == req.max_new_tokens, f"{where}: {len(out)} tokens")
            elif reason == "stop":
                require(bool(out) and len(out) <= req.max_new_tokens and (req.beam or out[-1] in req.stop_token_ids),
                        f"{where}: stopped on a token that is no stop token")
            elif reason.startswith("never"):
                need = never_blocks(len(req.prompt), req.max_new_tokens, req.lookahead, req.n)
                require(out == [] and (need > min(sc.num_blocks, cap) or req.n > cfg.max_running),
                        f"{where}: needs {need} of {sc.num_blocks} blocks (quota {cap}), yet never")
            elif reason.startswith("rejected"):
                require(not cfg.exact, f"{where}: a full reservation was rejected")
                require(len(out) < req.max_new_tokens, f"{where}: rejected after all its tokens")
            elif reason.startswith("error"):
                require(rid == sc.failing and f"injected fault in {rid}" in reason
                        or owns_failed_swap(reason, executor.swap_failed.get(rid, [])),
                        f"{where}: failed without a fault of its own (failed swaps by request: "
                        f"{executor.swap_failed})")
            elif reason == "pruned":
                require(req.beam, f"{where}: pruned but not a beam")
            else:
                require(reason == "cancelled" and cancelled, f"{where}: unexpected reason")
        need = never_blocks(len(req.prompt), req.max_new_tokens, req.lookahead, req.n)
        if cfg.exact and not cancelled and rid != sc.failing and need <= min(sc.num_blocks, cap) \
                and req.n <= cfg.max_running:
            require(all(r in ("length", "stop", "pruned") for r in f.finish_reasons),
                    f"{rid}: fits the pool under full reservation, yet ended {f.finish_reasons} ({sc.describe()})")
        if sc.faults is not None and rid in executor.swap_failed and not sc.faults.transient:
            # Its only copy of some KV is lost: it cannot have gone on as if nothing happened (a branch
            # that ended before the swap keeps its reason).
            require(any(r.startswith("error") or r == "cancelled" for r in f.finish_reasons),
                    f"{rid}: its swap failed ({executor.swap_failed[rid]}), yet it ended {f.finish_reasons} "
                    f"({sc.describe()})")
        outcome.append((rid, tuple(map(tuple, f.outputs)), tuple(f.finish_reasons), f.metrics.preemptions))
    if sc.faults is not None:
        outcome.append(check_transfer_faults(sc, s, executor, counts))
    return outcome


def owns_failed_swap(reason: str, own: list[str]) -> bool:
    """``reason`` is an injected transfer failure that names only swaps of the request's own."""
    m = re.search(r"injected transfer failure \((.*)\) in step", reason)
    return m is not None and all(item in own for item in m.group(1).split("; "))


def check_transfer_faults(sc: SchedulerScenario, s: Scheduler, executor: FuzzExecutor,
                          counts: Counter[str]) -> tuple:
    """The books on failed transfers agree with what failed; returns them (both cores must agree)."""
    assert sc.faults is not None
    stats = s.tier_stats()
    planned, injected = executor.planned, executor.injected
    lost_d, lost_p = stats["demotion_failures"], stats["promotion_failures"]
    where = f"({sc.describe()})"
    require(lost_d <= sum(planned[f] for f in CACHE_WRITES),
            f"{lost_d} tier entries lost of {sum(planned[f] for f in CACHE_WRITES)} written {where}")
    require(lost_p <= planned["promote"], f"{lost_p} promotions failed of {planned['promote']} planned {where}")
    reported = len(executor.reported_promotions)
    require(lost_p == reported, f"{reported} promoted blocks were reported lost, {lost_p} counted {where}")
    require(stats["promoted_tokens"] == BS * (planned["promote"] - lost_p) >= 0,
            f"promoted_tokens {stats['promoted_tokens']}: {planned['promote']} blocks promoted, {lost_p} lost {where}")
    if not sc.faults.transient:
        require(lost_p >= injected["promote"],
                f"{injected['promote']} promotions failed, {lost_p} counted {where}")
    counts["faults"] += sum(injected.values())
    counts.update({f"faults:{k}": v for k, v in injected.items() if v})
    counts["lost:demotions"] += lost_d
    counts["lost:promotions"] += lost_p
    if executor.swap_failed:
        counts["faults:swap owners"] += len(executor.swap_failed)
    return ("faults", tuple(sorted(injected.items())), lost_d, lost_p, stats["promoted_tokens"])


# ==== the runner =========================================================================================

EPISODES: dict[str, Callable[[int, int], Counter[str]]] = {
    "ledger": ledger_episode, "threads": threads_episode, "scheduler": scheduler_episode}
DEFAULT_OPS = {"ledger": 300, "threads": 20000, "scheduler": 0}


@dataclass
class PartResult:
    part: str
    base_seed: int
    episodes: int
    ops: int
    seconds: float
    counts: Counter[str]

    def line(self) -> str:
        rate = self.ops / self.seconds if self.seconds > 0 else 0.0
        faults = f"; {self.counts['faults']:,} transfer failures injected in {self.counts['fault episodes']:,} " \
            "episodes" if self.part == "scheduler" else ""
        return (f"fuzz {self.part:9s} seed={self.base_seed} episodes={self.episodes} ops={self.ops:,} "
                f"in {self.seconds:.1f} s ({rate:,.0f} ops/s) {cores_label(self.part)}{faults}")


def cores_label(part: str) -> str:
    if native.MODULE is None:
        return "core=python" + (" (KVLEDGER_NATIVE=0)" if native.REASON.startswith("disabled") else "")
    return "core=native" if part == "threads" else "cores=native+python, compared"


def episode_seed(base: int, i: int) -> int:
    return (base * 1_000_003 + i) % 2**63


def replay_command(part: str, seed: int, ops: int) -> str:
    env = "KVLEDGER_NATIVE=0 " if native.MODULE is None and native.REASON.startswith("disabled") else ""
    faults = f" --faults {FAULTS}" if part == "scheduler" and FAULTS != "drawn" else ""
    return f"{env}.venv/bin/python tests/fuzzing.py --part {part} --seed {seed} --episodes 1 --ops {ops}{faults}"


def run_part(part: str, base_seed: int, seconds: float, max_episodes: int | None = None,
             ops: int | None = None, progress: Callable[[str], None] | None = None) -> PartResult:
    """Episodes of ``part`` from ``base_seed`` until ``seconds`` pass or ``max_episodes`` ran (at least one).
    A failure raises FuzzFailure naming the episode's seed and the command that replays it."""
    ops = DEFAULT_OPS[part] if ops is None else ops
    fn = EPISODES[part]
    total: Counter[str] = Counter()
    started = time.perf_counter()
    last = started
    i = 0
    while True:
        seed = episode_seed(base_seed, i) if max_episodes != 1 else base_seed
        try:
            counts = fn(seed, ops)
        except BaseException as exc:
            raise FuzzFailure(f"fuzz {part}: episode {i} (seed {seed}) failed: {type(exc).__name__}: {exc}\n"
                              f"replay: {replay_command(part, seed, ops)}") from exc
        total.update(counts)
        i += 1
        now = time.perf_counter()
        if progress is not None and now - last > 30:
            last = now
            progress(f"  {part}: {i} episodes, {_ops(part, total):,} ops, {now - started:.0f} s")
        if (max_episodes is not None and i >= max_episodes) or now - started >= seconds:
            break
    return PartResult(part, base_seed, i, _ops(part, total), time.perf_counter() - started, total)


def _ops(part: str, counts: Counter[str]) -> int:
    return counts["steps"] if part == "scheduler" else counts["ops"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--part", choices=(*PARTS, "all"), default="all")
    ap.add_argument("--seed", type=int, default=None, help="base seed (default: a new random one)")
    ap.add_argument("--seconds", type=float, default=60.0, help="time per part (default 60)")
    ap.add_argument("--episodes", type=int, default=None, help="stop after this many episodes per part")
    ap.add_argument("--ops", type=int, default=None, help="operations per ledger / threads episode")
    ap.add_argument("--faults", choices=FAULTS_CHOICES, default="drawn",
                    help="scheduler episodes whose transfers fail: drawn (a fraction of those with a tier\n"
                         "below the pool; the default), always (every such episode) or off")
    args = ap.parse_args(argv)
    global FAULTS
    FAULTS = args.faults
    seed = random.SystemRandom().randrange(2**32) if args.seed is None else args.seed
    parts = PARTS if args.part == "all" else (args.part,)
    print(f"kvledger fuzz: seed {seed}; {native.status()}", flush=True)
    failed = False
    for part in parts:
        try:
            res = run_part(part, seed, args.seconds, args.episodes, args.ops,
                           progress=lambda msg: print(msg, flush=True))
        except FuzzFailure as exc:
            print(f"FAILED: {exc}", flush=True)
            failed = True
            continue
        print(res.line(), flush=True)
        detail = ", ".join(f"{k}={v:,}" for k, v in sorted(res.counts.items()) if k not in ("ops",))
        print(f"  {detail}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
