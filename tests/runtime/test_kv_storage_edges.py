"""The edges of the runtime's KV storage (``kv_store``, ``kv_quant``, ``host_store``, ``transfer``,
``attention``): errors that name what is wrong, tiers' folders and closing, a transfer's report. Each test
was written against a surviving mutant of a ``tests/mutation.py sample --per-package`` run (docs/testing.md,
"Mutation testing") and asserts a behaviour a user would notice."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from kvledger.core import KVSpec
from kvledger.errors import ConfigError
from kvledger.runtime import KVStore
from kvledger.runtime.host_store import FileTier, HostKVStore, TierStores
from kvledger.runtime.kv_store import torch_dtype
from kvledger.runtime.transfer import TransferEngine
from kvledger.scheduler import StepPlan


def test_a_kv_dtype_without_plain_storage_is_one_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"^KV dtype 'int4' has no plain torch storage \(plain: "):
        torch_dtype("int4")


def test_gather_dequantises_a_quantised_pool_to_float32_by_default() -> None:
    store = KVStore(KVSpec(2, 2, 16, kv_dtype="int8", block_size=4), 4)
    k, v = store.gather(0, [1, 2])
    assert k.dtype == v.dtype == torch.float32 and k.shape == (8, 2, 16)


def test_a_pool_without_residual_pages_has_no_open_blocks() -> None:
    assert KVStore(KVSpec(2, 2, 16, kv_dtype="fp16", block_size=4), 4).open_blocks() == 0


def test_a_bad_host_block_id_is_named_as_a_host_id() -> None:
    host = HostKVStore(KVStore(KVSpec(2, 2, 16, kv_dtype="fp32", block_size=4), 4), 2)
    with pytest.raises(ConfigError, match=r"^host block ids must be in \[0, 2\), got 5\.\.5$"):
        host.swap_out([(0, 5)])


def test_a_disk_tier_lives_in_the_folder_it_is_given_else_in_the_temporary_folder(tmp_path: Path) -> None:
    mine = FileTier(2, 64, directory=tmp_path)
    default = FileTier(2, 64)
    try:
        assert mine.path.startswith(str(tmp_path / "kvledger-tier-"))
        assert default.path.startswith(str(Path(tempfile.gettempdir()) / "kvledger-tier-"))
    finally:
        mine.close()
        default.close()


def test_closing_a_disk_tier_twice_closes_nothing_else(tmp_path: Path) -> None:
    saved = os.dup(1)  # the process's stdout, restored whatever happens
    try:
        tier = FileTier(2, 64, directory=tmp_path)
        tier.close()
        tier.close()  # and once more when it is collected
        os.fstat(1)  # still open: a second close must not close another file's descriptor
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def test_a_transfer_run_reports_its_time_and_each_links_blocks_and_bandwidth(tmp_path: Path) -> None:
    store = KVStore(KVSpec(2, 2, 8, kv_dtype="fp32", block_size=4), 4)
    stores = TierStores(store, ["host", "disk"], [2, 4], disk_dir=tmp_path)
    engine = TransferEngine(stores, staging_blocks=1, overlap=False)
    # Two blocks to host slots 0-1, three to disk slots 2-4 (one staging row: three staging rounds).
    batch = engine.run_now(StepPlan(1, demote=[(0, 0), (1, 1), (2, 2), (3, 3), (0, 4)]))
    assert 0 <= batch.inline_s < 600  # seconds this step waited, not a clock reading
    links = engine.stats()["links"]
    assert {name: link["blocks"] for name, link in links.items()} == {"host/out": 2, "disk/out": 3}
    assert all("bandwidth_Bps" in link for link in links.values())


def test_a_disk_tier_makes_the_folders_it_is_given(tmp_path: Path) -> None:
    tier = FileTier(2, 64, directory=tmp_path / "not" / "yet")
    try:
        assert (tmp_path / "not" / "yet").is_dir()
    finally:
        tier.close()


def test_a_write_to_a_slot_past_the_pool_is_refused() -> None:
    store = KVStore(KVSpec(2, 2, 16, kv_dtype="int4", block_size=4, residual_dtype="fp32"), 4, residual_slots=4)
    with pytest.raises(ConfigError, match=r"^slots must be in \[0, 16\), got 15\.\.16$"):
        store.begin_write([15, 16])
