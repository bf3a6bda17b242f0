"""How a request's life at the fleet's ingress ends (:meth:`FleetBackend._drive`), whatever ends it, and what
a replica gives back when its caller goes away -- in this process (``tests/fleet/inproc.py`` stands in for
Ray Serve's handles; no Ray process).

Pinned: every submitted request ends with a result and one last token event a client can read -- when an
internal error ends it (it says "cancelled", never a result without reasons), and when a caller reuses a
request id while the first is still in flight (each still gets its own last event); and a request that a
replica's door accepted but its engine had not admitted yet, cancelled at the ingress, leaves no booking
behind at that replica (its published load has the blocks back)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import pytest
from ray import serve

from kvledger.errors import ConfigError
from kvledger.fleet.serve import FleetBackend
from kvledger.placement.score import ReplicaLoad
from kvledger.runtime.sampling import SamplingParams

from .inproc import InprocDeployment, fleet_spec, inproc_fleet, run_fleet, shared_tiny_model
from .inproc import scripted_fleet as routed_fleet

BS = 4
LOAD = ReplicaLoad(16, 16, 0, 0, seq=1, stamp=0.0).to_dict()
REPLY = [{"type": "accepted", "load": LOAD, "seq": 1, "overshoot": 0}, {"type": "token", "branch": 0, "token": 7},
         {"type": "finished", "finish_reasons": ["stop"], "cached_prompt_tokens": 0, "seq": 2,
          "load": {**LOAD, "seq": 2}}]

run = run_fleet
_keys = itertools.count()


class Replying:
    """A replica that answers every ``generate`` with ``REPLY`` (accepted, one token, finished), yielding to
    the event loop between messages, and ``pid`` for the router's first call."""

    def __init__(self) -> None:
        self.name = serve.get_replica_context().replica_id.to_full_id_str()

    async def generate(self, job: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        for msg in REPLY:
            await asyncio.sleep(0)
            yield {"replica": self.name, **msg} if msg["type"] != "token" else msg

    async def pid(self, job: Any = None) -> dict[str, Any]:
        return {"replica": self.name, "pid": 0}


def scripted_fleet(name: str) -> tuple[InprocDeployment, FleetBackend]:
    """Two ``Replying`` replicas behind the real router, and an ingress backend, over a fresh view."""
    return routed_fleet(Replying, f"{name}-{next(_keys)}", block_size=BS)


def last_events(events: list[Any]) -> list[tuple[str, int, int | None, int, bool, str | None]]:
    return [(e.request_id, e.branch, e.token, e.position, e.finished, e.finish_reason) for e in events]


def test_a_request_ended_by_an_internal_error_says_cancelled_in_its_result_and_last_event() -> None:
    """The ingress's own view fails before the request reached any replica: the error surfaces on the
    request's task (not swallowed), and the client still reads a result -- reasons ["cancelled"], one
    attempt, no replica -- and one last event saying "cancelled" at the prompt's end; nothing stays
    counted as running and the audit is clean."""
    async def go() -> None:
        deployment, backend = scripted_fleet("drive-internal-error")
        try:
            calls = 0
            positions = backend.view.event_positions

            def broken() -> dict[str, int]:
                nonlocal calls
                calls += 1
                if calls == 1:
                    raise RuntimeError("the view broke")
                return positions()

            backend.view.event_positions = broken  # type: ignore[method-assign]
            events: list[Any] = []
            handle = backend.submit([1, 2, 3, 4, 5], 4, None, trust_group="t", request_id="oops",
                                    on_token=events.append)
            await asyncio.wait({handle.task})
            assert isinstance(handle.task.exception(), RuntimeError)
            result = handle.result()
            assert (result.finish_reasons, result.cached_prompt_tokens, result.replica, result.refusals,
                    result.attempts) == (["cancelled"], 0, None, 0, 1)
            assert last_events(events) == [("oops", 0, None, 5, True, "cancelled")]
            assert backend.running == 0 and backend.audit()["clean"] is True
            assert not deployment.sent  # no replica was asked
        finally:
            backend.stop()
    run(go())


def test_a_request_id_reused_while_in_flight_still_ends_each_request_with_its_last_event() -> None:
    """A caller submits two requests under one id at once. Either the ingress refuses the second
    (ConfigError), or both run -- and then each ends with its own result and its own last event, and the
    backend is left with nothing open (its audit clean)."""
    async def go() -> None:
        deployment, backend = scripted_fleet("drive-reused-id")
        try:
            first_events: list[Any] = []
            second_events: list[Any] = []
            first = backend.submit([1, 2, 3], 4, None, trust_group="t", request_id="dup", on_token=first_events.append)
            try:
                second = backend.submit([4, 5, 6, 7], 4, None, trust_group="t", request_id="dup",
                                        on_token=second_events.append)
            except ConfigError:
                second = None
            await asyncio.wait({first.task} | ({second.task} if second is not None else set()))
            assert first.task.exception() is None
            assert first.result().finish_reasons == ["stop"]
            assert last_events(first_events) == [("dup", 0, 7, 3, False, None), ("dup", 0, None, 4, True, "stop")]
            if second is not None:
                assert second.task.exception() is None
                assert second.result().finish_reasons == ["stop"]
                assert last_events(second_events) == [("dup", 0, 7, 4, False, None),
                                                      ("dup", 0, None, 5, True, "stop")]
            assert backend.running == 0 and backend.audit()["clean"] is True and backend.drain(0.0) is True
        finally:
            backend.stop()
    run(go())


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return shared_tiny_model(tmp_path_factory)


def test_a_request_cancelled_before_its_replica_admitted_it_gives_the_booked_blocks_back(model: str) -> None:
    """One replica whose engine is paused: the door accepts a 3-block request (booked: the replica's
    load shows 3 blocks fewer), the engine has not admitted it when the ingress cancels it. The replica
    then publishes its whole pool available again, its door's book is empty and its audit passes --
    before and after the engine resumes and applies the cancel. (A booking left behind would shrink what
    the replica accepts for good.)"""
    async def go() -> None:
        spec = fleet_spec(model, engine_replicas=1)
        async with inproc_fleet(spec) as (deployment, backend):
            replica = deployment.replicas[0].servable
            engine = replica.engine
            engine.stop()  # paused: nothing is admitted until it starts again
            events: list[Any] = []
            handle = backend.submit(list(range(1, 9)), 4, SamplingParams(temperature=0.0), request_id="gone",
                                    on_token=events.append)
            while backend.running == 0:  # the replica's "accepted" reached the ingress
                await asyncio.sleep(0.001)
            assert replica.door.is_booked("gone") and replica.door.booked == 3
            assert (await replica.news())["load"]["booked"] == 3
            assert backend.cancel("gone") is True
            await asyncio.wait({handle.task})
            assert handle.result().finish_reasons == ["cancelled"] and backend.running == 0
            assert last_events(events) == [("gone", 0, None, 8, True, "cancelled")]

            assert not replica.door.is_booked("gone") and replica.door.booked == 0
            load = ReplicaLoad.from_dict((await replica.news())["load"])
            assert (load.booked, load.backlog, load.available) == (0, 0, 16)
            audit = await replica.audit()
            assert audit["door"] == {"accepted": 1, "refused": 0, "never": 0, "overcommits": 0, "max_overshoot": 0,
                                     "booked": 0}
            engine.start()
            while engine.has_work():  # the engine applies the cancel at its next step
                await asyncio.sleep(0.005)
            audit = await replica.audit()
            assert audit["finished"] == 0 and audit["door"]["booked"] == 0
            assert audit["usage"]["promised"] == 0 and audit["usage"]["free"] == 16
    run(go())
