"""The ingress's replica calls in the background (its news poll): bounded in time, and a stop never waits
for a call that is slow to unwind (under load, a call still inside Ray's router ignored its cancellation
for longer than the 30 s the stop test allows)."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("ray")

from kvledger.fleet.serve import _ask  # noqa: E402


async def _stubborn(unwind_s: float) -> str:
    """A call that takes its time to unwind when cancelled (as a call being routed may)."""
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        await asyncio.sleep(unwind_s)
        raise
    return "late"


def test_a_cancelled_ask_returns_at_once_and_cancels_its_call() -> None:
    async def go() -> tuple[float, bool]:
        call = asyncio.ensure_future(_stubborn(5.0))
        asker = asyncio.ensure_future(_ask(call, 30))
        await asyncio.sleep(0.05)
        start = time.monotonic()
        asker.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asker
        took = time.monotonic() - start
        cancelling = call.cancelling() > 0
        call.cancel()
        return took, cancelling

    took, cancelling = asyncio.run(go())
    assert took < 1.0  # asyncio.wait_for would have waited the call's 5 s unwinding
    assert cancelling


def test_an_ask_past_its_time_is_a_timeout_and_an_answer_in_time_is_returned() -> None:
    async def answer() -> str:
        await asyncio.sleep(0.01)
        return "news"

    async def go() -> str:
        with pytest.raises(TimeoutError):
            await _ask(_stubborn(0.0), 0.05)
        return await _ask(answer(), 5)

    assert asyncio.run(go()) == "news"
