"""The tiers below the device pool and the transfers between them, as an operator reads them.

``TransferEngine.stats()`` feeds the diagnostics and ``/metrics``: its figures (blocks, bytes and batches per
link, failures by kind, staging, each tier's slots and bytes, the disk tier's compression) are compared here
whole, after transfers whose every figure is known, and every moved block is compared byte for byte. Also
pinned: how global tier slots map to the host and disk stores, the host and disk tiers' byte counters, the
one-tier host swap store's counters and refusals, a step's exposed/hidden time arithmetic, the lost-transfer
bookkeeping the scheduler reads, and the refusals' messages.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from kvledger.core import KVSpec
from kvledger.errors import ConfigError
from kvledger.runtime import KVStore
from kvledger.runtime import transfer as transfer_module
from kvledger.runtime.host_store import BlockRows, FileTier, HostKVStore, MemoryTier, TierStores, codec
from kvledger.runtime.transfer import StepTransfers, TransferEngine
from kvledger.scheduler import StepPlan

SPEC = KVSpec(2, 2, 8, kv_dtype="fp32", block_size=4)  # 2 x 2 x 4 x 2 x 8 x 4 bytes = 1024 per block
BLOCK = 1024


def filled(num_blocks: int = 6, spec: KVSpec = SPEC) -> KVStore:
    """A store whose every block holds a pattern of its own."""
    store = KVStore(spec, num_blocks)
    gen = torch.Generator().manual_seed(7)
    view = store.block_view
    if store.plain:
        view.copy_(torch.randn(view.shape, generator=gen).to(view.dtype))
    else:
        view.copy_(torch.randint(0, 256, view.shape, generator=gen, dtype=torch.uint8))
    return store


def block(store: KVStore, b: int) -> bytes:
    return BlockRows(store).snapshot(b)


class Clock:
    """A ``time`` stand-in whose ``perf_counter`` advances one second per reading: every timed span of the
    transfers is then an exact count of readings, and the figures built from them are known answers."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


def link_figures(engine: TransferEngine) -> dict[str, tuple[int, int, int]]:
    """(blocks, bytes, batches) per link; the seconds are timings and only checked for consistency."""
    out = {}
    for name, link in engine.stats()["links"].items():
        assert link["seconds"] >= 0
        assert link["bandwidth_Bps"] == (link["bytes"] / link["seconds"] if link["seconds"] else None)
        out[name] = (link["blocks"], link["bytes"], link["batches"])
    return out


def test_the_stats_of_known_transfers_are_exactly_what_moved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host slots 0-1, disk slots 2-4 (zlib). Demote 4 blocks (1 host, 3 disk in two staging rounds), move
    one host entry to disk, promote one from each tier, swap one out and in: every figure and byte known
    (on a clock that ticks once per reading, each link's seconds are its batches)."""
    monkeypatch.setattr(transfer_module, "time", Clock())
    store = filled()
    originals = {b: block(store, b) for b in range(6)}
    stores = TierStores(store, ["host", "disk"], [2, 3], disk_dir=tmp_path, compression="zlib")
    engine = TransferEngine(stores, staging_blocks=2, overlap=False)
    assert engine.staging_bytes == 2 * BLOCK and tuple(engine.staging.shape) == (2, BLOCK)
    engine.run_now(StepPlan(1, demote=[(0, 0), (1, 2), (2, 3), (3, 4)]))
    assert link_figures(engine) == {"disk/out": (3, 3 * BLOCK, 1), "host/out": (1, BLOCK, 1)}
    engine.run_now(StepPlan(2, tier_moves=[(0, 2)]))  # host slot 0 (block 0) onto disk slot 2 (block 1's)
    engine.run_now(StepPlan(3, promote=[(2, 5), (3, 4)]))  # disk slots 2 and 3 up into blocks 5 and 4
    assert block(store, 5) == originals[0] and block(store, 4) == originals[2]
    engine.run_now(StepPlan(4, promote=[(4, 1)], writeback=[(2, 1)]))
    assert block(store, 1) == originals[3]
    assert stores.tiers[0].row(1).numpy().tobytes() == originals[2]  # the write-back landed in host slot 1
    engine.run_now(StepPlan(5, swap_in=[(1, 0)]))
    assert block(store, 0) == originals[2]
    stats = engine.stats()
    assert {name: link["seconds"] for name, link in stats["links"].items()} == \
        {"disk/in": 2.0, "disk/move": 1.0, "disk/out": 1.0, "host/in": 1.0, "host/out": 2.0}
    assert link_figures(engine) == {
        "disk/in": (3, 3 * BLOCK, 2), "disk/move": (1, BLOCK, 1), "disk/out": (3, 3 * BLOCK, 1),
        "host/in": (1, BLOCK, 1), "host/out": (2, 2 * BLOCK, 2)}
    assert list(stats["links"]) == sorted(stats["links"])
    disk = stats["tiers"]["disk"]
    assert stats["tiers"]["host"] == {"slots": 2, "bytes": 2 * BLOCK, "block_bytes": BLOCK}
    assert {k: disk[k] for k in ("slots", "bytes", "block_bytes", "compression", "bytes_raw")} == \
        {"slots": 3, "bytes": 3 * BLOCK, "block_bytes": BLOCK, "compression": "zlib", "bytes_raw": 4 * BLOCK}
    assert disk["compression_ratio"] == 4 * BLOCK / disk["bytes_stored"]
    assert {k: stats[k] for k in ("staging_blocks", "staging_bytes", "overlap", "failures", "demotion_failures",
                                  "promotion_failures")} == {
        "staging_blocks": 2, "staging_bytes": 2 * BLOCK, "overlap": False,
        "failures": {"demote": 0, "tier_moves": 0, "writeback": 0, "promote": 0},
        "demotion_failures": 0, "promotion_failures": 0}
    engine.close()


def test_moves_between_tiers_both_ways_and_disk_to_disk_keep_the_bytes(tmp_path: Path) -> None:
    store = filled()
    stores = TierStores(store, ["host", "disk", "disk"], [1, 2, 2], disk_dir=tmp_path)
    engine = TransferEngine(stores, staging_blocks=1, overlap=False)
    engine.run_now(StepPlan(1, demote=[(3, 0), (4, 1)]))
    engine.run_now(StepPlan(2, tier_moves=[(1, 3)]))  # disk to disk, through the staging row
    engine.run_now(StepPlan(3, tier_moves=[(0, 4), (3, 2)]))  # host to disk, disk to disk
    engine.run_now(StepPlan(4, tier_moves=[(4, 0)]))  # disk to host
    assert stores.tiers[0].row(0).numpy().tobytes() == block(store, 3)
    engine.run_now(StepPlan(5, promote=[(2, 0)]))
    assert block(store, 0) == block(store, 4)
    assert link_figures(engine)["disk/move"] == (3, 3 * BLOCK, 2)
    assert link_figures(engine)["host/move"] == (1, BLOCK, 1)
    engine.close()


def test_failed_cache_transfers_are_counted_by_kind_and_the_rest_of_the_step_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = filled()
    stores = TierStores(store, ["host", "disk"], [1, 3], disk_dir=tmp_path)
    engine = TransferEngine(stores, staging_blocks=4, overlap=False)
    disk = stores.tiers[1]
    assert isinstance(disk, FileTier)
    real_write, real_read = disk.write, disk.read
    failing = {1}  # disk-local slots whose writes raise

    def write(slot: int, row: torch.Tensor) -> None:
        if slot in failing:
            raise OSError("No space left on device")
        real_write(slot, row)

    monkeypatch.setattr(disk, "write", write)
    with pytest.raises(OSError, match="No space left on device"):
        engine.run_now(StepPlan(1, demote=[(0, 1), (1, 2), (2, 3)], writeback=[(3, 0)]))
    assert link_figures(engine) == {"disk/out": (2, 2 * BLOCK, 1), "host/out": (1, BLOCK, 1)}
    failing.add(2)
    batch = engine.start(StepPlan(2, writeback=[(4, 2)], tier_moves=[(0, 3)]))
    batch.wait()
    assert batch.error is None
    assert batch.lost == {"demote": [], "tier_moves": [(0, 3)], "writeback": [(4, 2)], "promote": []}
    monkeypatch.setattr(disk, "read", lambda slot, row: (_ for _ in ()).throw(OSError("bad sector")))
    before = block(store, 5)
    batch = engine.start(StepPlan(3, promote=[(1, 5)]))
    assert batch.lost["promote"] == [(1, 5)] and block(store, 5) == before  # nothing half-copied
    stats = engine.stats()
    assert stats["failures"] == {"demote": 1, "tier_moves": 1, "writeback": 1, "promote": 1}
    assert stats["demotion_failures"] == 3 and stats["promotion_failures"] == 1
    monkeypatch.setattr(disk, "read", real_read)
    # A swap is a request's only copy: its failure is the step's error, and nothing after it runs.
    monkeypatch.setattr(disk, "write", lambda slot, row: (_ for _ in ()).throw(OSError("disk gone")))
    batch = engine.start(StepPlan(4, swap_out=[(0, 3)]), inbound_needed=False)
    batch.wait()
    assert isinstance(batch.error, OSError) and str(batch.error) == "disk gone"
    assert engine.stats()["failures"] == stats["failures"]
    engine.close()


def test_a_step_runs_what_it_waits_for_inline_and_queues_the_rest(tmp_path: Path) -> None:
    store = filled()
    stores = TierStores(store, ["host"], [4])
    engine = TransferEngine(stores, overlap=True)
    assert engine.staging_bytes == 0 and engine.stats()["staging_blocks"] == 0  # no disk tier, no staging
    engine.run_now(StepPlan(1, demote=[(1, 0), (2, 1)]))
    want = block(store, 1)
    batch = engine.start(StepPlan(2, promote=[(0, 4)], writeback=[(3, 2)]), inbound_needed=True)
    assert block(store, 4) == want  # the step reads it: copied before start() returns
    assert "kvledger-transfers" in [t.name for t in threading.enumerate()]  # the worker, named in thread dumps
    batch.wait()
    assert batch.done.is_set() and batch.error is None
    assert stores.tiers[0].row(2).numpy().tobytes() == block(store, 3)
    # A step that does not read its incoming block leaves the promotion (alone in phase B) to the worker.
    want = block(store, 2)
    batch = engine.start(StepPlan(3, promote=[(1, 5)]), inbound_needed=False)
    batch.wait()
    assert batch.error is None and block(store, 5) == want
    batch = engine.start(StepPlan(4, swap_in=[(0, 0)]), inbound_needed=False)
    batch.wait()
    assert block(store, 0) == block(store, 1)
    assert TransferEngine.has_work(StepPlan(3)) is False
    assert all(TransferEngine.has_work(StepPlan(3, **{k: [(0, 1)]}))
               for k in ("swap_out", "swap_in", "demote", "tier_moves", "writeback", "promote"))
    engine.close()
    assert engine.stats()["overlap"] is True


class _NotYet:
    """A step's ``done`` event that is not set yet and returns at once when waited on."""

    def is_set(self) -> bool:
        return False

    def wait(self) -> None:
        return None


def test_a_steps_exposed_and_hidden_time_and_its_lost_transfers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer_module, "time", Clock())
    waiting = StepTransfers(StepPlan(8))
    waiting.done = _NotYet()  # type: ignore[assignment]
    waiting.waited_s = 0.5
    assert waiting.wait() == 1.0 and waiting.waited_s == 1.5  # one tick between the two readings, added up
    batch = StepTransfers(StepPlan(9))
    batch.inline_s, batch.worker_s, batch.waited_s = 1.0, 3.0, 0.5
    assert (batch.busy_s, batch.exposed_s, batch.hidden_s) == (4.0, 1.5, 2.5)
    batch.worker_s = 0.25
    assert batch.hidden_s == 0.0
    batch.done.set()
    assert batch.wait() == 0.0 and batch.waited_s == 0.5
    assert batch.take_lost() is None
    first, second = OSError("one"), OSError("two")
    batch.lose("demote", (1, 2), first)
    batch.lose("promote", (3, 4), second)
    batch.lose("demote", (5, 6), second)
    assert batch.lost_error is first and batch.lost_count("demote") == 2 and batch.lost_count("writeback") == 0
    lost = batch.take_lost()
    assert lost is not None and lost.step == 9
    assert (lost.demote, lost.promote, lost.writeback, lost.tier_moves) == ([(1, 2), (5, 6)], [(3, 4)], [], [])
    assert batch.take_lost() is None  # reported once
    batch.lose("writeback", (7, 8), first)
    again = batch.take_lost()
    assert again is not None and (again.writeback, again.demote, again.promote) == ([(7, 8)], [], [])


def test_staging_must_be_a_whole_number_of_rows_within_bounds() -> None:
    stores = TierStores(filled(), ["host"], [1])
    for bad in (0, 4097, True, 2.0):
        with pytest.raises(ConfigError, match=r"^staging_blocks must be an integer in 1\.\.4096, got "):
            TransferEngine(stores, staging_blocks=bad)  # type: ignore[arg-type]
    for good in (1, 4096):
        TransferEngine(stores, staging_blocks=good)


# ---- the tiers' stores -----------------------------------------------------------------------------

def test_global_tier_slots_map_onto_each_tiers_own_slots(tmp_path: Path) -> None:
    stores = TierStores(filled(), ["host", "disk"], [2, 3], disk_dir=tmp_path)
    assert [(stores.tier_name(s), stores.locate(s)[1]) for s in range(5)] == \
        [("host", 0), ("host", 1), ("disk", 0), ("disk", 1), ("disk", 2)]
    assert stores.num_blocks == 5 and stores.nbytes == 5 * BLOCK and stores.host is stores.tiers[0]
    for bad in (-1, 5):
        with pytest.raises(ConfigError, match=rf"^tier slot {bad} is outside \[0, 5\)$"):
            stores.locate(bad)
    stores.close()
    empty_host = TierStores(filled(), ["host", "disk"], [0, 2], disk_dir=tmp_path)
    assert [empty_host.locate(s)[0].kind for s in (0, 1)] == ["disk", "disk"] and empty_host.host is not None
    empty_host.close()
    disk_only = TierStores(filled(), ["disk"], [2], disk_dir=tmp_path)
    assert disk_only.host is None and disk_only.stats() == {"disk": {
        "slots": 2, "bytes": 2 * BLOCK, "block_bytes": BLOCK, "compression": "none", "bytes_raw": 0,
        "bytes_stored": 0, "compression_ratio": None}}
    disk_only.close()
    with pytest.raises(ConfigError, match=r"^no byte store for a tier named 'ssd' \(host, disk\)$"):
        TierStores(filled(), ["host", "ssd"], [1, 1])


def test_the_host_tier_counts_the_bytes_it_moves_and_hands_out_its_rows_in_place() -> None:
    tier = MemoryTier(3, 16)
    assert tier.nbytes == 48 and tier.kind == "host" and not tier.data.is_pinned()
    tier.write(2, torch.arange(16, dtype=torch.uint8))
    assert tier.row(2).tolist() == list(range(16)) and tier.row(2).data_ptr() == tier.data[2].data_ptr()
    out = torch.zeros(16, dtype=torch.uint8)
    tier.read(2, out)
    tier.read(2, out)
    assert out.tolist() == list(range(16)) and (tier.bytes_written, tier.bytes_read) == (16, 32)
    assert MemoryTier(0, 16).nbytes == 0


@pytest.mark.parametrize("compression", ["none", "zlib"])
def test_the_disk_tier_stores_each_block_raw_or_smaller_and_reads_it_back(tmp_path: Path, compression: str) -> None:
    tier = FileTier(3, 4096, directory=tmp_path, compression=compression)
    assert tier.kind == "disk" and tier.nbytes == 3 * 4096 and tier.ratio is None
    assert tier.path.startswith(str(tmp_path / "kvledger-tier-")) and tier.path.endswith(".kv (unlinked)")
    assert not list(tmp_path.iterdir())  # unlinked at once: nothing left behind
    noise = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    zeros = torch.zeros(4096, dtype=torch.uint8)
    tier.write(2, noise)  # incompressible: stored raw either way
    tier.write(0, zeros)
    small = compression == "zlib"
    assert int(tier.stored[2]) == 4096 and (int(tier.stored[0]) < 100 if small else int(tier.stored[0]) == 4096)
    out = torch.ones(4096, dtype=torch.uint8)
    tier.read(0, out)
    assert not out.any()
    tier.read(2, out)
    assert torch.equal(out, noise)
    stored = 4096 + int(tier.stored[0])
    assert (tier.bytes_raw, tier.bytes_stored, tier.bytes_read) == (8192, stored, stored)
    assert tier.ratio == 8192 / stored
    tier.close()
    assert tier.fd == -1


def test_tier_sizes_and_codecs_are_refused_by_name() -> None:
    for slots, size, what in ((-1, 8, "slots >= 0, got -1"), (True, 8, "slots >= 0, got True"),
                              (2, -8, "block bytes >= 0, got -8"), (2, 8.0, "block bytes >= 0, got 8.0")):
        for tier in (MemoryTier, FileTier):
            with pytest.raises(ConfigError, match=rf"^a tier needs {what}$"):
                tier(slots, size)  # type: ignore[arg-type]
    for bad in ("gzip", None, ["zlib"]):
        with pytest.raises(ConfigError, match=r"^unknown tier compression .*; known: none, zlib$"):
            codec(bad)  # type: ignore[arg-type]
    assert codec("zlib").decode(codec("zlib").encode(b"abc" * 100)) == b"abc" * 100
    assert codec("none").encode(memoryview(b"xy")) == b"xy"


@pytest.mark.parametrize("fmt", ["bf16", "int8-token", "int8", "int4"])
def test_a_block_as_bytes_is_every_layer_and_an_open_blocks_residual_page(fmt: str) -> None:
    """int8 and int4 keep an open block's rows in a residual page, which travels with the block's bytes."""
    spec = KVSpec(2, 2, 8, kv_dtype=fmt, block_size=4, residual_dtype="fp32" if fmt in ("int8", "int4") else None)
    store = KVStore(spec, 4)
    rows = BlockRows(store)
    if fmt in ("int8", "int4"):
        page = 2 * 2 * 4 * 2 * 8 * 4
        assert rows.flag_offset == -(-spec.block_bytes // 8) * 8 and rows.nbytes == rows.flag_offset + 8 + page
        k = torch.randn(3, 2, 8)
        for layer in range(2):
            store.write(layer, [4, 5, 6], k, -k)  # block 1 open with 3 rows
        snap = rows.snapshot(1)
        assert snap[rows.flag_offset] == 1 and rows.snapshot(2)[rows.flag_offset] == 0
        store.attach(1, None)  # sealed
        target = torch.frombuffer(bytearray(snap), dtype=torch.uint8)
        rows.write(3, target)
        assert int(store.res_map[3]) >= 0
        got_k, got_v = store.read(1, torch.tensor([12, 13, 14]), torch.float32)
        assert torch.equal(got_k, k) and torch.equal(got_v, -k)
    else:
        assert rows.nbytes == spec.block_bytes
    store.block_tensors = lambda: [(store.kv, store.block_dim), (torch.zeros(3, 2), 0)]  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"^a block tensor has 3 blocks on dim 0, the store 4$"):
        BlockRows(store)


# ---- the one-tier host swap store ------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["fp16", "int4"])
def test_the_host_swap_store_counts_its_copies_and_brings_blocks_back_exactly(fmt: str) -> None:
    spec = KVSpec(2, 2, 8, kv_dtype=fmt, block_size=4, residual_dtype="fp32" if fmt == "int4" else None)
    store = KVStore(spec, 4)
    k = torch.randn(14, 2, 8)
    for layer in range(2):
        store.write(layer, list(range(14)), k, k * 2)  # int4: block 3 open with 2 rows
    before = [store.read(layer, torch.arange(16), torch.float32) for layer in range(2)]
    host = HostKVStore(store, 5)
    base = 5 * spec.block_bytes
    assert host.nbytes == base and host.blocks_out == host.blocks_in == 0
    host.swap_out([])
    host.swap_out([(2, 4), (3, 0), (0, 1), (1, 2)])
    assert host.blocks_out == 4
    page = 2 * 2 * 4 * 2 * 8 * 4
    assert host.nbytes == base + (page if fmt == "int4" else 0)
    store.kv.zero_()
    host.swap_in([(4, 2), (0, 3), (1, 0), (2, 1)])
    host.swap_in([])
    assert host.blocks_in == 4
    for layer in range(2):
        got = store.read(layer, torch.arange(16), torch.float32)
        assert torch.equal(got[0], before[layer][0]) and torch.equal(got[1], before[layer][1])
    host.swap_out([(0, 0)])  # a sealed block over host block 0 drops the residual it held
    assert host.nbytes == base and host.blocks_out == 5
    with pytest.raises(ConfigError, match=r"^device block ids must be in \[0, 4\), got 1\.\.4$"):
        host.swap_out([(1, 0), (4, 1)])
    with pytest.raises(ConfigError, match=r"^host block ids must be in \[0, 5\), got 5\.\.5$"):
        host.swap_in([(5, 0)])
    with pytest.raises(ConfigError, match=r"^device block ids must be in \[0, 4\), got -1\.\.-1$"):
        host.swap_in([(0, -1)])
    for bad in (-1, True, 1.0):
        with pytest.raises(ConfigError, match=r"^the host store needs a block count >= 0, got "):
            HostKVStore(store, bad)  # type: ignore[arg-type]
    assert HostKVStore(store, 0).nbytes == 0
