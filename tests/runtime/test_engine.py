"""The engine on a tiny random Llama against dense references (transformers, fp32).

Greedy outputs equal ``generate`` with its dense cache; seeded sampling equals the same sampler run
on dense logits (full forward over the whole sequence, no cache) with the same (seed, branch,
position) keys; beam search equals a dense beam search written here. Every case also runs with a pool
small enough to force preemption by recompute and then by swap, and every run ends with the ledger
clean: check() passes, nothing active or promised, no lease outstanding, the host pool empty.
"""

from __future__ import annotations

import pytest
import torch

from kvledger.errors import AdmissionError, ConfigError
from kvledger.runtime.engine import Engine, RequestResult
from kvledger.runtime.sampling import SamplingParams, beam_logprobs, sample_token
from kvledger.scheduler import SchedulerConfig

BS = 4  # small blocks: many boundaries, tails and copies in short sequences
NEW = 10


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts of different lengths; groups of them share a prefix (some longer than a block)."""
    gen = torch.Generator().manual_seed(seed)
    heads = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 5, 0)]
    out = []
    for i in range(count):
        own = torch.randint(0, 256, (1 + (3 * i) % 7,), generator=gen).tolist()
        out.append(heads[i % 3] + own)
    return out


@torch.no_grad()
def dense_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    x = torch.tensor([prompt])
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def dense_sample(hf: torch.nn.Module, prompt: list[int], n: int, params: SamplingParams, branch: int) -> list[int]:
    """The engine's sampler on dense logits: every token from a full forward pass, no cache."""
    seq = list(prompt)
    for _ in range(n):
        logits = hf(torch.tensor([seq])).logits[0, -1]
        seq.append(sample_token(logits, params, params.seed, branch, len(seq)))
    return seq[len(prompt):]


@torch.no_grad()
def dense_beam(hf: torch.nn.Module, prompt: list[int], n: int, width: int) -> list[tuple[float, list[int]]]:
    """Plain beam search without a cache or stop tokens: every step, each beam's full sequence is run
    through the model, ``score + logprob`` is ranked over all (beam, token) pairs (ties: beam rank,
    then token rank) and the best ``width`` become the beams. The first step expands the prompt once."""
    beams: list[tuple[float, list[int]]] = [(0.0, [])]
    for _ in range(n):
        cands = []
        for rank, (score, toks) in enumerate(beams):
            lp = beam_logprobs(hf(torch.tensor([prompt + toks])).logits[0, -1])
            vals, idx = torch.topk(lp, 2 * width)
            for t_rank, (v, t) in enumerate(zip(vals.tolist(), idx.tolist(), strict=True)):
                cands.append((score + v, rank, t_rank, toks + [t]))
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        beams = [(c[0], c[3]) for c in cands[:width]]
    return beams


def assert_clean(engine: Engine) -> None:
    engine.check()
    u = engine.ledger.usage()
    assert (u.active, u.promised, u.sequences, u.deferred) == (0, 0, 0, 0), u
    assert engine.ledger.outstanding_leases() == 0
    if engine.scheduler.host is not None:
        assert engine.scheduler.host.num_used == 0
    assert not engine.has_work()


# Pool of 200 blocks: everything fits. 14 blocks: the 16 requests must take turns and growth fails,
# so running requests are preempted (then recomputed, or swapped to a 64-block host tier).
MODES = {
    "roomy": dict(num_blocks=200),
    "recompute": dict(num_blocks=14, scheduler_config=SchedulerConfig(
        policy="incremental", on_growth_failure="preempt", recovery="recompute")),
    "swap": dict(num_blocks=14, host_blocks=64, scheduler_config=SchedulerConfig(
        policy="incremental", on_growth_failure="preempt", recovery="swap")),
}


def _engine(path, mode: str, tight_blocks: int | None = None, **extra) -> Engine:
    """``tight_blocks`` replaces the 14-block pool of the pressure modes (multi-branch requests
    need more to fit at all)."""
    kw = dict(MODES[mode])
    if tight_blocks is not None and mode != "roomy":
        kw["num_blocks"] = tight_blocks
    return Engine.from_model(path, block_size=BS, **kw, **extra)


def _assert_pressure(engine: Engine, mode: str) -> None:
    if mode == "roomy":
        assert engine.scheduler.preemptions == 0
    else:
        assert engine.scheduler.preemptions > 0
    if mode == "swap":
        assert engine.stats.swapped_out_blocks > 0 and engine.stats.swapped_in_blocks > 0


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def greedy_refs(tiny):
    _, hf = tiny
    prompts = _prompts(16)
    return prompts, [dense_greedy(hf, p, NEW) for p in prompts]


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_16_concurrent_equals_generate(tiny, greedy_refs, mode: str) -> None:
    path, _ = tiny
    prompts, refs = greedy_refs
    engine = _engine(path, mode)
    results = engine.generate(prompts, NEW)
    assert [r.output for r in results] == refs
    assert all(r.finish_reasons == ["length"] for r in results)
    _assert_pressure(engine, mode)
    if mode == "roomy":
        assert engine.stats.steps == NEW  # all 16 prefill together, then decode together
        # All 16 are admitted in one step. Six open with a 9-token head (2 full blocks of 4), five with a
        # 5-token head (1 block): the first of each group writes the head, and the others read it in that
        # same step (the forward pass writes every K/V of a layer before attending) instead of computing
        # it again: 5 x 8 + 4 x 4 = 56 prompt tokens skipped, and the outputs are unchanged.
        assert sum(r.cached_prompt_tokens for r in results) == 5 * 8 + 4 * 4
        computed = engine.stats.prefill_tokens + engine.stats.decode_tokens
        assert computed == sum(len(p) for p in prompts) - 56 + len(prompts) * (NEW - 1)
    assert_clean(engine)


def test_cached_prompt_tokens_count_only_tokens_really_skipped(tiny, greedy_refs) -> None:
    """Regression: cached_prompt_tokens counted prefix blocks another request was still filling (then
    computed again) as cached. Only tokens the request really skipped count: written blocks, and blocks
    another request writes in the very step that reads them."""
    path, _ = tiny
    prompts, refs = greedy_refs
    engine = _engine(path, "roomy")
    same_step = [engine.submit(p, NEW) for p in (prompts[0], prompts[3])]  # the 9-token head: read as written
    engine.step()
    later = engine.submit(prompts[6], NEW)  # the head is written now: 2 blocks of 4 tokens are skipped
    engine.run_until_idle()
    assert [h.result().cached_prompt_tokens for h in same_step] == [0, 8]
    assert later.result().cached_prompt_tokens == 8
    assert later.result().metrics.hit_tokens == 8
    assert [h.result().output for h in (*same_step, later)] == [refs[0], refs[3], refs[6]]
    prefilled = engine.stats.prefill_tokens + engine.stats.decode_tokens - 3 * (NEW - 1)
    assert prefilled == len(prompts[0]) + len(prompts[3]) + len(prompts[6]) - 2 * 8  # what was skipped, was
    assert_clean(engine)


@pytest.mark.parametrize("mode", list(MODES))
def test_seeded_sampling_n4_equals_dense_reference(tiny, mode: str) -> None:
    path, hf = tiny
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=1234, n=4)
    prompts = _prompts(3, seed=5)
    engine = _engine(path, mode, tight_blocks=24)
    results = engine.generate(prompts, NEW, params)
    for prompt, result in zip(prompts, results, strict=True):
        refs = [dense_sample(hf, prompt, NEW, params, branch) for branch in range(4)]
        assert result.outputs == refs
        assert len({tuple(o) for o in result.outputs}) > 1  # the branches really differ
        assert result.seed == 1234
    assert engine.stats.copies > 0  # the branches' shared tails were copied on write
    _assert_pressure(engine, mode)
    if mode == "roomy":
        assert engine.stats.deduplicated_rows > 0  # the 4 identical prefills ran once
    assert_clean(engine)


def test_single_branch_runs_match_the_branches_of_n4(tiny) -> None:
    """A request sampled with n=1 is branch 0 of the same request with n=4."""
    path, _ = tiny
    prompt = _prompts(1, seed=9)[0]
    many = _engine(path, "roomy").generate([prompt], NEW, SamplingParams(temperature=1.0, seed=7, n=4))[0]
    one = _engine(path, "roomy").generate([prompt], NEW, SamplingParams(temperature=1.0, seed=7))[0]
    assert one.outputs == many.outputs[:1]


@pytest.mark.parametrize("mode", list(MODES))
def test_beam_search_width4_equals_dense_reference(tiny, mode: str) -> None:
    path, hf = tiny
    prompts = _prompts(3, seed=11)
    engine = _engine(path, mode, tight_blocks=22)
    results = engine.generate(prompts, 8, SamplingParams(beam_width=4))
    for prompt, result in zip(prompts, results, strict=True):
        ref = dense_beam(hf, prompt, 8, 4)
        assert result.output == ref[0][1]  # the best sequence
        assert result.outputs == [toks for _, toks in ref]  # and every hypothesis, in order
        assert result.scores == pytest.approx([s for s, _ in ref], abs=1e-4)
    assert engine.ledger.stats()["lifetimes"]["forks"] > 0
    _assert_pressure(engine, mode)
    assert_clean(engine)


def test_beam_search_equals_transformers_beam_search(tiny) -> None:
    """With no stop token every hypothesis has the same length, so transformers' length penalty
    cannot reorder them: its beam search returns the same hypotheses."""
    path, hf = tiny
    prompt = _prompts(2, seed=3)[1]
    result = _engine(path, "roomy").generate([prompt], 6, SamplingParams(beam_width=4))[0]
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, num_beams=4, do_sample=False,
                          num_return_sequences=4, length_penalty=0.0)
    assert result.outputs == out[:, len(prompt):].tolist()


def test_beam_search_with_a_stop_token(tiny) -> None:
    """A hypothesis ending in a stop token is finished and kept if it stays among the best."""
    path, hf = tiny
    prompt = _prompts(1, seed=4)[0]
    free = _engine(path, "roomy").generate([prompt], 6, SamplingParams(beam_width=3))[0]
    stop = free.outputs[1][2]  # a token some hypothesis emits at its third position
    result = _engine(path, "roomy").generate([prompt], 6, SamplingParams(beam_width=3), stop_token_ids=[stop])[0]
    assert any(o[-1] == stop and r == "stop" for o, r in zip(result.outputs, result.finish_reasons, strict=True))
    assert result.scores == sorted(result.scores, reverse=True)


@pytest.mark.parametrize("mode", ["roomy", "recompute"])
def test_cancellation_and_copy_on_write_mid_batch(tiny, mode: str) -> None:
    path, hf = tiny
    prompts = _prompts(6, seed=21)
    sampled = SamplingParams(temperature=0.9, seed=99, n=2)
    engine = _engine(path, mode)
    cancel_in_forward: list[str] = []
    forward = engine.runner.forward

    def forward_then_cancel(steps):  # another thread cancelling while the step is in flight
        out = forward(steps)
        while cancel_in_forward:
            engine.cancel(cancel_in_forward.pop())
        return out

    engine.runner.forward = forward_then_cancel  # type: ignore[method-assign]
    keep_greedy = engine.submit(prompts[0], NEW, request_id="keep-greedy")
    keep_sampled = engine.submit(prompts[1], NEW, sampled, request_id="keep-sampled")

    def cancel_after_3(event) -> None:
        if event.token is not None and event.position - len(prompts[2]) == 2:
            engine.cancel("cb")

    by_callback = engine.submit(prompts[2], NEW, request_id="cb", on_token=cancel_after_3)
    in_flight = engine.submit(prompts[3], NEW, sampled, request_id="inflight")
    queued = engine.submit(prompts[4], NEW, request_id="queued")
    queued.cancel()  # before it ever reaches the scheduler
    later = engine.submit(prompts[5], NEW, sampled, request_id="later")
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        if steps == 4:
            cancel_in_forward.append("inflight")
        if steps == 6:
            later.cancel()
    assert keep_greedy.result().output == dense_greedy(hf, prompts[0], NEW)
    assert keep_sampled.result().outputs == [dense_sample(hf, prompts[1], NEW, sampled, b) for b in range(2)]
    for handle, prompt, params in ((by_callback, prompts[2], None), (in_flight, prompts[3], sampled),
                                   (later, prompts[5], sampled)):
        result = handle.result()
        assert set(result.finish_reasons) == {"cancelled"}, (handle.request_id, result.finish_reasons)
        for branch, out in enumerate(result.outputs):  # what was produced is a prefix of the reference
            ref = dense_greedy(hf, prompt, NEW) if params is None else dense_sample(hf, prompt, NEW, params, branch)
            assert out == ref[: len(out)]
    assert len(by_callback.result().output) == 3
    assert queued.result().outputs == [[]] and queued.result().finish_reasons == ["cancelled"]
    assert engine.stats.copies > 0 and engine.stats.cancelled == 4
    _assert_pressure(engine, mode)
    assert not engine.cancel("keep-greedy")  # finished: nothing to cancel
    assert_clean(engine)


def test_streaming_iterator_and_callback(tiny, greedy_refs) -> None:
    path, _ = tiny
    prompts, refs = greedy_refs
    engine = _engine(path, "roomy")
    seen: list[int] = []
    engine.submit(prompts[1], NEW, on_token=lambda e: seen.append(e.token) if e.token is not None else None)
    handle = engine.submit(prompts[0], NEW)
    events = list(handle.stream())  # steps the engine itself
    assert [e.token for e in events[:-1]] == refs[0]
    assert [e.position for e in events[:-1]] == list(range(len(prompts[0]), len(prompts[0]) + NEW))
    assert events[-1].finished and events[-1].finish_reason == "length"
    engine.run_until_idle()
    assert seen == refs[1]
    assert_clean(engine)


def test_background_thread(tiny, greedy_refs) -> None:
    path, _ = tiny
    prompts, refs = greedy_refs
    engine = _engine(path, "recompute")
    engine.start()
    try:
        handles = [engine.submit(p, NEW) for p in prompts[:6]]
        assert [h.result(timeout=60).output for h in handles] == refs[:6]
        streamed = [e.token for e in engine.submit(prompts[6], NEW).stream(timeout=60) if e.token is not None]
        assert streamed == refs[6]
    finally:
        engine.stop(timeout=10)
    assert engine.error is None
    assert_clean(engine)


def test_stop_tokens_end_a_request(tiny, greedy_refs) -> None:
    path, _ = tiny
    prompts, refs = greedy_refs
    stop = refs[0][3]
    result: RequestResult = _engine(path, "roomy").generate([prompts[0]], NEW, stop_token_ids=[stop])[0]
    assert result.output == refs[0][: refs[0].index(stop) + 1]
    assert result.finish_reasons == ["stop"]


def test_requests_that_can_never_run_are_refused(make_tiny) -> None:
    path, _ = make_tiny("llama", max_position_embeddings=32)
    engine = Engine.from_model(path, num_blocks=8, block_size=BS)
    assert engine.max_context == 32
    with pytest.raises(AdmissionError, match="context"):
        engine.submit(list(range(32)), 4)
    with pytest.raises(AdmissionError, match="pool is too small"):  # 2 branches of 28 tokens: 9 blocks
        engine.submit(list(range(20)), 8, SamplingParams(temperature=1.0, seed=1, n=2))
    with pytest.raises(ConfigError):
        engine.submit([], 4)
    with pytest.raises(ConfigError):
        engine.submit([300], 4)  # outside the vocabulary
    with pytest.raises(ConfigError):
        SamplingParams(beam_width=2, temperature=0.5)
    # The allowance is cut to what the context leaves: 28 + 4 = 32.
    result = engine.generate([list(range(20))], 100)
    assert len(result[0].output) == 12 and result[0].finish_reasons == ["length"]
    assert_clean(engine)



def test_a_prompt_that_is_not_token_ids_is_a_config_error(tiny) -> None:
    """Passing a tokenizer's output dict or floats instead of token ids is one clear ConfigError."""
    from kvledger.errors import ConfigError

    engine = _engine(tiny[0], "roomy")
    for bad in ({"input_ids": [1, 2]}, [1.5, 2]):
        with pytest.raises(ConfigError, match="integer token ids"):
            engine.submit(bad, 4)


def test_eviction_policy_write_only_requests_and_cache_reset(tiny, greedy_refs) -> None:
    path, _ = tiny
    prompts, refs = greedy_refs
    engine = _engine(path, "roomy", eviction="priority")
    assert engine.ledger.policy_name == "priority"
    with pytest.raises(ConfigError, match="eviction policy"):
        _engine(path, "roomy", eviction="fifo")
    first = engine.generate([prompts[0]], NEW)[0]
    again = engine.generate([prompts[0]], NEW, read_prefix_cache=False)[0]
    hit = engine.generate([prompts[0]], NEW)[0]
    assert first.output == again.output == hit.output == refs[0]
    assert (first.cached_prompt_tokens, again.cached_prompt_tokens) == (0, 0)  # write-only: no hits
    assert hit.cached_prompt_tokens == (len(prompts[0]) - 1) // BS * BS  # full blocks, last token runs
    assert engine.reset_prefix_cache() and engine.ledger.usage().retained == 0
    assert engine.generate([prompts[0]], NEW)[0].cached_prompt_tokens == 0
    assert_clean(engine)
