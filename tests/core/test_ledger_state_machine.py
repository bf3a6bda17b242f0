"""Random admit / compute / append / decode / release sequences against a small pool, checked after every
step against the ledger's own audit and an independent model of what a user may rely on.

The hits a request should get are computed from the model alone, without the hashing under test: the
model remembers which (trust group, token prefix) each block last held at a full-block position, and a
request hits block i exactly when an indexed block holds its group's first (i + 1) * B prompt tokens.
A digest that ignored the trust group, a token or a block boundary would hit a block the model says
holds something else."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Outcome, Request
from kvledger.errors import ConfigError, LedgerError, OutOfBlocksError

GROUPS = ("g0", "g1", "g2")
CONTEXTS = {g: CacheContext(trust_group=g) for g in GROUPS}
TOKENS = st.integers(0, 3)  # a tiny alphabet: random suffixes collide now and then, on purpose


@dataclass
class Model:
    group: str
    prompt_len: int
    max_new: int
    reserve: int
    tokens: list[int] = field(default_factory=list)

    @property
    def full_reserve(self) -> bool:
        return self.reserve == self.max_new


def _snapshot(ledger: KVLedger) -> tuple:
    pool = ledger.pool
    seqs = tuple(
        (rid, tuple(s.tokens), tuple(s.table.blocks), s.promised)
        for rid, s in sorted((rid, ledger.sequence(rid)) for rid in ledger.sequences())
    )
    return (ledger.usage(), tuple(pool.free_blocks()), tuple(pool.retained.blocks()),
            tuple(sorted(pool.index.items())), tuple(pool.ref), tuple(pool.written), seqs)


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ledger: KVLedger | None = None
        self.live: dict[str, Model] = {}
        self.counter = 0
        self.content: dict[int, tuple[str, tuple[int, ...]]] = {}  # block -> (group, tokens up to its end)

    # ---- setup ------------------------------------------------------------------------------------
    @initialize(bs=st.sampled_from([1, 2, 4, 16]),
                num_blocks=st.one_of(st.integers(8, 16), st.integers(8, 40)),  # small pools more often
                data=st.data())
    def setup(self, bs: int, num_blocks: int, data: st.DataObject) -> None:
        self.bs = bs
        self.num_blocks = num_blocks
        self.ledger = KVLedger(num_blocks, bs)
        self.prefixes = data.draw(
            st.lists(st.lists(TOKENS, min_size=1, max_size=5 * bs), min_size=1, max_size=3), label="prefixes")

    def blocks_for(self, n: int) -> int:
        return -(-n // self.bs)

    # ---- helpers ----------------------------------------------------------------------------------
    def _expected_append(self, rid: str) -> type[Exception] | None:
        """What appending one token to ``rid`` must do now: None (success) or the error type."""
        ledger, m = self.ledger, self.live[rid]
        seq = ledger.sequence(rid)
        n = len(seq.tokens)
        if n - m.prompt_len >= m.max_new:
            return LedgerError
        if n % self.bs == 0 and n >= len(seq.table.blocks) * self.bs and seq.promised == 0:
            if ledger.usage().available <= 0:
                assert not m.full_reserve, f"{rid} reserved its whole output but has no promise left"
                return OutOfBlocksError
        return None

    def _append_checked(self, rid: str, token: int) -> None:
        expected = self._expected_append(rid)
        seq = self.ledger.sequence(rid)
        before = (list(seq.tokens), list(seq.table.blocks), seq.promised, self.ledger.usage())
        if expected is None:
            self.ledger.append_token(rid, token)
            self.live[rid].tokens.append(token)
            assert seq.tokens[-1] == token
        else:
            with pytest.raises(expected) as info:
                self.ledger.append_token(rid, token)
            if expected is LedgerError:
                assert not isinstance(info.value, OutOfBlocksError)
            after = (list(seq.tokens), list(seq.table.blocks), seq.promised, self.ledger.usage())
            assert after == before

    def _live_rid(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(self.live)), label="rid")

    # ---- rules ------------------------------------------------------------------------------------
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        max_new = data.draw(st.integers(0, 3 * self.bs), label="max_new")
        reserve = data.draw(st.one_of(st.none(), st.just(0), st.integers(0, max_new)), label="reserve")
        self._admit(data, max_new, reserve)

    @rule(data=st.data())
    def admit_reserving_everything(self, data: st.DataObject) -> None:
        """The default policy, with a long output: many outstanding promises."""
        self._admit(data, data.draw(st.integers(self.bs, 3 * self.bs), label="max_new"), None)

    def _admit(self, data: st.DataObject, max_new: int, reserve: int | None) -> None:
        ledger, bs = self.ledger, self.bs
        group = data.draw(st.sampled_from(GROUPS), label="group")
        prefix = data.draw(st.sampled_from(self.prefixes), label="prefix")
        cut = data.draw(st.integers(0, len(prefix)), label="cut")
        suffix = data.draw(st.lists(TOKENS, max_size=2 * bs), label="suffix")
        prompt = prefix[:cut] + suffix or [0]
        self.counter += 1
        rid = f"r{self.counter}"
        reserve_n = max_new if reserve is None else reserve

        read = data.draw(st.sampled_from([True, True, True, False]), label="read_prefix_cache")
        req = Request(rid, prompt, max_new, CONTEXTS[group], reserve, read_prefix_cache=read,
                      readmission=data.draw(st.booleans(), label="readmission"))
        # the hits a user should get, from the model: for each leading full block, the one indexed block
        # that holds this group's tokens up to there (independent of the digests the ledger computes)
        self.remember_content()
        expected_hits = []
        for i in range(len(prompt) // bs if read else 0):
            key = (group, tuple(prompt[: (i + 1) * bs]))
            holders = [b for b, c in self.content.items() if c == key and ledger.pool.digest[b] is not None]
            assert len(holders) <= 1, f"two indexed blocks hold {key}"
            if not holders:
                break
            expected_hits.append(holders[0])
        retained_hits = sum(1 for b in expected_hits if ledger.pool.ref[b] == 0)
        available = ledger.usage().available

        before = _snapshot(ledger)
        predicted = ledger.can_admit(req)
        assert _snapshot(ledger) == before, "can_admit changed the ledger"
        decision = ledger.admit(req)
        assert decision == predicted, "can_admit predicted a different decision"

        if self.blocks_for(len(prompt) + max_new) > self.num_blocks:
            assert decision.outcome is Outcome.NEVER
            assert decision.reason
            assert _snapshot(ledger) == before
            return
        prompt_blocks = self.blocks_for(len(prompt))
        assert decision.blocks_total == self.blocks_for(len(prompt) + reserve_n)
        assert decision.blocks_hit == len(expected_hits)
        assert decision.blocks_hit + decision.blocks_new == prompt_blocks
        assert decision.blocks_promised == decision.blocks_total - prompt_blocks
        # admitted exactly when the new capacity it needs is unpromised (its own retained hits excluded)
        fits = decision.blocks_charged <= available - retained_hits
        if not fits:
            assert decision.outcome is Outcome.NOT_NOW
            assert decision.reason
            assert _snapshot(ledger) == before
            return
        assert decision.outcome is Outcome.ADMITTED
        seq = ledger.sequence(rid)
        assert seq.table.blocks[: len(expected_hits)] == expected_hits
        assert ledger.usage().available == available - decision.blocks_charged - retained_hits
        self.live[rid] = Model(group, len(prompt), max_new, reserve_n, list(prompt))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def mark_computed(self, data: st.DataObject) -> None:
        rid = self._live_rid(data)
        n = data.draw(st.integers(0, len(self.live[rid].tokens)), label="computed")
        self.ledger.mark_computed(rid, n)
        assert self.ledger.ready_tokens(rid) >= min(n, len(self.live[rid].tokens))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=TOKENS)
    def append(self, data: st.DataObject, token: int) -> None:
        self._append_checked(self._live_rid(data), token)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def decode_step(self, data: st.DataObject) -> None:
        """One engine step over every sequence that can take a token now."""
        ledger, bs = self.ledger, self.bs
        available = ledger.usage().available
        steps = []
        for rid in sorted(self.live):
            m, seq = self.live[rid], ledger.sequence(rid)
            n = len(seq.tokens)
            if n - m.prompt_len >= m.max_new:
                continue
            if n % bs == 0 and not seq.promised:  # growth from unpromised capacity
                if available <= 0:
                    continue
                available -= 1
            steps.append((rid, data.draw(TOKENS, label="token")))
        ledger.decode_step(steps)
        for rid, token in steps:
            self.live[rid].tokens.append(token)

    @precondition(lambda self: any(m.full_reserve for m in self.live.values()))
    @rule(data=st.data(), release=st.booleans())
    def drive_full_reservation_to_max_new(self, data: st.DataObject, release: bool) -> None:
        """No overcommit: a sequence that reserved its whole output always reaches max_new_tokens."""
        full = sorted(r for r, m in self.live.items() if m.full_reserve)
        rid = data.draw(st.sampled_from(full), label="rid")
        m = self.live[rid]
        while len(m.tokens) - m.prompt_len < m.max_new:
            self.ledger.append_token(rid, 1)  # must never raise OutOfBlocksError
            m.tokens.append(1)
        assert self.ledger.sequence(rid).promised == 0
        with pytest.raises(LedgerError):
            self.ledger.append_token(rid, 1)
        self.ledger.check()
        if release:
            self.release_rid(rid)

    @precondition(lambda self: any(not m.full_reserve for m in self.live.values()))
    @rule(data=st.data())
    def grow_past_reservation(self, data: st.DataObject) -> None:
        """A sequence with a partial reservation grows until max_new_tokens or, when no unpromised
        block is left, OutOfBlocksError -- which must leave everything as it was."""
        rid = data.draw(st.sampled_from(sorted(r for r, m in self.live.items() if not m.full_reserve)),
                        label="rid")
        while self._expected_append(rid) is None:
            self._append_checked(rid, 2)
        self._append_checked(rid, 2)  # the expected error, checked to change nothing
        self.ledger.check()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self.release_rid(self._live_rid(data))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """The common end of a request: all of its KV written, then released (its blocks become cache)."""
        rid = self._live_rid(data)
        self.ledger.mark_computed(rid, len(self.live[rid].tokens))
        self.release_rid(rid)

    def remember_content(self) -> None:
        """Record what every full block of every live sequence holds (the model's view of the cache)."""
        bs = self.bs
        for rid, m in self.live.items():
            blocks = self.ledger.sequence(rid).table.blocks
            for i in range(len(m.tokens) // bs):
                self.content[blocks[i]] = (m.group, tuple(m.tokens[: (i + 1) * bs]))

    def release_rid(self, rid: str) -> None:
        self.remember_content()
        ledger, pool = self.ledger, self.ledger.pool
        seq = ledger.sequence(rid)
        blocks = list(seq.table.blocks)
        promised_before, own_promise = ledger.usage().promised, seq.promised
        ledger.release(rid)
        del self.live[rid]
        assert ledger.usage().promised == promised_before - own_promise
        for b in blocks:
            if pool.ref[b] == 0:
                kept = pool.digest[b] is not None and pool.written[b]
                assert (b in pool.retained) == kept
                assert (b in pool.free_blocks()) == (not kept)

    @rule(rid=st.sampled_from(["ghost", "r0"]))
    def release_unknown(self, rid: str) -> None:
        before = _snapshot(self.ledger)
        with pytest.raises(LedgerError):
            self.ledger.release(rid)
        assert _snapshot(self.ledger) == before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def decode_step_with_a_bad_pair(self, data: st.DataObject) -> None:
        """A step naming an unknown sequence (or carrying a bad token) anywhere changes nothing."""
        steps = [(rid, data.draw(TOKENS, label="token")) for rid in sorted(self.live)
                 if len(self.live[rid].tokens) - self.live[rid].prompt_len < self.live[rid].max_new]
        bad = data.draw(st.sampled_from([("ghost", 1), (sorted(self.live)[0], -1), (sorted(self.live)[0], 1.5)]),
                        label="bad")
        steps.insert(data.draw(st.integers(0, len(steps)), label="at"), bad)
        before = _snapshot(self.ledger)
        with pytest.raises((LedgerError, ConfigError)):
            self.ledger.decode_step(steps)
        assert _snapshot(self.ledger) == before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def duplicate_id(self, data: st.DataObject) -> None:
        rid = self._live_rid(data)
        before = _snapshot(self.ledger)
        with pytest.raises(LedgerError):
            self.ledger.admit(Request(rid, [1], 0))
        assert _snapshot(self.ledger) == before

    # ---- invariants -------------------------------------------------------------------------------
    @invariant()
    def model_content(self) -> None:
        if self.ledger is not None:
            self.remember_content()

    @invariant()
    def conservation(self) -> None:
        if self.ledger is None:
            return
        ledger = self.ledger
        ledger.check()
        u = ledger.usage()
        assert u.free + u.active + u.retained == u.total == self.num_blocks
        assert u.evictable == u.retained
        assert 0 <= u.promised <= u.free + u.evictable
        assert u.active + u.promised <= u.total
        assert u.sequences == len(self.live)
        assert sorted(ledger.sequences()) == sorted(self.live)

    @invariant()
    def sequences_match_model(self) -> None:
        if self.ledger is None:
            return
        ledger, bs = self.ledger, self.bs
        promised = 0
        for rid, m in self.live.items():
            seq = ledger.sequence(rid)
            assert seq.tokens == m.tokens
            blocks = seq.table.blocks
            assert len(blocks) == self.blocks_for(len(m.tokens))
            assert len(set(blocks)) == len(blocks)
            assert all(ledger.pool.ref[b] >= 1 for b in blocks)
            reserved = self.blocks_for(m.prompt_len + m.reserve)
            assert seq.promised == max(0, reserved - len(blocks))
            assert 0 <= ledger.ready_tokens(rid) <= len(m.tokens)
            promised += seq.promised
            assert seq.table.capacity() - len(m.tokens) in range(bs)
        assert promised == ledger.usage().promised

    @invariant()
    def sharing_is_sound_and_isolated(self) -> None:
        """A block in two tables holds the same full block of the same tokens, at the same position,
        for the same trust group: never across trust groups."""
        if self.ledger is None:
            return
        bs = self.bs
        holders: dict[int, tuple[str, int]] = {}
        for rid, m in self.live.items():
            for i, b in enumerate(self.ledger.sequence(rid).table.blocks):
                if b not in holders:
                    holders[b] = (rid, i)
                    continue
                other_rid, j = holders[b]
                other = self.live[other_rid]
                assert other.group == m.group, f"block {b} shared across trust groups"
                assert i == j
                end = (i + 1) * bs
                assert len(m.tokens) >= end and len(other.tokens) >= end, "a partial block is shared"
                assert m.tokens[:end] == other.tokens[:end]

    def teardown(self) -> None:
        if self.ledger is None:
            return
        ledger = self.ledger
        for rid in list(self.live):
            ledger.release(rid)
            ledger.check()
        u = ledger.usage()
        assert (u.active, u.promised, u.sequences) == (0, 0, 0)
        assert u.free + u.retained == u.total
        assert all(ledger.pool.written[b] for b in ledger.pool.retained.blocks())


# Examples, seeds and shrinking come from the profile (tests/conftest.py): derandomised in `make test`.
LedgerMachine.TestCase.settings = settings(
    max_examples=max(150, settings().max_examples),
    stateful_step_count=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestLedgerMachine = LedgerMachine.TestCase
