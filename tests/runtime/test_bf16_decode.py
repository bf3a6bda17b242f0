"""bf16 decode attention on AVX-512 BF16 dot products (``paged_decode_bf16``, csrc/kvledger_bf16_decode.h).

It must give what the portable kernel gives: the same bf16 inputs, fp32 softmax and weighted sum, only the
order of a score's fp32 additions differs, so outputs agree with ``paged_decode`` to one bf16 rounding and
with a float64 reference of the same inputs to bf16 precision. Shapes it does not cover, and fp32 queries,
take ``paged_decode`` itself (bit for bit). Skipped where the binary has no such kernel (no AVX-512 BF16).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvledger.core import KVSpec
from kvledger.runtime import KVStore, NativePagedAttention, native

pytestmark = pytest.mark.skipif(os.environ.get(native.NATIVE_ENV) == "0", reason="KVLEDGER_NATIVE=0")


def ops():  # noqa: ANN201
    module = native.require()
    if not getattr(module, "HAS_BF16_DOTS", False):
        pytest.skip("this binary has no AVX-512 BF16 decode kernel (the CPU lacks avx512_bf16)")
    return module


def case(G: int, D: int, lens: list[int], seed: int = 0, bs: int = 16, kvh: int = 2, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    per = [-(-n // bs) for n in lens]
    nblk = sum(per) + 3
    kc = torch.randn(nblk, bs, kvh, D, generator=gen).to(dtype)
    vc = torch.randn(nblk, bs, kvh, D, generator=gen).to(dtype)
    order = torch.randperm(nblk, generator=gen).tolist()  # scattered physical blocks
    tables = torch.zeros(len(lens), max(per), dtype=torch.int32)
    at = 0
    for b, p in enumerate(per):
        tables[b, :p] = torch.tensor(order[at:at + p], dtype=torch.int32)
        at += p
    q = (torch.randn(len(lens) + 1, G * kvh, D, generator=gen) * 2).to(dtype)
    rows = torch.arange(1, len(lens) + 1)  # row 0 is someone else's (a prefill's): left alone
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), rows


def dense(q, kc, vc, tables, lens, rows, scale, window=0):  # noqa: ANN001, ANN201
    """float64 attention over the same (bf16) values, row by row."""
    bs, kvh = kc.shape[1], kc.shape[2]
    G = q.shape[1] // kvh
    out = {}
    for b, n in enumerate(lens.tolist()):
        blocks = tables[b, : -(-n // bs)].long()
        k = kc[blocks].reshape(-1, kvh, kc.shape[-1])[:n].double().repeat_interleave(G, dim=1)
        v = vc[blocks].reshape(-1, kvh, vc.shape[-1])[:n].double().repeat_interleave(G, dim=1)
        lo = max(0, n - window) if window else 0
        s = torch.einsum("hd,khd->hk", q[rows[b]].double(), k[lo:]) * scale
        out[b] = torch.einsum("hk,khd->hd", s.softmax(-1), v[lo:])
    return out


@pytest.mark.parametrize(("G", "D"), [(1, 64), (3, 64), (8, 64), (2, 128), (5, 128)])
@pytest.mark.parametrize(("lens", "partition", "window"), [
    ([1, 17, 40, 300, 95], 0, 0),    # whole contexts, mid-block ends, fewer than 16 rows in a block
    ([300, 5], -1, 0),                # few sequences: contexts split across threads and merged
    ([200, 64, 33], 48, 30),          # partitions that end mid-block, a window inside them
])
def test_dot_product_decode_matches_the_portable_kernel(G: int, D: int, lens: list[int], partition: int,
                                                         window: int) -> None:
    m = ops()
    q, kc, vc, tables, ctx, rows = case(G, D, lens, seed=G * D)
    scale = D ** -0.5
    fast, portable = torch.full_like(q, 7.0), torch.full_like(q, 7.0)
    m.paged_decode_bf16(fast, q, kc, vc, tables, ctx, rows, scale, window, partition)
    m.paged_decode(portable, q, kc, vc, tables, ctx, rows, scale, window, partition)
    assert torch.equal(fast[0], portable[0]) and (fast[0] == 7.0).all()  # rows not decoded: untouched
    ref = dense(q, kc, vc, tables, ctx, rows, scale, window)
    for b in range(len(lens)):
        got, base, want = fast[rows[b]].double(), portable[rows[b]].double(), ref[b]
        # One bf16 rounding apart at most (the fp32 results differ in their last bits only) ...
        ulp = torch.maximum(want.abs(), base.abs()) * 2.0 ** -7 + 1e-6
        assert ((got - base).abs() <= ulp).all(), (b, (got - base).abs().max().item())
        # ... and as close to the float64 result as the portable kernel is.
        err, base_err = (got - want).abs().max().item(), (base - want).abs().max().item()
        assert err <= max(2 * base_err, 1e-2), (b, err, base_err)


def test_other_dtypes_and_shapes_take_the_portable_kernel() -> None:
    m = ops()
    for G, D, dtype in ((3, 64, torch.float32), (3, 32, torch.bfloat16), (9, 64, torch.bfloat16)):
        q, kc, vc, tables, ctx, rows = case(G, D, [40, 7], dtype=dtype)
        a, b = torch.empty_like(q), torch.empty_like(q)
        m.paged_decode_bf16(a, q, kc, vc, tables, ctx, rows, 0.125, 0, 0)
        m.paged_decode(b, q, kc, vc, tables, ctx, rows, 0.125, 0, 0)
        assert torch.equal(a[1:], b[1:]), (G, D, dtype)


def test_a_bad_table_is_refused_not_read() -> None:
    m = ops()
    q, kc, vc, tables, ctx, rows = case(3, 64, [40, 7])
    tables[0, 1] = kc.shape[0] + 5
    with pytest.raises(RuntimeError, match="outside the"):
        m.paged_decode_bf16(torch.empty_like(q), q, kc, vc, tables, ctx, rows, 0.125, 0, 0)


@pytest.mark.parametrize(("path", "fast"), [("auto", True), ("avx2", False)])
def test_the_backend_takes_it_for_a_bf16_store_unless_told_avx2(monkeypatch: pytest.MonkeyPatch, path: str,
                                                                fast: bool) -> None:
    m = ops()
    from kvledger.runtime import cpu_features

    monkeypatch.setenv(cpu_features.PATH_ENV, path)
    monkeypatch.setattr(cpu_features, "_detected", None)
    bf16 = NativePagedAttention(KVStore(KVSpec(1, 3, 64, kv_dtype="bf16", block_size=16), 8))
    fp32 = NativePagedAttention(KVStore(KVSpec(1, 3, 64, kv_dtype="fp32", block_size=16), 8))
    if cpu_features.bf16_path() == "avx2" and path == "auto":
        pytest.skip("this CPU's bf16 path is avx2")
    assert (bf16._decode is m.paged_decode_bf16) is fast
    assert fp32._decode is m.paged_decode


def test_the_helper_thread_shares_the_decode_and_changes_no_bit() -> None:
    """The kernel's (sequence, head, partition) items go to the calling thread and the helper thread of
    csrc/kvledger_helper_pool.h in ranges claimed as they come: the same output whoever ran an item, with
    one thread, and with the helper off; and the helper does take ranges (waits for a time slice if busy)."""
    import time

    m = ops()
    q, kc, vc, tables, ctx, rows = case(3, 64, [410, 17, 300, 95, 64, 200, 33, 128], seed=5)
    threads = torch.get_num_threads()

    def run() -> torch.Tensor:
        out = torch.full_like(q, 7.0)
        m.paged_decode_bf16(out, q, kc, vc, tables, ctx, rows, 0.125, 0, 0)
        return out

    try:
        torch.set_num_threads(1)
        alone = run()
        torch.set_num_threads(2)
        m.helper_enabled(0)
        caller_only = run()
        m.helper_enabled(1)
        before, deadline, shared = m.helper_pieces(), time.monotonic() + 30, []
        while m.helper_pieces() == before and time.monotonic() < deadline:
            shared.append(run())
    finally:
        m.helper_enabled(1)
        torch.set_num_threads(threads)
    assert m.helper_pieces() > before
    assert torch.equal(caller_only, alone) and all(torch.equal(s, alone) for s in shared)
