"""Paged attention: queries of a batch of sequences attend to K/V read through their block tables.

The model talks to an :class:`AttentionBackend` only: it hands over a per-step :class:`AttentionBatch`
once (``plan``) and then, per layer, the new tokens' Q/K/V (``forward``). The backend owns both the
cache write (through the slot mapping) and the read (through the block tables), because fast kernels
fuse or order those themselves. A CUDA backend (FlashInfer, FlexAttention) implements the same two
methods; nothing in the ledger or the model changes.

Token layout is "varlen": the new tokens of all sequences are packed along dim 0, sequence after
sequence, so a batch mixing a 300-token prefill chunk with 1-token decodes wastes nothing.

Backends are chosen by name from a registry (:func:`attention_backends`, :func:`make_attention_backend`;
the CLI's ``--attention-backend`` choices come from it): ``torch`` is the reference that gathers each
context, ``native`` reads K/V in place with the compiled CPU kernels (:mod:`kvledger.runtime.native`),
``auto`` takes ``native`` where it is built and the store is on the CPU, else ``torch``. A CUDA backend
registers itself with :func:`register_attention_backend` and needs no other change.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch
import torch.nn.functional as F

from ..core.registry import Registry
from ..core.sizing.kv_formats import KVFormat
from ..errors import ConfigError
from . import kv_quant, native
from .cpu_features import bf16_path
from .kv_store import KVStore


@dataclass(slots=True)
class AttentionBatch:
    """Where each sequence's new tokens sit and where its K/V live. Built once per forward step.

    Sequence ``i`` contributes ``query_lens[i]`` new tokens at positions
    ``[starts[i], starts[i] + query_lens[i])``; they attend causally to every earlier position of the
    sequence (already cached) and to each other. ``block_tables[i]`` must cover all those positions,
    and ``slot_mapping`` holds the flat slot of every new token (packed in batch order).
    """

    starts: list[int]
    query_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [total new tokens], int64, on the store's device
    positions: torch.Tensor = field(init=False)  # [total new tokens], int64, for RoPE
    offsets: list[int] = field(init=False)  # where each sequence's tokens begin in the packed layout
    # A model with KV cache groups (runtime/kv_groups.py): the same step through each group's tables.
    groups: list[AttentionBatch] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.starts)
        if not (len(self.query_lens) == len(self.block_tables) == n):
            raise ConfigError("starts, query_lens and block_tables must have one entry per sequence")
        for i, (start, qlen) in enumerate(zip(self.starts, self.query_lens, strict=True)):
            if start < 0 or qlen <= 0:
                raise ConfigError(f"sequence {i}: start {start} / {qlen} new tokens are not a valid step")
        self.offsets = [0, *itertools.accumulate(self.query_lens)]
        if self.slot_mapping.numel() != self.offsets[-1]:
            raise ConfigError(
                f"slot mapping has {self.slot_mapping.numel()} slots for {self.offsets[-1]} new tokens")
        device = self.slot_mapping.device
        starts = torch.tensor(self.starts, dtype=torch.long)
        if self.offsets[-1] == n:  # decode-only step: one token per sequence, at its start
            positions = starts
        else:  # position of packed token j = starts[seq] + (j - offsets[seq])
            lens = torch.tensor(self.query_lens, dtype=torch.long)
            shift = starts - torch.tensor(self.offsets[:-1], dtype=torch.long)
            positions = torch.repeat_interleave(shift, lens) + torch.arange(self.offsets[-1])
        self.positions = positions.to(device)

    @property
    def num_seqs(self) -> int:
        return len(self.starts)

    @property
    def context_lens(self) -> list[int]:
        """Tokens each sequence attends over after this step: cached context plus the new tokens."""
        return [s + q for s, q in zip(self.starts, self.query_lens, strict=True)]


class AttentionBackend(Protocol):
    """What the model needs from an attention implementation bound to one :class:`KVStore`."""

    def plan(self, batch: AttentionBatch) -> None:
        """Prepare for one forward step (index tensors, masks, kernel plans); called before layer 0."""
        ...

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """Write ``k``/``v`` ``[T, kv_heads, D]`` into the cache, then return attention of ``q``
        ``[T, heads, D]`` over each sequence's context: ``[T, heads, D]``. ``window`` limits each query
        to the ``window`` most recent positions (itself included), as sliding-window layers do."""
        ...


def _context_slots(table: list[int], context_len: int, block_size: int) -> torch.Tensor:
    """Flat slots of positions ``[0, context_len)`` of one block table."""
    need = -(-context_len // block_size)
    if need > len(table):
        raise ConfigError(f"block table of {len(table)} blocks cannot hold {context_len} tokens")
    blocks = torch.tensor(table[:need], dtype=torch.long)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
    return slots[:context_len]


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean mask ``[q, k]``: causal, and inside the sliding window when there is one."""
    ok = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        ok &= k_pos[None, :] > q_pos[:, None] - window
    return ok


def _prefill_mask(masks: dict, key: tuple, start: int, qlen: int, window: int | None,
                  device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The mask of a prefill chunk of ``qlen`` queries from position ``start`` (cached in ``masks`` under
    ``key``); ``None`` when SDPA's own causal flag is exact (a square causal chunk inside its window)."""
    if key not in masks:
        if start == 0 and (window is None or window >= qlen):
            masks[key] = None
        else:
            q_pos = torch.arange(start, start + qlen, device=device)
            masks[key] = _allowed(q_pos, torch.arange(start + qlen, device=device), window)
    return masks[key]


@dataclass(slots=True)
class _Plan:
    batch: AttentionBatch
    prefill: list[int]  # sequences with more than one new token: one SDPA call each
    ctx_slots: list[torch.Tensor]  # per sequence, slots of its whole context
    decode: list[int]  # single-token sequences: batched into one padded SDPA call
    decode_rows: torch.Tensor | None  # where the decode tokens sit in the packed batch
    decode_slots: torch.Tensor | None  # [len(decode), max context], padded with slot 0
    decode_lens: torch.Tensor | None  # [len(decode)] context lengths
    # Built on first use and shared by every layer with the same window: (sequence | -1, window).
    masks: dict[tuple[int, int | None], torch.Tensor | None] = field(default_factory=dict)


_P = TypeVar("_P")


def _planned(plan: _P | None, backend: object) -> _P:
    """The step's plan, or the error of a ``forward`` called before ``plan``."""
    if plan is None:
        raise RuntimeError(f"{type(backend).__name__}.forward called before plan()")
    return plan


class TorchPagedAttention:
    """Reference backend for any device: gathers each context through its block table into a
    contiguous tensor and calls ``scaled_dot_product_attention``. Exact, simple, memory-hungry for long
    contexts (the gather copies every context, every layer, every step); :class:`NativePagedAttention`
    and the CUDA backends exist to avoid that copy."""

    def __init__(self, store: KVStore) -> None:
        self.store = store
        self._plan: _Plan | None = None

    def plan(self, batch: AttentionBatch) -> None:
        bs, dev = self.store.block_size, self.store.device
        ctx = [
            _context_slots(t, c, bs).to(dev)
            for t, c in zip(batch.block_tables, batch.context_lens, strict=True)
        ]
        decode = [i for i, q in enumerate(batch.query_lens) if q == 1]
        prefill = [i for i, q in enumerate(batch.query_lens) if q > 1]
        decode_rows = decode_slots = decode_lens = None
        if decode:
            decode_rows = torch.tensor([batch.offsets[i] for i in decode], device=dev)
            lens = [batch.context_lens[i] for i in decode]
            decode_slots = torch.zeros(len(decode), max(lens), dtype=torch.long, device=dev)
            for row, i in enumerate(decode):
                decode_slots[row, : lens[row]] = ctx[i]
            decode_lens = torch.tensor(lens, dtype=torch.long, device=dev)
        self._plan = _Plan(batch, prefill, ctx, decode, decode_rows, decode_slots, decode_lens)
        self.store.begin_write(batch.slot_mapping, batch.positions)

    def _decode_mask(self, plan: _Plan, window: int | None) -> torch.Tensor:
        """``[B, 1, 1, max context]``: each row's own context (hides the padding), within the window."""
        key = (-1, window)
        if key not in plan.masks:
            assert plan.decode_slots is not None and plan.decode_lens is not None
            k_pos = torch.arange(plan.decode_slots.shape[1], device=self.store.device)
            q_pos = plan.decode_lens - 1
            valid = k_pos[None, :] <= q_pos[:, None]
            if window is not None:
                valid &= k_pos[None, :] > q_pos[:, None] - window
            plan.masks[key] = valid[:, None, None, :]
        mask = plan.masks[key]
        assert mask is not None
        return mask

    def _mask(self, plan: _Plan, i: int, window: int | None) -> torch.Tensor | None:
        """Mask for prefill sequence ``i``; ``None`` when SDPA's own causal flag is exact."""
        return _prefill_mask(plan.masks, (i, window), plan.batch.starts[i], plan.batch.query_lens[i], window,
                             self.store.device)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        plan = _planned(self._plan, self)
        batch = plan.batch
        self.store.write(layer, batch.slot_mapping, k, v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for i in plan.prefill:
            lo, hi = batch.offsets[i], batch.offsets[i + 1]
            slots = plan.ctx_slots[i]
            mask = self._mask(plan, i, window)
            # [1, heads, tokens, dim]: SDPA broadcasts the KV heads over query groups (GQA).
            qs = q[lo:hi].transpose(0, 1)[None]
            kr, vr = self.store.read(layer, slots, q.dtype)
            ks, vs = kr.transpose(0, 1)[None], vr.transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
            out[lo:hi] = o[0].transpose(0, 1)
        if plan.decode_rows is not None:
            # All single-token sequences in one call, contexts padded to the longest and masked.
            rows, slots = plan.decode_rows, plan.decode_slots
            assert slots is not None
            qs = q[rows][:, :, None]  # [B, heads, 1, dim]
            kr, vr = self.store.read(layer, slots, q.dtype)
            ks, vs = kr.transpose(1, 2), vr.transpose(1, 2)  # [B, kv_heads, ctx, dim]
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=self._decode_mask(plan, window), scale=scale, enable_gqa=True)
            out[rows] = o[:, :, 0]
        return out




@dataclass(slots=True)
class _Prefill:
    """One sequence with several new tokens: rows ``[lo, hi)`` of the packed batch."""

    index: int
    lo: int
    hi: int
    start: int
    fresh: bool  # no cached context and K/V stored exactly: attend over this step's own k/v
    ctx_slots: torch.Tensor | None  # otherwise: slots of its whole context, read back from the store


@dataclass(slots=True)
class _PrefillArgs:
    """Every multi-token chunk of the step, for one ``paged_prefill`` call per layer."""

    tables: torch.Tensor  # int32 [P, blocks], padded with block 0
    starts: torch.Tensor  # int64 [P]
    query_lens: torch.Tensor  # int64 [P]
    offsets: torch.Tensor  # int64 [P]: first packed row of each chunk


@dataclass(slots=True)
class _NativePlan:
    batch: AttentionBatch
    prefills: list[_Prefill]
    prefill_args: _PrefillArgs | None
    decode_rows: torch.Tensor | None  # int64 [B]: the packed row of each single-token sequence
    decode_tables: torch.Tensor | None  # int32 [B, blocks]: their block tables, padded with block 0
    decode_lens: torch.Tensor | None  # int32 [B]: their context lengths (new token included)
    masks: dict[tuple[int, int | None], torch.Tensor | None] = field(default_factory=dict)


def _table_tensor(tables: list[list[int]], context_lens: list[int], block_size: int) -> torch.Tensor:
    """int32 ``[seqs, blocks]``: the blocks each context uses, padded with block 0 (never read)."""
    width = max(-(-c // block_size) for c in context_lens)
    rows = [list(t[:width]) + [0] * (width - min(width, len(t))) for t in tables]
    return torch.tensor(rows, dtype=torch.int32)


_ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # rows the native KV writes take
_NATIVE_PREFILL_DIMS = (64, 128)  # head dims paged_prefill is instantiated for
# Plain KV dtypes the native kernels read and write directly (quantised formats have their own loaders).
_NATIVE_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
# The kernels' codes for a quantised tensor's layout (QuantKind in the C++), by (scales, element, K or V). A
# rotated format stores the same codes (the backend turns queries and outputs), so it shares its kind.
_QUANT_KINDS = {("token-head", "fp8_e4m3", "k"): 1, ("token-head", "fp8_e4m3", "v"): 1, ("token-head", "int8", "k"): 2,
                ("token-head", "int8", "v"): 2, ("kivi", "uint8", "k"): 3, ("kivi", "uint8", "v"): 4,
                ("channel", "int8", "k"): 5, ("channel", "int8", "v"): 2, ("token4", "uint8", "k"): 4,
                ("token4", "uint8", "v"): 4}
_TURNED_V = {2: 6, 4: 7}  # values stored turned by H: the kernels' loaders (and the fused decode) turn them back


def _quant_kind(fmt: KVFormat, kv: str) -> int:
    kind = _QUANT_KINDS[(fmt.scales, fmt.element, kv)]
    return _TURNED_V[kind] if kv == "v" and fmt.rotates("v") else kind


def _quant_layout(store: KVStore) -> torch.Tensor:
    """int64 [8]: K kind, K codes / scale / min byte offsets, then the same for V (min 0 when absent)."""
    out: list[int] = []
    fmt = store.format
    for kv in "kv":
        out.append(_quant_kind(fmt, kv))
        for name in ("codes", "scale", "min"):
            entry = store.offsets.get((kv, name))
            out.append(entry[0] if entry is not None else 0)
    return torch.tensor(out, dtype=torch.long)


def _native_reads(store: KVStore) -> bool:
    """The native kernels read this store: a plain dtype they know, or a quantised format with a loader."""
    if store.plain:
        return store.dtype in _NATIVE_KV_DTYPES
    fmt = store.format
    if (fmt.scales, fmt.element, "k") not in _QUANT_KINDS:
        return False
    # Turned values: the loaders turn them back (head dims a power of two, which the format requires anyway).
    return not fmt.rotates("v") or _QUANT_KINDS[(fmt.scales, fmt.element, "v")] in _TURNED_V


class NativePagedAttention:
    """CPU backend on the compiled kernels: K/V are written to their slots and read in place.

    Per layer: one ``kv_write`` of the step's new K/V into their slots, one ``paged_prefill`` for every
    chunk of several tokens (causal, over cached context and the chunk itself, tiles of 32 queries, K/V
    read block by block through the table), one ``paged_decode`` for every single-token sequence (each
    block table walked block by block; contexts split across threads when the batch is small). No
    gather, no padding, no mask tensor. Head dims other than 64 and 128 take prefills through
    ``scaled_dot_product_attention`` instead (a chunk with no cached context over its own new K/V, one
    that continues a cached context over that context read back through :meth:`KVStore.read`)."""

    partition = -1  # context tokens per decode work item; -1: automatic (see paged_decode)

    def __init__(self, store: KVStore) -> None:
        if store.device.type != "cpu":
            raise ConfigError(f"the native attention backend runs on the CPU; the KV store is on {store.device}")
        if not _native_reads(store):
            raise ConfigError(f"the native attention backend cannot read a {store.format.name} KV store")
        self.ops = native.require()
        self.store = store
        self._plan: _NativePlan | None = None
        self._layout = None if store.plain else _quant_layout(store)
        self._no_residual = torch.empty(0)
        # Per-token formats quantise on write in the kernels (kv_write_q); formats with a residual page
        # write their open blocks' rows with kv_write (the store seals full blocks itself).
        self._write_q = (not store.plain and store.format.scales in ("token-head", "token4")
                         and hasattr(self.ops, "kv_write_q"))
        if not store.plain and store.format.has_residual:
            store.residual_writer = self.ops.kv_write
        # bf16 over a bf16 store on a CPU with AVX-512 BF16 (AMX CPUs have it too): decode scores as bf16 dot
        # products on the rows as stored, instead of widening each row to fp32 first (csrc/kvledger_bf16_decode.h).
        self._decode = self.ops.paged_decode
        if (store.plain and store.dtype == torch.bfloat16 and getattr(self.ops, "HAS_BF16_DOTS", False)
                and bf16_path() != "avx2"):
            self._decode = self.ops.paged_decode_bf16

    def plan(self, batch: AttentionBatch) -> None:
        bs, dev = self.store.block_size, self.store.device
        prefills: list[_Prefill] = []
        decode: list[int] = []
        for i, (start, qlen) in enumerate(zip(batch.starts, batch.query_lens, strict=True)):
            need = -(-(start + qlen) // bs)
            table = batch.block_tables[i]
            if need > len(table):
                raise ConfigError(f"block table of {len(table)} blocks cannot hold {start + qlen} tokens")
            if qlen == 1:
                decode.append(i)
                continue
            fresh = start == 0
            slots = None if fresh else _context_slots(table, start + qlen, bs).to(dev)
            prefills.append(_Prefill(i, batch.offsets[i], batch.offsets[i + 1], start, fresh, slots))
        prefill_args = None
        if prefills:
            ends = [p.start + p.hi - p.lo for p in prefills]
            prefill_args = _PrefillArgs(
                _table_tensor([batch.block_tables[p.index] for p in prefills], ends, bs),
                torch.tensor([p.start for p in prefills]), torch.tensor([p.hi - p.lo for p in prefills]),
                torch.tensor([p.lo for p in prefills]))
        rows = tables = lens = None
        if decode:
            rows = torch.tensor([batch.offsets[i] for i in decode], dtype=torch.long)
            ctx = [batch.starts[i] + 1 for i in decode]
            lens = torch.tensor(ctx, dtype=torch.int32)
            tables = _table_tensor([batch.block_tables[i] for i in decode], ctx, bs)
        self._plan = _NativePlan(batch, prefills, prefill_args, rows, tables, lens)
        self.store.begin_write(batch.slot_mapping, batch.positions)

    def _mask(self, plan: _NativePlan, p: _Prefill, window: int | None) -> torch.Tensor | None:
        """Mask for a prefill chunk; ``None`` when SDPA's own causal flag is exact."""
        return _prefill_mask(plan.masks, (p.index, window), p.start, p.hi - p.lo, window)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        plan = _planned(self._plan, self)
        store = self.store
        if not store.plain:
            return self._forward_quantised(plan, layer, q, k, v, scale, window)
        kc, vc = store.blocks(layer)
        if k.stride(-1) == 1 and v.stride(-1) == 1 and k.dtype in (torch.float32, torch.bfloat16, torch.float16):
            self.ops.kv_write(kc, vc, plan.batch.slot_mapping, k, v)
        else:
            store.write(layer, plan.batch.slot_mapping, k, v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        pa = plan.prefill_args
        if pa is not None and q.shape[-1] in _NATIVE_PREFILL_DIMS:
            self.ops.paged_prefill(out, q, kc, vc, pa.tables, pa.starts, pa.query_lens, pa.offsets, scale, window or 0)
        else:
            self._sdpa_prefills(plan, layer, q, k, v, out, scale, window)
        if plan.decode_rows is not None:
            self._decode(out, q, kc, vc, plan.decode_tables, plan.decode_lens, plan.decode_rows,
                         scale, window or 0, self.partition)
        return out

    def _forward_quantised(self, plan: _NativePlan, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           scale: float, window: int | None) -> torch.Tensor:
        """A quantised store: rows quantised on write (the store), dequantised by the kernels' loaders."""
        store = self.store
        if self._write_q and k.stride(-1) == 1 and v.stride(-1) == 1 and k.dtype in _ROW_DTYPES:
            # Turned keys are quantised from fp32, as the store does (v widened alike: the kernel takes one dtype).
            fmt = store.format
            k = store.stored_keys(layer, k)
            kw, vw = (kv_quant.rotate(k.float()), v.float()) if fmt.rotates("k") else (k, v)
            if fmt.rotates("v"):
                vw = kv_quant.rotate(v.float())
            self.ops.kv_write_q(store.layer_bytes[layer], self._layout, store.block_size, plan.batch.slot_mapping,
                                kw, vw)
        else:
            store.write(layer, plan.batch.slot_mapping, k, v)
        # Keys stored turned by H: the kernels score the queries turned alike ((q H) . (k H) = q . k).
        # Smoothed keys ((k - mu) / s): the queries times s score them softmax-equal to q . k.
        qk = q if store.smoothing is None else store.smoothing.query(layer, q)
        qk = kv_quant.rotate(qk) if store.format.rotates("k") else qk
        blocks = store.layer_bytes[layer]
        residual = store.layer_residual[layer] if store.residual_slots else self._no_residual
        res_map = store.res_map if store.residual_slots else self._no_residual
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        pa = plan.prefill_args
        if pa is not None and q.shape[-1] in _NATIVE_PREFILL_DIMS:
            self.ops.paged_prefill_q(out, qk, blocks, self._layout, store.block_size, store.kv_heads, residual,
                                     res_map, pa.tables, pa.starts, pa.query_lens, pa.offsets, scale, window or 0)
        else:
            self._sdpa_prefills(plan, layer, q, k, v, out, scale, window)
        if plan.decode_rows is not None:
            self.ops.paged_decode_q(out, qk, blocks, self._layout, store.block_size, store.kv_heads, residual, res_map,
                                    plan.decode_tables, plan.decode_lens, plan.decode_rows, scale, window or 0,
                                    self.partition)
        return out

    def _sdpa_prefills(self, plan: _NativePlan, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, scale: float, window: int | None) -> None:
        """Prefill chunks through ``scaled_dot_product_attention`` (head dims the kernel lacks)."""
        store = self.store
        exact = store.dtype == q.dtype  # the cache holds this step's k/v bit for bit
        for p in plan.prefills:
            mask = self._mask(plan, p, window)
            qs = q[p.lo:p.hi].transpose(0, 1)[None]  # [1, heads, tokens, dim]
            if p.fresh and exact:
                ks, vs = k[p.lo:p.hi].transpose(0, 1)[None], v[p.lo:p.hi].transpose(0, 1)[None]
            else:
                # A fresh chunk's context is its own new tokens; otherwise the planned context slots.
                slots = plan.batch.slot_mapping[p.lo:p.hi] if p.ctx_slots is None else p.ctx_slots
                kr, vr = store.read(layer, slots, q.dtype)
                ks, vs = kr.transpose(0, 1)[None], vr.transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
            out[p.lo:p.hi] = o[0].transpose(0, 1)


# ---- the registry -------------------------------------------------------------------------------------
BackendFactory = Callable[[KVStore], AttentionBackend]


@dataclass(frozen=True, slots=True)
class BackendInfo:
    name: str
    factory: BackendFactory
    description: str


_BACKENDS: Registry[BackendInfo] = Registry("attention backend")


def register_attention_backend(name: str, factory: BackendFactory, description: str, *,
                               replace: bool = False) -> None:
    """Make ``factory`` selectable as ``name`` (engine, runner and CLI); a name already registered is
    refused unless ``replace=True`` (the registries' one rule)."""
    if not name or not isinstance(name, str):
        raise ConfigError(f"an attention backend needs a non-empty name, got {name!r}")
    _BACKENDS.register(name, BackendInfo(name, factory, description), description, replace=replace)


def attention_backends() -> dict[str, BackendInfo]:
    """Every registered backend by name (the CLI's choices)."""
    return dict(_BACKENDS.items())


def attention_backend_factory(name: str) -> BackendFactory:
    info = _BACKENDS.get(name)
    if info is None:
        known = ", ".join(_BACKENDS)
        raise ConfigError(f"unknown attention backend {name!r} (known: {known})")
    return info.factory


def make_attention_backend(name: str, store: KVStore) -> AttentionBackend:
    return attention_backend_factory(name)(store)


def _auto(store: KVStore) -> AttentionBackend:
    if store.device.type == "cpu" and _native_reads(store) and native.available():
        return NativePagedAttention(store)
    return TorchPagedAttention(store)


register_attention_backend("auto", _auto, "native on the CPU when its kernels are built, else torch")
register_attention_backend("torch", TorchPagedAttention, "reference: gathers each context, any device")
register_attention_backend("native", NativePagedAttention, "compiled CPU kernels reading K/V in place")

__all__ = ["AttentionBackend", "AttentionBatch", "BackendFactory", "BackendInfo", "NativePagedAttention",
           "TorchPagedAttention", "attention_backend_factory", "attention_backends", "make_attention_backend",
           "register_attention_backend"]
