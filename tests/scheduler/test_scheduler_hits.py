"""The scheduler carries a request's drafter rule (``GenRequest.drop_last_hit_block``) and its images
(``GenRequest.mm_items``) to the pool, uniform and hybrid pools:
where the prefill starts is what they change. Block size 4."""

from __future__ import annotations

import pytest

from kvledger.core.groups import KVCacheGroup
from kvledger.core.identity import MMItem
from kvledger.core.ledger import KVLedger
from kvledger.errors import ConfigError
from kvledger.scheduler import Admission, GenRequest, Scheduler, SchedulerConfig
from kvledger.scheduler.driver import Driver
from kvledger.scheduler.execution import ConstantExecutor

try:  # the module name pytest gives tests/scheduler/test_scheduler.py depends on its import mode
    from tests.scheduler.test_scheduler import BS, FakeEngine, assert_drained, toks
except ImportError:  # pragma: no cover
    from test_scheduler import BS, FakeEngine, assert_drained, toks

CAT, DOG = MMItem("cat", 8, 4), MMItem("dog", 8, 4)


def _first_plan(s: Scheduler, engine: FakeEngine, request: GenRequest) -> tuple[list[Admission], list[tuple]]:
    s.add(request)
    plan = engine.step()
    works = [(w.seq_id, w.start, w.end) for w in plan.works]
    engine.drain()
    return plan.admissions, works


def test_a_drafters_request_computes_the_last_block_of_its_hit_again() -> None:
    s = Scheduler(KVLedger(16, BS), SchedulerConfig())
    engine = FakeEngine(s)
    prompt = toks(13, 0)
    _first_plan(s, engine, GenRequest("a", prompt, 2))
    assert _first_plan(s, engine, GenRequest("b", prompt, 2)) == ([Admission("b", 12, False)], [("b", 12, 13)])
    assert _first_plan(s, engine, GenRequest("c", prompt, 2, drop_last_hit_block=True)) == (
        [Admission("c", 8, False)], [("c", 8, 13)])
    assert_drained(s)


def test_requests_with_one_text_and_different_images_share_the_text_blocks_only() -> None:
    s = Scheduler(KVLedger(32, BS), SchedulerConfig())
    engine = FakeEngine(s)
    prompt = toks(17, 0)  # positions 8-11 (block 2) are the image's placeholder tokens
    _first_plan(s, engine, GenRequest("a", prompt, 2, mm_items=(CAT,)))
    assert _first_plan(s, engine, GenRequest("b", prompt, 2, mm_items=(DOG,)))[0] == [Admission("b", 8, False)]
    assert _first_plan(s, engine, GenRequest("c", prompt, 2, mm_items=(CAT,)))[0] == [Admission("c", 16, False)]
    assert_drained(s)
    with pytest.raises(ConfigError, match="mm_items must be MMItem values within the first 17 positions"):
        s.add(GenRequest("d", prompt, 2, mm_items=(MMItem("cat", 16, 2),)))
    with pytest.raises(ConfigError, match="drop_last_hit_block must be a bool"):
        s.add(GenRequest("d", prompt, 2, drop_last_hit_block=1))  # type: ignore[arg-type]


def test_a_hybrid_pool_keys_images_and_drops_the_drafters_block_too() -> None:
    groups = (KVCacheGroup("full", 2), KVCacheGroup("sliding", 2, 8))
    ledger = KVLedger(128, BS, kv_groups=groups, step_tokens=16)
    prompt = toks(25, 100)
    image = MMItem("cat", 12, 4)  # block 3
    sched = Scheduler(ledger, SchedulerConfig(token_budget=16, prefill_chunk=16))
    Driver(sched, ConstantExecutor(), check_every=1).run([GenRequest("a", prompt, 2, mm_items=(image,))])
    for rid, kw, hit in (("b", {"mm_items": (MMItem("dog", 12, 4),)}, 3), ("c", {"mm_items": (image,)}, 6),
                         ("d", {"mm_items": (image,), "drop_last_hit_block": True}, 5)):
        before = ledger.stats()["prefix_cache"]["hit_blocks"]
        Driver(sched, ConstantExecutor(), check_every=1).run([GenRequest(rid, prompt, 2, **kw)])
        assert ledger.stats()["prefix_cache"]["hit_blocks"] - before == hit, rid
    assert ledger.usage().active == 0 and ledger.usage().promised == 0
