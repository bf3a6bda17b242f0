"""kvtc through the KV store (runtime/kv_transform_pages.py, kv_store.py) on hand-made tables: a block's page holds
what the tables code (keys turned back to before RoPE, forward again at read), slots laid over the whole page
across layers' parts, the block's first position and first token in front, the sink row exact from the store's
cache of first tokens' rows (shared by sequences with one first token, recomputed once evicted; held at bf16 in the
slots where the writer named no token), blocks sealed by a prefill or by their last decoded row, copies and swaps
carrying a page to another block, and the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvledger.core.sizing.geometry import KVSpec
from kvledger.errors import ConfigError, InvariantError
from kvledger.runtime import kv_transform as kt
from kvledger.runtime import kv_transform_pages as ktp
from kvledger.runtime import native
from kvledger.runtime.kv_store import KVStore

pytestmark = pytest.mark.skipif(not native.available() or not hasattr(native.load(), "ec_fit_blocks"),
                                reason="the native CPU kernels are not built")
L, H, D, B = 2, 2, 64, 8
INV_FREQ = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
# Bytes a row: layer 0's first key head takes twice the format's share, layer 1's keys less (so a slot of layer 0
# runs into layer 1's part of the page); every slot holds the sink row (128 bytes) and a little more.
KEY_ROWS = ((60.0, 30.5), (17.0, 20.0))
VALUE_ROWS = ((38.0, 40.0), (36.75, 41.0))


def _side(row_bytes, seed) -> kt.SideCode:
    g = torch.Generator().manual_seed(seed)
    # fp32-exact, as saved tables are: a loaded copy codes the same slots
    turn = (torch.linalg.qr(torch.randn(L, H, D, D, generator=g, dtype=torch.float64))[0] * 0.5).float().double()
    return kt.SideCode(
        mu=(torch.randn(L, H, D, generator=g, dtype=torch.float64) * 0.1).float().double(), turn=turn,
        back=torch.linalg.inv(turn),
        sigma=(2.0 ** torch.linspace(-3, 3, D, dtype=torch.float64)).expand(L, H, D).clone(),
        laplace=(torch.arange(D) % 3 == 0).expand(L, H, D).clone(),
        base=torch.full((L, H), 0.25, dtype=torch.float64),
        row_bytes=torch.tensor(row_bytes, dtype=torch.float64), block_size=B)


TABLES = ktp.TransformTables(_side(KEY_ROWS, 0), _side(VALUE_ROWS, 1), "test")
# A sequence's first block laid out apart: its sink row paid by every head (layer 1's keys wider than elsewhere).
FIRST = ktp.TransformTables(
    dataclasses.replace(TABLES.keys, first_row_bytes=torch.tensor(((48.0, 30.5), (30.0, 30.0)), dtype=torch.float64)),
    dataclasses.replace(TABLES.values, first_row_bytes=torch.tensor(((34.0, 36.0), (34.0, 37.0)),
                                                                     dtype=torch.float64)), "first")
SPEC = KVSpec(layers=L, kv_heads=H, head_dim=D, block_size=B, kv_dtype="kvtc", residual_dtype="fp32")


def _store(blocks=8, tables=TABLES) -> KVStore:
    return KVStore(SPEC, blocks, residual_slots=2, transform=tables, rope_inv_freq=INV_FREQ.float())


def _rope(x: torch.Tensor, pos: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """The model's half-split RoPE (sign -1: turned back), rows ``x [n, H, D]`` at ``pos [n]``."""
    ang = pos.double()[:, None] * INV_FREQ
    ang = torch.cat((ang, ang), -1)[:, None, :]
    x = x.double()
    rot = torch.cat((-x[..., D // 2:], x[..., :D // 2]), -1)
    return x * ang.cos() + sign * rot * ang.sin()


def _rows(n, seed):
    """K and V rows per layer ``[L, n, H, D]``: the tables' models with a steady offset (keys after RoPE)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, n, H, D, generator=g) * 2 + 0.5
    v = torch.randn(L, n, H, D, generator=g)
    return k, v


FIRST_TOKEN = 7  # the first token _write names for a write at position 0


def _write(store, slots, pos, k, v, token=FIRST_TOKEN):
    if pos[0] == 0 and token is not None:
        store.note_first_tokens([(slots[0], token)])
    store.begin_write(torch.tensor(slots), torch.tensor(pos))
    for layer in range(L):
        store.write(layer, slots, k[layer], v[layer])


def _expected(k, v, first, tables=TABLES, untold=False):
    """What a sealed block of rows ``k``/``v [L, B, H, D]`` at ``first`` reads back: each layer-head coded by the
    tables directly (keys before RoPE), RoPE applied again. At position 0 the sink row is exact (the store's cache of
    first tokens' rows) and the other rows have the whole slot; where the writer named no first token
    (``untold``), the sink row is held at bf16 in the slots (the first block's own layout)."""
    pos = torch.arange(first, first + B)
    held = ktp.HELD_ROWS if first == 0 and untold else 0
    skip = 1 if first == 0 and not untold else 0
    ks, vs = [], []
    for layer in range(L):
        pre = _rope(k[layer], pos, -1.0).float()
        rows = []
        for code, x in ((tables.keys, pre), (tables.values, v[layer])):
            got = torch.stack([code.decode(layer, h, code.encode(layer, h, x[None, :, h], held=held, skip=skip)[0],
                                           held=held, skip=skip)[0] for h in range(H)], 1)
            if skip:
                got[0] = x[0]
            rows.append(got)
        ks.append(_rope(rows[0], pos).float())
        vs.append(rows[1].float())
    return torch.stack(ks), torch.stack(vs)


def _read(store, block):
    slots = torch.arange(block * B, block * B + B)
    got = [store.read(layer, slots, torch.float32) for layer in range(L)]
    return torch.stack([g[0] for g in got]), torch.stack([g[1] for g in got])


def test_a_page_lays_every_slot_once_across_the_layers_parts_behind_its_header():
    store = _store()
    pages = store.coded
    layer_bytes = SPEC.layer_block_bytes
    stride = store.num_blocks * layer_bytes  # one layer of the pool
    assert layer_bytes == B * H * (33 + 40)  # the format's share: 73 bytes a head-row at 64 channels
    page = []
    for layer in range(L):
        for side in "kv":
            for h in range(H):
                flat = pages.slots[side][layer][h]
                page += ((flat // stride) * layer_bytes + flat % layer_bytes).tolist()
    widths = [int(w) for layer in range(L) for c in (TABLES.keys, TABLES.values) for w in c.slot_bytes[layer]]
    assert ktp.HEADER_BYTES == 8  # the first position and the first token (int32 each)
    assert page == list(range(ktp.HEADER_BYTES, ktp.HEADER_BYTES + sum(widths)))  # disjoint, in order
    assert pages.page_bytes_used == ktp.HEADER_BYTES + sum(widths) <= L * layer_bytes
    # the blocks, 2 fp32 residual pages and the cache of 32 first tokens' rows (fp32), as the spec sizes the pool
    cache = 32 * L * 2 * H * D * 4
    assert store.nbytes == store.num_blocks * L * layer_bytes + 2 * L * 2 * B * H * D * 4 + cache
    assert store.nbytes == SPEC.pool_bytes_for(store.num_blocks, 2) and pages.constant_bytes == cache
    first_key = pages.slots["k"][0][0]
    assert int(first_key[0]) // stride == 0 and sum(widths[:2]) > 0
    spans = {int(o) // stride for h in range(H) for o in pages.slots["v"][0][h]}
    assert spans == {0, 1}  # layer 0's value slots run on into layer 1's part of the page


@pytest.mark.parametrize("tables", [TABLES, FIRST], ids=["one-layout", "first-block-apart"])
def test_a_prefill_seals_its_whole_blocks_as_the_tables_code_them_and_keeps_the_tail(tables):
    store = _store(tables=tables)
    k, v = _rows(20, seed=2)
    _write(store, list(range(8, 28)), list(range(20)), k, v)  # blocks 1, 2 whole (positions 0-15), block 3 open
    assert store.open_blocks() == 1
    for block, first in ((1, 0), (2, 8)):
        got_k, got_v = _read(store, block)
        want_k, want_v = _expected(k[:, first:first + B], v[:, first:first + B], first, tables)
        torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-5)
        torch.testing.assert_close(got_v, want_v, rtol=0, atol=1e-5)
        assert int(store.coded.positions(store.kv, torch.tensor([block]))[0]) == first
    sink_k, sink_v = _read(store, 1)
    assert torch.equal(sink_k[:, 0], k[:, 0]) and torch.equal(sink_v[:, 0], v[:, 0])  # exact, from the sink table
    assert not torch.equal(sink_k[:, 1], k[:, 1])  # the others are coded
    assert store.coded.tokens(store.kv, torch.tensor([1, 2])).tolist() == [FIRST_TOKEN, -1]
    tail_k, tail_v = _read(store, 3)
    assert torch.equal(tail_k[:, :4], k[:, 16:20]) and torch.equal(tail_v[:, :4], v[:, 16:20])  # fp32 residual


def test_a_first_block_has_its_own_layout_in_the_same_page():
    pages = _store(tables=FIRST).coded
    widths = [int(w) for layer in range(L) for c in (FIRST.keys, FIRST.values) for w in c.first_slot_bytes[layer]]
    assert widths[4:6] == [240, 240] and pages.first_page_bytes_used == ktp.HEADER_BYTES + sum(widths)
    assert pages.first_slots["k"][1][0].tolist() != pages.slots["k"][1][0].tolist()
    assert pages.first_page_bytes_used <= L * SPEC.layer_block_bytes
    assert pages.page_bytes_used == _store().coded.page_bytes_used  # every other block: as before


def test_a_prefills_attention_reads_each_layers_coded_blocks_before_the_step_ends():
    store = _store()
    k, v = _rows(8, seed=7)
    store.note_first_tokens([(0, FIRST_TOKEN)])  # as the model runner does before a step
    store.begin_write(torch.arange(8), torch.arange(8))
    for layer in range(L):  # as a backend: write one layer, read it back at once
        store.write(layer, list(range(8)), k[layer], v[layer])
        got_k, got_v = store.read(layer, torch.arange(8), torch.float32)
        want_k, want_v = _expected(k, v, 0)
        torch.testing.assert_close(got_k, want_k[layer], rtol=0, atol=1e-5)
        torch.testing.assert_close(got_v, want_v[layer], rtol=0, atol=1e-5)


def test_a_block_sealed_by_its_last_decoded_row_reads_as_one_written_whole():
    store = _store()
    k, v = _rows(24, seed=3)
    _write(store, list(range(16, 37)), list(range(40, 61)), k[:, :21], v[:, :21])  # 2 whole blocks, block 4 open
    for i in (21, 22, 23):  # decode steps: the last fills block 4 (positions 56..63 at slots 32..39)
        _write(store, [16 + i], [40 + i], k[:, i:i + 1], v[:, i:i + 1])
    assert store.open_blocks() == 0
    got_k, got_v = _read(store, 4)
    want_k, want_v = _expected(k[:, 16:24], v[:, 16:24], 56)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_v, want_v, rtol=0, atol=1e-5)


def test_first_rows_are_cached_by_token_recomputed_once_evicted_and_held_in_the_slots_when_untold(monkeypatch):
    monkeypatch.setattr(ktp, "SINK_ENTRIES", 2)
    store = _store(blocks=8)
    k, v = _rows(B, seed=8)
    other_k, other_v = _rows(B, seed=9)
    # a and b start with token 5 (so with one first row) and differ after it; c with token 6; d names no token
    seqs = {"a": ((k, v), 5),
            "b": ((torch.cat((k[:, :1], other_k[:, 1:]), 1), torch.cat((v[:, :1], other_v[:, 1:]), 1)), 5),
            "c": ((other_k, other_v), 6), "d": (_rows(B, seed=10), None)}
    for block, ((sk, sv), token) in enumerate(seqs.values()):
        _write(store, list(range(block * B, block * B + B)), list(range(B)), sk, sv, token)
    assert store.coded.tokens(store.kv, torch.arange(4)).tolist() == [5, 5, 6, -1]
    assert store.coded.sink_tokens == [5, 6]  # one cached row a first token
    assert store.coded.constant_bytes == 2 * L * 2 * H * D * 4

    def check(block):
        (sk, sv), token = list(seqs.values())[block]
        got_k, got_v = _read(store, block)
        want_k, want_v = _expected(sk, sv, 0, untold=token is None)
        torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-5)
        torch.testing.assert_close(got_v, want_v, rtol=0, atol=1e-5)

    for block in range(4):
        check(block)
    assert torch.equal(_read(store, 3)[0][:, 0], seqs["d"][0][0][:, 0].bfloat16().float())  # held at bf16
    # a third first token evicts the least recently used (5, read before 6): its rows come back from recompute
    e_k, e_v = _rows(B, seed=12)
    _write(store, list(range(4 * B, 5 * B)), list(range(B)), e_k, e_v, 9)
    assert store.coded.sink_tokens == [6, 9]
    with pytest.raises(InvariantError, match="no longer cached"):
        _read(store, 0)
    asked = []

    def recompute(token):
        asked.append(token)
        return torch.stack((k[:, 0], v[:, 0]), 1)  # [layers, 2, heads, dim]: token 5's rows

    store.coded.recompute = recompute
    check(0)
    check(1)
    assert asked == [5] and store.coded.recomputed == 1  # once for every layer, then cached again
    # the same token with another first row is no token's: refused, never read back as another's
    bad_k = k.clone()
    bad_k[1, 0] += 5.0
    with pytest.raises(InvariantError, match="token alone"):
        _write(store, list(range(5 * B, 6 * B)), list(range(B)), bad_k, v, 5)


def test_a_first_block_sealed_by_its_last_decoded_row_keeps_its_sink_row_exact():
    store = _store()
    k, v = _rows(B, seed=11)
    _write(store, list(range(B, B + 5)), list(range(5)), k[:, :5], v[:, :5])  # block 1 open: 5 rows
    for i in range(5, B):
        _write(store, [B + i], [i], k[:, i:i + 1], v[:, i:i + 1])
    assert store.open_blocks() == 0 and store.coded.tokens(store.kv, torch.tensor([1])).tolist() == [FIRST_TOKEN]
    got_k, got_v = _read(store, 1)
    want_k, want_v = _expected(k, v, 0)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_v, want_v, rtol=0, atol=1e-5)
    assert torch.equal(got_k[:, 0], k[:, 0])


def test_copies_and_swaps_carry_a_page_and_its_position_to_other_blocks():
    store = _store()
    k, v = _rows(16, seed=4)
    _write(store, list(range(16)), list(range(16, 32)), k, v)
    before = [_read(store, b) for b in (0, 1)]
    taken = store.take_blocks([0, 1])
    store.put_blocks([5, 6], taken)
    store.copy_blocks([(1, 7)])
    for b, ref in ((5, before[0]), (6, before[1]), (7, before[1])):
        got = _read(store, b)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert store.coded.positions(store.kv, torch.tensor([5, 6, 7])).tolist() == [16, 24, 24]


def test_a_sealing_write_without_positions_and_tables_that_do_not_fit_are_refused():
    store = _store()
    k, v = _rows(8, seed=5)
    with pytest.raises(ConfigError, match="positions"):
        store.write(0, list(range(8)), k[0], v[0])
    store.write(0, [8, 9], k[0, :2], v[0, :2])  # an open block's rows need none
    wide = ktp.TransformTables(_side(((60.0, 60.0), (60.0, 60.0)), 0), TABLES.values, "wide")
    with pytest.raises(ConfigError, match="bytes a page"):
        _store(tables=wide)
    with pytest.raises(ConfigError, match="tables"):
        KVStore(SPEC, 4, residual_slots=1)
    other = KVSpec(layers=L, kv_heads=1, head_dim=D, block_size=B, kv_dtype="kvtc")
    with pytest.raises(ConfigError, match="tables"):
        KVStore(other, 4, residual_slots=1, transform=TABLES, rope_inv_freq=INV_FREQ.float())


def test_tables_saved_and_loaded_code_the_same_slots(tmp_path):
    path = tmp_path / "t.pt"
    TABLES.to_file(path, revision="test")
    back = ktp.TransformTables.from_file(path)
    k, _ = _rows(8, seed=6)
    x = k[1].transpose(0, 1)[1:2].contiguous()  # one block of head 1 of layer 1
    assert torch.equal(back.keys.encode(1, 1, x)[0], TABLES.keys.encode(1, 1, x)[0])
    (tmp_path / "bad.pt").write_bytes(b"not tables")
    with pytest.raises(ConfigError, match="unreadable"):
        ktp.TransformTables.from_file(tmp_path / "bad.pt")
    with pytest.raises(ConfigError, match="none ship"):
        ktp.load_for("sha256:0000000000000000")


def test_a_models_tables_are_found_on_it_or_refused_in_one_line():
    class Decoder:
        pass

    bare = Decoder()
    with pytest.raises(ConfigError, match="kvtc needs the model's transform-coding tables; this decoder has none"):
        ktp.for_model(bare)
    bare.kv_transform = TABLES
    assert ktp.for_model(bare) is TABLES  # set on the model (or loaded once): kept there
