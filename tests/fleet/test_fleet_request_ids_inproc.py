"""Request ids at the fleet's ingress. An id still in flight is refused at once (ConfigError), and an id a
replica's engine has already seen is that replica's "never" -- an answer -- not a failure of the replica:
the ingress used to blame the replica and retry the same refusal for ever (6,722 "failures" in 15 s, the
request never ending)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvledger.errors import ConfigError
from kvledger.runtime.sampling import SamplingParams

from .inproc import fleet_spec, inproc_fleet, shared_tiny_model

HANG_GUARD_S = 60  # a request not ended by then never ends: a hang guard, not a timing


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return shared_tiny_model(tmp_path_factory)


def run(coro: Any) -> None:
    asyncio.run(coro)


def test_an_id_in_flight_is_refused_and_a_finished_id_reused_is_one_answer(model: str) -> None:
    async def go() -> None:
        spec = fleet_spec(model, engine_replicas=1)
        async with inproc_fleet(spec) as (deployment, backend):
            replica = deployment.replicas[0].servable
            engine = replica.engine
            engine.stop()  # paused: the first request stays in flight
            first = backend.submit([1, 2, 3], 2, SamplingParams(temperature=0.0), request_id="same")
            with pytest.raises(ConfigError, match="request id 'same' is already in flight"):
                backend.submit([4, 5, 6], 2, SamplingParams(temperature=0.0), request_id="same")
            engine.start()
            await asyncio.wait_for(asyncio.wait({first.task}), HANG_GUARD_S)
            assert first.task.exception() is None and first.result().finish_reasons == ["length"]
            failures = backend.counters["replica_failures"]

            again = backend.submit([4, 5, 6], 2, SamplingParams(temperature=0.0), request_id="same")
            done, _ = await asyncio.wait({again.task}, timeout=HANG_GUARD_S)
            assert done, "a reused id kept the request retrying"
            assert again.task.exception() is None and again.result().finish_reasons == ["never"]
            assert backend.counters["replica_failures"] == failures  # an answer, not a failure of the replica
            assert backend.running == 0 and replica.door.booked == 0
    run(go())
