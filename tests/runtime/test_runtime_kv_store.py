"""The KV store: its size is the inventory's number, and block copies/swaps preserve contents."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvledger.core import BlockTable, KVSpec
from kvledger.errors import ConfigError
from kvledger.runtime import KVStore


@pytest.mark.parametrize(
    "spec",
    [
        KVSpec(2, 2, 16, kv_dtype="fp32", block_size=4),
        KVSpec(30, 3, 64, kv_dtype="bf16", block_size=16, name="smollm2-135m"),
        KVSpec(4, 8, 32, kv_dtype="fp16", block_size=8, tp=2),  # per-rank heads: 4 of the 8
        KVSpec(3, 2, 16, kv_dtype="fp8_e4m3", block_size=16, tp=4),  # tp > kv_heads: one replicated head
        KVSpec(2, 4, 16, kv_dtype="fp8_e5m2", block_size=2, attention="sliding", sliding_window=8),
    ],
    ids=lambda s: f"{s.kv_dtype}-tp{s.tp}-bs{s.block_size}",
)
def test_nbytes_matches_kvspec(spec: KVSpec) -> None:
    store = KVStore(spec, 7)
    assert store.nbytes == spec.block_bytes * 7
    assert store.nbytes == spec.pool_bytes_for_sequence(7 * spec.block_size)
    assert store.kv.shape == (spec.layers, 2, 7, spec.block_size, spec.kv_heads_per_rank, spec.head_dim)


def test_pool_bytes_give_whole_blocks() -> None:
    spec = KVSpec(2, 2, 16, kv_dtype="bf16", block_size=4)
    blocks = spec.pool_blocks(10 * spec.block_bytes + 1)
    assert KVStore(spec, blocks).nbytes == 10 * spec.block_bytes


def _filled(spec: KVSpec, num_blocks: int, seed: int = 0) -> KVStore:
    store = KVStore(spec, num_blocks)
    gen = torch.Generator().manual_seed(seed)
    store.kv.copy_(torch.randn(store.kv.shape, generator=gen).to(store.dtype))
    return store


def test_write_then_gather_through_a_block_table() -> None:
    spec = KVSpec(2, 2, 8, kv_dtype="fp32", block_size=4)
    store = KVStore(spec, 16)
    table = BlockTable(4, [9, 3, 12])  # scattered physical blocks
    k, v = torch.randn(11, 2, 8), torch.randn(11, 2, 8)
    store.write(1, table.slot_mapping(0, 11), k, v)
    gk, gv = store.gather(1, table.blocks, 11)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    assert store.kv[0].abs().sum() == 0  # layer 0 untouched
    # Slot = block * block_size + offset: token 5 sits in block 3 at offset 1.
    assert torch.equal(store.kv[1, 0, 3, 1], k[5])


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp8_e4m3"])
def test_block_views_and_dequantising_reads(kv_dtype: str) -> None:
    """``blocks`` is the paged kernels' view of the same memory; ``read`` returns stored rows as the
    compute dtype (the cast a dequantising read replaces for a compressed format)."""
    store = KVStore(KVSpec(2, 2, 8, kv_dtype=kv_dtype, block_size=4), 6)
    table = BlockTable(4, [5, 0, 2])
    k, v = torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    slots = torch.tensor(table.slot_mapping(0, 10))
    store.write(1, slots, k, v)
    kb, vb = store.blocks(1)
    assert kb.shape == (6, 4, 2, 8) and kb.data_ptr() == store.kv[1, 0].data_ptr()
    assert torch.equal(vb[0, 1].float(), v[5].to(store.dtype).float())  # position 5: block 0, offset 1
    rk, rv = store.read(1, slots.view(2, 5), torch.float32)
    assert rk.shape == (2, 5, 2, 8) and rk.dtype == torch.float32
    assert torch.equal(rk.reshape(10, 2, 8), k.to(store.dtype).float())
    assert torch.equal(rv.reshape(10, 2, 8), v.to(store.dtype).float())


def test_plain_fp8_write_rounds_like_a_cast() -> None:
    store = KVStore(KVSpec(1, 1, 8, kv_dtype="fp8_e4m3", block_size=2), 4)
    k = torch.randn(3, 1, 8)
    store.write(0, [0, 1, 7], k, k)
    gk, _ = store.gather(0, [0], 2, dtype=torch.float32)
    assert torch.equal(gk, k[:2].to(torch.float8_e4m3fn).float())


def test_copy_blocks_is_copy_on_write() -> None:
    spec = KVSpec(3, 2, 8, kv_dtype="bf16", block_size=4)
    store = _filled(spec, 8)
    before = store.kv.clone()
    store.copy_blocks([(1, 5), (2, 6)])
    assert torch.equal(store.kv[:, :, 5], before[:, :, 1])
    assert torch.equal(store.kv[:, :, 6], before[:, :, 2])
    untouched = [0, 1, 2, 3, 4, 7]
    assert torch.equal(store.kv[:, :, untouched], before[:, :, untouched])


def test_copy_blocks_reads_all_sources_first() -> None:
    store = _filled(KVSpec(1, 1, 4, kv_dtype="fp32", block_size=2), 4)
    before = store.kv.clone()
    store.copy_blocks([(0, 1), (1, 2)])  # block 2 gets block 1's OLD contents
    assert torch.equal(store.kv[:, :, 1], before[:, :, 0])
    assert torch.equal(store.kv[:, :, 2], before[:, :, 1])
    with pytest.raises(ConfigError, match="same destination"):
        store.copy_blocks([(0, 3), (1, 3)])


def test_partial_copies_take_only_the_leading_slots() -> None:
    """A forked partial tail: the ledger's CopyOp says how many slots hold tokens."""

    @dataclass
    class Op:  # the shape of kvledger.core CopyOp
        src: int
        dst: int
        slots: int

    store = _filled(KVSpec(2, 2, 4, kv_dtype="fp32", block_size=4), 6)
    before = store.kv.clone()
    store.copy_blocks([Op(1, 4, 3), (2, 5, 1), (0, 3)])
    assert torch.equal(store.kv[:, :, 4, :3], before[:, :, 1, :3])
    assert torch.equal(store.kv[:, :, 4, 3:], before[:, :, 4, 3:])  # beyond the tokens: untouched
    assert torch.equal(store.kv[:, :, 5, :1], before[:, :, 2, :1])
    assert torch.equal(store.kv[:, :, 5, 1:], before[:, :, 5, 1:])
    assert torch.equal(store.kv[:, :, 3], before[:, :, 0])
    with pytest.raises(ConfigError, match="slots"):
        store.copy_blocks([(0, 1, 5)])


def test_swap_round_trip_into_other_blocks() -> None:
    spec = KVSpec(2, 2, 8, kv_dtype="fp16", block_size=4)
    store = _filled(spec, 10)
    before = store.kv.clone()
    host = store.swap_out([7, 2, 4])
    assert host.data.device.type == "cpu"
    assert host.data.shape == (3, 2, 2, 4, 2, 8)  # block first, then the block's whole layout
    assert host.data.is_pinned() == torch.cuda.is_available()
    store.kv.zero_()  # the device blocks get reused while the sequence is swapped out
    store.swap_in(host, [0, 1, 9])
    assert torch.equal(store.kv[:, :, [0, 1, 9]], before[:, :, [7, 2, 4]])
    with pytest.raises(ConfigError, match="shape"):
        store.swap_in(host, [0, 1])


def test_unsupported_stores() -> None:
    with pytest.raises(ConfigError, match="MLA"):
        KVStore(KVSpec(2, 1, 576, attention="mla", kv_lora_rank=512, rope_dim=64), 4)
    with pytest.raises(ConfigError, match="divisible by 4"):
        KVStore(KVSpec(2, 2, 6, kv_dtype="int8-token"), 4)
    with pytest.raises(ConfigError, match="at least one block"):
        KVStore(KVSpec(2, 2, 8), 0)
