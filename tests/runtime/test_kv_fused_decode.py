"""The native decode reads quantised codes in place (issue 36): fused dequantisation, e4m3 without a table, and the
quantising write of the per-token formats, each held to the torch reference."""

from __future__ import annotations

import os

import pytest
import torch

from kvledger.core import BlockTable, KVSpec
from kvledger.runtime import AttentionBatch, KVStore, make_attention_backend, native
from kvledger.runtime.attention import _quant_layout

QUANTISED = ["fp8-scaled", "int8", "int8-token", "int8-hadamard", "int4", "int4-hadamard"]


@pytest.fixture(autouse=True)
def _native() -> None:
    if os.environ.get(native.NATIVE_ENV) == "0":
        pytest.skip("KVLEDGER_NATIVE=0: only the pure-torch paths")
    native.require()


@pytest.mark.parametrize("dim", [64, 32])  # 64: the fused decode; 32: the loader
def test_every_finite_e4m3_code_reads_back_exactly_as_torchs_cast(dim: int) -> None:
    """fp8-scaled's codes are decoded by bit arithmetic (no 256-entry table): each of the 254 finite codes,
    times its row's scale, equals torch's float8_e4m3fn -> fp32 cast times that scale, bit for bit."""
    spec = KVSpec(1, 1, dim, kv_dtype="fp8-scaled", block_size=16)
    store = KVStore(spec, 1)
    p = store.parts(0)
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    codes = finite.repeat(-(-16 * dim // finite.numel()))[: 16 * dim].view(16, 1, dim)
    p["v.codes"][0] = codes.view(torch.float8_e4m3fn)
    p["v.scale"][0] = torch.linspace(0.5, 3.0, 16, dtype=torch.float16)[:, None]
    ops = native.require()
    q = torch.randn(16, 1, dim)
    out = torch.empty_like(q)
    # Sequence b has context b + 1 and a window of 1: it reads row b alone, so its output is that row.
    ops.paged_decode_q(out, q, store.kv[0], _quant_layout(store), 16, 1, torch.empty(0), torch.empty(0),
                       torch.zeros(16, 1, dtype=torch.int32), torch.arange(1, 17, dtype=torch.int32),
                       torch.arange(16), 0.125, 1, 0)
    want = codes.view(torch.float8_e4m3fn).float() * p["v.scale"][0].float()[..., None]
    assert torch.equal(out, want)


@pytest.mark.parametrize("fmt", ["int8-token", "fp8-scaled", "int8-hadamard", "int4-hadamard"])
def test_the_native_quantising_write_stores_the_bytes_the_torch_store_writes(fmt: str) -> None:
    """kv_write_q quantises per token in C++ exactly as kv_quant does (quant_token; int4-hadamard's _asym over
    turned rows): same codes, scales and minimums, for rows with an outlier channel, a zero row and bf16 input."""
    stores = []
    for backend in ("torch", "native"):
        spec = KVSpec(1, 2, 64, kv_dtype=fmt, block_size=16)
        store = KVStore(spec, 4)
        be = make_attention_backend(backend, store)
        g = torch.Generator().manual_seed(11)
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (torch.randn(20, n, 64, generator=g).to(dtype) for n in (4, 2, 2))
            k[:, :, 5] *= 40
            v[3] = 0
            table = [1, 3] if dtype == torch.float32 else [2, 0]
            slots = torch.tensor(BlockTable(16, table).slot_mapping(0, 20))
            be.plan(AttentionBatch([0], [20], [table], slots))
            be.forward(0, q, k, v, scale=0.125)
        stores.append(store)
    assert torch.equal(stores[0].kv, stores[1].kv)


@pytest.fixture
def int_dot():
    """Switches the integer-dot kernels (AVX-512 VNNI builds) for one test: int_dot(False) -> the float kernels."""
    ops = native.require()
    before = ops.int_dot(-1)

    def switch(on: bool) -> bool:
        return ops.int_dot(1 if on else 0)

    yield switch
    ops.int_dot(1 if before else 0)


def _decode_and_reference(fmt: str, group: int, dim: int) -> tuple[torch.Tensor, list[torch.Tensor], KVStore]:
    """Decode one token for two sequences (300 and 45 tokens of context: sealed blocks read in place from their
    codes, an open block from its residual page, contexts split across work items) and dense attention over
    the store's dequantised rows."""
    kv_heads = 2
    spec = KVSpec(1, kv_heads, dim, kv_dtype=fmt, block_size=16, residual_dtype="fp32")
    store = KVStore(spec, 48, residual_slots=4)
    be = make_attention_backend("native", store)
    gen = torch.Generator().manual_seed(group * dim)
    tables = [BlockTable(16, list(range(0, 22))), BlockTable(16, list(range(22, 26)))]
    lens = [300, 45]
    q = torch.randn(sum(lens), kv_heads * group, dim, generator=gen)
    k = torch.randn(q.shape[0], kv_heads, dim, generator=gen) * 2 + 0.5
    k[..., 7] += 15  # an outlier channel
    v = torch.randn(q.shape[0], kv_heads, dim, generator=gen)
    slots = [s for t, n in zip(tables, lens, strict=True) for s in t.slot_mapping(0, n)]
    be.plan(AttentionBatch([0, 0], lens, [t.blocks for t in tables], torch.tensor(slots)))
    be.forward(0, q, k, v, scale=dim ** -0.5)
    qd = torch.randn(2, kv_heads * group, dim, generator=gen)
    kd, vd = torch.randn(2, kv_heads, dim, generator=gen), torch.randn(2, kv_heads, dim, generator=gen)
    dslots = [t.slot_mapping(n, n + 1)[0] for t, n in zip(tables, lens, strict=True)]
    be.plan(AttentionBatch(lens, [1, 1], [t.blocks for t in tables], torch.tensor(dslots)))
    out = be.forward(0, qd, kd, vd, scale=dim ** -0.5)
    refs = []
    for i, (t, n) in enumerate(zip(tables, lens, strict=True)):
        rk, rv = store.read(0, torch.tensor(t.slot_mapping(0, n + 1)), torch.float32)
        rk, rv = rk.repeat_interleave(group, 1), rv.repeat_interleave(group, 1)
        w = (torch.einsum("hd,khd->hk", qd[i], rk) * dim ** -0.5).softmax(-1)
        refs.append(torch.einsum("hk,khd->hd", w, rv))
    return out, refs, store


@pytest.mark.parametrize(("group", "dim"), [(1, 64), (3, 64), (8, 128), (2, 128)])
@pytest.mark.parametrize("fmt", QUANTISED)
def test_fused_decode_equals_attention_over_the_rows_the_store_holds(fmt: str, group: int, dim: int, int_dot) -> None:
    """Decode over sealed blocks (read in place from their codes) and an open block (its residual page), with
    contexts split across work items, equals dense attention over the store's dequantised rows (the float
    kernels)."""
    int_dot(False)
    out, refs, store = _decode_and_reference(fmt, group, dim)
    for i, ref in enumerate(refs):
        # fp32 rounding only: the Hadamard formats turn values back once per output row (a 128-term sum),
        # which reorders additions; a wrong code, scale or block shows as 1e-2 or more.
        assert (out[i] - ref).abs().max() < (5e-5 if "hadamard" in fmt else 2e-5)
    if store.format.has_residual:
        assert store.open_blocks() == 2  # 301 and 46 tokens: both tails are open


# The formats with integer-dot kernels: int8-channel / int4 keys, int8 / 4-bit per-token values.
INT_DOT = ["int8", "int8-hadamard", "int8-channel", "int4", "int4-hadamard"]


@pytest.mark.parametrize(("group", "dim"), [(1, 64), (3, 64), (8, 128), (2, 128)])
@pytest.mark.parametrize("fmt", INT_DOT)
def test_integer_dot_decode_stays_within_its_stated_error(fmt: str, group: int, dim: int, int_dot) -> None:
    """The integer-dot kernels (a 15-bit query against the key codes, 15-bit weights against the value codes)
    give dense attention over the store's rows to within 1e-3 (outputs of size ~1; measured 4e-5 to 2.1e-4,
    the float kernels 3e-7 to 2e-5, the formats' own rounding ~1e-2), and they do run: their output is not the
    float kernels' bit for bit."""
    if not int_dot(True):
        pytest.skip("this build has no integer-dot kernels (no AVX-512 VNNI)")
    out, refs, _ = _decode_and_reference(fmt, group, dim)
    int_dot(False)
    out_float, _, _ = _decode_and_reference(fmt, group, dim)
    for i, ref in enumerate(refs):
        assert (out[i] - ref).abs().max() < 1e-3
    assert not torch.equal(out, out_float)


@pytest.mark.parametrize("fmt", ["fp32", "int8"])
def test_a_small_decode_runs_unsplit_on_the_calling_thread(fmt: str) -> None:
    """A decode step of a few hundred token x KV-head rows is not split into flash-decoding partitions for
    threads to share (waking the pool costs more than it saves): with the automatic partition its output is the
    unsplit decode's bit for bit, while a split (which sums in another order) is not; a long one still splits."""
    from kvledger.runtime.attention import _quant_layout

    ops = native.require()
    spec = KVSpec(1, 2, 64, kv_dtype=fmt, block_size=16)
    store = KVStore(spec, 200)
    gen = torch.Generator().manual_seed(5)
    n = 2000
    table = list(range(0, 2000 // 16 + 1))
    slots = torch.tensor(BlockTable(16, table).slot_mapping(0, n))
    store.write(0, slots, torch.randn(n, 2, 64, generator=gen), torch.randn(n, 2, 64, generator=gen))
    q = torch.randn(1, 6, 64, generator=gen)
    tables = torch.tensor([table], dtype=torch.int32)

    def decode(length: int, partition: int) -> torch.Tensor:
        out = torch.empty_like(q)
        lens = torch.tensor([length], dtype=torch.int32)
        if fmt == "fp32":
            kc, vc = store.blocks(0)
            ops.paged_decode(out, q, kc, vc, tables, lens, torch.arange(1), 0.125, 0, partition)
        else:
            e = torch.empty(0)
            ops.paged_decode_q(out, q, store.kv[0], _quant_layout(store), 16, 2, e, e, tables, lens, torch.arange(1),
                               0.125, 0, partition)
        return out

    assert torch.equal(decode(300, -1), decode(300, 300))  # 600 rows: inline, unsplit
    assert not torch.equal(decode(300, 150), decode(300, 300))  # a split is visible in the bits
    assert not torch.equal(decode(2000, -1), decode(2000, 2000))  # 4,000 rows: split for the threads


@pytest.mark.parametrize("window", [None, 200])
@pytest.mark.parametrize("partition", [-1, 64])
@pytest.mark.parametrize("fmt", QUANTISED)
def test_decode_reads_every_block_of_every_kv_head_once(fmt: str, partition: int, window: int | None,
                                                        int_dot) -> None:
    """Every block of every KV head is read once, whatever the work split. With three KV heads, five sequences
    of uneven length in scattered blocks, contexts whole or cut into partitions, a window, and two threads whose
    shares of the work items begin and end inside a (sequence, partition)'s heads, the float kernels' output
    equals dense attention over the store's rows to fp32 rounding: one block dropped or read twice for one head
    moves that head's output by 2e-2 or more (measured on these rows, every format), as does a head given
    another head's rows."""
    int_dot(False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        kv_heads, group, dim = 3, 3, 64
        spec = KVSpec(1, kv_heads, dim, kv_dtype=fmt, block_size=16, residual_dtype="fp32")
        store = KVStore(spec, 80, residual_slots=8)
        be = make_attention_backend("native", store)
        be.partition = partition  # 64: 9 partitions, 135 items, 68 to the first thread (68 = 3 * 22 + 2)
        gen = torch.Generator().manual_seed(3)
        lens = [300, 45, 130, 17, 520]
        ids = torch.randperm(80, generator=gen).tolist()
        tables, used = [], 0
        for n in lens:
            need = -(-(n + 1) // 16)
            tables.append(BlockTable(16, ids[used:used + need]))
            used += need
        q = torch.randn(sum(lens), kv_heads * group, dim, generator=gen)
        k = torch.randn(q.shape[0], kv_heads, dim, generator=gen) + torch.arange(kv_heads)[:, None]
        v = torch.randn(q.shape[0], kv_heads, dim, generator=gen) * (1 + torch.arange(kv_heads)[:, None])
        slots = [s for t, n in zip(tables, lens, strict=True) for s in t.slot_mapping(0, n)]
        be.plan(AttentionBatch([0] * len(lens), lens, [t.blocks for t in tables], torch.tensor(slots)))
        be.forward(0, q, k, v, scale=dim ** -0.5)
        qd = torch.randn(len(lens), kv_heads * group, dim, generator=gen)
        kd, vd = (torch.randn(len(lens), kv_heads, dim, generator=gen) for _ in range(2))
        dslots = [t.slot_mapping(n, n + 1)[0] for t, n in zip(tables, lens, strict=True)]
        be.plan(AttentionBatch(lens, [1] * len(lens), [t.blocks for t in tables], torch.tensor(dslots)))
        out = be.forward(0, qd, kd, vd, scale=dim ** -0.5, window=window)
        for i, (t, n) in enumerate(zip(tables, lens, strict=True)):
            rows = torch.tensor(t.slot_mapping(0, n + 1))[-window if window else 0:]
            rk, rv = store.read(0, rows, torch.float32)
            rk, rv = rk.repeat_interleave(group, 1), rv.repeat_interleave(group, 1)
            w = (torch.einsum("hd,khd->hk", qd[i], rk) * dim ** -0.5).softmax(-1)
            ref = torch.einsum("hk,khd->hd", w, rv)
            assert (out[i] - ref).abs().max() < (5e-5 if "hadamard" in fmt else 2e-5), (i, n)
    finally:
        torch.set_num_threads(threads)
