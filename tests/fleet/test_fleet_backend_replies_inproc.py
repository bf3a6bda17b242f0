"""The fleet's ingress backend against replicas that answer from a script (no model): the replies a real
engine replica rarely gives -- an acceptance that overshot, a stream that breaks before or after the
acceptance, a cache-event history with a gap, a news poll that fails -- and what the backend makes of
each: its counters, its view, its ``running`` count and the request's result."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from kvledger.core.identity import CacheContext, prompt_digests
from kvledger.fleet.serve import FleetBackend
from kvledger.placement.score import ReplicaLoad

from .inproc import InprocDeployment, run_fleet, scripted_fleet

BS = 4
SCRIPTS: list[list[Any]] = []  # the replies of the next generate calls, whichever replica they reach
LOAD = ReplicaLoad(16, 16, 0, 0, seq=1, stamp=0.0).to_dict()


class Scripted:
    """A replica that answers ``generate`` from ``SCRIPTS`` (``"die"``: the call fails there) and ``news``
    with an empty pool (failing the first time)."""

    def __init__(self) -> None:
        self.name = serve.get_replica_context().replica_id.to_full_id_str()
        self.jobs: list[dict[str, Any]] = []
        self.news_calls = 0

    async def generate(self, job: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        self.jobs.append(job)
        for msg in SCRIPTS.pop(0):
            await asyncio.sleep(0)
            if msg == "die":
                raise RuntimeError("the replica died")
            if msg == "hold":  # a long generation: nothing more until the caller goes away
                await asyncio.Event().wait()
            yield {"replica": self.name, **msg} if msg.get("type") != "token" else msg

    async def pid(self, job: Any = None) -> dict[str, Any]:
        return {"replica": self.name, "pid": 0}

    async def news(self, job: dict[str, Any]) -> dict[str, Any]:
        self.news_calls += 1
        if self.news_calls == 1:
            raise RuntimeError("busy")  # a failed poll is skipped: news later
        return {"replica": self.name, "load": LOAD, "events": [], "events_next": job["since"],
                "events_complete": True}


run = run_fleet


def fleet(key: str, **spec: Any) -> tuple[InprocDeployment, FleetBackend, list[str]]:
    SCRIPTS.clear()
    deployment, backend = scripted_fleet(Scripted, key, block_size=BS, **spec)
    return deployment, backend, [r.name for r in deployment.replicas]


def accepted(seq: int = 1, overshoot: int = 0) -> dict[str, Any]:
    return {"type": "accepted", "load": LOAD, "seq": seq, "overshoot": overshoot}


def finished(seq: int = 2, cached: int = 0, **extra: Any) -> dict[str, Any]:
    return {"type": "finished", "finish_reasons": ["stop"], "cached_prompt_tokens": cached, "seq": seq,
            "load": {**LOAD, "seq": seq}, **extra}


def token(t: int, branch: int = 0) -> dict[str, Any]:
    return {"type": "token", "branch": branch, "token": t}


async def result_of(backend: FleetBackend, prompt: list[int], events: list[Any] | None = None) -> Any:
    handle = backend.submit(prompt, 4, None, trust_group="t", on_token=events.append if events is not None else None)
    await asyncio.wait({handle.task})
    return handle.result()


def test_an_overshooting_acceptance_is_counted_and_replies_feed_the_view():
    """An acceptance that overshot the replica's pool is an overcommit (the ingress counts it); a finished
    reply's cache events reach the view, and one with a gap in its history first makes the view forget
    what it believed that replica holds."""
    async def go() -> None:
        deployment, backend, names = fleet("replies-overshoot")
        try:
            prompt = list(range(8))
            digests = prompt_digests(CacheContext(trust_group="t", model=backend.model_name, kv_dtype="fp32")
                                     .root_digest(), prompt, BS)
            SCRIPTS.append([accepted(overshoot=2), token(5), finished(
                cached=4, events=[("stored", digests[0]), ("stored", digests[1])], events_next=2,
                events_complete=True)])
            events: list[Any] = []
            result = await result_of(backend, prompt, events)
            assert (result.finish_reasons, result.cached_prompt_tokens, result.attempts) == (["stop"], 4, 1)
            assert [(e.token, e.position, e.finished, e.finish_reason) for e in events] == [
                (5, 8, False, None), (None, 9, True, "stop")]
            assert backend.counters["overcommits"] == 1 and backend.counters["accepted"] == 1
            where = result.replica
            assert backend.view.known()[where] == 2 and backend.view.event_positions()[where] == 2

            SCRIPTS.append([accepted(seq=3), finished(seq=4, events=[("stored", b"x" * 32)], events_next=9,
                                                      events_complete=False)])
            again = await result_of(backend, prompt)
            assert again.replica == where  # it holds the prefix
            assert backend.view.known()[where] == 1 and backend.view.event_positions()[where] == 9
            assert backend.counters["overcommits"] == 1 and backend.running == 0
        finally:
            backend.stop()
    run(go())


def test_a_stream_that_breaks_is_a_replica_failure_and_the_request_goes_elsewhere():
    """A replica whose stream fails before it answered: a failure, the request is resubmitted (no replica
    to avoid: it never said who it was); one whose stream fails after accepting, or simply ends without a
    result: a failure, that replica is avoided and dropped from the view, the request is no longer
    counted running there, and it completes on the other replica."""
    async def go() -> None:
        deployment, backend, names = fleet("replies-broken")
        try:
            SCRIPTS[:] = [["die"], [accepted(), finished()]]
            result = await result_of(backend, [1, 2, 3])
            assert backend.counters["replica_failures"] == 1 and result.attempts == 2
            jobs = [job for r in deployment.replicas for job in r.servable.jobs]
            assert sorted(job["avoid"] for job in jobs) == [[], []]  # the failed one named no replica

            for broken in ([accepted(), token(7), "die"], [accepted(), token(7)]):  # fails; ends without a result
                backend.counters["replica_failures"] = 0
                SCRIPTS[:] = [broken, [accepted(), token(7), finished()]]
                events: list[Any] = []
                result = await result_of(backend, list(range(1, 9)), events)  # two full blocks
                assert result.finish_reasons == ["stop"] and result.attempts == 2
                assert backend.counters["replica_failures"] == 1 and backend.running == 0
                assert [(e.token, e.position, e.finished) for e in events] == [(7, 8, False), (None, 9, True)]
                calls = [(name, args[0]) for method, name, args in deployment.sent if method == "generate"]
                assert calls[-1][1]["avoid"] == [calls[-2][0]]  # the retry avoids the replica that failed
                if broken[-1] == "die":  # and the view forgets what it believed the failed one holds
                    assert backend.view.known().get(calls[-2][0], 0) == 0 and backend.view.in_flight() == 0
        finally:
            backend.stop()
    run(go())


def test_news_skips_a_replica_that_fails_to_answer_and_asks_again_later():
    """The background poll: a replica whose news call fails is skipped this round, the others are heard
    (their loads and event positions taken); a later round hears it too."""
    async def go() -> None:
        deployment, backend, names = fleet("replies-news", news_period_s=0.01)
        try:
            while backend.counters["news"] < 2 * len(names) - 1:
                await asyncio.sleep(0.002)
            backend.stop()
            await asyncio.sleep(0)
            assert all(r.servable.news_calls >= 2 for r in deployment.replicas)
            heard = sum(r.servable.news_calls - 1 for r in deployment.replicas)  # each failed once
            assert heard - 1 <= backend.counters["news"] <= heard  # one per answer (the last may be cut short)
            assert {n: backend.view.available(n) for n in names} == dict.fromkeys(names, 16)
            # With an empty view the poll's first call builds the router; if Ray told the router who the
            # replicas are before the poll began (a busy machine), the poll goes straight to the news.
            methods = [c[0] for c in deployment.sent]
            assert set(methods) <= {"pid", "news"} and "pid" not in methods[1:]
            polled = [name for method, name, _ in deployment.sent if method == "news"]
            assert sorted(polled[:2]) == sorted(names)  # one failure did not end the first round
        finally:
            backend.stop()
    run(go())


def test_a_request_cancelled_after_a_refusal_says_cancelled():
    """Regression: a request refused once ("not now"), then accepted elsewhere and cancelled while it
    streamed (client gone, ingress stopping), ended with finish reason "not_now" -- the earlier refusal's
    -- in its result and its last token event, instead of "cancelled"."""
    async def go() -> None:
        deployment, backend, names = fleet("replies-cancel")
        try:
            SCRIPTS[:] = [[{"type": "not_now", "reason": "full", "load": LOAD, "seq": 1}],
                          [accepted(seq=2), token(9), "hold"]]
            events: list[Any] = []
            streaming = asyncio.Event()

            def on_token(e: Any) -> None:
                events.append(e)
                streaming.set()

            handle = backend.submit([1, 2, 3], 4, None, trust_group="t", on_token=on_token)
            await streaming.wait()
            assert backend.cancel(handle.request_id) is True
            await asyncio.wait({handle.task})
            result = handle.result()
            assert (result.finish_reasons, result.refusals, result.attempts) == (["cancelled"], 1, 2)
            assert [(e.token, e.finished, e.finish_reason) for e in events] == [(9, False, None),
                                                                                 (None, True, "cancelled")]
            assert backend.counters["refusals"] == 1 and backend.counters["retries"] == 1
        finally:
            backend.stop()
    run(go())
