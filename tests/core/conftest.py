"""Fixtures shared by the core's tests (the ledger's and the sizing planner's)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import ModuleType

import pytest

from kvledger.core import native
from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Request

# The core's test modules that never reach the ledger core's C part (kvledger.core._native): the sizing
# planner's, the catalogues', the block table's and the identity's value encoding. On either core they run
# the same code, so test_native_core.py's pure-Python pass leaves them out; the tripwire below fails any of
# their tests that reads the C part (and that pass refuses a listed module that starts a subprocess, which
# the tripwire cannot see), so a module cannot stay listed once it exercises code with a native twin.
NO_NATIVE_TWIN = frozenset({
    "test_checks.py", "test_geometry.py", "test_gpu_catalogue.py", "test_identity_encoding.py", "test_inventory.py",
    "test_measured_peaks.py", "test_plan.py", "test_registries.py", "test_table.py", "test_vllm_kv_formats.py",
    "test_weights.py",
})


class _Tripwire(ModuleType):
    """The C part, as ``native.MODULE``, noting each of its names that is read (then reading it)."""

    def __init__(self, real: ModuleType, read: list[str]) -> None:
        super().__init__(real.__name__)
        object.__setattr__(self, "_real_and_read", (real, read))

    def __getattribute__(self, name: str) -> object:
        if name in ("_real_and_read", "__class__"):
            return object.__getattribute__(self, name)
        real, read = object.__getattribute__(self, "_real_and_read")
        read.append(name)
        return getattr(real, name)


@pytest.fixture(autouse=True)
def _no_native_twin_tripwire(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """In a module of ``NO_NATIVE_TWIN``, a test that reaches the C part fails (in its teardown)."""
    if request.path.name not in NO_NATIVE_TWIN or native.MODULE is None:
        yield
        return
    read: list[str] = []
    monkeypatch.setattr(native, "MODULE", _Tripwire(native.MODULE, read))
    yield
    assert not read, (f"{request.path.name} reaches the ledger core's C part (kvledger.core._native."
                      f"{read[0]}): take it off NO_NATIVE_TWIN in tests/core/conftest.py so that the "
                      "pure-Python pass of test_native_core.py runs it")


@pytest.fixture()
def no_native_twin() -> frozenset[str]:
    """The names of the core's test modules that never reach the C part (``NO_NATIVE_TWIN``)."""
    return NO_NATIVE_TWIN


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
