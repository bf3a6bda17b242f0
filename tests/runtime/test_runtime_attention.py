"""Paged attention through block tables equals dense causal attention over the same tokens.

Every behaviour is checked for both CPU paths: ``torch`` (the reference: gathers each context) and
``native`` (the compiled kernels reading K/V in place; built by ``make install``). With
``KVLEDGER_NATIVE=0`` the native cases are skipped; otherwise a missing build fails them.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from kvledger.core import BlockTable, KVLedger, KVSpec, Request
from kvledger.errors import ConfigError
from kvledger.runtime import (
    AttentionBatch,
    KVStore,
    NativePagedAttention,
    TorchPagedAttention,
    attention_backends,
    make_attention_backend,
    native,
    register_attention_backend,
)
from kvledger.runtime import attention as attention_module

DIM = 16
BACKENDS = ["torch", "native"]


def need(backend: str) -> None:
    if backend == "native" and os.environ.get(native.NATIVE_ENV) == "0":
        pytest.skip("KVLEDGER_NATIVE=0: only the pure-torch paths")
    if backend == "native":
        native.require()  # built by `make install`; its absence is a failure, not a skip


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

    def __init__(self, heads: int, kv_heads: int, block_size: int, num_blocks: int = 256, seed: int = 0,
                 backend: str = "torch", dim: int = DIM, kv_dtype: str = "fp32"):
        need(backend)
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.store = KVStore(KVSpec(1, kv_heads, dim, kv_dtype=kv_dtype, block_size=block_size), num_blocks)
        self.backend = make_attention_backend(backend, self.store)
        self.gen = torch.Generator().manual_seed(seed)
        # Scrambled physical order: logical block i of a sequence is nowhere near physical block i.
        self.free = torch.randperm(num_blocks, generator=self.gen).tolist()
        self.tables: list[BlockTable] = []
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def add(self, max_len: int) -> int:
        need = -(-max_len // self.store.block_size)
        self.tables.append(BlockTable(self.store.block_size, [self.free.pop() for _ in range(need)]))
        self.k.append(torch.empty(0, self.kv_heads, self.dim))
        self.v.append(torch.empty(0, self.kv_heads, self.dim))
        return len(self.tables) - 1

    def step(self, new: dict[int, int], window: int | None = None) -> float:
        """Run ``new[seq]`` new tokens for each listed sequence in ONE batch; return max |paged - dense|."""
        r = lambda *s: torch.randn(*s, generator=self.gen)  # noqa: E731
        seqs = list(new)
        starts = [self.k[i].shape[0] for i in seqs]
        qs = [r(new[i], self.heads, self.dim) for i in seqs]
        # What the store holds (a low-precision store rounds K/V; the dense reference sees the same).
        ks = [r(new[i], self.kv_heads, self.dim).to(self.store.dtype).float() for i in seqs]
        vs = [r(new[i], self.kv_heads, self.dim).to(self.store.dtype).float() for i in seqs]
        slots = [x for i, s in zip(seqs, starts, strict=True)
                 for x in self.tables[i].slot_mapping(s, s + new[i])]
        batch = AttentionBatch(starts, [new[i] for i in seqs], [self.tables[i].blocks for i in seqs],
                               torch.tensor(slots))
        self.backend.plan(batch)
        out = self.backend.forward(0, torch.cat(qs), torch.cat(ks), torch.cat(vs), scale=self.dim ** -0.5,
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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
def test_prefill_batch_of_different_lengths(block_size: int, heads: int, kv_heads: int, backend: str) -> None:
    h = Harness(heads, kv_heads, block_size, backend=backend)
    lens = [1, 5, 16, 33]
    for n in lens:
        h.add(n)
    assert h.step(dict(enumerate(lens))) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
def test_chunked_prefill_then_decode(block_size: int, heads: int, kv_heads: int, backend: str) -> None:
    h = Harness(heads, kv_heads, block_size, backend=backend)
    for _ in range(3):
        h.add(64)
    # Chunks that start and end mid-block, then single-token decodes: new tokens see the cache.
    for chunk in ([7, 3, 16], [9, 13, 1], [1, 1, 5], [1, 1, 1], [1, 1, 1]):
        assert h.step(dict(enumerate(chunk))) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [2, 16])
def test_decode_batch_many_lengths(block_size: int, backend: str) -> None:
    h = Harness(8, 2, block_size, num_blocks=256, backend=backend)
    lens = [1, 2, 3, 15, 16, 17, 40]
    for n in lens:
        h.add(n + 4)
    h.step(dict(enumerate(lens)))
    for _ in range(4):
        assert h.step({i: 1 for i in range(len(lens))}) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_batch_prefill_chunk_and_decode_together(backend: str) -> None:
    h = Harness(4, 2, 4, backend=backend)
    for _ in range(4):
        h.add(48)
    assert h.step({0: 10, 1: 3}) < 1e-5
    # seq 0 decodes, seq 1 continues a chunk, seq 2 starts its prefill, seq 3 prefills one token.
    assert h.step({0: 1, 1: 6, 2: 11, 3: 1}) < 1e-5
    assert h.step({2: 1, 0: 1, 3: 9, 1: 1}) < 1e-5  # batch order differs from admission order


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [1, 3, 8])
def test_sliding_window(window: int, backend: str) -> None:
    h = Harness(4, 2, 4, backend=backend)
    for _ in range(2):
        h.add(40)
    assert h.step({0: 12, 1: 5}, window) < 1e-5
    assert h.step({0: 7, 1: 1}, window) < 1e-5
    assert h.step({0: 1, 1: 1}, window) < 1e-5


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_block_tables_from_a_real_ledger(backend_name: str) -> None:
    """Block ids come from KVLedger admission and slots from its tables, not from the test."""
    need(backend_name)
    bs = 4
    ledger = KVLedger(32, bs)
    store = KVStore(KVSpec(1, 2, DIM, kv_dtype="fp32", block_size=bs), ledger.num_blocks)
    backend = make_attention_backend(backend_name, store)
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


# ---- the native kernels at the shapes real models use (head dim 64 / 128: the compiled prefill) -----

@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 128), (8, 1, 64)])
@pytest.mark.parametrize("window", [None, 5, 40])
def test_native_prefill_and_decode_at_model_head_dims(heads: int, kv_heads: int, dim: int, window: int | None) -> None:
    """Chunks that start mid-block, continue a cached context, sit beside decodes; windows cut inside
    a 32-query tile and across blocks."""
    h = Harness(heads, kv_heads, 16, backend="native", dim=dim)
    for _ in range(4):
        h.add(160)
    assert h.step({0: 70, 1: 33, 2: 1}, window) < 1e-5
    assert h.step({0: 1, 1: 40, 2: 50, 3: 100}, window) < 1e-5
    for _ in range(3):
        assert h.step({0: 1, 1: 1, 2: 1, 3: 1}, window) < 1e-5


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16", "fp8_e4m3"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_low_precision_stores_are_read_exactly(kv_dtype: str, backend: str) -> None:
    """The kernels dequantise each stored row to fp32 exactly as a cast would (the reference sees the
    rounded K/V too); queries and outputs stay fp32."""
    h = Harness(9, 3, 16, backend=backend, dim=64, kv_dtype=kv_dtype)
    for _ in range(3):
        h.add(96)
    assert h.step({0: 40, 1: 17, 2: 3}) < 1e-5
    assert h.step({0: 1, 1: 20, 2: 1}) < 1e-5


@pytest.mark.parametrize("partition", [0, 1, 16, 48, 1000])
def test_native_decode_context_partitions_merge_exactly(partition: int) -> None:
    """Splitting a context across work items (flash-decoding) and merging the partial softmax states
    gives the whole-context result, including partitions that end mid-block or are empty."""
    h = Harness(9, 3, 16, backend="native", dim=64)
    assert isinstance(h.backend, NativePagedAttention)
    h.backend.partition = partition
    for n in (5, 200, 97):
        h.add(n + 4)
    h.step({0: 5, 1: 200, 2: 97})
    for _ in range(2):
        assert h.step({0: 1, 1: 1, 2: 1}) < 1e-5
    assert h.step({1: 1}, window=30) < 1e-5  # one sequence, window inside a partition


def test_native_and_torch_agree_in_bf16() -> None:
    """bf16 queries and store: both paths round the same inputs; they agree to bf16 precision."""
    need("native")
    outs = []
    for backend in BACKENDS:
        gen = torch.Generator().manual_seed(3)
        store = KVStore(KVSpec(1, 3, 64, kv_dtype="bf16", block_size=16), 64)
        b = make_attention_backend(backend, store)
        table = torch.randperm(64, generator=gen)[:8].tolist()
        q = torch.randn(100, 9, 64, generator=gen).bfloat16()
        k = torch.randn(100, 3, 64, generator=gen).bfloat16()
        v = torch.randn(100, 3, 64, generator=gen).bfloat16()
        slots = BlockTable(16, table).slot_mapping(0, 100)
        b.plan(AttentionBatch([0], [100], [table], torch.tensor(slots)))
        outs.append(b.forward(0, q, k, v, scale=0.125).float())
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)


def test_native_kernels_refuse_tables_outside_the_store() -> None:
    """A block id past the store is an error raised before any read, never a wild memory access."""
    ops = native.require() if os.environ.get(native.NATIVE_ENV) != "0" else pytest.skip("native disabled")
    store = KVStore(KVSpec(1, 1, 64, kv_dtype="fp32", block_size=16), 4)
    kc, vc = store.blocks(0)
    q, out = torch.zeros(1, 1, 64), torch.zeros(1, 1, 64)
    with pytest.raises(RuntimeError, match="outside the 4-block cache"):
        ops.paged_decode(out, q, kc, vc, torch.tensor([[7]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                         torch.tensor([0]), 0.125, 0, 0)
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        ops.paged_decode(out, q, kc, vc, torch.tensor([[1]], dtype=torch.int32), torch.tensor([17], dtype=torch.int32),
                         torch.tensor([0]), 0.125, 0, 0)
    with pytest.raises(RuntimeError, match="slot 64 out of range"):
        ops.kv_write(kc, vc, torch.tensor([64]), torch.zeros(1, 1, 64), torch.zeros(1, 1, 64))
    one = torch.tensor([1])
    with pytest.raises(RuntimeError, match="outside the 4-block cache"):
        ops.paged_prefill(out, q, kc, vc, torch.tensor([[9]], dtype=torch.int32), torch.tensor([0]), one,
                          torch.tensor([0]), 0.125, 0)


# ---- the registry ---------------------------------------------------------------------------------

def test_registry_names_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    names = attention_backends()
    assert {"auto", "torch", "native"} <= set(names)
    store = KVStore(KVSpec(1, 1, 64, kv_dtype="fp32", block_size=16), 4)
    with pytest.raises(ConfigError, match="unknown attention backend 'flash'.*known: auto, torch, native"):
        make_attention_backend("flash", store)
    assert isinstance(make_attention_backend("torch", store), TorchPagedAttention)
    # auto: the native kernels where they are built, the reference where they are not.
    monkeypatch.setattr(native, "available", lambda: False)
    assert isinstance(make_attention_backend("auto", store), TorchPagedAttention)
    monkeypatch.setattr(native, "available", lambda: True)
    if os.environ.get(native.NATIVE_ENV) != "0":
        assert isinstance(make_attention_backend("auto", store), NativePagedAttention)
    # The native backend refuses what it cannot run, with the reason.
    with pytest.raises(ConfigError, match="runs on the CPU"):
        NativePagedAttention(KVStore(KVSpec(1, 1, 64, kv_dtype="fp32", block_size=16), 4, device="meta"))


def test_a_registered_backend_is_selectable_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a CUDA backend does: register a factory; the runner, engine and CLI then accept its name."""
    monkeypatch.setattr(attention_module, "_BACKENDS", attention_module._BACKENDS.copy())
    made: list[KVStore] = []

    def factory(store: KVStore) -> TorchPagedAttention:
        made.append(store)
        return TorchPagedAttention(store)

    register_attention_backend("counting", factory, "test double around the reference")
    store = KVStore(KVSpec(1, 1, 16, kv_dtype="fp32", block_size=4), 4)
    assert isinstance(make_attention_backend("counting", store), TorchPagedAttention) and made == [store]
    assert attention_backends()["counting"].description == "test double around the reference"
    from click.testing import CliRunner

    from kvledger.cli.main import app
    help_text = CliRunner().invoke(app, ["generate", "--help"]).output
    assert "counting" in help_text and "native" in help_text
