"""Fixtures shared by the core's tests (the ledger's and the sizing planner's)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Request


@pytest.fixture()
def tiny_dense() -> dict:
    """A tiny Llama-shaped decoder config, small enough to count every tensor by hand. It has no
    ``tie_word_embeddings`` key, so the model type decides: without one (as here) the model has its own
    lm_head; ``{**tiny_dense, "model_type": "gemma"}`` shares the embedding. A fresh dict per test."""
    return {"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 10, "num_attention_heads": 2,
            "num_key_value_heads": 2, "intermediate_size": 12}


def _run_once(led: KVLedger, rid: str, prompt: list[int], **kw: object) -> None:
    assert led.admit(Request(rid, prompt, 0, **kw)).admitted  # type: ignore[arg-type]
    led.mark_computed(rid, len(prompt))
    led.release(rid)
    led.check()


@pytest.fixture()
def run_once() -> Callable[..., None]:
    """``run_once(led, rid, prompt, **request_fields)``: admit the prompt with no output, compute all of it,
    release it, audit: its full blocks stay behind as retained cache."""
    return _run_once


@pytest.fixture()
def grow_into_a_full_pool() -> Callable[[KVLedger], None]:
    """``grow_into_a_full_pool(led)`` on a 4-block pool of 4-token blocks whose other blocks hold retained
    cache: request x takes the two free blocks and is promised two more; its decode then opens blocks 3 and 4
    with ``allocate`` one at a time, each evicting one retained block (x is left holding the whole pool)."""

    def grow(led: KVLedger) -> None:
        assert led.admit(Request("x", list(range(500, 508)), 8)).admitted
        for t in range(8):
            led.append_token("x", 600 + t)
            led.check()
        assert led.usage().free == 0 and len(led.sequence("x").table.blocks) == 4

    return grow


@pytest.fixture()
def run_in_group() -> Callable[..., None]:
    """``run_in_group(led, rid, prompt, group="default")``: admit the prompt for one output token in that
    trust group, compute all of it and release it (no audit): its full blocks stay behind as the group's
    retained cache."""

    def run(led: KVLedger, rid: str, prompt: list[int], group: str = "default") -> None:
        assert led.admit(Request(rid, prompt, 1, CacheContext(trust_group=group))).admitted
        led.mark_computed(rid, len(prompt))
        led.release(rid)

    return run
