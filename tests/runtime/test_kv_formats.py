"""Quantised KV formats in the store and both attention paths: exact byte layouts, the planner's bytes,
dequantising reads, KIVI's residual pages, copies and swaps of a block's whole byte layout."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from int_dot import decode_tol
from kvledger.core import BlockTable, KVSpec
from kvledger.core.sizing.inventory import build_inventory
from kvledger.errors import ConfigError, InvariantError
from kvledger.runtime import AttentionBatch, KVStore, make_attention_backend, native
from kvledger.runtime.host_store import HostKVStore
from kvledger.runtime.kv_quant import quant_kivi_k, quant_token

QUANTISED = ["fp8-scaled", "int8", "int8-token", "int8-hadamard", "int4", "int4-hadamard"]
BACKENDS = ["torch", "native"]
NO_NATIVE: set[str] = set()  # every quantised format has a native loader and a fused decode


def need(backend: str) -> None:
    if backend == "native" and os.environ.get(native.NATIVE_ENV) == "0":
        pytest.skip("KVLEDGER_NATIVE=0: only the pure-torch paths")
    if backend == "native":
        native.require()  # built by `make install`; its absence is a failure, not a skip


def _store(fmt: str, *, layers: int = 2, heads: int = 2, dim: int = 16, block: int = 4, blocks: int = 16,
           slots: int | None = 4) -> KVStore:
    spec = KVSpec(layers, heads, dim, kv_dtype=fmt, block_size=block, residual_dtype="fp32")
    return KVStore(spec, blocks, residual_slots=slots)


def _write_all(store: KVStore, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
    """One step's write through every layer (the way a forward pass writes)."""
    store.begin_write(torch.tensor(slots))
    for layer in range(store.spec.layers):
        store.write(layer, slots, k, v)


# ---- bytes ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fmt", "block", "seqs"), [("fp8-scaled", 16, 0), ("int8-token", 16, 0), ("int8", 16, 4),
                                                    ("int4", 16, 8), ("int4", 64, 3), ("bf16", 16, 0),
                                                    ("fp8_e4m3", 16, 0)])
def test_the_store_allocates_exactly_the_bytes_the_planner_states(fmt: str, block: int, seqs: int) -> None:
    """SmolLM2's geometry in a 64 MiB pool: the planner's blocks and residual pages are what the store holds."""
    spec = KVSpec(30, 3, 64, kv_dtype=fmt, block_size=block, residual_dtype="bf16")
    inv = build_inventory(spec, pool_bytes="64MiB", max_seqs=max(seqs, 1))
    store = KVStore(spec, inv.pool_blocks, residual_slots=seqs or None)
    assert store.nbytes == inv.pool_bytes + inv.residual_bytes == spec.pool_bytes_for(inv.pool_blocks, seqs)
    assert store.nbytes <= 64 * 2**20 < store.nbytes + spec.block_bytes  # no whole block left over
    assert inv.pool_bytes == inv.pool_blocks * spec.block_bytes
    assert sum(p["bytes"] for p in inv.to_dict()["kv_format_parts"]) * 30 == spec.block_bytes


def test_bytes_per_token_count_scales_and_hit_the_targets_on_smollm2() -> None:
    """Metadata included, against bf16 (23,040 B per token): int8-token/fp8 1.94x, int8 1.75x (a key scale and
    minimum per channel per block), int4 3.05x in 16-token blocks and 3.56x in 64-token blocks (the block is
    the key quantisation group)."""
    bf16 = KVSpec(30, 3, 64, kv_dtype="bf16").bytes_per_token
    assert bf16 == 23040
    assert KVSpec(30, 3, 64, kv_dtype="int8-token").bytes_per_token == 30 * 2 * 3 * (64 + 2) == 11880
    # int8: keys 64 codes + an fp16 scale and minimum per channel over 16 tokens, values 64 codes + one scale.
    assert KVSpec(30, 3, 64, kv_dtype="int8").bytes_per_token == 30 * 3 * (64 + 2 * 2 * 64 // 16 + 64 + 2) == 13140
    assert KVSpec(30, 3, 64, kv_dtype="int8-channel") == KVSpec(30, 3, 64, kv_dtype="int8")  # the former name
    assert round(bf16 / 13140, 2) == 1.75
    assert KVSpec(30, 3, 64, kv_dtype="fp8-scaled").bytes_per_token == 11880
    assert KVSpec(30, 3, 64, kv_dtype="int4").bytes_per_token == 30 * 3 * (64 + 4 * 64 // 16 + 4) == 7560
    assert KVSpec(30, 3, 64, kv_dtype="int4", block_size=64).bytes_per_token == 6480
    assert bf16 / 11880 >= 1.9 and bf16 / 6480 >= 3.5
    # The seed's geometry: 128 KiB per token in bf16.
    seed = KVSpec(32, 8, 128, kv_dtype="int8-token")
    assert seed.bytes_per_token == 66560 and seed.block_bytes == 1064960
    assert seed.pool_blocks("512MiB") == 504


def test_a_compressed_blocks_identity_names_the_format_and_its_parameters() -> None:
    specs = [KVSpec(2, 2, 16, kv_dtype=f, block_size=b, residual_dtype=r)
             for f, b, r in (("int8-token", 16, None), ("fp8-scaled", 16, None), ("int4", 16, "fp32"),
                             ("int4", 64, "fp32"), ("int4", 16, "bf16"), ("fp8_e4m3", 16, None), ("bf16", 16, None),
                             ("int8", 16, "fp32"))]
    ids = [s.kv_format_id for s in specs]
    assert len(set(ids)) == len(ids)
    assert ids[0] == "int8-token:sym,scale=fp16/token-head"
    assert ids[-1] == "int8:k=asym/channel/group16,v=sym/token-head,rot=hadamard/v,meta=fp16,residual=fp32/16"
    assert ids[2] == "int4:kivi,k=asym/channel/group16,v=asym/token,meta=fp16,residual=fp32/16"
    assert KVSpec(2, 2, 16, kv_dtype="int8-token", residual_dtype="fp32") == specs[0]  # no residual: no field


# ---- layouts and reads ------------------------------------------------------------------------------------
def test_int8_token_layout_codes_then_fp16_scales_per_token_and_head() -> None:
    store = _store("int8-token", layers=1, blocks=4)
    k = torch.randn(4, 2, 16)
    v = torch.randn(4, 2, 16)
    _write_all(store, [8, 9, 10, 11], k, v)  # block 2, rows 0..3
    raw = store.kv[0, 2]
    codes = raw[: 4 * 2 * 16].view(torch.int8).view(4, 2, 16)
    scale = raw[4 * 2 * 16: 4 * 2 * 18].view(torch.float16).view(4, 2)
    want_codes, want_scale = quant_token(k, "int8")
    assert torch.equal(codes, want_codes) and torch.equal(scale, want_scale)
    assert torch.equal(scale, (k.abs().amax(-1) / 127).half())
    assert int(codes.abs().max()) == 127  # every row uses the full range at its largest value
    rk, rv = store.read(0, torch.tensor([8, 9, 10, 11]), torch.float32)
    assert ((rk - k).abs() <= scale.float()[..., None] / 2 + 1e-6).all()  # within half a step


@pytest.mark.parametrize("fmt", QUANTISED)
def test_reads_dequantise_within_the_formats_error(fmt: str) -> None:
    store = _store(fmt, dim=64, blocks=8)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(24, 2, 64, generator=gen) * 3 + 1
    v = torch.randn(24, 2, 64, generator=gen)
    slots = list(range(4, 28))  # blocks 1..6, all full
    _write_all(store, slots, k, v)
    rk, rv = store.read(1, torch.tensor(slots), torch.float32)
    err = max(float((rk - k).norm() / k.norm()), float((rv - v).norm() / v.norm()))
    bound = {"int8": 0.01, "int8-token": 0.01, "int8-hadamard": 0.01, "fp8-scaled": 0.04, "int4": 0.12,
             "int4-hadamard": 0.12}[fmt]
    assert 0 < err < bound


def test_int4_keys_share_a_scale_and_minimum_per_channel_over_the_block() -> None:
    store = _store("int4", layers=1, blocks=4)
    k = torch.randn(4, 2, 16)
    _write_all(store, [4, 5, 6, 7], k, torch.randn(4, 2, 16))  # block 1, whole: quantised at once
    p = store.parts(0)
    codes, scale, low = quant_kivi_k(k[None])
    assert torch.equal(p["k.codes"][1], codes[0]) and torch.equal(p["k.scale"][1], scale[0])
    assert torch.equal(p["k.min"][1], low[0])
    # The minimum is rounded down to fp16 (the whole group stays on the code grid): at most one fp16 step.
    assert bool((low[0].float() <= k.amin(0)).all()) and bool((low[0].float() >= k.amin(0).half().float() - 2e-3).all())
    assert p["k.codes"].shape[-1] == 8  # two 4-bit values per byte
    assert store.open_blocks() == 0


# ---- the int4 residual ------------------------------------------------------------------------------------
def test_int4_keeps_a_partly_written_block_unquantised_until_its_last_row() -> None:
    store = _store("int4", layers=2, blocks=8, slots=2)
    table = BlockTable(4, [5, 2])
    k, v = torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    _write_all(store, table.slot_mapping(0, 3), k[:3], v[:3])  # 3 of block 5's 4 rows: open
    assert store.res_map[5] >= 0 and store.open_blocks() == 1
    rk, rv = store.read(1, torch.tensor(table.slot_mapping(0, 3)), torch.float32)
    assert torch.equal(rk, k[:3]) and torch.equal(rv, v[:3])  # bit for bit: unquantised
    _write_all(store, table.slot_mapping(3, 7), k[3:], v[3:])  # fills block 5 (sealed), opens block 2
    assert store.res_map[5] == -1 and store.res_map[2] >= 0 and store.open_blocks() == 1
    rk, _ = store.read(0, torch.tensor(table.slot_mapping(0, 4)), torch.float32)
    assert not torch.equal(rk, k[:4]) and float((rk - k[:4]).abs().max()) < 0.5  # quantised now
    rk, _ = store.read(0, torch.tensor(table.slot_mapping(4, 7)), torch.float32)
    assert torch.equal(rk, k[4:])


def test_int4_sealed_blocks_are_immutable_and_lost_rows_are_an_error() -> None:
    store = _store("int4", layers=1, blocks=8, slots=1)
    k = torch.randn(4, 2, 16)
    _write_all(store, [8, 9, 10, 11], k, k)  # block 2 sealed
    before = store.kv.clone()
    _write_all(store, [11], torch.zeros(1, 2, 16), torch.zeros(1, 2, 16))  # the recomputed last prompt token
    assert torch.equal(store.kv, before)  # dropped: the row is already there
    with pytest.raises(InvariantError, match="no residual page"):
        _write_all(store, [13], k[:1], k[:1])  # row 1 of a block never opened


def test_int4_residual_pages_run_out_clearly_and_are_reclaimed_from_the_ledger() -> None:
    store = _store("int4", layers=1, blocks=8, slots=2)
    x = torch.randn(1, 2, 16)
    _write_all(store, [0], x, x)
    _write_all(store, [4], x, x)
    with pytest.raises(ConfigError, match="residual pages are held"):
        _write_all(store, [8], x, x)
    held = {1}  # the ledger freed block 0 (its sequence finished with a partly written tail)
    store.block_in_use = lambda b: b in held
    _write_all(store, [8], x, x)
    assert store.res_map[0] == -1 and store.res_map[2] >= 0 and store.open_blocks() == 2


# ---- copies and swaps ---------------------------------------------------------------------------------------
@dataclass
class Op:  # the shape of kvledger.core CopyOp
    src: int
    dst: int
    slots: int


@pytest.mark.parametrize("fmt", QUANTISED)
def test_copy_on_write_copies_a_blocks_whole_byte_layout(fmt: str) -> None:
    store = _store(fmt, blocks=12, slots=4)
    k, v = torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    _write_all(store, list(range(8, 18)), k, v)  # blocks 2, 3 full; block 4 holds 2 rows
    full = torch.tensor(list(range(8, 16)))
    tail = torch.tensor([16, 17])
    store.copy_blocks([(2, 6), (3, 7), Op(4, 9, 2)])
    for layer in range(2):
        a = store.read(layer, full, torch.float32)
        b = store.read(layer, full + 16, torch.float32)  # blocks 6, 7
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        a = store.read(layer, tail, torch.float32)
        b = store.read(layer, tail + 20, torch.float32)  # block 9
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert torch.equal(store.kv[:, 6], store.kv[:, 2])
    if store.format.has_residual:
        assert store.res_map[9] >= 0 and store.res_map[9] != store.res_map[4]  # a page of its own
        # The copy's next row lands in its own page; the source is untouched.
        _write_all(store, [38], torch.ones(1, 2, 16), torch.ones(1, 2, 16))
        assert torch.equal(store.read(0, torch.tensor([18]), torch.float32)[0], torch.zeros(1, 2, 16))


@pytest.mark.parametrize("fmt", QUANTISED)
def test_swap_out_and_in_is_bit_identical_for_quantised_blocks(fmt: str) -> None:
    store = _store(fmt, blocks=10, slots=3)
    host = HostKVStore(store, 6)
    k, v = torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    table = BlockTable(4, [3, 8])
    _write_all(store, table.slot_mapping(0, 7), k, v)  # block 3 full, block 8 open (int4) with 3 rows
    slots = torch.tensor(table.slot_mapping(0, 7))
    before = [store.read(layer, slots, torch.float32) for layer in range(2)]
    raw = store.kv.clone()
    host.swap_out([(3, 5), (8, 0)])
    store.kv.zero_()
    if store.format.has_residual:
        store.attach(8, None)  # the device block is reused by someone else meanwhile
    host.swap_in([(5, 1), (0, 4)])
    moved = torch.tensor(BlockTable(4, [1, 4]).slot_mapping(0, 7))
    for layer in range(2):
        after = store.read(layer, moved, torch.float32)
        assert all(torch.equal(x, y) for x, y in zip(before[layer], after, strict=True))
    assert torch.equal(store.kv.movedim(store.block_dim, 0)[1], raw.movedim(store.block_dim, 0)[3])
    assert host.blocks_out == host.blocks_in == 2
    if store.format.has_residual:
        assert store.res_map[4] >= 0 and 0 in host.residual  # the open tail travelled with its page


# ---- attention on both paths ---------------------------------------------------------------------------------
def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    ok = torch.arange(k.shape[0])[None, :] <= torch.arange(start, start + q.shape[0])[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~ok, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("dim", [64, 32])  # 64: the prefill kernel; 32: prefills through SDPA
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", QUANTISED)
def test_attention_reads_what_the_store_holds(fmt: str, backend: str, dim: int) -> None:
    """Paged attention over a quantised store equals dense attention over the store's dequantised rows
    (prefill chunks, decodes, a chunk that seals an int4 block), on the torch and the native path."""
    need(backend)
    spec = KVSpec(1, 2, dim, kv_dtype=fmt, block_size=16, residual_dtype="fp32")
    store = KVStore(spec, 24, residual_slots=4)
    if fmt in NO_NATIVE and backend == "native":
        with pytest.raises(ConfigError, match=f"cannot read a {fmt} KV store"):
            make_attention_backend(backend, store)
        assert type(make_attention_backend("auto", store)).__name__ == "TorchPagedAttention"
        return
    be = make_attention_backend(backend, store)
    gen = torch.Generator().manual_seed(3)
    tables = [BlockTable(16, [9, 2, 17, 5]), BlockTable(16, [11, 0, 20])]
    lens = [0, 0]
    for steps in ({0: 40, 1: 20}, {0: 1, 1: 1}, {1: 12}, {0: 1, 1: 1}):
        seqs = list(steps)
        starts = [lens[i] for i in seqs]
        q = torch.randn(sum(steps.values()), 4, dim, generator=gen)
        k = torch.randn(q.shape[0], 2, dim, generator=gen) * 2 + 0.5
        v = torch.randn(q.shape[0], 2, dim, generator=gen)
        slots = [s for i in seqs for s in tables[i].slot_mapping(lens[i], lens[i] + steps[i])]
        batch = AttentionBatch(starts, [steps[i] for i in seqs], [tables[i].blocks for i in seqs], torch.tensor(slots))
        be.plan(batch)
        out = be.forward(0, q, k, v, scale=dim ** -0.5)
        for j, i in enumerate(seqs):
            lens[i] += steps[i]
            ctx = torch.tensor(tables[i].slot_mapping(0, lens[i]))
            rk, rv = store.read(0, ctx, torch.float32)
            ref = _dense(q[batch.offsets[j]:batch.offsets[j + 1]], rk, rv, starts[j])
            assert (out[batch.offsets[j]:batch.offsets[j + 1]] - ref).abs().max() < decode_tol(backend, fmt, 1e-5)
    if store.format.has_residual:
        assert store.open_blocks() == 2  # each sequence's tail


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_decode_steps_write_each_layers_rows_into_that_layers_residual_page(fmt: str, backend: str) -> None:
    """A decode step over several layers (each with its own K/V, the way a forward pass runs) leaves every
    layer's open-block rows in its own residual page, bit for bit, and each layer's attention reads them; the
    step's last layer seals a block that fills (the native path appends the layers before the last apart)."""
    need(backend)
    layers, dim = 3, 64
    store = KVStore(KVSpec(layers, 2, dim, kv_dtype=fmt, block_size=16, residual_dtype="fp32"), 8, residual_slots=2)
    be = make_attention_backend(backend, store)
    gen = torch.Generator().manual_seed(11)
    table = BlockTable(16, [4, 1])
    written = [([], []) for _ in range(layers)]
    length = 0
    for n in (13, 1, 1, 1, 1, 1):  # the prefill, then decodes: the third fills block 4, the rest open block 1
        batch = AttentionBatch([length], [n], [table.blocks], torch.tensor(table.slot_mapping(length, length + n)))
        be.plan(batch)
        for layer in range(layers):
            q = torch.randn(n, 4, dim, generator=gen)
            k, v = torch.randn(n, 2, dim, generator=gen) + layer, torch.randn(n, 2, dim, generator=gen) - layer
            written[layer][0].append(k)
            written[layer][1].append(v)
            out = be.forward(layer, q, k, v, scale=dim ** -0.5)
            rk, rv = store.read(layer, torch.tensor(table.slot_mapping(0, length + n)), torch.float32)
            assert (out - _dense(q, rk, rv, length)).abs().max() < decode_tol(backend, fmt, 1e-5)
        length += n
        if length > 16:  # block 1 is open: its rows are exactly what each layer wrote
            assert store.res_map[4] == -1 and store.res_map[1] >= 0
            for layer in range(layers):
                rk, rv = store.read(layer, torch.tensor(table.slot_mapping(16, length)), torch.float32)
                assert torch.equal(rk, torch.cat(written[layer][0])[16:length])
                assert torch.equal(rv, torch.cat(written[layer][1])[16:length])
    for layer in range(layers):  # the sealed block holds each layer's own rows, within the format's error
        rk, _ = store.read(layer, torch.tensor(table.slot_mapping(0, 16)), torch.float32)
        assert float((rk - torch.cat(written[layer][0])[:16]).abs().max()) < 0.5


@pytest.mark.parametrize("fmt", [f for f in QUANTISED if f not in NO_NATIVE])
def test_native_and_torch_paths_agree_on_quantised_stores(fmt: str) -> None:
    need("native")
    outs = []
    for backend in BACKENDS:
        spec = KVSpec(1, 2, 64, kv_dtype=fmt, block_size=16, residual_dtype="fp32")
        store = KVStore(spec, 8, residual_slots=2)
        be = make_attention_backend(backend, store)
        gen = torch.Generator().manual_seed(5)
        table = [3, 6, 1]
        batch = AttentionBatch([0], [37], [table], torch.tensor(BlockTable(16, table).slot_mapping(0, 37)))
        be.plan(batch)
        q, k, v = (torch.randn(37, n, 64, generator=gen) for n in (4, 2, 2))
        outs.append(be.forward(0, q, k, v, scale=0.125))
        assert type(be).__name__ == ("TorchPagedAttention" if backend == "torch" else "NativePagedAttention")
    assert (outs[0] - outs[1]).abs().max() < decode_tol("native", fmt, 1e-5)
