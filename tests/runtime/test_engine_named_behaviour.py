"""Finish reasons and preemption counts through the real engine (a tiny random Llama, CPU), each rule in a
test named after it (the scheduler-level rules: ``tests/test_named_behaviour.py``).

* A stop token sampled as the ``max_new_tokens``-th token ends the request ``stop`` (not ``length``) and
  is kept as the last output token; the result, the metrics and the final streamed event say so.
* Each branch of an ``n > 1`` request ends with its own reason.
* A preempted family counts once in ``RequestResult.preemptions`` (= its metrics) and in the
  scheduler's count, and once per branch in the ledger's count.
"""

from __future__ import annotations

import pytest

from kvledger.runtime.engine import Engine, RequestResult
from kvledger.runtime.sampling import SamplingParams
from kvledger.scheduler import SchedulerConfig

BS = 4
PROMPT = [17, 201, 5, 88, 140, 33, 9]


def roomy(path) -> Engine:
    return Engine.from_model(path, num_blocks=200, block_size=BS)


def assert_clean(engine: Engine) -> None:
    engine.check()
    u = engine.ledger.usage()
    assert (u.active, u.promised, u.sequences, u.deferred) == (0, 0, 0, 0), u
    assert engine.ledger.outstanding_leases() == 0
    assert not engine.has_work()


def last_fresh_position(tokens: list[int], start: int) -> int:
    """The last position >= ``start`` whose token did not occur before it (a stop token there ends the
    output exactly there)."""
    found = [k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k]]
    assert found, f"no fresh token in {tokens}"  # a random model's 8 greedy tokens out of 256
    return found[-1]


def test_engine_a_stop_token_sampled_as_the_last_allowed_token_finishes_stop_and_is_kept(tiny_llama) -> None:
    path, _ = tiny_llama
    reference = roomy(path).generate([PROMPT], 8)[0].output
    k = last_fresh_position(reference, 1) + 1  # max_new_tokens: the stop token is the k-th token
    stop = reference[k - 1]
    engine = roomy(path)
    handle = engine.submit(PROMPT, k, stop_token_ids=[stop])
    events = list(handle.stream(timeout=60))
    result: RequestResult = handle.result(timeout=60)
    assert result.outputs == [reference[:k]] and result.output[-1] == stop
    assert result.finish_reasons == ["stop"]
    assert result.metrics is not None and result.metrics.finish_reason == "stop"
    assert events[-1].finished and events[-1].finish_reason == "stop"
    assert [e.token for e in events if e.token is not None] == reference[:k]
    assert_clean(engine)


def test_engine_each_branch_of_an_n_request_ends_with_its_own_reason(tiny_llama) -> None:
    path, _ = tiny_llama
    params = SamplingParams(temperature=1.0, seed=3, n=2)
    free = roomy(path).generate([PROMPT], 8, params)[0].outputs
    # A token only branch 1 samples, at a position before the limit where it samples it first.
    k = min(k for k in range(1, 7) if free[1][k] not in free[1][:k] and free[1][k] not in free[0])
    stop = free[1][k]
    result = roomy(path).generate([PROMPT], 8, params, stop_token_ids=[stop])[0]
    assert result.outputs == [free[0], free[1][: k + 1]]
    assert result.finish_reasons == ["length", "stop"]
    assert result.metrics is not None and result.metrics.finish_reason == "length,stop"


@pytest.mark.parametrize("recovery", ["recompute", "swap"])
def test_engine_counts_a_preempted_family_once_and_the_ledger_once_per_branch(tiny_llama, recovery: str) -> None:
    """Three n = 4 requests on a pool of 24 blocks: growth fails and families are preempted whole. No
    stop tokens, so every branch of a family is live whenever it is preempted: the ledger's count is
    exactly four times the scheduler's, which is the sum of the requests' counts."""
    path, _ = tiny_llama
    params = SamplingParams(temperature=0.8, seed=1234, n=4)
    prompts = [PROMPT + [i] * (1 + 3 * i) for i in range(3)]
    free = roomy(path).generate(prompts, 10, params)
    engine = Engine.from_model(path, num_blocks=24, block_size=BS, host_blocks=64 if recovery == "swap" else 0,
                               scheduler_config=SchedulerConfig(policy="incremental", on_growth_failure="preempt",
                                                                recovery=recovery))
    results = engine.generate(prompts, 10, params)
    preempted = engine.scheduler.preemptions
    assert preempted > 0
    assert [r.preemptions for r in results] == [r.metrics.preemptions for r in results]  # type: ignore[union-attr]
    assert sum(r.preemptions for r in results) == preempted
    assert engine.ledger.stats()["lifetimes"]["preemptions"] == 4 * preempted
    assert engine.summary()["preemptions"] == preempted
    assert [r.outputs for r in results] == [r.outputs for r in free]  # preemption changes no token
    assert all(r.finish_reasons == ["length"] * 4 for r in results)
    assert_clean(engine)
