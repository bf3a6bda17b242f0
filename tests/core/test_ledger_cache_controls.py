"""What a vLLM user expects of the cache manager: reset_prefix_cache, write-but-not-read requests,
re-admissions counted apart, and eviction policies chosen by name."""

from __future__ import annotations

import pytest

from kvledger.core.eviction import EVICTION_POLICIES, LRUPolicy, PriorityPolicy, make_policy, policy_names
from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Outcome, Request
from kvledger.core.observe import EventLog
from kvledger.core.types import Retention
from kvledger.errors import ConfigError


def warm(ledger: KVLedger, rid: str, prompt: list[int], **kw) -> None:
    ledger.admit(Request(rid, prompt, 0, **kw)).raise_for_outcome()
    ledger.mark_computed(rid, len(prompt))
    ledger.release(rid)


# ---- reset_prefix_cache -----------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["lru", "priority", "lfu", "gdsf", "arc", "s3fifo", "sglang-priority"])
def test_reset_prefix_cache_leaves_nothing_behind(policy: str) -> None:
    events = EventLog()
    clock = [0.0]
    ledger = KVLedger(32, 4, policy=policy, events=events, clock=lambda: clock[0])
    warm(ledger, "a", list(range(12)), retention=(Retention(0, 12, 90, 30.0),))
    warm(ledger, "b", list(range(100, 108)), context=CacheContext(trust_group="t"))
    assert ledger.admit(Request("waiting", list(range(200, 400)), 4)).outcome is Outcome.NEVER
    ledger.admit(Request("busy", list(range(300, 400)), 0)).raise_for_outcome()
    assert ledger.admit(Request("told-not-now", list(range(500, 540)), 0)).outcome is Outcome.NOT_NOW
    ledger.release("busy")  # never written: its blocks go back to the free list, not the cache
    assert ledger._admission.remembered()  # a waiting request's digests are remembered
    before_events = len(events)
    result = ledger.reset_prefix_cache()
    assert result and result.done and result.cleared_blocks == 3 + 2
    assert len(events) - before_events == 5 and {e.kind for e in events.all()[before_events:]} == {"cleared"}
    pool = ledger.pool
    assert pool.index == {} and pool.num_retained == 0 and pool.retained.blocks() == []
    assert pool.num_free == 32 and all(d is None for d in pool.digest) and not any(pool.written)
    assert all(g is None for g in pool.group)
    assert ledger._admission.remembered() == []
    if isinstance(pool.retained, PriorityPolicy):
        assert pool.retained.is_empty()
    else:
        assert len(pool.retained) == 0
    stats = ledger.stats()
    assert stats["lifetimes"]["cache_resets"] == 1 and stats["lifetimes"]["cleared"] == 5
    ledger.check()
    # The same prompt is a miss afterwards, and the cache fills again as usual.
    assert ledger.admit(Request("a2", list(range(12)), 0)).blocks_hit == 0
    ledger.mark_computed("a2", 12)
    ledger.release("a2")
    assert ledger.admit(Request("a3", list(range(12)), 0)).blocks_hit == 3
    ledger.check()


@pytest.mark.parametrize("holder", ["sequence", "pin", "lease", "deferred"])
def test_reset_prefix_cache_is_refused_while_any_block_is_held(holder: str) -> None:
    ledger = KVLedger(32, 4)
    warm(ledger, "a", list(range(12)))
    lease = None
    if holder == "sequence":
        ledger.admit(Request("r", [7, 7, 7], 4)).raise_for_outcome()
    elif holder == "pin":
        assert ledger.pin("system", list(range(8)), CacheContext()) == 2
    elif holder == "lease":
        ledger.admit(Request("r", [7, 7, 7], 4)).raise_for_outcome()
        lease = ledger.lease(request_ids=["r"], owner="step")
    else:
        ledger.admit(Request("r", [7, 7, 7], 4)).raise_for_outcome()
        lease = ledger.lease(request_ids=["r"], owner="step")
        ledger.release("r")  # its block waits for the lease: a deferred release
        assert ledger.usage().deferred == 1
    before = (dict(ledger.pool.index), ledger.pool.retained.blocks(), ledger.usage())
    result = ledger.reset_prefix_cache()
    assert not result and not result.done and result.cleared_blocks == 0
    assert {"sequence": "running", "pin": "pinned", "lease": "lease", "deferred": "lease"}[holder] in result.reason
    assert (dict(ledger.pool.index), ledger.pool.retained.blocks(), ledger.usage()) == before
    ledger.check()
    if holder == "deferred":
        ledger.end_lease(lease)
        assert ledger.reset_prefix_cache().done


# ---- write the cache, do not read it ------------------------------------------------------------------

def test_a_request_that_does_not_read_the_cache_computes_its_prompt_and_still_writes_it() -> None:
    """vLLM skips reading the prefix cache for requests that want prompt logprobs: every prompt
    token is computed. Its blocks still serve later requests where nobody cached them yet."""
    ledger = KVLedger(32, 4)
    warm(ledger, "w", list(range(8)))  # blocks 0-1 of the prompt below are cached
    prompt = list(range(16))
    d = ledger.admit(Request("logprobs", prompt, 2, read_prefix_cache=False))
    assert (d.blocks_hit, d.blocks_new) == (0, 4)
    assert ledger.ready_tokens("logprobs") == 0  # nothing to skip: the whole prompt is computed
    held = ledger.sequence("logprobs").table.blocks
    assert ledger.pool.digest[held[0]] is None and ledger.pool.digest[held[1]] is None  # already cached elsewhere
    assert ledger.pool.digest[held[2]] is not None and ledger.pool.digest[held[3]] is not None  # written for others
    ledger.mark_computed("logprobs", 16)
    ledger.release("logprobs")
    assert ledger.admit(Request("reader", prompt, 0)).blocks_hit == 4
    stats = ledger.stats()["prefix_cache"]
    assert stats["read_skipped"] == 1 and stats["queries"] == 2  # "w" and "reader"; the skip is no query
    ledger.check()


# ---- re-admissions counted apart ------------------------------------------------------------------------

def test_readmissions_are_counted_apart_from_first_admissions() -> None:
    """A preempted request finds its own blocks again; mixing that into the hit rate flatters it."""
    ctx = CacheContext(trust_group="t")
    ledger = KVLedger(32, 4)
    prompt = list(range(12))
    ledger.admit(Request("r", prompt, 8, ctx)).raise_for_outcome()
    ledger.mark_computed("r", 12)
    ledger.append_tokens("r", [1, 2, 3, 4, 5])
    tokens = ledger.preempt("r")
    d = ledger.admit(Request("r", tokens, 3, ctx, readmission=True))
    assert d.admitted and d.blocks_hit == 4
    stats = ledger.stats()
    assert stats["admissions"]["admitted"] == 1 and stats["admissions"]["readmitted"] == 1
    first, again = stats["prefix_cache"], stats["prefix_cache_readmissions"]
    assert (first["queries"], first["hit_blocks"], first["hit_rate"]) == (1, 0, 0.0)
    assert (again["queries"], again["hit_blocks"], again["hit_tokens"], again["query_tokens"]) == (1, 4, 16, 17)
    assert stats["prefix_cache"]["window_hit_rate"] == 0.0
    tenant = ledger.tenant_stats("t")
    assert tenant["prefix_cache"]["queries"] == 1 and tenant["prefix_cache_readmissions"]["hit_blocks"] == 4
    ledger.retract("r")  # the undo of a re-admission takes back the re-admission count
    assert ledger.stats()["admissions"]["readmitted"] == 0
    ledger.check()


# ---- the eviction-policy registry -------------------------------------------------------------------

def test_the_registry_is_the_one_list_of_policies() -> None:
    assert policy_names() == ("lru", "arc", "gdsf", "lfu", "priority", "s3fifo", "sglang-priority")
    assert set(EVICTION_POLICIES) == set(policy_names())
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("priority", clock=lambda: 5.0), PriorityPolicy)
    for name in policy_names():
        policy = make_policy(name)
        assert policy.name == name and len(policy) == 0
        assert KVLedger(4, 4, policy=name).policy_name == name
    with pytest.raises(ConfigError, match="lru, arc, gdsf, lfu, priority, s3fifo, sglang-priority"):
        make_policy("fifo")
    with pytest.raises(TypeError):
        EVICTION_POLICIES["fifo"] = LRUPolicy  # type: ignore[index]  # read-only


def test_a_policy_object_that_already_holds_blocks_is_refused() -> None:
    used = LRUPolicy()
    used.add(3)
    with pytest.raises(ConfigError):
        KVLedger(8, 4, policy=used)


# ---- an engine that computes prompts in chunks (vLLM) ----------------------------------------------

def test_share_pending_false_never_shares_a_block_another_request_is_still_computing() -> None:
    ledger = KVLedger(32, 4)
    prompt = list(range(16))  # 4 blocks
    ledger.admit(Request("a", prompt, 4)).raise_for_outcome()
    ledger.mark_computed("a", 8)  # a's first chunk: blocks 0, 1 written; 2, 3 still being computed
    ledger.admit(Request("b", prompt + [99], 4, share_pending=False)).raise_for_outcome()
    ledger.admit(Request("c", prompt + [98], 4)).raise_for_outcome()
    a, b, c = (ledger.sequence(r).table.blocks for r in "abc")
    assert b[:2] == a[:2] and not set(b[2:]) & set(a)  # b computes its own copy of blocks 2, 3
    assert c[:4] == a[:4]  # the default shares them (an engine that waits for pending blocks)
    ledger.check()


def test_append_tokens_unconfirmed_marks_no_block_written() -> None:
    ledger = KVLedger(32, 4)
    ledger.admit(Request("a", list(range(11)), 4, reserve_new_tokens=4)).raise_for_outcome()
    ledger.append_tokens("a", [11, 12], confirm=False)  # the prompt's tail: known, not run yet
    assert not any(ledger.pool.written[b] for b in ledger.sequence("a").table.blocks)
    ledger.append_tokens("a", [13])  # a sampled token confirms everything before it
    assert [ledger.pool.written[b] for b in ledger.sequence("a").table.blocks[:3]] == [True, True, True]
    ledger.check()
