"""Paged attention with the scale and the dtypes a real model uses, on every path, against a dense reference.

The older attention tests call ``forward`` with the default scale ``head_dim ** -0.5`` and fp32 tensors, so a
path that ignored the scale it is given, or returned fp32 for bf16 queries, passed them. A model whose
config sets ``query_pre_attn_scalar`` (Gemma) or a softmax temperature gets another scale, and a bf16 model
expects bf16 activations back: both are checked here, for prefill chunks (fresh and continuing a cached
context), single-token decodes padded beside longer ones, sliding windows, and every KV format.

``native`` cases run the compiled CPU kernels; with ``KVLEDGER_NATIVE=0`` (how mutmut runs) they are
skipped and the torch reference is what is checked. Also pinned: :class:`AttentionBatch`'s positions and
refusals, the backends' error messages and the registry's choice of backend with and without the kernels.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from int_dot import decode_tol
from kvledger.core import BlockTable, KVSpec
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

BACKENDS = ["torch", "native"]
NATIVE_OFF = os.environ.get(native.NATIVE_ENV) == "0"


def need(backend: str) -> None:
    """Skip the native cases where the kernels are switched off; a missing build fails them."""
    if backend == "native" and NATIVE_OFF:
        pytest.skip("KVLEDGER_NATIVE=0: only the pure-torch paths")
    if backend == "native":
        native.require()


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
          window: int | None = None) -> torch.Tensor:
    """Textbook attention in fp64: q ``[n, H, D]`` at positions ``start..``; k/v ``[ctx, KVH, D]``."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    ok = k_pos <= q_pos
    if window is not None:
        ok &= k_pos > q_pos - window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~ok, -math.inf).softmax(-1), v)


class Run:
    """One store of two layers and a backend over it; each sequence's context slots are kept, so each
    step is checked against dense() over what the store holds."""

    def __init__(self, backend: str, *, heads: int = 6, kv_heads: int = 2, dim: int = 16, block_size: int = 4,
                 kv_dtype: str = "fp32", dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        need(backend)
        spec = KVSpec(2, kv_heads, dim, kv_dtype=kv_dtype, block_size=block_size,
                      residual_dtype="fp32" if kv_dtype == "int4" else None)
        self.store = KVStore(spec, 64)
        self.backend = make_attention_backend(backend, self.store)
        self.heads, self.kv_heads, self.dim, self.dtype = heads, kv_heads, dim, dtype
        self.gen = torch.Generator().manual_seed(seed)
        free = torch.randperm(64, generator=self.gen).tolist()  # scrambled physical blocks
        self.tables = [free[i * 12:(i + 1) * 12] for i in range(4)]
        self.slots: list[list[int]] = [[] for _ in range(4)]  # each sequence's context, in order

    def step(self, new: dict[int, int], scale: float, window: int | None = None, tol: float = 1e-5,
             first_window: int | None | str = "same") -> None:
        """``new[seq]`` new tokens per listed sequence in one batch through both layers (layer 0 with
        ``first_window``, by default the same as layer 1's: hybrid models mix them in one step); asserts
        every row of both layers against dense()."""
        r = lambda n, h: torch.randn(n, h, self.dim, generator=self.gen).to(self.dtype)  # noqa: E731
        seqs = list(new)
        starts = [len(self.slots[i]) for i in seqs]
        bs = self.store.block_size
        slots = [x for i, s in zip(seqs, starts, strict=True)
                 for x in BlockTable(bs, self.tables[i]).slot_mapping(s, s + new[i])]
        batch = AttentionBatch(starts, [new[i] for i in seqs], [self.tables[i] for i in seqs], torch.tensor(slots))
        for j, i in enumerate(seqs):
            self.slots[i] += slots[batch.offsets[j]:batch.offsets[j + 1]]
        self.backend.plan(batch)
        for layer, win in ((0, window if first_window == "same" else first_window), (1, window)):
            qs = [r(new[i], self.heads) for i in seqs]
            ks = [r(new[i], self.kv_heads) for i in seqs]
            vs = [r(new[i], self.kv_heads) for i in seqs]
            out = self.backend.forward(layer, torch.cat(qs), torch.cat(ks), torch.cat(vs), scale=scale, window=win)
            assert out.dtype == self.dtype and out.shape == (sum(new.values()), self.heads, self.dim)
            for j, i in enumerate(seqs):
                # The whole context as the store holds it now (int4 seals a block when the step's last layer
                # writes its last row), read back through its own dequantisation: the reference's K/V.
                k, v = self.store.read(layer, torch.tensor(self.slots[i]), torch.float64)
                ref = dense(qs[j], k, v, starts[j], scale, win)  # type: ignore[arg-type]
                got = out[batch.offsets[j]:batch.offsets[j + 1]].double()
                err = (got - ref).abs().max().item()
                assert err < tol, f"layer {layer}, sequence {i}: max error {err} (scale {scale}, window {win})"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dim", [16, 64])
def test_every_path_attends_with_the_scale_it_is_given(backend: str, dim: int) -> None:
    """Fresh prefills, a chunk continuing its context, decodes of different lengths padded into one call,
    and all of it again with a sliding window: each at a scale far from ``dim ** -0.5``."""
    run = Run(backend, dim=dim)
    for scale in (1.3, 0.02):
        assert abs(scale - dim ** -0.5) > 0.1
    run.step({0: 9, 1: 3, 2: 1}, scale=1.3)  # prefills, one of a single token (a decode at position 0)
    run.step({0: 1, 1: 6, 2: 3, 3: 5}, scale=0.02)  # decodes beside continued chunks (one from position 1)
    run.step({0: 1, 1: 1, 2: 1, 3: 1}, scale=1.3)  # decodes only
    run.step({0: 1, 1: 7, 3: 1}, scale=0.9, window=3)
    run.step({0: 1, 1: 1, 2: 4, 3: 1}, scale=1.7, window=5)
    run.step({0: 1, 1: 3, 2: 1, 3: 1}, scale=0.9, window=2, first_window=None)  # a full and a sliding layer
    run.step({0: 4, 1: 2}, scale=1.2, window=None, first_window=3)  # prefill chunks only, no decode


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("dtype", "kv_dtype"), [(torch.bfloat16, "bf16"), (torch.float16, "fp16"),
                                                 (torch.bfloat16, "fp32"), (torch.float16, "bf16")])
@pytest.mark.parametrize("dim", [16, 64])
def test_low_precision_queries_get_outputs_of_their_own_dtype(backend: str, dtype: torch.dtype, kv_dtype: str,
                                                              dim: int) -> None:
    """A bf16/fp16 model gets its activations back in its dtype from every path, within that dtype's
    rounding of the exact answer over the K/V the store holds."""
    run = Run(backend, dim=dim, kv_dtype=kv_dtype, dtype=dtype, seed=1)
    run.step({0: 10, 1: 2, 2: 1}, scale=0.6, tol=3e-2)
    run.step({0: 1, 1: 5, 2: 1, 3: 7}, scale=0.3, tol=3e-2)
    run.step({0: 1, 1: 1, 2: 1, 3: 1}, scale=0.6, window=4, tol=3e-2)
    run.step({0: 3, 3: 2}, scale=0.6, tol=3e-2)  # prefill chunks only


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2", "fp8", "int8", "int8-token", "int4"])
@pytest.mark.parametrize(("dim", "dtype"), [(16, torch.float32), (64, torch.float32), (16, torch.bfloat16),
                                            (64, torch.bfloat16)])
def test_every_kv_format_is_attended_exactly_as_it_is_held(backend: str, kv_dtype: str, dim: int,
                                                           dtype: torch.dtype) -> None:
    """Attention reads what the store holds (its own dequantisation): chunks that end mid-block leave int4
    blocks open in their residual pages, later steps seal them; scales differ step to step; bf16 queries
    get bf16 outputs."""
    run = Run(backend, dim=dim, kv_dtype=kv_dtype, dtype=dtype, seed=2)
    tol = decode_tol(backend, kv_dtype, 1e-4) if dtype == torch.float32 else 8e-2  # bf16: K/V read as bf16 too
    run.step({0: 6, 1: 4, 2: 1}, scale=0.8, tol=tol)
    run.step({0: 3, 1: 1, 2: 1, 3: 9}, scale=0.15, tol=tol)
    run.step({0: 1, 1: 1, 2: 1, 3: 1}, scale=1.1, tol=tol)
    run.step({0: 1, 1: 2, 2: 1, 3: 1}, scale=0.5, window=6, tol=tol)


# ---- the batch ----------------------------------------------------------------------------------------

def test_a_batch_knows_each_tokens_position_and_each_sequences_context() -> None:
    """Positions feed RoPE: a wrong one is a wrong token. Mixed prefill/decode and decode-only batches."""
    mixed = AttentionBatch([5, 0, 2], [3, 1, 2], [[0, 1], [2], [3]], torch.tensor([5, 6, 7, 8, 14, 15]))
    assert mixed.positions.tolist() == [5, 6, 7, 0, 2, 3]
    assert mixed.positions.dtype == torch.long
    assert mixed.offsets == [0, 3, 4, 6] and mixed.context_lens == [8, 1, 4] and mixed.num_seqs == 3
    decode = AttentionBatch([7, 0, 30], [1, 1, 1], [[0, 1], [2], [3, 4, 5, 6, 7, 8, 9, 10]], torch.tensor([7, 8, 42]))
    assert decode.positions.tolist() == [7, 0, 30] and decode.offsets == [0, 1, 2, 3]
    assert decode.context_lens == [8, 1, 31]
    # Two sequences whose first chunk has as many tokens as there are sequences: still not decode-only.
    two = AttentionBatch([5, 0], [2, 3], [[0, 1], [2]], torch.tensor([5, 6, 8, 9, 10]))
    assert two.positions.tolist() == [5, 6, 0, 1, 2]


def test_a_batch_refuses_what_is_not_a_step_naming_the_problem() -> None:
    one = torch.tensor([0])
    with pytest.raises(ConfigError, match=r"^starts, query_lens and block_tables must have one entry per sequence$"):
        AttentionBatch([0, 1], [1], [[0]], one)
    with pytest.raises(ConfigError, match=r"^starts, query_lens and block_tables must have one entry per sequence$"):
        AttentionBatch([0], [1], [[0], [1]], one)
    with pytest.raises(ConfigError, match=r"^sequence 1: start -1 / 1 new tokens are not a valid step$"):
        AttentionBatch([0, -1], [1, 1], [[0], [1]], torch.tensor([0, 1]))
    with pytest.raises(ConfigError, match=r"^sequence 0: start 3 / 0 new tokens are not a valid step$"):
        AttentionBatch([3], [0], [[0]], torch.tensor([], dtype=torch.long))
    with pytest.raises(ConfigError, match=r"^slot mapping has 2 slots for 5 new tokens$"):
        AttentionBatch([0, 4], [3, 2], [[0], [1, 2]], torch.tensor([0, 1]))
    # Boundaries that are valid: a step at position 0, one token.
    AttentionBatch([0], [1], [[0]], one)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_block_table_too_short_for_the_step_is_refused_before_any_write(backend: str) -> None:
    need(backend)
    store = KVStore(KVSpec(1, 1, 16, kv_dtype="fp32", block_size=4), 8)
    attn = make_attention_backend(backend, store)
    for starts, lens in (([6], [3]), ([8], [1])):  # 9 tokens need 3 blocks; so do 9 for a decode at 8
        with pytest.raises(ConfigError, match=r"^block table of 2 blocks cannot hold 9 tokens$"):
            attn.plan(AttentionBatch(starts, lens, [[1, 2]], torch.arange(lens[0])))
    # Exactly full: 8 tokens in 2 blocks of 4 plan fine.
    attn.plan(AttentionBatch([7], [1], [[1, 2]], torch.tensor([11])))


@pytest.mark.parametrize(("backend", "cls"), [("torch", "TorchPagedAttention"), ("native", "NativePagedAttention")])
def test_forward_before_plan_is_an_error_naming_the_backend(backend: str, cls: str) -> None:
    need(backend)
    attn = make_attention_backend(backend, KVStore(KVSpec(1, 1, 16, kv_dtype="fp32", block_size=4), 4))
    x = torch.zeros(1, 1, 16)
    with pytest.raises(RuntimeError, match=rf"^{cls}\.forward called before plan\(\)$"):
        attn.forward(0, x, x, x, scale=0.25)


@pytest.mark.parametrize("window", [None, 2])
def test_the_reference_backend_keeps_every_tensor_on_the_stores_device(window: int | None) -> None:
    """``torch`` is the backend for any device (a CUDA store without a CUDA backend runs it): its plan, masks
    and output must live where the store and the queries are, or SDPA refuses the mix. ``meta`` (no data)
    stands in for a GPU on a CPU-only machine: a tensor left on the CPU shows as a device mismatch."""
    store = KVStore(KVSpec(1, 2, 16, kv_dtype="fp32", block_size=4), 8, device="meta")
    attn = TorchPagedAttention(store)
    # A fresh prefill, a chunk continuing its context (an explicit mask), and a decode.
    batch = AttentionBatch([0, 2, 7], [3, 2, 1], [[1], [2], [3, 4]], torch.tensor([4, 5, 6, 10, 11, 19]).to("meta"))
    assert batch.positions.device.type == "meta"
    attn.plan(batch)
    q, kv = torch.empty(6, 4, 16, device="meta"), torch.empty(6, 2, 16, device="meta")
    out = attn.forward(0, q, kv, kv, scale=0.3, window=window)
    assert out.device.type == "meta" and out.shape == (6, 4, 16) and out.dtype == torch.float32


# ---- choosing a backend -------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp8", "int8", "int4"])
def test_auto_takes_the_native_kernels_exactly_when_they_load(kv_dtype: str) -> None:
    """``auto`` (the default) is native for every format when the kernels load, and the torch reference when
    they do not (``KVLEDGER_NATIVE=0``, no build); ``native`` itself then says why it is unavailable."""
    store = KVStore(KVSpec(1, 2, 16, kv_dtype=kv_dtype, block_size=4), 4)
    chosen = make_attention_backend("auto", store)
    if native.available():
        assert type(chosen) is NativePagedAttention
        assert type(make_attention_backend("native", store)) is NativePagedAttention
    else:
        assert type(chosen) is TorchPagedAttention
        with pytest.raises(ConfigError, match=r"^the native CPU kernels are unavailable: "):
            make_attention_backend("native", store)
    assert type(make_attention_backend("torch", store)) is TorchPagedAttention


def test_auto_keeps_a_store_off_the_cpu_on_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the kernels' state, a store on another device gets the torch path, and ``native`` refuses it."""
    monkeypatch.setattr(native, "available", lambda: True)
    store = KVStore(KVSpec(1, 2, 16, kv_dtype="fp32", block_size=4), 4, device="meta")
    assert type(make_attention_backend("auto", store)) is TorchPagedAttention
    with pytest.raises(ConfigError, match=r"^the native attention backend runs on the CPU; the KV store is on meta$"):
        NativePagedAttention(store)


def test_the_registry_refuses_a_nameless_backend_and_lists_the_known_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_module, "_BACKENDS", attention_module._BACKENDS.copy())
    for bad in ("", None, 3):
        with pytest.raises(ConfigError, match=r"^an attention backend needs a non-empty name, got "):
            register_attention_backend(bad, TorchPagedAttention, "x")  # type: ignore[arg-type]
    listed = attention_backends()
    assert list(listed)[:3] == ["auto", "torch", "native"]
    assert listed["torch"].factory is TorchPagedAttention and listed["native"].factory is NativePagedAttention
    assert listed["auto"].description == "native on the CPU when its kernels are built, else torch"
    listed.pop("torch")  # a copy: the caller cannot unregister anything
    assert "torch" in attention_backends()
    with pytest.raises(ConfigError, match=r"^attention backend 'torch' is already registered$"):
        register_attention_backend("torch", NativePagedAttention, "replaced")  # the registries' one rule
    register_attention_backend("torch", NativePagedAttention, "replaced", replace=True)
    replaced = attention_backends()["torch"]
    assert (replaced.name, replaced.factory, replaced.description) == ("torch", NativePagedAttention, "replaced")
    with pytest.raises(ConfigError, match=r"^unknown attention backend 'flash' \(known: auto, torch, native\)$"):
        attention_module.attention_backend_factory("flash")
