"""The ingress backend's own bounds, no cluster: a request of exactly as many branches as a replica runs at
once is taken (one more is "never"), and its audit is clean only with nothing running and no handle open."""

from __future__ import annotations

import pytest

from kvledger.core.sizing.geometry import KVSpec
from kvledger.errors import AdmissionError
from kvledger.fleet.serve import FleetBackend, FleetSpec
from kvledger.runtime.sampling import SamplingParams

BS = 4


def _backend() -> FleetBackend:
    spec = FleetSpec(pool_blocks=64, block_size=BS, max_running=4, view_key="bounds-test")
    return FleetBackend(None, spec, vocab_size=100, max_context=200,
                        kv_spec=KVSpec(layers=1, kv_heads=1, head_dim=4, kv_dtype="fp32", block_size=BS))


def test_exactly_max_num_seqs_branches_fit_and_one_more_never_does() -> None:
    backend = _backend()
    ids, max_new, _ = backend.check_request([1, 2], 1, SamplingParams(temperature=1.0, n=4), trust_group="t")
    assert (ids, max_new) == ([1, 2], 1)
    with pytest.raises(AdmissionError, match="at once"):
        backend.check_request([1, 2], 1, SamplingParams(temperature=1.0, n=5), trust_group="t")


def test_the_audit_is_clean_only_with_nothing_running() -> None:
    backend = _backend()
    assert backend.audit()["clean"] is True
    backend.running = 1  # a replica accepted a request that has not ended
    audit = backend.audit()
    assert audit["clean"] is False and audit["running"] == 1


def test_the_ingress_names_a_quantised_kv_format_as_the_engines_do() -> None:
    """The router's digests must equal the replicas' ledgers', so the ingress builds each context from the
    engines' KV spec: the exact format id (scales and groups included), not the format's bare name."""
    from kvledger.core.identity import CacheContext

    spec = FleetSpec(pool_blocks=64, block_size=BS, max_running=4, view_key="int8-identity")
    kv = KVSpec(layers=1, kv_heads=1, head_dim=4, kv_dtype="int8", block_size=BS)
    backend = FleetBackend(None, spec, vocab_size=100, max_context=200, kv_spec=kv)
    ctx = backend.check_request([1, 2, 3], 1, trust_group="t", cache_salt="s")[2]
    assert ctx.kv_dtype == kv.kv_format_id != "int8"
    assert ctx.root_digest() == kv.cache_context("t", spec.model, "s").root_digest()
    assert ctx.root_digest() != CacheContext(trust_group="t", model=spec.model, kv_dtype="int8",
                                             extra=(("cache_salt", "s"),)).root_digest()
