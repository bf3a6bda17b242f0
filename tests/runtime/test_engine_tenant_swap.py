"""Tenant isolation under preemption by swap, on real tensors (a tiny random Llama).

Two tenants send the same long prompt. The pool is too small for everyone, so running requests are
swapped out to the host tier and restored -- their blocks leave the device, come back into other physical
blocks, and the prefix index is consulted again on every re-admission. Throughout, no request of one
tenant may hit a block of the other (its first request gets 0 cached tokens although the identical
prompt sits written in the pool), the group ledgers partition the pool after every step, and every
output is bit-identical to an undisturbed run with a pool large enough for all.
"""

from __future__ import annotations

import pytest

from kvledger.runtime.engine import Engine
from kvledger.runtime.sampling import SamplingParams
from kvledger.scheduler import SchedulerConfig

BS = 4
PROMPT = [(7 * i + 3) % 250 for i in range(24)]  # 6 full blocks, the same for both tenants
NEW = 24


def _run(path, num_blocks: int, host_blocks: int) -> tuple[Engine, dict[str, object]]:
    cfg = SchedulerConfig(policy="incremental", recovery="swap", watermark=0.0, victim="latest")
    engine = Engine.from_model(path, num_blocks=num_blocks, block_size=BS, host_blocks=host_blocks,
                               scheduler_config=cfg)
    engine.step_observers.append(lambda _result: engine.check())  # every law, every step (group ledgers too)
    handles: dict[str, object] = {}
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=11)

    def send(rid: str, group: str) -> None:
        handles[rid] = engine.submit(PROMPT, NEW, sampled if rid.endswith("2") else None, trust_group=group,
                                     request_id=rid)

    # Tenant a's prompt is written and indexed before tenant b asks for the same tokens; each tenant's
    # later requests come once its own first prompt is written (so they can hit it).
    send("a0", "tenant-a")
    engine.step()
    engine.step()
    for rid, group in (("a1", "tenant-a"), ("a2", "tenant-a"), ("b0", "tenant-b")):
        send(rid, group)
    engine.step()
    engine.step()
    send("b1", "tenant-b")
    send("b2", "tenant-b")
    engine.run_until_idle()
    return engine, handles


@pytest.mark.parametrize("pool", [26, 30])
def test_no_cross_tenant_hit_and_identical_outputs_under_swap(tiny_llama, pool: int) -> None:
    path, _ = tiny_llama
    roomy, ref = _run(path, 400, 0)
    tight, got = _run(path, pool, 64)
    assert roomy.scheduler.preemptions == 0
    assert tight.scheduler.preemptions > 0 and tight.stats.swapped_out_blocks > 0
    assert tight.stats.swapped_in_blocks > 0  # restored from the host (prefix hits of its own group need no copy)
    results = {rid: h.result() for rid, h in got.items()}  # type: ignore[attr-defined]
    refs = {rid: h.result() for rid, h in ref.items()}  # type: ignore[attr-defined]
    for rid, r in results.items():
        assert r.outputs == refs[rid].outputs, rid  # bit-identical tokens, swapped or not
        assert r.finish_reasons == ["length"], rid
    # Tenant b's first request finds tenant a's identical, written prompt in the pool -- and may not use it.
    assert results["b0"].cached_prompt_tokens == 0
    assert refs["b0"].cached_prompt_tokens == 0
    # Within a tenant the prefix is shared (its later requests hit its own blocks).
    assert max(results[f"a{i}"].cached_prompt_tokens for i in (1, 2)) > 0
    assert max(results[f"b{i}"].cached_prompt_tokens for i in (1, 2)) > 0
    # The ledger's per-tenant figures agree: each tenant's hits are its own.
    for group in ("tenant-a", "tenant-b"):
        stats = tight.ledger.tenant_stats(group)
        assert stats["prefix_cache"]["queries"] == 3
        assert stats["prefix_cache"]["hit_tokens"] <= 2 * len(PROMPT)
    tight.check()
    u = tight.ledger.usage()
    assert (u.active, u.promised, u.sequences, u.deferred) == (0, 0, 0, 0)
    assert tight.scheduler.host.num_used == 0
