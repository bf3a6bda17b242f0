"""Every KV format through the store's writes, reads, gathers, copies and swaps, at block boundaries.

A store that put a row in the wrong block, the wrong layer, swapped K and V, dropped a block's last row,
read a quantised row with another row's scale, or lost an int4 block's open residual page would hand the
model wrong K/V; here each format's reads are compared with what was written (within the format's own
rounding, which ``test_quantisers_exact.py`` pins bit for bit), rows nobody wrote must read zero, and
copies and swaps must reproduce reads exactly. Also pinned: the refusals' messages, the dtypes reads
return, the pool's byte size and the int4 residual pages' bookkeeping.
"""

from __future__ import annotations

import pytest
import torch

from kvledger.core import BlockTable, KVSpec
from kvledger.errors import ConfigError
from kvledger.runtime import KVStore
from kvledger.runtime.kv_store import BlockBytes

FORMATS = ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp8-scaled", "int8-token", "int8-hadamard", "int8",
           "int4", "int4-hadamard"]
# Largest error of a read against what was written, as a fraction of the written rows' largest magnitude.
TOLERANCE = {"fp32": 0.0, "bf16": 2 ** -8, "fp16": 2 ** -11, "fp8_e4m3": 2 ** -4, "fp8_e5m2": 2 ** -3,
             "fp8-scaled": 2 ** -4, "int8-token": 1 / 127, "int4": 0.15,
             # Turned rows (int8-hadamard's K, int8's V; D = 8): an element's error is at most the row's
             # error norm, sqrt(D) half-steps of a step of at most sqrt(D) * max|x| / 127: D / 254 of the largest.
             "int8-hadamard": 8 / 254, "int8": 8 / 254,
             # 4-bit turned rows: sqrt(D) half-steps of a step of at most 2 sqrt(D) max|x| / 15.
             "int4-hadamard": 8 / 15}
LAYERS, HEADS, DIM, BS = 2, 2, 8, 4


def spec(fmt: str) -> KVSpec:
    return KVSpec(LAYERS, HEADS, DIM, kv_dtype=fmt, block_size=BS,
                  residual_dtype="fp32" if fmt in ("int4", "int8") else None)


def rows(n: int, seed: int) -> torch.Tensor:
    """``n`` rows of K or V, each row and head on its own scale (a quantiser mixing rows shows)."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(n, HEADS, 1, generator=gen) * 3 + 0.25
    return torch.randn(n, HEADS, DIM, generator=gen) * scale


def close(got: torch.Tensor, want: torch.Tensor, fmt: str) -> bool:
    return bool((got.float() - want).abs().max() <= TOLERANCE[fmt] * want.abs().max() + 1e-6)


def filled(fmt: str, table: list[int], n: int) -> tuple[KVStore, list[torch.Tensor]]:
    """A store of 8 blocks with ``n`` tokens written through ``table``, different K/V in each layer."""
    store = KVStore(spec(fmt), 8)
    slots = BlockTable(BS, table).slot_mapping(0, n)
    data = []
    for layer in range(LAYERS):
        k, v = rows(n, 10 * layer + 1), rows(n, 10 * layer + 2)
        store.write(layer, slots, k, v)
        data += [k, v]
    return store, data


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_reads_back_each_layers_k_and_v_where_they_were_written(fmt: str) -> None:
    """11 tokens through a scattered table [5, 0, 3]: two whole blocks and a partial one (int4: open)."""
    table = [5, 0, 3]
    store, (k0, v0, k1, v1) = filled(fmt, table, 11)
    slots = torch.tensor(BlockTable(BS, table).slot_mapping(0, 11))
    for layer, (k, v) in enumerate([(k0, v0), (k1, v1)]):
        rk, rv = store.read(layer, slots, torch.float32)
        assert rk.shape == rv.shape == (11, HEADS, DIM) and rk.dtype == rv.dtype == torch.float32
        assert close(rk, k, fmt) and close(rv, v, fmt), f"layer {layer}"
        # gather over the table is the same read, trimmed to the tokens asked for.
        gk, gv = store.gather(layer, table, 11, dtype=torch.float32)
        assert torch.equal(gk, rk) and torch.equal(gv, rv)
        # Two-dimensional slot indices (the decode path's padded table) read the same rows.
        tk, tv = store.read(layer, slots.view(1, 11), torch.float32)
        assert torch.equal(tk[0], rk) and torch.equal(tv[0], rv)
    # The last block's unwritten row and the blocks nobody wrote read zero.
    for layer in range(LAYERS):
        rk, rv = store.read(layer, torch.tensor([3 * BS + 3, 1 * BS, 2 * BS + 3, 7 * BS + 1]), torch.float32)
        assert not rk.any() and not rv.any()
    if spec(fmt).format.has_residual:
        assert store.open_blocks() == 1 and int(store.res_map[3]) >= 0 and int(store.res_map[5]) == -1
        # The open block reads its fp32 residual page: exactly what was written.
        rk, rv = store.read(1, slots[8:], torch.float32)
        assert torch.equal(rk, k1[8:]) and torch.equal(rv, v1[8:])


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_written_one_step_at_a_time_read_as_if_written_at_once(fmt: str) -> None:
    """A prompt, then decodes one row at a time across a block boundary (int4 seals the block on its
    last row; the next row opens a new block): reads equal the whole write's within the format."""
    table = [6, 2, 4]
    store = KVStore(spec(fmt), 8)
    k, v = rows(10, 5), rows(10, 6)
    mapping = BlockTable(BS, table).slot_mapping(0, 10)
    store.write(0, mapping[:3], k[:3], v[:3])
    store.write(1, mapping[:3], k[:3], v[:3])
    for i in range(3, 10):
        for layer in range(LAYERS):
            store.begin_write(mapping[i:i + 1])
            store.write(layer, mapping[i:i + 1], k[i:i + 1], v[i:i + 1])
    for layer in range(LAYERS):
        gk, gv = store.gather(layer, table, 10)
        assert close(gk, k, fmt) and close(gv, v, fmt)
    if spec(fmt).format.has_residual:
        assert store.open_blocks() == 1  # blocks 6 and 2 sealed, block 4 open with 2 rows


@pytest.mark.parametrize("fmt", FORMATS)
def test_gather_returns_the_stores_dtype_unless_asked_and_refuses_more_tokens_than_the_table(fmt: str) -> None:
    store, _ = filled(fmt, [1, 2], 6)
    k, v = store.gather(0, [1, 2])
    default = store.dtype if store.plain else torch.float32
    assert k.shape == v.shape == (8, HEADS, DIM) and k.dtype == v.dtype == default
    assert not k[6:].any() and not v[6:].any()  # the untrimmed tail: slots nobody wrote
    k, v = store.gather(0, torch.tensor([2, 1]), 5, dtype=torch.float16)
    assert k.shape == (5, HEADS, DIM) and k.dtype == v.dtype == torch.float16
    assert not k[2:4].any() and k[:2].any() and k[4].any()  # block 2 then block 1
    store.gather(0, [1, 2], 8)  # exactly full
    with pytest.raises(ConfigError, match=r"^9 tokens do not fit in 2 blocks of 4$"):
        store.gather(0, [1, 2], 9)


@pytest.mark.parametrize("fmt", FORMATS)
def test_copy_on_write_reproduces_the_sources_reads_and_leaves_the_rest(fmt: str) -> None:
    """Whole and partial copies (a forked tail: 2 of 4 rows) read back exactly as their sources, all layers;
    a chain copies the old contents; other blocks are untouched."""
    store, _ = filled(fmt, [0, 1, 2, 3], 14)  # block 3 half written (int4: open)
    before = {layer: store.read(layer, torch.arange(8 * BS), torch.float32) for layer in range(LAYERS)}
    store.copy_blocks([(1, 5), (0, 1), (3, 6, 2), (2, 7, 3)])
    for layer in range(LAYERS):
        k, v = store.read(layer, torch.arange(8 * BS), torch.float32)
        old_k, old_v = before[layer]
        for src, dst, n in ((1, 5, 4), (0, 1, 4), (3, 6, 2), (2, 7, 3)):
            s, d = slice(src * BS, src * BS + n), slice(dst * BS, dst * BS + n)
            assert torch.equal(k[d], old_k[s]) and torch.equal(v[d], old_v[s]), f"{src}->{dst}, layer {layer}"
        for b in (0, 2, 3, 4):
            blk = slice(b * BS, (b + 1) * BS)
            assert torch.equal(k[blk], old_k[blk]) and torch.equal(v[blk], old_v[blk])
    if spec(fmt).format.has_residual:
        assert store.open_blocks() == 3  # block 3 still open; its partial copy (6) and the sealed 2's (7) too


def test_copy_blocks_refuses_a_repeated_destination_and_a_slot_count_outside_the_block() -> None:
    store = KVStore(spec("fp32"), 8)
    with pytest.raises(ConfigError, match=r"^copy_blocks got the same destination block twice$"):
        store.copy_blocks([(0, 2), (1, 2)])
    for n in (0, 5):
        with pytest.raises(ConfigError, match=rf"^copy of {n} slots from block 1 to 2: must be in \[1, 4\]$"):
            store.copy_blocks([(1, 2, n)])
    store.copy_blocks([])  # nothing to do


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_swap_round_trip_into_other_blocks_reads_back_exactly(fmt: str) -> None:
    store, _ = filled(fmt, [0, 1, 2], 10)  # int4: block 2 open
    before = [store.read(layer, torch.arange(3 * BS), torch.float32) for layer in range(LAYERS)]
    host = store.swap_out([0, 1, 2])
    assert host.data.device.type == "cpu" and host.data.shape == (3, *store.block_view.shape[1:])
    open_tail = spec(fmt).format.has_residual
    assert [r is not None for r in host.residual] == ([False, False, True] if open_tail else [False] * 3)
    store.kv.zero_()
    store.swap_in(host, [7, 4, 5])
    for layer in range(LAYERS):
        k, v = store.read(layer, torch.tensor([7, 4, 5]).repeat_interleave(BS) * BS + torch.arange(BS).repeat(3),
                          torch.float32)
        assert torch.equal(k, before[layer][0]) and torch.equal(v, before[layer][1])
    with pytest.raises(ConfigError, match=r"^restored blocks have shape \(3, "):
        store.put_blocks([1, 2], host)
    with pytest.raises(ConfigError, match=r"^restored blocks have shape "):
        store.put_blocks([1, 2, 3], BlockBytes(host.data, host.residual[:2]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_pool_holds_exactly_the_bytes_the_planner_charges(fmt: str) -> None:
    s = spec(fmt)
    store = KVStore(s, 5)
    pages = 5 if spec(fmt).format.has_residual else 0  # int4: one residual page per block up to 64 by default
    assert store.residual_slots == pages and store.num_slots == 20
    assert store.nbytes == s.pool_bytes_for(5, pages) == 5 * s.block_bytes + pages * s.residual_page_bytes
    assert store.block_view.shape[0] == 5 and store.block_view.numel() * store.block_view.element_size() == \
        5 * s.block_bytes
    if spec(fmt).format.has_residual:
        assert KVStore(s, 100).residual_slots == 64 and KVStore(s, 64).residual_slots == 64
        assert KVStore(s, 100, residual_slots=3).nbytes == s.pool_bytes_for(100, 3)


def test_a_store_refuses_what_it_cannot_hold_naming_it() -> None:
    for bad in (0, -1, True, 2.0, "3"):
        with pytest.raises(ConfigError, match=r"^the KV store needs at least one block, got "):
            KVStore(spec("fp32"), bad)  # type: ignore[arg-type]
    KVStore(spec("fp32"), 1)
    with pytest.raises(ConfigError, match=r"^the runtime stores int8-token for head dims divisible by 4, got 6$"):
        KVStore(KVSpec(1, 1, 6, kv_dtype="int8-token", block_size=4), 2)
    for bad in (0, True, 1.5):
        with pytest.raises(ConfigError, match=r"^int4 needs at least one residual page, got "):
            KVStore(spec("int4"), 4, residual_slots=bad)  # type: ignore[arg-type]
    assert KVStore(spec("int4"), 4, residual_slots=1).residual_slots == 1
    quantised = KVStore(spec("int8"), 2)
    for what, view in (("layer", quantised.layer), ("block", quantised.blocks)):
        with pytest.raises(ConfigError, match=rf"^{what} views exist for plain KV formats only; int8 is read through "
                                              r"read\(\)$"):
            view(0)
    plain = KVStore(spec("bf16"), 2)
    with pytest.raises(ConfigError, match=r"^write of K \(2, 2, 8\) / V \(2, 2, 8\) through 3 slots does not match "
                                          r"\[n, 2, 8\]$"):
        plain.write(0, [0, 1, 2], torch.zeros(2, 2, 8), torch.zeros(2, 2, 8))
    with pytest.raises(ConfigError, match=r"^write of K \(1, 2, 8\) / V \(1, 2, 4\) through 1 slots"):
        plain.write(0, [0], torch.zeros(1, 2, 8), torch.zeros(1, 2, 4))


def test_plain_views_are_the_pool_itself() -> None:
    store = KVStore(spec("fp16"), 3)
    k, v = store.layer(1)
    assert k.shape == (12, HEADS, DIM) and k.data_ptr() == store.kv[1, 0].data_ptr()
    assert v.data_ptr() == store.kv[1, 1].data_ptr()
    kb, vb = store.blocks(1)
    assert kb.shape == (3, BS, HEADS, DIM) and kb.data_ptr() == k.data_ptr() and vb.data_ptr() == v.data_ptr()
    assert set(KVStore(spec("int4"), 2).parts(0)) == {"k.codes", "k.scale", "k.min", "v.codes", "v.scale", "v.min"}
    assert set(KVStore(spec("fp8-scaled"), 2).parts(1)) == {"k.codes", "k.scale", "v.codes", "v.scale"}


def test_int4_pages_of_finished_sequences_are_reclaimed_only_when_none_is_free() -> None:
    """Four pages; five sequences' open blocks: the fifth takes the page of the one the ledger freed."""
    store = KVStore(spec("int4"), 8, residual_slots=4)
    held = {0, 1, 2, 3}
    store.block_in_use = lambda b: b in held
    def write(block: int, seed: int) -> None:  # one token, every layer (a step)
        for layer in range(LAYERS):
            store.write(layer, [block * BS], rows(1, seed), rows(1, seed + 50))

    for b in range(4):
        write(b, b)
    assert store.open_blocks() == 4 and sorted(store.res_map[:4].tolist()) == [0, 1, 2, 3]
    held.discard(2)
    held.add(4)
    page_of_2 = int(store.res_map[2])
    write(4, 7)
    assert int(store.res_map[2]) == -1 and int(store.res_map[4]) == page_of_2 and store.open_blocks() == 4
    held.discard(0)  # the block holding page 0
    held.add(5)
    write(5, 9)
    assert int(store.res_map[0]) == -1 and int(store.res_map[5]) == 0
    held.add(6)
    with pytest.raises(ConfigError, match=r"^all 4 int4 residual pages are held by open blocks of running sequences"):
        write(6, 11)


@pytest.mark.parametrize("fmt", ["fp32", "int8", "int4"])
def test_a_store_allocates_its_pool_on_the_device_it_is_given(fmt: str) -> None:
    """A GPU store must hold its pages on the GPU, not in host memory; ``meta`` (allocates nothing) shows
    where each tensor would go on a CPU-only machine. The int4 block map stays on the host (the planner
    reads it every step)."""
    store = KVStore(spec(fmt), 4, device="meta")
    assert store.device == torch.device("meta") and store.kv.device.type == "meta"
    if spec(fmt).format.has_residual:
        assert store.residual.device.type == "meta" and store.res_map.device.type == "cpu"
