"""The lab's hybrid-pool view: global blocks grow with every token, window blocks stay bounded, blocks out of the
window are kept as cache, and a uniform pool would hold more for the same tokens."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

from kvledger.weblab import create_app

CLIENT = TestClient(create_app(), raise_server_exceptions=False)


def test_default_view_global_vs_window_blocks() -> None:
    got = CLIENT.post("/api/views/hybrid", json={})
    assert got.status_code == 200
    res = got.json()
    assert [g["kind"] for g in res["groups"]] == ["sliding"] * 5 + ["full"] and res["group_size"] == 1
    steps = res["steps"]
    assert res["finished"] == ["R0", "R1", "R2", "R3"] and steps[-1]["done"] == 4
    # A window of 32 tokens in blocks of 8 never needs more than ceil((32 - 1 + 32) / 8) + 1 = 9 blocks per sliding
    # group and request; the global group keeps every block (160 tokens: 20 blocks per request).
    assert max(s["sliding"] / (5 * max(1, s["running"])) for s in steps) <= 9
    assert max(s["full"] for s in steps) <= 20 * 4
    peak = res["peak"]
    assert peak["full"] + peak["sliding"] < res["peak_uniform"]
    assert max(s["retained"] for s in steps) > 0  # blocks out of the window stay as cache
    assert all(s["full"] + s["sliding"] + s["retained"] + s["free"] == 192 for s in steps)
    assert steps[0]["waiting"] > 0  # four requests do not all fit at their prefill bound at once


def test_a_request_larger_than_the_pool_and_the_work_bound() -> None:
    res = CLIENT.post("/api/views/hybrid", json={"pool_blocks": 10}).json()
    assert res["steps"] == [] and res["never"].startswith("R0: needs")
    got = CLIENT.post("/api/views/hybrid", json={"requests": 16, "prompt": 4096, "step_tokens": 1})
    assert got.status_code == 422 and "the view runs at most 600" in got.json()["error"]
    got = CLIENT.post("/api/views/hybrid", json={"window": 0})
    assert got.status_code == 422 and got.json()["error"].startswith("window: must be >= 1")


def test_the_heaviest_accepted_input_answers_promptly() -> None:
    body = {"requests": 16, "prompt": 64, "step_tokens": 64, "max_new": 36, "sliding_layers": 128, "full_layers": 1,
            "pool_blocks": 4096, "window": 1, "block_size": 64}
    t0 = time.perf_counter()
    got = CLIENT.post("/api/views/hybrid", json=body)
    assert got.status_code == 200 and len(got.json()["finished"]) == 16
    assert time.perf_counter() - t0 < 5  # about half a second on a quiet core
