"""Paged attention through block tables equals dense causal attention over the same tokens."""

from __future__ import annotations

import math

import pytest
import torch

from kvledger.core import BlockTable, KVLedger, KVSpec, Request
from kvledger.runtime import AttentionBatch, KVStore, TorchPagedAttention

DIM = 16


def dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None = None,
) -> torch.Tensor:
    """Textbook attention: q ``[n, H, D]`` at positions ``start..``; k/v ``[ctx, KVH, D]``."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    ok = k_pos <= q_pos
    if window is not None:
        ok &= k_pos > q_pos - window
    scores = scores.masked_fill(~ok, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class Harness:
    """A store plus full per-sequence K/V kept densely, so every step can be checked against dense()."""

    def __init__(self, heads: int, kv_heads: int, block_size: int, num_blocks: int = 256, seed: int = 0):
        self.heads, self.kv_heads = heads, kv_heads
        self.store = KVStore(KVSpec(1, kv_heads, DIM, kv_dtype="fp32", block_size=block_size), num_blocks)
        self.backend = TorchPagedAttention(self.store)
        self.gen = torch.Generator().manual_seed(seed)
        # Scrambled physical order: logical block i of a sequence is nowhere near physical block i.
        self.free = torch.randperm(num_blocks, generator=self.gen).tolist()
        self.tables: list[BlockTable] = []
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def add(self, max_len: int) -> int:
        need = -(-max_len // self.store.block_size)
        self.tables.append(BlockTable(self.store.block_size, [self.free.pop() for _ in range(need)]))
        self.k.append(torch.empty(0, self.kv_heads, DIM))
        self.v.append(torch.empty(0, self.kv_heads, DIM))
        return len(self.tables) - 1

    def step(self, new: dict[int, int], window: int | None = None) -> float:
        """Run ``new[seq]`` new tokens for each listed sequence in ONE batch; return max |paged - dense|."""
        r = lambda *s: torch.randn(*s, generator=self.gen)  # noqa: E731
        seqs = list(new)
        starts = [self.k[i].shape[0] for i in seqs]
        qs = [r(new[i], self.heads, DIM) for i in seqs]
        ks = [r(new[i], self.kv_heads, DIM) for i in seqs]
        vs = [r(new[i], self.kv_heads, DIM) for i in seqs]
        slots = [x for i, s in zip(seqs, starts, strict=True)
                 for x in self.tables[i].slot_mapping(s, s + new[i])]
        batch = AttentionBatch(starts, [new[i] for i in seqs], [self.tables[i].blocks for i in seqs],
                               torch.tensor(slots))
        self.backend.plan(batch)
        out = self.backend.forward(0, torch.cat(qs), torch.cat(ks), torch.cat(vs), scale=DIM ** -0.5,
                                   window=window)
        err = 0.0
        for j, i in enumerate(seqs):
            self.k[i] = torch.cat([self.k[i], ks[j]])
            self.v[i] = torch.cat([self.v[i], vs[j]])
            ref = dense(qs[j], self.k[i], self.v[i], starts[j], window)
            got = out[batch.offsets[j] : batch.offsets[j + 1]]
            err = max(err, (got - ref).abs().max().item())
        return err


GQA = [(4, 4), (8, 2), (6, 1)]  # MHA, groups of 4, MQA


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
def test_prefill_batch_of_different_lengths(block_size: int, heads: int, kv_heads: int) -> None:
    h = Harness(heads, kv_heads, block_size)
    lens = [1, 5, 16, 33]
    for n in lens:
        h.add(n)
    assert h.step(dict(enumerate(lens))) < 1e-5


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
def test_chunked_prefill_then_decode(block_size: int, heads: int, kv_heads: int) -> None:
    h = Harness(heads, kv_heads, block_size)
    for _ in range(3):
        h.add(64)
    # Chunks that start and end mid-block, then single-token decodes: new tokens see the cache.
    for chunk in ([7, 3, 16], [9, 13, 1], [1, 1, 5], [1, 1, 1], [1, 1, 1]):
        assert h.step(dict(enumerate(chunk))) < 1e-5


@pytest.mark.parametrize("block_size", [2, 16])
def test_decode_batch_many_lengths(block_size: int) -> None:
    h = Harness(8, 2, block_size, num_blocks=256)
    lens = [1, 2, 3, 15, 16, 17, 40]
    for n in lens:
        h.add(n + 4)
    h.step(dict(enumerate(lens)))
    for _ in range(4):
        assert h.step({i: 1 for i in range(len(lens))}) < 1e-5


def test_mixed_batch_prefill_chunk_and_decode_together() -> None:
    h = Harness(4, 2, 4)
    for _ in range(4):
        h.add(48)
    assert h.step({0: 10, 1: 3}) < 1e-5
    # seq 0 decodes, seq 1 continues a chunk, seq 2 starts its prefill, seq 3 prefills one token.
    assert h.step({0: 1, 1: 6, 2: 11, 3: 1}) < 1e-5
    assert h.step({2: 1, 0: 1, 3: 9, 1: 1}) < 1e-5  # batch order differs from admission order


@pytest.mark.parametrize("window", [1, 3, 8])
def test_sliding_window(window: int) -> None:
    h = Harness(4, 2, 4)
    for _ in range(2):
        h.add(40)
    assert h.step({0: 12, 1: 5}, window) < 1e-5
    assert h.step({0: 7, 1: 1}, window) < 1e-5
    assert h.step({0: 1, 1: 1}, window) < 1e-5


def test_block_tables_from_a_real_ledger() -> None:
    """Block ids come from KVLedger admission and slots from its tables, not from the test."""
    bs = 4
    ledger = KVLedger(32, bs)
    store = KVStore(KVSpec(1, 2, DIM, kv_dtype="fp32", block_size=bs), ledger.num_blocks)
    backend = TorchPagedAttention(store)
    gen = torch.Generator().manual_seed(1)
    prompts = {"a": list(range(10)), "b": list(range(100, 107))}
    for rid, p in prompts.items():
        ledger.admit(Request(rid, p, 4)).raise_for_outcome()
    seqs = [ledger.sequence(rid) for rid in prompts]
    lens = [len(p) for p in prompts.values()]
    q = torch.randn(sum(lens), 4, DIM, generator=gen)
    k = torch.randn(sum(lens), 2, DIM, generator=gen)
    v = torch.randn(sum(lens), 2, DIM, generator=gen)
    slots = [x for s, n in zip(seqs, lens, strict=True) for x in s.table.slot_mapping(0, n)]
    batch = AttentionBatch([0, 0], lens, [s.table.blocks for s in seqs], torch.tensor(slots))
    backend.plan(batch)
    out = backend.forward(0, q, k, v, scale=DIM ** -0.5)
    ref = torch.cat([dense(q[:10], k[:10], v[:10], 0), dense(q[10:], k[10:], v[10:], 0)])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
