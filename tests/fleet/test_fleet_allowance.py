"""The fleet ingress's largest output allowance: the server's default ``max_tokens`` behind a fleet. It is
exactly the boundary of the ingress's own "never" (a replica's pool, the tenant's cap, the model's
context), so a request given it is taken and one token more is refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.core.sizing.geometry import KVSpec
from kvledger.errors import AdmissionError, QuotaError
from kvledger.fleet.serve import FleetBackend, FleetSpec
from kvledger.runtime.sampling import SamplingParams

BS = 4


def _backend(pool: int, max_context: int | None) -> FleetBackend:
    spec = FleetSpec(pool_blocks=pool, block_size=BS, max_running=8, view_key="allowance-test")
    return FleetBackend(None, spec, vocab_size=100, max_context=max_context,
                        kv_spec=KVSpec(layers=1, kv_heads=1, head_dim=4, kv_dtype="fp32", block_size=BS))


@settings(max_examples=150, deadline=None)
@given(prompt_len=st.integers(1, 60), pool=st.integers(1, 40), n=st.integers(1, 4),
       quota=st.none() | st.integers(1, 40), max_context=st.none() | st.integers(2, 120))
def test_the_allowance_is_the_boundary_of_the_ingress_never(prompt_len: int, pool: int, n: int,
                                                           quota: int | None, max_context: int | None) -> None:
    backend = _backend(pool, max_context)
    backend.set_quota("t", quota)
    prompt, params = [1] * prompt_len, SamplingParams(temperature=1.0, n=n)
    try:
        backend.check_request(prompt, 1, params, trust_group="t")
    except (AdmissionError, QuotaError) as exc:
        with pytest.raises(type(exc)):
            backend.largest_allowance(prompt, params, trust_group="t")
        return
    most = backend.largest_allowance(prompt, params, trust_group="t")
    assert most >= 1
    assert backend.check_request(prompt, most, params, trust_group="t")[1] == most
    if max_context is not None and prompt_len + most >= max_context:
        return  # the context, not the pool, is the bound: one more is cut, not refused
    with pytest.raises((AdmissionError, QuotaError)):
        backend.check_request(prompt, most + 1, params, trust_group="t")


def test_refusals_name_what_is_wrong() -> None:
    from kvledger.errors import ConfigError
    from kvledger.placement.score import request_blocks

    for args, what in (((0, 1, 4), "prompt length"), ((1, 0, 4), "max_new_tokens"), ((1, 1, 0), "block size"),
                       ((1, 1, 4, 0), "n")):
        with pytest.raises(ConfigError, match=rf"^{what} must be at least 1$"):
            request_blocks(*args)
    backend = _backend(16, None)
    with pytest.raises(ConfigError, match="cache_salt must be a non-empty string or None"):
        backend.largest_allowance([1, 2, 3], None, trust_group="t", cache_salt="")
    assert backend.largest_allowance([1, 2, 3], None, trust_group="t", cache_salt="s") == 16 * BS - 3
