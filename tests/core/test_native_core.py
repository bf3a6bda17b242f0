"""The ledger core's C part (``kvledger.core._native``) computes exactly what the pure-Python core computes.

Every check here runs both: digests against hashlib and RFC 7693's test vector, each kernel against the
Python loop it stands in for, and -- the main one -- two ledgers, one per core, driven by the same random
operation sequences (hypothesis), compared after every operation: return values, errors (type and
message), every block's state, the sequences, promises, counters, events and the audit. The pure-Python
core is also run over the core's own test modules with ``KVLEDGER_NATIVE=0``.

Where the C part is not built (no compiler), the native half of each comparison is skipped -- and
``test_the_native_core_is_built_where_a_compiler_is`` fails, so CI cannot lose it silently.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fuzzing import core  # build ledgers with a given core (None: pure Python); one owner
from kvledger.core import identity, native
from kvledger.core.eviction import LRUPolicy
from kvledger.core.identity import CacheContext, chain_digests, token_bytes
from kvledger.core.ledger import KVLedger, Request, Retention
from kvledger.core.observe import EventLog
from kvledger.errors import ConfigError, LedgerError

NATIVE = native.MODULE  # the C part as this process loaded it (None: not built, or KVLEDGER_NATIVE=0)
needs_native = pytest.mark.skipif(NATIVE is None, reason=f"the native core is not in use: {native.REASON}")
REPO = Path(__file__).resolve().parents[2]




@pytest.fixture(params=["python", "native"])
def fast(request: pytest.FixtureRequest):
    if request.param == "python":
        return None
    if NATIVE is None:
        pytest.skip(f"the native core is not in use: {native.REASON}")
    return NATIVE


# ---- the build and the switch -------------------------------------------------------------------------

def test_the_native_core_is_built_where_a_compiler_is() -> None:
    """`make install` builds the C part wherever a C compiler and Python's headers are present (CI
    included); a build that failed there would otherwise pass unnoticed, since the fallback is silent."""
    if os.environ.get(native.NATIVE_ENV) == "0":
        assert native.MODULE is None and "disabled" in native.status()
        return
    compiler = shutil.which("cc") or shutil.which("gcc")
    headers = Path(sysconfig.get_paths()["include"], "Python.h").exists()
    if not (compiler and headers):
        pytest.skip("no C compiler or Python headers here: the pure-Python core is the expected one")
    assert native.available(), native.status()
    assert native.MODULE.ABI == native.ABI


def test_kvledger_native_0_switches_every_native_part_off() -> None:
    code = ("from kvledger.core import native; from kvledger.core.ledger import KVLedger; "
            "l = KVLedger(8, 4); print(native.MODULE is None, l._native is None, l.pool._native is None, "
            "type(l.pool.retained._order).__name__, native.status())")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KVLEDGER_NATIVE": "0"},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.startswith("True True True OrderedDict pure-Python core in use: native part disabled by "
                          "KVLEDGER_NATIVE=0")


def test_a_failed_native_build_is_one_warning_not_a_failed_install(tmp_path: Path) -> None:
    """setup.py's build step with a compiler that fails: the build exits 0 and says so in one line."""
    shutil.copy(REPO / "setup.py", tmp_path / "setup.py")
    (tmp_path / "src" / "kvledger" / "core").mkdir(parents=True)
    shutil.copy(REPO / "src" / "kvledger" / "core" / "_native.c", tmp_path / "src" / "kvledger" / "core")
    env = {**os.environ, "CC": "false", "LDSHARED": "false", "KVLEDGER_NATIVE": "1"}
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if "kvledger: the native core was not built" in ln]
    assert len(warnings) == 1 and "pure-Python core is used" in warnings[0]
    assert not list(tmp_path.rglob("_native*.so"))
    # KVLEDGER_NATIVE=0 at install time: nothing is compiled and nothing is said.
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tmp_path,
                          env={**env, "KVLEDGER_NATIVE": "0"}, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and "native core" not in proc.stderr, proc.stderr
    assert not list(tmp_path.rglob("_native*.so"))


def test_a_stale_binary_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    if NATIVE is None:
        pytest.skip(f"the native core is not in use: {native.REASON}")
    monkeypatch.setattr(native, "ABI", native.ABI + 1)
    module, reason = native._load()
    assert module is None and reason.startswith("stale build")


# ---- digests ------------------------------------------------------------------------------------------

@needs_native
def test_blake2b_rfc7693_test_vector() -> None:
    """RFC 7693, Appendix A: BLAKE2b-512("abc")."""
    assert NATIVE.blake2b(b"abc").hex() == (
        "ba80a53f981c4d0d6a2797b69f12f6e94c212f14685ac4b74b12bb6fdbffa2d1"
        "7d87c5392aab792dc252d5de4533cc9518d38aa8dbf1925ab92386edd4009923")


@needs_native
@given(st.binary(max_size=700))
def test_blake2b_matches_hashlib(data: bytes) -> None:
    assert NATIVE.blake2b(data) == hashlib.blake2b(data).digest()


@needs_native
@settings(max_examples=200)
@given(root=st.binary(max_size=130), tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
       bs=st.sampled_from([1, 2, 3, 4, 7, 16, 31, 32, 33, 64]))
def test_the_chain_matches_the_python_chain(root: bytes, tokens: list[int], bs: int) -> None:
    expected = identity._chain(root, token_bytes(tokens), bs)
    assert NATIVE.chain_bytes(root, token_bytes(tokens), bs) == expected
    assert NATIVE.prompt_digests(root, tuple(tokens), bs) == expected
    assert NATIVE.prompt_digests(root, tokens, bs) == expected
    for i, digest in enumerate(expected):
        assert NATIVE.block_digest(expected[i - 1] if i else root, tokens, i * bs, bs) == digest
    assert NATIVE.check_tokens(tokens) is True


def test_known_answers_on_both_cores(fast: object) -> None:
    """tests/core/test_identity_known_answers.py's chain, through the ledger entry points of each core."""
    root = CacheContext().root_digest()
    expected = ["c14b50c699854eb168d871cb8fcc9da7", "ccbddeee6cb13b348597c3f7cf149088"]
    chain = identity.prompt_digests(root, tuple(range(8)), 4, fast)
    assert [d.hex()[:32] for d in chain] == expected
    assert identity.block_digest_at(chain[0], list(range(8)), 4, 4, fast) == chain[1]
    with core(fast):
        ledger = KVLedger(8, 4)
        ledger.admit(Request("r", list(range(9)), 4)).raise_for_outcome()
        assert [d.hex()[:32] for d in ledger.sequence("r").digests] == expected
        ledger.append_tokens("r", [9, 10, 11])  # the third block fills at token 12, identified at 13
        ledger.append_token("r", 12)
        assert ledger.sequence("r").digests[2] == identity.block_digest(ledger.sequence("r").digests[1],
                                                                       [8, 9, 10, 11])


@pytest.mark.parametrize("bad", [-1, 2**32, 2**64, 1.5, "7", None])
def test_bad_token_ids_fail_alike_on_both_cores(fast: object, bad: object) -> None:
    with core(fast):
        ledger = KVLedger(16, 4)
        with pytest.raises(ConfigError) as err:
            ledger.admit(Request("r", [1, 2, 3, 4, bad], 4))  # type: ignore[list-item]
        nocache = KVLedger(16, 4, prefix_caching=False)
        with pytest.raises(ConfigError) as err2:
            nocache.admit(Request("r", [1, bad, 3], 4))  # type: ignore[list-item]
    with pytest.raises(ConfigError) as ref:
        token_bytes([1, 2, 3, 4, bad])  # type: ignore[list-item]
    assert str(err.value) == str(ref.value) and str(err2.value) == str(ref.value)
    ledger.check()


class IntLike:
    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v


def test_integer_likes_hash_as_their_value_on_both_cores(fast: object) -> None:
    """The C chain declines what is not a plain int; the Python path takes it as array('I') does."""
    with core(fast):
        ledger = KVLedger(16, 4)
        ledger.admit(Request("a", [1, 2, 3, 4, 5], 1)).raise_for_outcome()
        ledger.mark_computed("a", 5)
        ledger.release("a")
        d = ledger.admit(Request("b", [True, IntLike(2), 3, 4, 9], 1))  # type: ignore[list-item]
    assert d.blocks_hit == 1
    ledger.check()


def test_the_public_chain_is_the_same_on_both_cores(monkeypatch: pytest.MonkeyPatch, fast: object) -> None:
    monkeypatch.setattr(native, "MODULE", fast)
    root = CacheContext(trust_group="t").root_digest()
    data = token_bytes(list(range(40)))
    assert chain_digests(root, data, 4) == identity._chain(root, data, 4)


# ---- the LRU order ------------------------------------------------------------------------------------

ORDER_OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 40)),
    st.tuples(st.just("add_many"), st.lists(st.integers(0, 40), max_size=6)),
    st.tuples(st.just("remove"), st.integers(0, 40)),
    st.tuples(st.just("pop"), st.integers(0, 4)),
    st.tuples(st.just("contains"), st.integers(-1, 41)),
    st.tuples(st.just("clear"), st.none()),
    st.tuples(st.just("odd"), st.sampled_from([-1, 2**40, "x", True])),  # keys no block id is
), max_size=60)


def _apply_order(policy: LRUPolicy, ops: list) -> list:
    seen = []
    for op, arg in ops:
        try:
            if op == "add":
                policy.add(arg)
            elif op == "add_many":
                policy.add_many(arg)
            elif op == "remove":
                policy.remove(arg)
            elif op == "pop":
                seen.append(policy.pop_victims(arg))
            elif op == "contains":
                seen.append(arg in policy)
            elif op == "clear":
                policy.clear()
            else:
                policy.add(arg)
            seen.append(("ok", policy.blocks(), len(policy)))
        except (KeyError, LedgerError) as exc:  # popping more than it holds: a LedgerError, nothing taken
            seen.append((type(exc).__name__, str(exc), policy.blocks()))
    return seen


@needs_native
@settings(max_examples=200)
@given(ORDER_OPS)
def test_the_native_lru_order_is_the_ordered_dict_order(ops: list) -> None:
    with core(None):
        reference = LRUPolicy()
    with core(NATIVE):
        fast = LRUPolicy()
    assert type(reference._order) is OrderedDict and type(fast._order) is not OrderedDict
    assert _apply_order(fast, ops) == _apply_order(reference, ops)


# ---- pool kernels on odd inputs: they decline, the Python loop decides -----------------------------------

def test_pool_paths_on_odd_block_lists_behave_alike(fast: object) -> None:
    with core(fast):
        ledger = KVLedger(8, 4)
    pool = ledger.pool
    first = pool.allocate_many(3)
    pool.release_many([first[-1]])
    pool.release_many((first[0],))
    with pytest.raises(IndexError):
        pool.release_many([99])
    with pytest.raises(Exception) as err:
        pool.release_many([first[0]])
    assert "released more often than it was taken" in str(err.value)
    pool.ref[first[1]] = "x"  # type: ignore[call-overload]  # a corrupted count: the Python loop's TypeError
    with pytest.raises(TypeError):
        pool.release_many([first[1]])


# ---- two ledgers, one per core, driven alike ------------------------------------------------------------

GROUPS = ("g0", "g1")
CONTEXTS = {g: CacheContext(trust_group=g, model="m") for g in GROUPS}
IDS = ("r0", "r1", "r2", "r3", "r4", "r0/1", "r1/1", "r2/1", "c0", "c1")
TOKEN = st.integers(0, 3)
ODD_TOKEN = st.sampled_from([-1, 2**32, True, 1.5, 7])


def _snapshot(ledger: KVLedger) -> dict:
    pool = ledger.pool
    seqs = {}
    for rid in ledger.sequences():
        s = ledger.sequence(rid)
        seqs[rid] = (tuple(s.tokens), tuple(s.table.blocks), s.promised, tuple(s.digests), s.computed_mark,
                     s.written_blocks, s.hit_blocks, s.cow_tail, s.reserved_blocks, s.family, s.readmitted)
    return {
        "usage": ledger.usage(), "ref": list(pool.ref), "leased": list(pool.leased), "digest": list(pool.digest),
        "group": list(pool.group), "written": list(pool.written), "free": pool.free_blocks(),
        "retained": pool.retained.blocks(), "index": dict(pool.index), "deferred": pool.deferred,
        "evictions": pool.evictions, "promised": ledger.promised, "cow": dict(ledger.promises.copies),
        "copies": list(ledger._branches.copies), "seqs": seqs, "counters": asdict(ledger.counters),
        "stats": ledger.stats(), "memo": ledger._admission.remembered(), "leases": ledger.leases(),
        "pins": ledger.pins(), "order": list(ledger.sequences()),
    }


class TwoCores(RuleBasedStateMachine):
    """Every rule runs on both ledgers with the same arguments; results and states must be identical."""

    POLICY = "lru"  # each configuration is its own test below, so that every one is searched alike
    EVENTS = False

    @initialize(bs=st.sampled_from([1, 2, 4, 16]), num_blocks=st.integers(4, 40), caching=st.booleans(),
                prefixes=st.lists(st.lists(TOKEN, min_size=1, max_size=40), min_size=1, max_size=3))
    def setup(self, bs: int, num_blocks: int, caching: bool, prefixes: list[list[int]]) -> None:
        policy, events = self.POLICY, self.EVENTS
        if NATIVE is None:
            pytest.skip(f"the native core is not in use: {native.REASON}")
        self.now = [0.0]
        self.bs, self.prefixes = bs, prefixes
        self.ledgers = []
        self.logs = []
        for fast in (None, NATIVE):
            with core(fast):
                log = EventLog() if events else None
                self.logs.append(log)
                self.ledgers.append(KVLedger(num_blocks, bs, prefix_caching=caching, policy=policy, events=log,
                                             clock=lambda: self.now[0]))
        assert self.ledgers[0]._native is None and self.ledgers[1]._native is NATIVE
        self.lease_ids: list[int] = []
        self.compare()

    def both(self, name: str, *args, **kwargs):
        """Call ``name`` on both ledgers (fresh copies of list arguments for each); results must agree."""
        outcomes = []
        for ledger in self.ledgers:
            call_args = [list(a) if isinstance(a, list) else a for a in args]
            try:
                outcomes.append(("ok", getattr(ledger, name)(*call_args, **kwargs)))
            except Exception as exc:  # noqa: BLE001 -- the error itself is what is compared
                outcomes.append((type(exc).__name__, str(exc)))
        assert outcomes[0] == outcomes[1], (name, args, outcomes)
        return outcomes[0]

    def compare(self) -> None:
        py, nat = (_snapshot(ledger) for ledger in self.ledgers)
        for key in py:
            assert py[key] == nat[key], key
        if self.logs[0] is not None:
            strip = [[(e.kind, e.block, e.digest, e.trust_group, e.source_block) for e in log.all()]
                     for log in self.logs]
            assert strip[0] == strip[1]

    def prompt(self, data: st.DataObject) -> list[int]:
        head = data.draw(st.sampled_from(self.prefixes), label="prefix")
        tail = data.draw(st.lists(TOKEN, max_size=3 * self.bs), label="suffix")
        return head[: data.draw(st.integers(0, len(head)), label="cut")] + tail or [0]

    def live(self) -> list[str]:
        return self.ledgers[0].sequences()

    def pick(self, data: st.DataObject) -> str:
        """A live sequence, now and then an unknown one."""
        live = self.live()
        if not live or data.draw(st.integers(0, 9), label="ghost?") == 0:
            return "ghost"
        return data.draw(st.sampled_from(live), label="live id")

    def free_id(self, data: st.DataObject) -> str:
        free = [r for r in IDS[:5] if r not in self.live()]
        return data.draw(st.sampled_from(free or list(IDS[:5])), label="new id")

    # ---- rules ----------------------------------------------------------------------------------------
    @rule(data=st.data(), max_new=st.integers(0, 12), branches=st.integers(1, 3),
          reserve=st.one_of(st.none(), st.integers(0, 12)), lookahead=st.integers(0, 2), group=st.sampled_from(GROUPS),
          read=st.booleans(), keep_free=st.integers(0, 2), retain=st.booleans(), check_only=st.booleans())
    def admit(self, data, max_new, branches, reserve, lookahead, group, read, keep_free, retain, check_only):
        rid = self.free_id(data)
        prompt = self.prompt(data)
        reserve = None if reserve is None else min(reserve, max_new)
        retention = (Retention(0, len(prompt), 90, 5.0),) if retain else ()
        request = Request(rid, prompt, max_new, CONTEXTS[group], reserve_new_tokens=reserve, branches=branches,
                          lookahead=lookahead, read_prefix_cache=read, retention=retention)
        self.both("can_admit" if check_only else "admit", request, keep_free)

    @rule(data=st.data(), n=st.integers(1, 3), group=st.sampled_from(GROUPS))
    def admit_family(self, data, n, group):
        base = self.prompt(data)
        reqs = []
        for i in range(n):
            extra = data.draw(st.lists(TOKEN, max_size=self.bs), label="divergence")
            reqs.append(Request("c0" if i == 0 else f"c0/{i}", base + extra, 4, CONTEXTS[group], family="c0"))
        self.both("admit_family", reqs)

    @rule(data=st.data())
    def mark_computed(self, data):
        rid = self.pick(data)
        n = len(self.ledgers[0].sequence(rid).tokens) if rid != "ghost" else 4
        self.both("mark_computed", rid, data.draw(st.integers(0, n + 1)))

    @rule(data=st.data(), token=st.one_of(TOKEN, ODD_TOKEN))
    def append_token(self, data, token):
        self.both("append_token", self.pick(data), token)

    @rule(data=st.data(), tokens=st.lists(TOKEN, max_size=20))
    def append_tokens(self, data, tokens):
        self.both("append_tokens", self.pick(data), tokens)

    @rule(data=st.data(), repeat=st.integers(1, 20))
    def decode_steps(self, data, repeat):
        """Several engine steps over the live sequences, now and then with a duplicate, an unknown id
        or an odd token: the C common case and the Python loop must take and undo the same pairs."""
        for _ in range(repeat):
            pairs = [(rid, data.draw(TOKEN)) for rid in self.live()]
            if data.draw(st.integers(0, 4)) == 0:
                kind = data.draw(st.sampled_from(["dup", "ghost", "odd", "list"]))
                if kind == "dup" and pairs:
                    pairs.insert(data.draw(st.integers(0, len(pairs))), (pairs[0][0], 1))
                elif kind == "ghost":
                    pairs.insert(data.draw(st.integers(0, len(pairs))), ("ghost", 1))
                elif kind == "odd" and pairs:
                    pairs[-1] = (pairs[-1][0], data.draw(ODD_TOKEN))
                elif kind == "list" and pairs:
                    pairs[0] = [pairs[0][0], pairs[0][1]]  # type: ignore[call-overload]
            outcome = self.both("decode_step", pairs)
            if outcome[0] not in ("ok", "OutOfBlocksError"):
                break

    @rule(data=st.data(), max_new=st.integers(1, 10), group=st.sampled_from(GROUPS), steps=st.integers(0, 12),
          branches=st.integers(1, 2), count=st.integers(1, 4))
    def lifecycle(self, data, max_new, group, steps, branches, count):
        """Requests as an engine runs them: admit, prefill, a few decode steps beside the others, release.
        Several in a row fill a small pool with cache, so that later allocations evict."""
        for _ in range(count):
            rid = self.free_id(data)
            outcome = self.both("admit", Request(rid, self.prompt(data), max_new, CONTEXTS[group], branches=branches))
            if outcome[0] != "ok" or not outcome[1].admitted:
                return
            self.both("mark_computed", rid, len(self.ledgers[0].sequence(rid).tokens))
            for _ in range(min(steps, max_new)):
                seqs = [self.ledgers[0].sequence(r) for r in self.live()]
                self.both("decode_step", [(s.request_id, data.draw(TOKEN)) for s in seqs
                                          if s.num_generated < s.max_new_tokens])
            for sid in [rid] + [f"{rid}/{k}" for k in range(1, branches)]:
                self.both("release", sid)

    @rule(data=st.data(), how=st.sampled_from(["release", "preempt", "cancel", "retract"]))
    def finish(self, data, how):
        self.both(how, self.pick(data))

    @rule(data=st.data(), child=st.sampled_from(IDS[5:]))
    def fork(self, data, child):
        self.both("fork", self.pick(data), child)

    @precondition(lambda self: len(self.live()) >= 2)
    @rule(data=st.data(), child=st.sampled_from(IDS[5:]))
    def beam_step(self, data, child):
        live = self.live()
        parent = data.draw(st.sampled_from(live))
        drop = data.draw(st.sampled_from([r for r in live if r != parent]))
        self.both("beam_step", [(parent, child)], [drop])

    @rule(data=st.data(), owner=st.sampled_from(["step", "swap"]))
    def lease(self, data, owner):
        ids = data.draw(st.lists(st.sampled_from(self.live() or ["ghost"]), max_size=2, unique=True))
        held = [b for b, r in enumerate(self.ledgers[0].pool.ref) if r]
        blocks = data.draw(st.lists(st.sampled_from(held or [0]), max_size=2))
        outcome = self.both("lease", ids, blocks, owner)
        if outcome[0] == "ok":
            self.lease_ids.append(outcome[1])

    @precondition(lambda self: self.lease_ids)
    @rule(data=st.data())
    def end_lease(self, data):
        lid = data.draw(st.sampled_from(self.lease_ids))
        self.lease_ids.remove(lid)
        self.both("end_lease", lid)

    @rule(data=st.data(), name=st.sampled_from(["p0", "p1"]), group=st.sampled_from(GROUPS), unpin=st.booleans())
    def pin(self, data, name, group, unpin):
        if unpin:
            self.both("unpin", name)
        else:
            self.both("pin", name, self.prompt(data), CONTEXTS[group])

    @rule(data=st.data(), slots=st.integers(0, 6), trim=st.booleans())
    def lookahead(self, data, slots, trim):
        self.both("trim_lookahead" if trim else "reserve_lookahead", self.pick(data), *(() if trim else (slots,)))

    @rule(what=st.sampled_from(["take_copies", "usage", "token_usage", "take_copies", "clear_cache",
                                "reset_prefix_cache"]))
    def whole_pool(self, what):
        self.both(what)

    @rule(seconds=st.sampled_from([1.0, 10.0]))
    def time_passes(self, seconds):
        self.now[0] += seconds

    @invariant()
    def same_state_and_audit(self):
        if not hasattr(self, "ledgers"):
            return
        self.compare()
        self.both("check")


def _two_cores(policy: str, events: bool) -> type:
    machine = type(f"TwoCores_{policy}_{'events' if events else 'quiet'}", (TwoCores,),
                   {"POLICY": policy, "EVENTS": events})
    machine.TestCase.settings = settings(max_examples=60, stateful_step_count=60)
    return machine.TestCase


test_two_cores_agree_lru = _two_cores("lru", False)
test_two_cores_agree_lru_with_events = _two_cores("lru", True)
test_two_cores_agree_priority = _two_cores("priority", False)
test_two_cores_agree_priority_with_events = _two_cores("priority", True)


def _bench_like(fast: object, branches: int, share: bool) -> dict:
    """A scaled-down benchmarks/ledger_ops.py schedule: a warm cache that evicts on every new block."""
    import random

    rng = random.Random(1)
    prefixes = [[rng.randrange(32000) for _ in range(64)] for _ in range(3)]
    prompts = [(prefixes[i % 3] if share and i % 2 == 0 else [rng.randrange(32000) for _ in range(64)])
               + [rng.randrange(32000) for _ in range(64 + i % 5)] for i in range(60)]
    with core(fast):
        ledger = KVLedger(160, 8)
    ctx = CacheContext(trust_group="t", model="bench")
    pending = [Request(f"r{i}", p, 21, ctx, branches=branches) for i, p in enumerate(prompts)]
    running: dict[str, int] = {}
    decisions = []
    while pending or running:
        while pending and len(running) < 5:
            d = ledger.admit(pending[0])
            decisions.append(d)
            if not d.admitted:
                break
            ledger.mark_computed(pending[0].request_id, len(pending[0].prompt))
            running[pending.pop(0).request_id] = 21
        ledger.decode_step([(sid, 5 + b) for rid in running for b, sid in
                            enumerate([rid] + [f"{rid}/{k}" for k in range(1, branches)])])
        for rid in [r for r in running if running[r] == 1]:
            for sid in [rid] + [f"{rid}/{k}" for k in range(1, branches)]:
                ledger.release(sid)
            del running[rid]
        for rid in running:
            running[rid] -= 1
    ledger.check()
    return {"decisions": decisions, **_snapshot(ledger)}


@pytest.mark.parametrize(("branches", "share"), [(1, True), (3, True), (1, False)], ids=["base", "n3", "unique"])
def test_the_benchmark_schedule_ends_in_the_same_state_on_both_cores(branches: int, share: bool) -> None:
    if NATIVE is None:
        pytest.skip(f"the native core is not in use: {native.REASON}")
    py, nat = _bench_like(None, branches, share), _bench_like(NATIVE, branches, share)
    assert py["stats"]["lifetimes"]["evictions"] > 100  # the cache was warm: allocation evicted
    for key in py:
        assert py[key] == nat[key], key


@pytest.mark.slow
def test_the_core_test_modules_pass_on_the_pure_python_core(no_native_twin: frozenset[str]) -> None:
    """The core's own tests, rerun with KVLEDGER_NATIVE=0 (this process runs them on the C part): every
    module that reaches the C part (a new one joins without being listed), but this one."""
    if NATIVE is None:
        pytest.skip("this run already uses the pure-Python core")
    every = sorted(p for p in (REPO / "tests" / "core").glob("test_*.py") if p.name != Path(__file__).name)
    listed = [p for p in every if p.name in no_native_twin]
    assert len(listed) == len(no_native_twin), "NO_NATIVE_TWIN names a module tests/core does not have"
    # The tripwire watches this process only: a listed module must not start one (`python -m kvledger ...`).
    assert not [p.name for p in listed if "subprocess" in p.read_text(encoding="utf-8")]
    modules = [p for p in every if p.name not in no_native_twin]
    assert len(modules) > 20
    # vLLM's own allocator checks the sizing planner's figures (no native twin): the run above did that once.
    env = {**os.environ, "KVLEDGER_NATIVE": "0", "KVLEDGER_VLLM_PY": str(REPO / "no-vllm-in-the-pure-pass")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, modules)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("steps", [
    [("a", 1), (5, 1)], [("a", 1), ([], 1)], [("a", 1), ("b", 1, 2)], [["a", 1], ("b", 1)], [("a", 1), ("b", -1)],
    [("a", 1), ("b", 2**32)], [("a", True), ("b", 1)], [("a", 1), ("a", 2), ("b", 3)], [("b", 1), ("ghost", 1)],
], ids=["int-id", "unhashable-id", "triple", "list-pair", "negative", "too-big", "bool", "twice", "unknown"])
def test_odd_decode_steps_end_alike_on_both_cores(fast: object, steps: list) -> None:
    """What the C loop declines, the Python loop decides: same error, same tokens afterwards."""
    with core(fast):
        ledger = KVLedger(32, 4)
    for rid in ("a", "b"):
        ledger.admit(Request(rid, [1, 2, 3, 4, 5, 6], 8)).raise_for_outcome()
        ledger.append_token(rid, 9)  # past the prompt: the next tokens take the common case
    try:
        ledger.decode_step(list(steps))
        outcome = "ok"
    except Exception as exc:  # noqa: BLE001 -- compared below
        outcome = f"{type(exc).__name__}: {exc}"
    state = (outcome, ledger.sequence("a").tokens, ledger.sequence("b").tokens)
    with core(None):
        reference = KVLedger(32, 4)
    for rid in ("a", "b"):
        reference.admit(Request(rid, [1, 2, 3, 4, 5, 6], 8)).raise_for_outcome()
        reference.append_token(rid, 9)
    try:
        reference.decode_step(list(steps))
        expected = "ok"
    except Exception as exc:  # noqa: BLE001
        expected = f"{type(exc).__name__}: {exc}"
    assert state == (expected, reference.sequence("a").tokens, reference.sequence("b").tokens)
    ledger.check()
