"""The ledger's refusals of bad arguments: each names the argument and quotes what it got (block size, pool
size, cache context, leases, beam steps, tenant statistics, keep_free) before anything changes."""

from __future__ import annotations

import pytest

from kvledger.core.ledger import KVLedger, Request
from kvledger.errors import ConfigError

BS = 4


def toks(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def test_a_bad_block_size_names_the_block_size() -> None:
    with pytest.raises(ConfigError, match="block size"):
        KVLedger(8, "four")  # type: ignore[arg-type]


def test_beam_step_refuses_what_is_not_pairs_with_its_message() -> None:
    led = KVLedger(8, BS)
    with pytest.raises(ConfigError, match=r"^beam_step takes \(parent, child\) pairs and a list of dropped ids$"):
        led.beam_step([("a",)], [])  # type: ignore[list-item]


def test_lease_names_the_argument_that_is_not_a_collection() -> None:
    led = KVLedger(8, BS)
    with pytest.raises(ConfigError, match="lease request_ids must be a collection"):
        led.lease(request_ids="a")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="lease blocks must be a collection"):
        led.lease(blocks=3)  # type: ignore[arg-type]


def test_tenant_stats_says_what_it_needs() -> None:
    with pytest.raises(ConfigError, match=r"tenant_stats needs a trust group name \(str\), got None"):
        KVLedger(8, BS).tenant_stats(None)  # type: ignore[arg-type]


def test_promote_from_tiers_names_keep_free() -> None:
    led = KVLedger(5, BS)
    with pytest.raises(ConfigError, match="keep_free"):
        led.promote_from_tiers(Request("c", toks(8, 0), 1), owner="x", keep_free=-1)


def test_the_largest_supported_pool_is_accepted_and_one_more_block_is_refused() -> None:
    """The refusal quotes the supported maximum (2**24 blocks); a pool of exactly that many blocks is a
    pool the ledger promises to manage (about 1.3 GB of bookkeeping, a second or two), one more is not.
    (Seed 2 of the sample: the bound as ``>=`` refused the documented maximum.)"""
    from kvledger.core.ledger import MAX_POOL_BLOCKS

    assert MAX_POOL_BLOCKS == 2**24
    with pytest.raises(ConfigError, match="beyond the supported 16,777,216"):
        KVLedger(MAX_POOL_BLOCKS + 1, BS)
    led = KVLedger(MAX_POOL_BLOCKS, BS)
    assert led.stats()["usage"]["total"] == MAX_POOL_BLOCKS
    del led


def test_a_request_whose_context_is_not_a_cache_context_quotes_what_it_got() -> None:
    """A trust group passed where the context goes (a common slip) is refused with the value shown, so
    the caller sees what went wrong. (Seed 3 of the sample: the message quoted None instead.)"""
    with pytest.raises(ConfigError, match=r"^request 'a': context must be a CacheContext, got 'tenant-a'$"):
        Request("a", [1, 2, 3], 1, "tenant-a")  # type: ignore[arg-type]
