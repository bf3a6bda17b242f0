"""Faults injected into the engine: an exception in the forward pass, in sampling, in a request's
``on_token`` callback (in the caller's thread and in background mode), and the cancellation of a
swapped-out family. The request at fault ends with the error; every other request's tokens equal an
undisturbed run; nothing leaks (ledger, host pool, leases)."""

from __future__ import annotations

import pytest
import torch

import kvledger.runtime.executor as executor_module
from kvledger.runtime.engine import Engine, RequestResult
from kvledger.runtime.sampling import SamplingParams
from kvledger.scheduler import SchedulerConfig

BS = 4
NEW = 10
SAMPLED = SamplingParams(temperature=0.9, seed=7, n=2)
CULPRIT_SEED = 4242
SWAP = dict(num_blocks=14, host_blocks=64, scheduler_config=SchedulerConfig(
    policy="incremental", on_growth_failure="preempt", recovery="swap"))


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (5 + (3 * i) % 7,), generator=gen).tolist() for i in range(count)]


PROMPTS = _prompts(6)


def _engine(path, **kw) -> Engine:
    return Engine.from_model(path, block_size=BS, **(kw or dict(num_blocks=64)))


def _workload(engine: Engine, on_token=None) -> dict:
    """Four greedy requests, one sampled family (n=2), and the culprit "X" (its own seed)."""
    handles = {f"g{i}": engine.submit(p, NEW, request_id=f"g{i}") for i, p in enumerate(PROMPTS[:4])}
    handles["F"] = engine.submit(PROMPTS[4], NEW, SAMPLED, request_id="F")
    handles["X"] = engine.submit(PROMPTS[5], NEW, SamplingParams(temperature=0.7, seed=CULPRIT_SEED),
                                 request_id="X", on_token=on_token)
    return handles


def _results(engine: Engine, handles: dict) -> dict[str, RequestResult]:
    if not engine.running_in_background:
        engine.run_until_idle()
    return {rid: h.result(timeout=120) for rid, h in handles.items()}


def assert_clean(engine: Engine) -> None:
    engine.check()
    u = engine.ledger.usage()
    assert (u.active, u.promised, u.sequences, u.deferred) == (0, 0, 0, 0), u
    assert engine.ledger.outstanding_leases() == 0
    if engine.scheduler.host is not None:
        assert engine.scheduler.host.num_used == 0
    assert not engine.has_work()


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama[0]


@pytest.fixture(scope="module", params=["roomy", "swap"])
def mode(request) -> str:
    return request.param


_REFERENCES: dict[str, dict[str, RequestResult]] = {}


def _reference(path, mode: str) -> dict[str, RequestResult]:
    if mode not in _REFERENCES:
        engine = _engine(path, **({} if mode == "roomy" else SWAP))
        results = _results(engine, _workload(engine))
        assert all(set(r.finish_reasons) == {"length"} for r in results.values())
        if mode == "swap":
            assert engine.stats.swapped_out_blocks > 0
        assert_clean(engine)
        _REFERENCES[mode] = results
    return _REFERENCES[mode]


@pytest.fixture(scope="module")
def undisturbed(tiny, mode) -> dict[str, RequestResult]:
    return _reference(tiny, mode)


def _assert_others_undisturbed(results: dict[str, RequestResult], reference: dict[str, RequestResult]) -> None:
    for rid, ref in reference.items():
        if rid != "X":
            assert (results[rid].outputs, results[rid].finish_reasons) == (ref.outputs, ref.finish_reasons), rid


def test_an_exception_in_the_forward_pass_fails_only_its_request(tiny, mode, undisturbed) -> None:
    """Regression (defect 5): an exception in forward escaped Engine.step() and left the step's lease
    outstanding (its blocks deferred forever while check() passed)."""
    engine = _engine(tiny, **({} if mode == "roomy" else SWAP))
    forward = engine.runner.forward

    def forward_failing_for_x(steps):
        x = set(engine.ledger.sequence("X").table.blocks) if "X" in engine.ledger else set()
        if engine.stats.forward_steps >= 2 and any(x & set(s.block_table) for s in steps):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return forward(steps)

    engine.runner.forward = forward_failing_for_x  # type: ignore[method-assign]
    results = _results(engine, _workload(engine))
    x = results["X"]
    assert x.finish_reasons == ["error: RuntimeError: CUDA error: an illegal memory access was encountered"]
    assert x.output == undisturbed["X"].output[: len(x.output)]  # what it made before the fault is right
    _assert_others_undisturbed(results, undisturbed)
    assert engine.stats.failed == 1
    assert_clean(engine)


def test_an_exception_in_sampling_fails_only_its_request(tiny, mode, undisturbed, monkeypatch) -> None:
    engine = _engine(tiny, **({} if mode == "roomy" else SWAP))
    sample_rows = executor_module.sample_rows
    calls = [0]

    def sample_rows_failing_for_x(logits, params, keys):
        calls[0] += 1
        if calls[0] > 3 and any(seed == CULPRIT_SEED for seed, _, _ in keys):
            raise ValueError("probabilities contain NaN")
        return sample_rows(logits, params, keys)

    monkeypatch.setattr(executor_module, "sample_rows", sample_rows_failing_for_x)
    results = _results(engine, _workload(engine))
    assert results["X"].finish_reasons == ["error: ValueError: probabilities contain NaN"]
    _assert_others_undisturbed(results, undisturbed)
    assert_clean(engine)


@pytest.mark.parametrize("background", [False, True])
def test_an_exception_in_a_callback_fails_only_its_request(tiny, mode, undisturbed, background: bool) -> None:
    """Regression (defect 9): the callback's exception propagated out of Engine.step() and, in
    background mode, stopped the engine for every tenant."""
    engine = _engine(tiny, **({} if mode == "roomy" else SWAP))
    seen: list[int] = []

    def on_token(event) -> None:
        if event.token is not None:
            seen.append(event.token)
            if len(seen) == 3:
                raise KeyError("the client went away")

    if background:
        engine.start()
    try:
        results = _results(engine, _workload(engine, on_token=on_token))
    finally:
        engine.stop(timeout=30)
    assert engine.error is None
    x = results["X"]
    assert x.finish_reasons == ["error: the on_token callback raised KeyError: 'the client went away'"]
    assert seen == x.output[:3] and len(x.output) >= 3  # no more callbacks after it raised
    assert x.output == undisturbed["X"].output[: len(x.output)]
    _assert_others_undisturbed(results, undisturbed)
    assert engine.stats.callback_errors == 1
    assert_clean(engine)


def test_cancel_of_a_swapped_family(tiny) -> None:
    """Regression (defect 4): cancelling a swapped-out n > 1 request freed the host blocks its branches
    share once per branch; the next step raised 'host block ... freed but not in use'."""
    undisturbed = _reference(tiny, "swap")
    engine = _engine(tiny, **SWAP)
    handles = _workload(engine)
    while not any(u[0].request.request_id == "F" for u in engine.scheduler.swapped):
        engine.step()
    (unit,) = [u for u in engine.scheduler.swapped if u[0].request.request_id == "F"]
    assert set(unit[0].host_blocks) & set(unit[1].host_blocks)  # the branches share host copies
    assert handles["F"].cancel()
    results = _results(engine, handles)
    assert results["F"].finish_reasons == ["cancelled", "cancelled"]
    for branch, out in enumerate(results["F"].outputs):
        assert out == undisturbed["F"].outputs[branch][: len(out)]
    for rid, ref in undisturbed.items():
        if rid != "F":
            assert results[rid].outputs == ref.outputs, rid
    assert_clean(engine)
