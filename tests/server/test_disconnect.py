"""32 concurrent streaming clients, a quarter of them hanging up mid-stream: every other stream gets
exactly the tokens of an undisturbed run, and afterwards the ledger is clean (nothing active, promised
or leased; every conservation law holds).

The clients that hang up ask for far more tokens than the others, so they are certainly still running
when they go: each one must be cancelled in the engine, not run to its end.
"""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.model

CLIENTS = 32
TOKENS = 12
LONG = 400  # what a client that hangs up asks for
SHARED = "You are a terse assistant. Answer in one short sentence. "


def prompts() -> list[str]:
    # Half of them share a system prefix (shared blocks, then cancelled sharers), half are on their own.
    return [(SHARED if i % 2 == 0 else "") + f"Question {i}: what is {i} plus {i}?" for i in range(CLIENTS)]


async def run_all(server, hang_up: set[int]) -> dict[int, str]:  # noqa: ANN001
    client = server.client(async_=True)

    async def one(i: int, prompt: str) -> tuple[int, str]:
        stream = await client.completions.create(model="smollm2-135m", prompt=prompt,
                                                 max_tokens=LONG if i in hang_up else TOKENS,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        text, chunks = "", 0
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            chunks += 1
            if i in hang_up and chunks == 2:
                await stream.close()  # the client goes away mid-stream
                return i, "<hung up>"
        return i, text

    results = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts())])
    await client.close()
    return dict(results)


def test_disconnects_release_blocks_and_leave_others_untouched(server) -> None:
    undisturbed = asyncio.run(run_all(server, set()))
    assert all(undisturbed[i] for i in range(CLIENTS))
    before = server.wait_idle()
    assert before["clean"], before

    hang_up = set(range(0, CLIENTS, 4))
    cancelled_before = metric(server, "kvledger:requests_cancelled_total")
    disturbed = asyncio.run(run_all(server, hang_up))
    for i in range(CLIENTS):
        if i in hang_up:
            assert disturbed[i] == "<hung up>"
        else:
            assert disturbed[i] == undisturbed[i], i

    report = server.wait_idle()
    # /admin/ledger runs every conservation law between two engine steps, then reports.
    assert report["checked"] and report["clean"], report
    assert report["blocks"]["active"] == 0 and report["blocks"]["promised"] == 0
    assert report["blocks"]["leased"] == 0 and report["leases"] == 0
    assert report["gate"] == {"in_flight": 0, "waiting": 0}
    # Each hung-up request was cancelled in the engine (not run to its 400 tokens) and counted as aborted.
    assert metric(server, "kvledger:requests_cancelled_total") - cancelled_before == len(hang_up)
    assert metric(server, "vllm:request_success_total", finished_reason="abort") >= len(hang_up)


def metric(server, name: str, **labels: str) -> float:  # noqa: ANN001
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(server.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0
