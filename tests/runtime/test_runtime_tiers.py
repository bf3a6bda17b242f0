"""The tiers' bytes and the transfer worker: swaps and promotions are bit-identical for every KV dtype,
through host memory, a disk file and zlib; the engine generates exactly what it generates without tiers;
a failed transfer of the prefix cache loses only cache entries and leaves no bytes anyone could be served;
staging is counted."""

from __future__ import annotations

import os

import pytest
import torch

from kvledger.core import KVSpec
from kvledger.core.tiers import TierLedger
from kvledger.errors import ConfigError
from kvledger.runtime import KVStore
from kvledger.runtime.engine import Engine
from kvledger.runtime.host_store import CODECS, BlockRows, FileTier, MemoryTier, TierStores
from kvledger.runtime.transfer import TransferEngine
from kvledger.scheduler import SchedulerConfig, StepPlan

BS = 4
NEW = 8


def filled(spec: KVSpec, blocks: int, seed: int = 0) -> KVStore:
    """A store whose every byte is random (NaN and inf bit patterns included for floats)."""
    store = KVStore(spec, blocks)
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (store.nbytes,), dtype=torch.uint8, generator=gen)
    store.kv.view(-1).view(torch.uint8).copy_(raw) if store.kv.element_size() == 1 else \
        store.kv.view(torch.uint8).view(-1).copy_(raw)
    return store


def block_bytes(store: KVStore, block: int) -> bytes:
    return BlockRows(store).snapshot(block)


SPECS = [KVSpec(3, 2, 8, kv_dtype=d, block_size=BS) for d in ("fp32", "bf16", "fp16", "fp8-scaled")]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kv_dtype)
@pytest.mark.parametrize("tiers,compression", [([("host", 6)], "none"), ([("disk", 6)], "none"),
                                               ([("disk", 6)], "zlib"), ([("host", 2), ("disk", 4)], "zlib")],
                         ids=["host", "disk", "disk-zlib", "host+disk"])
def test_swap_out_and_in_is_bit_identical(spec: KVSpec, tiers, compression: str, tmp_path) -> None:
    store = filled(spec, 8)
    before = {b: block_bytes(store, b) for b in range(8)}
    names, sizes = [n for n, _ in tiers], [s for _, s in tiers]
    stores = TierStores(store, names, sizes, disk_dir=tmp_path, compression=compression)
    engine = TransferEngine(stores, staging_blocks=2)  # 5 blocks: three staging rounds on disk
    out = StepPlan(0, swap_out=[(b, s) for s, b in enumerate((1, 3, 4, 6, 7))])
    batch = engine.start(out, inbound_needed=False)  # swap-outs go to the worker
    batch.wait()
    assert batch.error is None and batch.worker_s > 0  # the worker ran them (worker_s stays 0 otherwise)
    store.kv.zero_()  # the device blocks are reused by others meanwhile
    back = StepPlan(1, swap_in=[(s, d) for s, d in enumerate((0, 2, 5, 1, 3))])  # other device blocks
    engine.run_now(back)
    for (s, b), d in zip(enumerate((1, 3, 4, 6, 7)), (0, 2, 5, 1, 3), strict=True):
        assert block_bytes(store, d) == before[b], f"slot {s}: block {b} came back as {d} with other bytes"
    engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA transfer path needs a GPU")
def test_the_cuda_path_uses_pinned_buffers_and_a_copy_stream_and_is_bit_identical(tmp_path) -> None:
    spec = KVSpec(3, 2, 8, kv_dtype="bf16", block_size=BS)
    cpu = filled(spec, 8, seed=5)
    store = KVStore(spec, 8, device="cuda")
    store.kv.copy_(cpu.kv)
    before = {b: block_bytes(cpu, b) for b in range(8)}
    stores = TierStores(store, ["host", "disk"], [2, 4], disk_dir=tmp_path, compression="zlib")
    engine = TransferEngine(stores, staging_blocks=2)
    assert engine.cuda and engine.stream is not None
    assert stores.host.data.is_pinned() and engine.staging.is_pinned()
    batch = engine.start(StepPlan(0, swap_out=[(b, s) for s, b in enumerate((1, 3, 4, 6, 7, 0))]), inbound_needed=False)
    batch.wait()
    assert batch.error is None
    store.kv.zero_()  # the compute stream overwrites the blocks; the copy stream must have read them first
    engine.start(StepPlan(1, swap_in=[(s, d) for s, d in enumerate((7, 6, 5, 4, 3, 2))]))  # needed: inline
    for (s, b), d in zip(enumerate((1, 3, 4, 6, 7, 0)), (7, 6, 5, 4, 3, 2), strict=True):
        assert BlockRows(store).snapshot(d) == before[b], f"slot {s}: block {b} came back as {d} with other bytes"
    engine.close()


def test_a_store_with_more_per_block_tensors_moves_them_all(tmp_path) -> None:
    """A format that keeps scales beside the values names both in ``block_tensors()``: a tier moves the
    block's whole byte layout."""
    spec = KVSpec(2, 2, 8, kv_dtype="bf16", block_size=BS)
    store = filled(spec, 4)
    scales = torch.randn(spec.layers, 2, 4, 2)  # [layers, K/V, blocks, heads]
    store.block_tensors = lambda: [(store.kv, 2), (scales, 2)]  # type: ignore[attr-defined]
    bb = BlockRows(store)
    assert bb.nbytes == spec.block_bytes + spec.layers * 2 * 2 * 4
    stores = TierStores(store, ["disk"], [4], disk_dir=tmp_path)
    engine = TransferEngine(stores, staging_blocks=1)
    want = (block_bytes(store, 1), scales[:, :, 1].clone())
    engine.run_now(StepPlan(0, swap_out=[(1, 0)]))
    store.kv.zero_()
    scales.zero_()
    engine.run_now(StepPlan(1, swap_in=[(0, 3)]))
    assert block_bytes(store, 3)[: spec.block_bytes] == want[0][: spec.block_bytes]
    assert torch.equal(scales[:, :, 3], want[1])
    engine.close()


def test_moves_between_tiers_keep_the_bytes(tmp_path) -> None:
    spec = KVSpec(2, 2, 8, kv_dtype="bf16", block_size=BS)
    store = filled(spec, 4, seed=3)
    want = block_bytes(store, 2)
    stores = TierStores(store, ["host", "disk"], [1, 2], disk_dir=tmp_path, compression="zlib")
    engine = TransferEngine(stores, staging_blocks=1)
    engine.run_now(StepPlan(0, demote=[(2, 0)]))  # device -> host slot 0
    engine.run_now(StepPlan(1, tier_moves=[(0, 2)]))  # host slot 0 -> disk slot 2 (global)
    store.kv.zero_()
    stores.host.data.zero_()
    engine.run_now(StepPlan(2, promote=[(2, 1)]))
    assert block_bytes(store, 1) == want
    assert engine.stats()["links"]["disk/move"]["blocks"] == 1
    engine.close()


def test_codecs_are_lossless_and_zlib_measures_its_ratio(tmp_path) -> None:
    data = bytes(range(256)) * 64
    for c in CODECS.values():
        assert c.decode(c.encode(data)) == data
    tier = FileTier(2, len(data), tmp_path, "zlib")
    row = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    tier.write(1, row)
    assert tier.ratio is not None and tier.ratio > 10  # a repeating pattern compresses well
    out = torch.zeros(len(data), dtype=torch.uint8)
    tier.read(1, out)
    assert out.numpy().tobytes() == data
    assert not any(p.name.startswith("kvledger-tier-") for p in tmp_path.iterdir())  # unlinked at once
    tier.close()
    with pytest.raises(ConfigError, match="unknown tier compression"):
        FileTier(1, 8, tmp_path, "lz77")
    with pytest.raises(ConfigError, match="cannot create the disk tier"):
        FileTier(1, 8, "/proc/kvledger-no-such-dir")
    with pytest.raises(ConfigError):
        MemoryTier(-1, 8)
    with pytest.raises(ConfigError, match="staging_blocks"):
        TransferEngine(TierStores(KVStore(SPECS[0], 2), ["host"], [1]), staging_blocks=0)


# ---- the engine with tiers, on a tiny random Llama ------------------------------------------------------


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    heads = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 13)]
    return [heads[i % 2] + torch.randint(0, 256, (1 + (3 * i) % 5,), generator=gen).tolist() for i in range(count)]


@torch.no_grad()
def dense_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    x = torch.tensor([prompt])
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def refs(tiny_llama):
    path, hf = tiny_llama
    prompts = _prompts(12)
    return path, prompts, [dense_greedy(hf, p, NEW) for p in prompts]


def assert_clean(engine: Engine) -> None:
    engine.check()
    u = engine.ledger.usage()
    assert (u.active, u.promised, u.sequences, u.deferred) == (0, 0, 0, 0), u
    assert engine.ledger.outstanding_leases() == 0
    assert engine.scheduler.host.counts["held"] == 0 and engine.scheduler.host.counts["draining"] == 0


SWAP = SchedulerConfig(policy="incremental", on_growth_failure="preempt", recovery="swap")


@pytest.mark.parametrize("tiers", [dict(disk_blocks=64), dict(host_blocks=4, disk_blocks=64, tier_compression="zlib")],
                         ids=["disk", "host+disk-zlib"])
def test_swapping_to_disk_generates_exactly_the_dense_tokens(refs, tiers, tmp_path) -> None:
    path, prompts, want = refs
    engine = Engine.from_model(path, num_blocks=14, block_size=BS, scheduler_config=SWAP, disk_dir=tmp_path,
                               staging_blocks=2, **tiers)
    results = engine.generate(prompts, NEW)
    assert [r.output for r in results] == want
    s = engine.stats
    assert s.swapped_out_blocks > 0 and s.swapped_in_blocks > 0
    assert s.transfer_s > 0 and s.transfer_hidden_s <= s.transfer_s
    links = engine.summary()["transfers"]["links"]
    assert links["disk/out"]["blocks"] > 0 and links["disk/in"]["blocks"] > 0
    assert_clean(engine)
    engine.close()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("restore_ahead", [False, True])
def test_offloaded_prefixes_come_back_and_generate_the_same_tokens(refs, tmp_path, overlap: bool,
                                                                   restore_ahead: bool) -> None:
    """A pool too small to keep the two shared heads: between requests they are evicted, demoted, and
    promoted back when the next request with that head arrives."""
    path, prompts, want = refs
    cfg = SchedulerConfig(offload_prefixes=True, restore_ahead=restore_ahead, max_running=1)
    engine = Engine.from_model(path, num_blocks=8, block_size=BS, scheduler_config=cfg, host_blocks=2,
                               disk_blocks=32, disk_dir=tmp_path, overlap_transfers=overlap)
    outs = []
    for p in prompts:
        outs.append(engine.generate([p], NEW)[0].output)
    assert outs == want
    s = engine.stats
    assert s.demoted_blocks > 0 and s.promoted_blocks > 0 and s.moved_blocks > 0
    tier = engine.scheduler.tier_stats()
    assert tier["flow"]["promoted"] == s.promoted_blocks and tier["promoted_tokens"] == BS * s.promoted_blocks
    if not overlap:
        assert s.transfer_hidden_s == 0.0  # every transfer ran before its step's compute
    assert_clean(engine)
    engine.close()


def test_a_failed_disk_write_loses_only_its_cache_entry_and_serves_nothing_it_did_not_write(refs, tmp_path,
                                                                                           monkeypatch) -> None:
    path, prompts, want = refs
    cfg = SchedulerConfig(offload_prefixes=True, max_running=1)
    engine = Engine.from_model(path, num_blocks=8, block_size=BS, scheduler_config=cfg, disk_blocks=32,
                               disk_dir=tmp_path)
    assert engine.generate([prompts[0]], NEW)[0].output == want[0]
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    evicting = engine.generate([prompts[1]], NEW)[0]  # its admission evicts prompt 0's head: a demotion fails
    assert (evicting.finish_reasons, evicting.output) == (["length"], want[1])  # only cache entries are lost
    monkeypatch.setattr(os, "pwrite", real)
    assert engine.scheduler.host.flow["discarded"] > 0 and engine.scheduler.host.index == {}
    # Prompt 0 again: nothing wrong comes back from the tier; the tokens are still the dense ones.
    assert engine.generate([prompts[0]], NEW)[0].output == want[0]
    assert engine.generate([prompts[1]], NEW)[0].output == want[1]
    assert_clean(engine)
    engine.close()


def test_staging_is_bounded_and_counted_by_the_diagnostics(refs, tmp_path) -> None:
    from kvledger.runtime.measure.diagnostics.snapshot import engine_registry
    from kvledger.runtime.measure.diagnostics.tensors import scan

    path, _, _ = refs
    engine = Engine.from_model(path, num_blocks=10, block_size=BS, host_blocks=4, disk_blocks=8, disk_dir=tmp_path,
                               staging_blocks=3)
    rows = engine.transfers.staging
    assert tuple(rows.shape) == (3, engine.spec.block_bytes)
    sample = scan(engine_registry(engine))
    assert sample.owner_bytes("staging", "cpu") == 3 * engine.spec.block_bytes
    assert sample.owner_bytes("kv/host", "cpu") == 4 * engine.spec.block_bytes
    engine.close()


def test_a_tier_ledger_and_its_stores_agree_on_slots(tmp_path) -> None:
    spec = KVSpec(2, 2, 8, kv_dtype="fp32", block_size=BS)
    tiers = TierLedger([("host", 3), ("disk", 5)])
    stores = TierStores(KVStore(spec, 2), tiers.names, tiers.sizes, disk_dir=tmp_path)
    for slot in range(tiers.num_blocks):
        assert stores.tier_name(slot) == tiers.tier_name(slot)
    with pytest.raises(ConfigError):
        stores.locate(8)
    with pytest.raises(ConfigError, match="no byte store"):
        TierStores(KVStore(spec, 2), ["nvme"], [2])


def test_measure_links_times_each_tier_on_the_real_path_and_leaves_the_store_as_it_was(tmp_path) -> None:
    from kvledger.runtime.measure.links import measure_links
    from kvledger.sim.calibrate import fit_links

    store = filled(SPECS[1], 8, seed=9)
    before = [block_bytes(store, b) for b in range(8)]
    got = measure_links(store, sizes=(1, 2, 4), repeats=1, disk_dir=tmp_path, compression="zlib")
    assert got["block_bytes"] == SPECS[1].block_bytes and set(got["tiers"]) == {"host", "disk"}
    for entry in got["tiers"].values():
        for direction in ("out", "in"):
            assert [n for n, _ in entry["points"][direction]] == [1, 2, 4]
            assert all(t > 0 for _, t in entry["points"][direction])
    assert got["tiers"]["disk"]["compression"] == "zlib" and got["tiers"]["disk"]["compression_ratio"] > 0
    assert "compression" not in got["tiers"]["host"]
    assert [block_bytes(store, b) for b in range(8)] == before  # the blocks it moved are restored
    assert not list(tmp_path.iterdir())
    links, report = fit_links(got)
    for tier in ("host", "disk"):
        assert links[tier]["out_Bps"] > 0 and links[tier]["in_Bps"] > 0
        assert links[tier]["out_overhead_s"] >= 0 and links[tier]["in_overhead_s"] >= 0
        assert len(report[tier]["points"]) == 6
    with pytest.raises(ConfigError, match="link sizes"):
        measure_links(store, sizes=(1, 9))
    with pytest.raises(ConfigError, match="at least one repeat"):
        measure_links(store, sizes=(1,), repeats=0)


@pytest.mark.parametrize("fmt", ["fp8-scaled", "int8", "int4"])
@pytest.mark.parametrize("tiers", [[("host", 4)], [("disk", 4)], [("host", 1), ("disk", 3)]],
                         ids=["host", "disk", "both"])
def test_quantised_blocks_go_through_every_tier_bit_for_bit_with_their_residual(fmt: str, tiers, tmp_path) -> None:
    """A quantised block moves as its whole byte layout (codes, scales, minimums); an open int4 block takes
    its unquantised residual page along and gets a page again on the way back."""
    from kvledger.core import BlockTable

    spec = KVSpec(2, 2, 16, kv_dtype=fmt, block_size=4, residual_dtype="fp32")
    store = KVStore(spec, 10, residual_slots=3)
    k, v = torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    slots = BlockTable(4, [3, 8]).slot_mapping(0, 7)  # block 3 full, block 8 open (int4) with 3 rows
    store.begin_write(torch.tensor(slots))
    for layer in range(2):
        store.write(layer, slots, k, v)
    before = [store.read(layer, torch.tensor(slots), torch.float32) for layer in range(2)]
    raw3 = store.block_view[3].clone()
    stores = TierStores(store, [n for n, _ in tiers], [s for _, s in tiers], disk_dir=tmp_path, compression="zlib")
    engine = TransferEngine(stores, staging_blocks=1)
    engine.run_now(StepPlan(0, swap_out=[(3, 2), (8, 0)]))
    store.kv.zero_()
    if fmt == "int4":
        store.attach(8, None)  # the device block is reused by someone else meanwhile
    engine.run_now(StepPlan(1, swap_in=[(2, 1), (0, 4)]))
    moved = torch.tensor(BlockTable(4, [1, 4]).slot_mapping(0, 7))
    for layer in range(2):
        after = store.read(layer, moved, torch.float32)
        assert all(torch.equal(x, y) for x, y in zip(before[layer], after, strict=True))
    assert torch.equal(store.block_view[1], raw3)
    if fmt == "int4":
        assert store.res_map[4] >= 0 and store.res_map[1] < 0  # open again with its page; the full one sealed
    engine.close()
