"""Forks on the hybrid pool's group tables (`KVLedger(kv_groups=...)`, `core.windows.GroupTables`), operation by
operation: random admissions with n branches, prompt chunks and decodes (sliding groups releasing what left the
window), forks, beam steps, leases, preemption, and swaps (every branch's group blocks out, the family re-admitted
and restored from the host copy), with `check()` -- each group's conservation law, one owner per live block, every
holder holding it, promises matching -- after every operation and a model of every group page's KV."""

from __future__ import annotations

import random

import pytest

from kvledger.core import CacheContext, KVLedger, Request
from kvledger.core.groups import NULL_BLOCK, KVCacheGroup
from kvledger.errors import AdmissionError, LedgerError, OutOfBlocksError

BS = 4
GROUPS = (KVCacheGroup("full", 2), KVCacheGroup("sliding", 2, 5), KVCacheGroup("full", 2),
          KVCacheGroup("sliding", 2, 9))
STEP = 6


class Model:
    """The ledger under test plus fake KV pages: ``kv[block][slot]`` is the (tokens up to and including the
    position) a work wrote there; every read of a group's position must find its own sequence's."""

    def __init__(self, rng: random.Random, caching: bool) -> None:
        self.rng = rng
        self.led = KVLedger(rng.randint(30, 90), BS, prefix_caching=caching, kv_groups=GROUPS, step_tokens=STEP)
        self.kv: dict[int, list] = {}
        self.done: dict[str, int] = {}  # positions each sequence's KV is written for (all groups)
        self.host: dict[str, tuple] = {}  # swapped: tokens, done, group host slots, first-group pages
        self.host_kv: dict[int, list] = {}
        self.slots = 0
        self.copies = self.forks = self.swaps = 0

    def page(self, b: int) -> list:
        return self.kv.setdefault(b, [None] * BS)

    def apply_copies(self) -> None:
        for op in self.led.take_copies():
            self.page(op.dst)[: op.slots] = self.page(op.src)[: op.slots]
            self.copies += 1

    def work(self, rid: str, n: int) -> None:
        """Compute the next ``n`` positions of ``rid`` (a prompt chunk or a decode) through every group."""
        led = self.led
        seq = led.sequence(rid)
        start = self.done[rid]
        end = min(start + n, seq.num_tokens)
        if start >= seq.num_prompt:
            end = start + 1
        if end <= start:
            return
        tables = led.group_tables(rid, start, end)
        self.apply_copies()
        toks = tuple(seq.tokens)
        for g, (group, table) in enumerate(zip(GROUPS, tables, strict=True)):
            lo = 0 if group.kind == "full" else max(0, start - group.window + 1)
            for p in range(lo, start):  # what the step's attention reads
                b = table[p // BS]
                assert b != NULL_BLOCK and self.page(b)[p % BS] == toks[: p + 1], (rid, g, p, b)
            for p in range(start, end):
                self.page(table[p // BS])[p % BS] = toks[: p + 1]
        self.done[rid] = end
        led.mark_computed(rid, end)

    def admit(self, i: int, heads: list[list[int]]) -> None:
        rng = self.rng
        prompt = rng.choice(heads) + [rng.randrange(100) for _ in range(rng.randint(1, 6))]
        k = rng.choice([1, 2, 3])
        d = self.led.admit(Request(f"r{i}", prompt, rng.randint(1, 10), branches=k))
        if d.admitted:
            rid = f"r{i}"
            for sid in [rid, *(f"{rid}/{j}" for j in range(1, k))]:
                self.done[sid] = self.led.ready_tokens(sid) if self.led.groups.seqs[sid].tables[0] else 0
                self.done[sid] = min(self.done[sid], len(prompt) - 1)

    def swap_out(self, rid: str) -> None:
        """A running sequence's memory goes to the host -- the first group's pages and every other group's live
        blocks (`group_entries`) -- and it is preempted."""
        led = self.led
        host: dict[tuple[int, int], int] = {}
        for g, j, b in led.group_entries(rid):
            self.host_kv[self.slots] = list(self.page(b))
            host[(g, j)] = self.slots
            self.slots += 1
        seq = led.sequence(rid)
        first = [list(self.page(b)) for b in seq.table.blocks]
        self.host[rid] = (list(seq.tokens), self.done.pop(rid), host, first)
        led.preempt(rid)
        self.swaps += 1

    def swap_in(self, rid: str) -> None:
        """The family comes back (`admit_family`) and every group is restored from the host copy."""
        tokens, done, host, first = self.host[rid]
        d = self.led.admit_family([Request(rid, tokens, self.rng.randint(1, 6), read_prefix_cache=False)])
        if not d.admitted:
            return
        del self.host[rid]
        copies = self.led.restore_group_tables(rid, done, host)
        if copies is None:  # a host entry the window reads is missing: recompute from 0
            self.done[rid] = 0
            return
        for h, b in copies:
            self.kv[b] = list(self.host_kv[h])
        for b, page in zip(self.led.sequence(rid).table.blocks, first, strict=False):
            self.kv[b] = list(page)
        self.led.mark_computed(rid, done)
        self.done[rid] = done


def _step(m: Model, i: int, heads: list[list[int]], leases: list[int], full: bool) -> None:
    """One random operation. A lease is a step in flight: taken, a sequence dropped under it (its blocks wait for
    the lease), ended before the next operation (the scheduler plans group tables only once the step is confirmed:
    a window block released under a lease is not back yet)."""
    rng, led = m.rng, m.led
    while leases:
        led.end_lease(leases.pop())
    live = list(m.done)
    op = rng.random()
    if op < 0.15 or not live:
        m.admit(i, heads)
        return
    rid = rng.choice(live)
    seq = led.sequence(rid)
    if op < 0.6:
        if m.done[rid] < seq.num_tokens:
            m.work(rid, rng.randint(1, STEP))
        elif seq.num_tokens < seq.num_prompt + seq.max_new_tokens:
            led.append_token(rid, rng.randrange(100))
            m.apply_copies()
        else:
            led.release(rid)
            del m.done[rid]
    elif op < 0.72:
        if m.done[rid] == seq.num_tokens:
            led.fork(rid, f"f{i}")
            m.done[f"f{i}"] = m.done[rid]
            m.forks += 1
    elif op < 0.78 and full:
        drops = [r for r in live if r != rid and rng.random() < 0.3]
        if m.done[rid] == seq.num_tokens:
            led.beam_step([(rid, f"b{i}")], drops)
            for r in drops:
                del m.done[r]
            m.done[f"b{i}"] = m.done[rid]
            m.forks += 1
    elif op < 0.82 and full:
        led.preempt(rid)
        del m.done[rid]
    elif op < 0.89:
        m.swap_out(rid)
    elif op < 0.94 and m.host:
        m.swap_in(rng.choice(sorted(m.host)))
    elif full:
        leases.append(led.lease([rid, *(r for r in live if rng.random() < 0.3)], owner="step"))
        victim = rng.choice(live)
        if rng.random() < 0.5:
            led.preempt(victim)
        else:
            led.release(victim)
        del m.done[victim]


@pytest.mark.parametrize("seed", range(12))
def test_random_forks_windows_preemption_and_swaps_keep_every_groups_law(seed: int) -> None:
    rng = random.Random(seed)
    m = Model(rng, caching=seed % 2 == 0)
    led = m.led
    heads = [[rng.randrange(100) for _ in range(rng.randint(3, 12))] for _ in range(3)]
    leases: list[int] = []
    for i in range(300):
        try:
            _step(m, i, heads, leases, True)
        except (AdmissionError, OutOfBlocksError):
            pass
        led.check()
    for lease in leases:
        led.end_lease(lease)
    for rid in list(m.done):
        led.release(rid)
    led.check()
    u = led.usage()
    assert (u.active, u.promised, u.sequences) == (0, 0, 0), u
    assert not led.groups.seqs and led.groups.total == 0


def test_the_random_operations_fork_copy_and_swap() -> None:
    """The walk above really forks, copies shared group blocks and swaps (else it would pass vacuously)."""
    totals = [0, 0, 0]
    for seed in range(12):
        rng = random.Random(seed)
        m = Model(rng, caching=seed % 2 == 0)
        heads = [[rng.randrange(100) for _ in range(rng.randint(3, 12))] for _ in range(3)]
        for i in range(150):
            try:
                _step(m, i, heads, [], False)
            except (AdmissionError, OutOfBlocksError):
                pass
        totals[0] += m.forks
        totals[1] += m.copies
        totals[2] += m.swaps
    assert totals[0] > 20 and totals[1] > 20 and totals[2] > 10, totals


def test_a_hybrid_pool_refuses_a_pin_it_could_not_keep() -> None:
    """A prefix hit on a hybrid pool needs every group's blocks (a sliding group's window too), so pinning only the
    full-attention group's blocks would hold memory without keeping the hit: refused in one clear error, nothing
    held. (Before: the first group's blocks were pinned and the count returned as if the prefix were kept.)"""
    led = KVLedger(40, BS, prefix_caching=True, kv_groups=GROUPS, step_tokens=STEP)
    prompt = list(range(1, 18))
    assert led.admit(Request("a", prompt, 2)).admitted
    for start in range(0, len(prompt), STEP):
        end = min(start + STEP, len(prompt))
        led.group_tables("a", start, end)
        led.mark_computed("a", end)
    led.release("a")  # the prompt's blocks stay in the prefix index, retained
    with pytest.raises(LedgerError, match="a hybrid KV pool pins no prefixes yet"):
        led.pin("system", prompt, CacheContext())
    assert led.pins() == {} and led.check() is None
