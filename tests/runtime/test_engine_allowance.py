"""The engine's largest output allowance (the server's default ``max_tokens``), on a tiny random Llama:
the most ``check_request`` accepts, cut by the pool, the tenant's quota, the branches and the model's
context, and one token more is "never"."""

from __future__ import annotations

import pytest

from kvledger.errors import AdmissionError, QuotaError
from kvledger.runtime.engine import Engine
from kvledger.runtime.sampling import SamplingParams

BS = 4
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32]  # 9 tokens: 2 full blocks and a partial tail


@pytest.fixture(scope="module")
def engine(tiny_llama) -> Engine:
    return Engine.from_model(tiny_llama[0], block_size=BS, num_blocks=40, max_context=120)


def test_the_pool_bounds_it(engine: Engine) -> None:
    assert engine.largest_allowance(PROMPT) == 111  # the context (120) binds before the pool (160 tokens)
    engine.check_request(PROMPT, 111)


def test_branches_and_a_quota_bound_it(engine: Engine) -> None:
    # n=3 on 40 blocks: the longest branch covers (40 + 2 * 2) // 3 = 14 blocks = 56 tokens -> 47 new
    params = SamplingParams(temperature=1.0, n=3)
    assert engine.largest_allowance(PROMPT, params) == 47
    engine.check_request(PROMPT, 47, params)
    with pytest.raises(AdmissionError, match="the KV pool is too small"):
        engine.check_request(PROMPT, 48, params)
    engine.set_quota("acme", 10)
    try:
        assert engine.largest_allowance(PROMPT, trust_group="acme") == 31  # 10 blocks of 4, 9 in the prompt
        engine.check_request(PROMPT, 31, trust_group="acme")
        with pytest.raises(QuotaError):
            engine.check_request(PROMPT, 32, trust_group="acme")
        engine.set_quota("acme", 2)  # the prompt alone needs 3 blocks: not one token fits
        with pytest.raises(QuotaError, match="larger than its trust group's quota"):
            engine.largest_allowance(PROMPT, trust_group="acme")
    finally:
        engine.set_quota("acme", None)
