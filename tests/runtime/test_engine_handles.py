"""Request handles, counters and the server-facing API of the engine, on a tiny random Llama.

Regression tests (each failed before its fix): ``result()`` spun while token events were queued, the
final ``finished`` callback came before the handle had its result, a handle kept every event of a
request nobody streamed, ``n`` above ``max_running`` was accepted and then ended silently by the
scheduler; plus repeated cancels counted once, the snapshot API, quotas and cache salts.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvledger.errors import AdmissionError, ConfigError
from kvledger.runtime.engine import Engine, EngineSnapshot
from kvledger.runtime.sampling import SamplingParams
from kvledger.scheduler import SchedulerConfig

BS = 4
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32]


@pytest.fixture(scope="module")
def path(tiny_llama):
    return tiny_llama[0]


def _engine(path, **kw) -> Engine:
    kw.setdefault("num_blocks", 64)
    return Engine.from_model(path, block_size=BS, **kw)


def assert_clean(engine: Engine) -> None:
    engine.check()
    u = engine.ledger.usage()
    assert (u.active, u.promised, u.sequences, u.deferred) == (0, 0, 0, 0), u


def test_result_sleeps_while_token_events_are_queued(path) -> None:
    """With the engine in its thread, ``result()`` waits on the handle's condition until the result is
    set. It used to return from its wait at once whenever an event was queued -- and nothing it does
    drains the queue -- so after the first token it spun until the request ended (32 tokens took 9-14 s
    through result() against ~2 s through a callback). Here the engine is held after 3 tokens while the
    caller waits in result(); its wake-ups during the hold are counted."""
    engine = _engine(path)
    hold, held = threading.Event(), threading.Event()

    def observer(_result) -> None:  # runs in the engine thread, at the step boundary
        if engine.stats.generated_tokens >= 3 and not hold.is_set():
            held.set()
            hold.wait(30)

    engine.step_observers.append(observer)
    wakeups = 0
    raise_if_failed = engine._raise_if_failed

    def counting() -> None:  # result() checks the engine thread after every wake-up
        nonlocal wakeups
        wakeups += 1
        raise_if_failed()

    engine._raise_if_failed = counting  # type: ignore[method-assign]
    during: list[int] = []

    def release() -> None:
        held.wait(30)
        before = wakeups
        time.sleep(0.5)  # the caller waits in result() with 3 events queued
        during.append(wakeups - before)
        hold.set()

    releaser = threading.Thread(target=release)
    engine.start()
    try:
        releaser.start()
        handle = engine.submit(PROMPT, 12)
        result = handle.result(timeout=60)
    finally:
        hold.set()
        releaser.join(30)
        engine.stop(timeout=10)
    assert len(result.output) == 12
    # A tenth of a second per wait: about 5 wake-ups in half a second (a spin makes tens of thousands).
    assert during and during[0] <= 20, during
    assert_clean(engine)


@pytest.mark.parametrize("background", [False, True])
def test_the_finished_callback_sees_a_finished_handle(path, background: bool) -> None:
    """The server reads the result when its ``finished`` event arrives; it used to have to poll done()."""
    engine = _engine(path)
    handles: dict[str, object] = {}
    seen: list[tuple[bool, list[int] | None]] = []
    ready = threading.Event()

    def on_token(event) -> None:
        if event.finished:
            ready.wait(10)
            h = handles["r"]
            seen.append((h.done(), h.result(timeout=0).output if h.done() else None))  # type: ignore[attr-defined]

    if background:
        engine.start()
    try:
        handles["r"] = engine.submit(PROMPT, 6, request_id="r", on_token=on_token)
        ready.set()
        result = handles["r"].result(timeout=60)  # type: ignore[attr-defined]
    finally:
        engine.stop(timeout=10)
    assert seen == [(True, result.output)]
    assert len(result.output) == 6


def test_a_handle_keeps_no_event_nobody_will_stream(path) -> None:
    engine = _engine(path)
    plain = engine.submit(PROMPT, 8)
    with_callback = engine.submit(PROMPT[:5], 8, on_token=lambda e: None)
    engine.step()
    assert len(plain._events) > 0  # buffered for a stream that may still come (bounded by its tokens)
    assert len(with_callback._events) == 0  # its callback is its stream
    engine.run_until_idle()
    # Finished with nobody streaming: the buffer is gone, the result has every token.
    assert len(plain._events) == 0 and len(plain.result().output) == 8
    # A stream started afterwards replays the result.
    replay = list(plain.stream())
    assert [e.token for e in replay[:-1]] == plain.result().output
    assert [e.position for e in replay[:-1]] == list(range(len(PROMPT), len(PROMPT) + 8))
    assert replay[-1].finished and replay[-1].finish_reason == "length"
    # A stream on a callback handle, started before the engine steps it, sees every event.
    later = engine.submit(PROMPT, 5, on_token=lambda e: None)
    events = list(later.stream())
    assert [e.token for e in events[:-1]] == later.result().output and events[-1].finished
    assert len(later._events) == 0
    assert_clean(engine)


def test_repeated_cancels_in_one_step_count_once(path) -> None:
    engine = _engine(path)
    handle = engine.submit(PROMPT, 20, request_id="c")
    other = engine.submit(PROMPT[:4], 20, request_id="d",
                          on_token=lambda e: (engine.cancel("d"), engine.cancel("d")))  # twice per token
    engine.step()
    assert handle.cancel() and handle.cancel()  # both accepted before the next step: one cancellation
    assert engine.cancel("c")
    engine.run_until_idle()
    assert not handle.cancel()  # finished: nothing to cancel
    assert handle.result().finish_reasons == ["cancelled"] and other.result().finish_reasons == ["cancelled"]
    assert engine.stats.cancelled == 2 and engine.stats.completed == 2
    assert engine.snapshot().stats["cancelled"] == 2
    assert engine.ledger.counters.cancelled == 2
    assert_clean(engine)


def test_more_sequences_than_run_at_once_are_never(path) -> None:
    """n (or beam width) above max_running can never run: refused at submission, not ended later by
    the scheduler with a finish reason the caller has to dig for."""
    engine = _engine(path, scheduler_config=SchedulerConfig(max_running=2))
    with pytest.raises(AdmissionError, match=r"n=3 sequences can never run at once here: at most 2"):
        engine.submit(PROMPT, 4, SamplingParams(temperature=1.0, seed=1, n=3))
    with pytest.raises(AdmissionError, match=r"beam width 3 sequences can never run"):
        engine.check_request(PROMPT, 4, SamplingParams(beam_width=3))
    assert not engine.has_work()
    ok = engine.submit(PROMPT, 4, SamplingParams(temperature=1.0, seed=1, n=2))
    engine.run_until_idle()
    assert [len(o) for o in ok.result().outputs] == [4, 4]


def test_snapshot_quota_and_cache_salt(path) -> None:
    engine = _engine(path, num_blocks=40)
    engine.set_quota("acme", 10)
    # 9 prompt tokens + 30 new: 10 blocks of 4 at most -> the whole quota; 32 new tokens (11) is never.
    with pytest.raises(AdmissionError, match="larger than its trust group's quota: it needs 11 blocks"):
        engine.submit(PROMPT, 32, trust_group="acme")
    a = engine.submit(PROMPT, 30, trust_group="acme", request_id="a")
    b = engine.submit(PROMPT, 30, trust_group="acme", request_id="b")  # waits for a: the quota is full
    g = engine.submit(PROMPT, 30, trust_group="globex", request_id="g")  # not held up by acme's cap
    engine.step()
    snap = engine.snapshot()
    assert isinstance(snap, EngineSnapshot)
    assert (snap.running, snap.waiting, snap.max_running, snap.pool_blocks, snap.block_size) == (2, 1, 256, 40, 4)
    acme = snap.groups["acme"]
    assert (acme["charged"], acme["cap"], acme["quota_refusals"]) == (10, 10, 1)
    assert snap.groups["globex"]["cap"] is None and snap.groups["globex"]["charged"] == 10
    assert snap.admissions["admitted"] == 2 and snap.blocks["total"] == 40
    engine.run_until_idle()
    assert a.result().output == b.result().output == g.result().output  # greedy: same prompt, same tokens
    assert b.result().cached_prompt_tokens == 8  # a's two full prompt blocks, after a finished
    assert g.result().cached_prompt_tokens == 0  # another trust group never hits acme's blocks
    # A cache salt splits the group's cache: no hit across salts, hits within one.
    s1 = engine.submit(PROMPT, 2, trust_group="acme", cache_salt="user-1")
    engine.run_until_idle()
    s2 = engine.submit(PROMPT, 2, trust_group="acme", cache_salt="user-1")
    s3 = engine.submit(PROMPT, 2, trust_group="acme", cache_salt="user-2")
    engine.run_until_idle()
    assert (s1.result().cached_prompt_tokens, s2.result().cached_prompt_tokens,
            s3.result().cached_prompt_tokens) == (0, 8, 0)
    with pytest.raises(ConfigError):
        engine.submit(PROMPT, 2, cache_salt="")
    assert_clean(engine)
