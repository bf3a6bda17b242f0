"""The physical KV cache of one rank: preallocated tensors laid out by a :class:`KVSpec` and its format.

Plain formats (fp32, bf16, fp16, and the unscaled fp8 casts) keep one tensor
``kv[layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]`` of the storage dtype. Quantised
formats with metadata (fp8-scaled and int8-token with a scale per token and head, int8, KIVI int4) keep one byte tensor
``kv[layers, num_blocks, layer_block_bytes]``: the bytes of one layer of one block, part after part in the
order of :meth:`KVFormat.parts` (codes, scales, minimums; K, then V). Either way ledger block ``b`` is one
whole-model page, exactly the bytes the block pool charges ``KVSpec.block_bytes`` for, and
:attr:`KVStore.block_view` shows the pool with the block id on dim 0, so a swap or an offload copies a
block's whole byte layout whatever the format.

int4 and int8 (keys quantised per channel over a whole block) also keep ``residual_slots`` unquantised
residual pages (``residual[layers, 2, slots, block_size, kv_heads, head_dim]`` in ``spec.residual_dtype``): a
block that is not yet full lives there (it is *open*) and is quantised into its packed bytes when its last row
is written (then *sealed*). A sealed block is immutable: a later write of some of its rows (the last prompt
token of a fully cached prompt is recomputed) is dropped. Which block holds which page is ``res_map`` (int32,
-1 for none), the map both attention paths read. Pages of blocks the ledger freed are reclaimed through
``block_in_use`` (the engine wires it to its ledger) when no page is free.

int8-hadamard stores keys (and int8 its values) turned by the normalised Walsh-Hadamard matrix
(``kv_quant.rotate``); :meth:`read` turns them back, and a kernel reading int8-hadamard's codes in place turns
the queries instead (same scores). int4-smooth stores keys smoothed by the model's static constants
(``kv_smoothing``: ``(k - mu) / s`` before turning); :meth:`read` undoes them, the native kernels score ``q * s``.
kvtc codes each whole block into its page (``kv_transform_pages``: keys turned back to before RoPE, so a write
plan that seals blocks needs each row's position, and a first block's page names its first token, which the
writer gives through :meth:`note_first_tokens` and the block keeps until it is sealed) and :meth:`read` decodes the
blocks it touches.

The module stays whole past 600 lines: one class owns the pool's bytes, the residual pages and every read,
write and copy of them, and each of those reads the same layout (``offsets``, ``res_map``, the write plan).
Splitting it by format would give each piece a copy of the residual-page and write-plan bookkeeping that every
residual format shares; what is one format's own (kvtc's page layout, coding, RoPE and first-row cache) lives
beside it instead (``kv_transform_pages.CodedPages``), and the store only routes to it (and remembers, with the
write plan, which token opened a first block).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..core.sizing.geometry import KVSpec
from ..errors import ConfigError, InvariantError
from . import kv_quant as q
from .kv_smoothing import KVSmoothing
from .kv_transform_pages import CodedPages, TransformTables

# Element names of the core's formats -> torch storage dtypes.
_TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


def torch_dtype(kv_dtype: str) -> torch.dtype:
    """The torch dtype that stores a plain KV format's values (or a part's element)."""
    try:
        return _TORCH_DTYPES[kv_dtype]
    except KeyError:
        known = ", ".join(_TORCH_DTYPES)
        raise ConfigError(f"KV dtype {kv_dtype!r} has no plain torch storage (plain: {known})") from None


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _saturate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` cast to ``dtype``; the fp8 formats saturate at their largest finite value (as
    ``core.sizing.kv_formats`` documents): torch's e5m2 cast makes inf of what lies past it, and an inf key
    turns attention into NaN."""
    if dtype in _FP8:
        top = torch.finfo(dtype).max
        x = x.clamp(-top, top)
    return x.to(dtype)


def _index(ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(ids, dtype=torch.long).to(device)


class _CopyLike(Protocol):
    """The shape of the ledger's ``CopyOp`` (duck-typed: the runtime needs only these fields)."""

    src: int
    dst: int
    slots: int


def _normalise(op: tuple[int, ...] | _CopyLike, block_size: int) -> tuple[int, int, int]:
    if isinstance(op, tuple):
        src, dst, *rest = op
        slots = rest[0] if rest else block_size
    else:
        src, dst, slots = op.src, op.dst, op.slots
    if not 0 < slots <= block_size:
        raise ConfigError(f"copy of {slots} slots from block {src} to {dst}: must be in [1, {block_size}]")
    return int(src), int(dst), int(slots)


@dataclass(slots=True)
class BlockBytes:
    """Blocks taken out of a store: ``data`` (``block_view`` rows, block on dim 0) and, per block, the
    unquantised residual page of an open int4 block (``None`` for every other block)."""

    data: torch.Tensor
    residual: list[torch.Tensor | None]


_WRITER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # rows the native residual writer takes


@dataclass(slots=True)
class _WritePlan:
    """One step's writes into a store with residual pages (int4, int8), decided once (``begin_write``) and
    applied per layer."""

    rows: torch.Tensor  # int64 [n]: residual row (page * block_size + offset) of each written row, -1: none
    all_kept: bool  # every row goes to a residual page (a plain decode step)
    direct: list[tuple[int, list[int]]]  # blocks written whole this step: (block, the B rows in offset order)
    seal: list[tuple[int, int]]  # open blocks whose last row is written this step: (block, page)
    first: dict[int, int]  # block -> position of its row 0, for the blocks written whole or sealed (when known)
    # Every row goes to a residual page through the native writer and no block is written whole: the layers
    # before the last only append rows (write's fast path; the last layer also seals).
    rows_only: bool = False


class KVStore:
    """All K/V pages of one rank. Block ids and slots come from the ledger's tables."""

    def __init__(self, spec: KVSpec, num_blocks: int, device: str | torch.device = "cpu", *,
                 residual_slots: int | None = None, smoothing: KVSmoothing | None = None,
                 transform: TransformTables | None = None, rope_inv_freq: torch.Tensor | None = None) -> None:
        """``smoothing``: the model's static key constants, required by (and only used for) a format that
        smooths keys (int4-smooth). ``transform`` and ``rope_inv_freq``: the model's coding tables and RoPE
        frequencies, required by (and only used for) kvtc."""
        if spec.attention == "mla":
            raise ConfigError("the runtime KV store holds K and V heads; MLA latent caches are not supported")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ConfigError(f"the KV store needs at least one block, got {num_blocks!r}")
        fmt = spec.format
        self.spec = spec
        self.format = fmt
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        self.kv_heads = spec.kv_heads_per_rank
        self.head_dim = spec.head_dim
        self.device = torch.device(device)
        self.plain = fmt.plain
        self.residual_slots = 0
        self.block_in_use: Callable[[int], bool] | None = None
        # Writes rows into residual pages (k_page, v_page, rows, k, v), e.g. the native kv_write; None: torch.
        self.residual_writer: Callable[..., None] | None = None
        L, B, H, D = spec.layers, self.block_size, self.kv_heads, self.head_dim
        self.smoothing: KVSmoothing | None = None
        if fmt.smooth:
            if smoothing is None:
                raise ConfigError(f"{fmt.name} stores keys smoothed by the model's calibrated constants; the store "
                                  "was given none")
            smoothing.check(L, H, D)
            self.smoothing = smoothing
        if self.plain:
            self.dtype = torch_dtype(fmt.element)
            # Zero-filled so unwritten slots are finite: a kernel reading a padded tail never sees NaN.
            self.kv = torch.zeros((L, 2, num_blocks, B, H, D), dtype=self.dtype, device=self.device)
            self.block_dim = 2
        else:
            if D % 4:
                raise ConfigError(f"the runtime stores {fmt.name} for head dims divisible by 4, got {D}")
            self.dtype = torch.uint8
            self.kv = torch.zeros((L, num_blocks, spec.layer_block_bytes), dtype=torch.uint8, device=self.device)
            self.block_dim = 1
            self.layer_bytes = list(self.kv.unbind(0))  # each layer's blocks, [num_blocks, bytes] views
            self.coded: CodedPages | None = None
            if fmt.scales == "coded":
                if transform is None or rope_inv_freq is None:
                    raise ConfigError(f"{fmt.name} codes K/V with the model's transform tables and RoPE; the store "
                                      "was given " + ("none" if transform is None else "no RoPE frequencies"))
                self.coded = CodedPages(transform, L, H, D, B, num_blocks, spec.layer_block_bytes, rope_inv_freq)
            self.offsets: dict[tuple[str, str], tuple[int, tuple[int, ...], torch.dtype]] = {}
            at = 0
            for p in fmt.parts(B, H, D):
                self.offsets[(p.kv, p.name)] = (at, p.shape, torch_dtype(p.element))
                at += p.nbytes
        if fmt.has_residual:
            slots = min(num_blocks, 64) if residual_slots is None else residual_slots
            if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
                raise ConfigError(f"{fmt.name} needs at least one residual page, got {slots!r}")
            self.residual_slots = slots
            assert spec.residual_dtype is not None
            self.residual = torch.zeros((L, 2, slots, B, H, D), dtype=torch_dtype(spec.residual_dtype),
                                        device=self.device)
            self.res_map = torch.full((num_blocks,), -1, dtype=torch.int32)
            self._sealed = bytearray(num_blocks)  # 1: full and quantised (immutable until rewritten from row 0)
            self._free_pages = list(range(slots - 1, -1, -1))
            self._plan: _WritePlan | None = None
            # kvtc: the token at position 0 of each first block written, bound when its row 0 is written (the
            # writer names it through note_first_tokens), read when the block is sealed
            self._first_tokens: dict[int, int] = {}
            self._noted: dict[int, int] = {}
            # Each layer's residual pages and their (K, V) halves, made once: a decode step reads and writes
            # through them in every layer (a view costs microseconds to make).
            self.layer_residual = list(self.residual.unbind(0))
            self._res_views = [(r[0], r[1]) for r in self.layer_residual]
        self._layers_parts: dict[str, torch.Tensor] | None = None

    # ---- sizes ------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes the pool occupies: ``spec.pool_bytes_for(num_blocks, residual_slots)`` by construction (kvtc's
        cache of first rows counted at its capacity: it fills as sequences start)."""
        total = self.kv.numel() * self.kv.element_size()
        if self.residual_slots:
            total += self.residual.numel() * self.residual.element_size()
        coded: CodedPages | None = getattr(self, "coded", None)
        if coded is not None:
            total += coded.constant_bytes
        return total

    @property
    def block_view(self) -> torch.Tensor:
        """The pool with the block id on dim 0 (a view): ``block_view[b]`` is every byte of block ``b``."""
        return self.kv.movedim(self.block_dim, 0)

    # ---- per-layer views ----------------------------------------------------------------------
    def parts(self, layer: int) -> dict[str, torch.Tensor]:
        """Every part of one layer by ``'k.codes'``-style name (quantised formats): ``[num_blocks, *shape]``
        views of its element type."""
        return {name: view[layer] for name, view in self.layers_parts().items()}

    def layers_parts(self) -> dict[str, torch.Tensor]:
        """Every part of every layer as ``[layers, num_blocks, *shape]`` views (made once: the pool's bytes
        never move)."""
        if self._layers_parts is None:
            views = {}
            for (kv, name), (at, shape, dtype) in self.offsets.items():
                nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                raw = self.kv[:, :, at:at + nbytes]
                views[f"{kv}.{name}"] = raw.view(dtype).view(self.spec.layers, self.num_blocks, *shape)
            self._layers_parts = views
        return self._layers_parts

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer as ``[num_slots, kv_heads, head_dim]`` views (plain formats, no copy)."""
        self._need_plain("layer views")
        kv = self.kv[layer]
        shape = (self.num_slots, self.kv_heads, self.head_dim)
        return kv[0].view(shape), kv[1].view(shape)

    def blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer as ``[num_blocks, block_size, kv_heads, head_dim]`` views (plain formats):
        the shape paged kernels walk block by block."""
        self._need_plain("block views")
        kv = self.kv[layer]
        return kv[0], kv[1]

    def _need_plain(self, what: str) -> None:
        if not self.plain:
            raise ConfigError(f"{what} exist for plain KV formats only; {self.format.name} is read through read()")

    # ---- reads --------------------------------------------------------------------------------
    def read(
        self, layer: int, slots: torch.Tensor, dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at flat ``slots`` (any index shape ``S``) as ``dtype``: ``[*S, kv_heads, head_dim]``.

        Every read that leaves the store goes through here (and through the native kernels' row
        loaders): quantised formats dequantise here, open int4 blocks are read from their residual page."""
        if self.plain:
            kc, vc = self.layer(layer)
            return kc[slots].to(dtype), vc[slots].to(dtype)
        slots = slots.to(self.device)
        p = self.parts(layer)
        B = self.block_size
        block, off = slots // B, slots % B
        if self.format.scales == "token-head":
            k = q.dequant_token(p["k.codes"][block, off], p["k.scale"][block, off])
            v = q.dequant_token(p["v.codes"][block, off], p["v.scale"][block, off])
            if self.format.rotates("k"):
                k = q.rotate(k)
            if self.format.rotates("v"):
                v = q.rotate(v)
            return k.to(dtype), v.to(dtype)
        if self.format.scales == "token4":
            k = q.dequant_kivi_v(p["k.codes"][block, off], p["k.scale"][block, off], p["k.min"][block, off])
            v = q.dequant_kivi_v(p["v.codes"][block, off], p["v.scale"][block, off], p["v.min"][block, off])
            if self.format.rotates("k"):
                k = q.rotate(k)
            if self.format.rotates("v"):
                v = q.rotate(v)
            if self.smoothing is not None:
                k = self.smoothing.unsmooth(layer, k)
            return k.to(dtype), v.to(dtype)
        if self.format.scales == "coded":
            k, v = self._read_coded(layer, block, off)
        elif self.format.scales == "channel":
            k = q.dequant_channel(p["k.codes"][block, off], p["k.scale"][block], p["k.min"][block])
            v = q.dequant_token(p["v.codes"][block, off], p["v.scale"][block, off])
            if self.format.rotates("v"):
                v = q.rotate(v)
        else:
            k = q.dequant_kivi_k(p["k.codes"][block, off], p["k.scale"][block], p["k.min"][block])
            v = q.dequant_kivi_v(p["v.codes"][block, off], p["v.scale"][block, off], p["v.min"][block, off])
        page = self.res_map.to(self.device)[block]
        open_ = page >= 0
        if bool(open_.any()):
            rows = page.clamp(min=0).long() * B + off
            flat = (self.residual_slots * B, self.kv_heads, self.head_dim)
            rk = self.residual[layer, 0].view(flat)[rows].float()
            rv = self.residual[layer, 1].view(flat)[rows].float()
            mask = open_[..., None, None]
            k, v = torch.where(mask, rk, k), torch.where(mask, rv, v)
        return k.to(dtype), v.to(dtype)

    def _read_coded(self, layer: int, block: torch.Tensor, off: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kvtc: the sealed blocks among ``block`` decoded once each (other rows zero: open ones are read from
        their residual page by the caller, and no reader asks for rows never written)."""
        assert self.coded is not None
        used, where = torch.unique(block, return_inverse=True)
        # A block a prefill writes whole is coded layer by layer, before each layer's attention reads it, and
        # marked sealed after the step's last layer.
        coding = {b for b, _ in self._plan.direct} if self._plan is not None else set()
        sealed = torch.tensor([(self._sealed[b] == 1 or b in coding) and int(self.res_map[b]) < 0
                               for b in used.tolist()], dtype=torch.bool, device=self.device)
        shape = (used.numel(), self.block_size, self.kv_heads, self.head_dim)
        kd = torch.zeros(shape, device=self.device)
        vd = torch.zeros(shape, device=self.device)
        if bool(sealed.any()):
            kd[sealed], vd[sealed] = self.coded.read(self.kv, layer, used[sealed])
        return kd[where, off], vd[where, off]

    def gather(
        self, layer: int, blocks: Sequence[int] | torch.Tensor, num_tokens: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a block table, token-contiguous: ``[num_tokens, kv_heads, head_dim]`` each.

        ``num_tokens`` trims the unused tail of the last block (default: every slot of the table).
        """
        idx = _index(blocks, self.device)
        if num_tokens is not None and num_tokens > idx.numel() * self.block_size:
            raise ConfigError(f"{num_tokens} tokens do not fit in {idx.numel()} blocks of {self.block_size}")
        if self.plain:
            kv = self.kv[layer][:, idx].flatten(1, 2)  # [2, len(blocks) * block_size, heads, dim]
            if num_tokens is not None:
                kv = kv[:, :num_tokens]
            if dtype is not None:
                kv = kv.to(dtype)
            return kv[0], kv[1]
        slots = (idx[:, None] * self.block_size + torch.arange(self.block_size, device=self.device)).flatten()
        if num_tokens is not None:
            slots = slots[:num_tokens]
        return self.read(layer, slots, dtype or torch.float32)

    # ---- writes -------------------------------------------------------------------------------
    def note_first_tokens(self, pairs: Iterable[tuple[int, int]]) -> None:
        """kvtc: the next write's rows at position 0, as ``(slot, token)``: a first block's page names its token
        and keeps the sink row out of its slots (K/V at position 0 are the token's alone). A first block written
        without one holds its sink row in its slots. A no-op for other formats."""
        if getattr(self, "coded", None) is not None:
            self._noted = {int(slot) // self.block_size: int(token) for slot, token in pairs}

    def begin_write(self, slots: torch.Tensor | Sequence[int],
                    positions: torch.Tensor | Sequence[int] | None = None) -> None:
        """Decide once per step where each new row goes (int4: residual page or a whole block quantised
        directly) and bind residual pages to newly opened blocks. Backends call it from ``plan``; every
        layer's :meth:`write` then applies it. A no-op for other formats. ``positions`` (each row's, as
        the batch's): kvtc seals blocks with them, and refuses a step that seals a block without them."""
        if not self.format.has_residual:
            return
        B = self.block_size
        values = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        # Only kvtc seals with positions: other formats never turn them into a list (a step's hot path).
        where = None if positions is None or self.coded is None else (
            positions.tolist() if isinstance(positions, torch.Tensor) else list(positions))
        if where is not None and len(where) != len(values):
            raise ConfigError(f"{len(where)} positions for {len(values)} slots")
        if values and not 0 <= min(values) <= max(values) < self.num_slots:
            raise ConfigError(f"slots must be in [0, {self.num_slots}), got {min(values)}..{max(values)}")
        by_block: dict[int, list[tuple[int, int]]] = {}
        for i, s in enumerate(values):
            by_block.setdefault(s // B, []).append((s % B, i))
        if self.coded is not None:  # a block's row 0 written now binds its first token (or none, unnoted)
            for block, items in by_block.items():
                if any(o == 0 for o, _ in items):
                    self._first_tokens[block] = self._noted.get(block, -1)
            self._noted = {}
        rows = [-1] * len(values)
        direct: list[tuple[int, list[int]]] = []
        seal: list[tuple[int, int]] = []
        for block, items in by_block.items():
            offsets = {o for o, _ in items}
            page = int(self.res_map[block])
            if page < 0 and min(offsets) == 0 and len(offsets) == B:
                first = {}
                for o, i in items:
                    first.setdefault(o, i)
                direct.append((block, [first[o] for o in range(B)]))
                continue
            if page < 0:
                if min(offsets) > 0:
                    if self._sealed[block]:
                        continue  # rows of a sealed block are already there: immutable, dropped
                    raise InvariantError(f"block {block}: a write at row {min(offsets)} into a block with no "
                                         "residual page and no sealed contents (its earlier rows are lost)")
                page = self._take_page()
                self.res_map[block] = page
                self._sealed[block] = 0
            for o, i in items:
                rows[i] = page * B + o
            if max(offsets) == B - 1:
                seal.append((block, page))
        kept = all(r >= 0 for r in rows)
        first: dict[int, int] = {}
        if where is not None:
            for block, items in by_block.items():
                o, i = items[0]
                first[block] = where[i] - o
        if self.coded is not None:
            missing = [b for b in [b for b, _ in direct] + [b for b, _ in seal] if b not in first]
            if missing:
                raise ConfigError(f"{self.format.name} seals blocks with their rows' positions (keys are coded before "
                                  f"RoPE); this write of block {missing[0]} gave none")
        self._plan = _WritePlan(torch.tensor(rows, dtype=torch.long, device=self.device), kept, direct, seal, first,
                                kept and not direct and self.residual_writer is not None and self.device.type == "cpu")

    def write(
        self, layer: int, slots: Sequence[int] | torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        positions: Sequence[int] | torch.Tensor | None = None,
    ) -> None:
        """Store ``k``/``v`` (``[n, kv_heads, head_dim]``) for ``n`` tokens at flat ``slots``. ``positions``:
        each row's, for a write with no plan from :meth:`begin_write` (kvtc needs them to seal a block)."""
        plan = self._plan if self.residual_slots else None
        if (plan is not None and plan.rows_only and layer < self.spec.layers - 1 and k.shape == v.shape
                and k.shape[0] == plan.rows.numel() and k.shape[1:] == (self.kv_heads, self.head_dim)
                and k.stride(-1) == 1 and v.stride(-1) == 1 and k.dtype in _WRITER_DTYPES and k.device == self.device):
            # A planned decode step (begin_write checked its slots): each layer's rows straight into its residual
            # pages, one native call, as a plain store's write is. Inside a decode step this path is most of a
            # quantised store's write cost at batch 1 (tens of microseconds a layer with caches cold).
            page_k, page_v = self._res_views[layer]
            self.residual_writer(page_k, page_v, plan.rows, k, v)  # type: ignore[misc]
            return
        idx = _index(slots, self.device)
        if k.shape != v.shape or k.shape[0] != idx.numel() or k.shape[1:] != (self.kv_heads, self.head_dim):
            raise ConfigError(
                f"write of K {tuple(k.shape)} / V {tuple(v.shape)} through {idx.numel()} slots does not "
                f"match [n, {self.kv_heads}, {self.head_dim}]")
        if self.plain:
            kc, vc = self.layer(layer)
            # Index assignment (not index_copy_) because CPU has no index_copy for float8 dtypes.
            kc[idx] = _saturate(k, self.dtype)
            vc[idx] = _saturate(v, self.dtype)
            return
        if self.format.scales == "token-head":
            p = self.parts(layer)
            block, off = idx // self.block_size, idx % self.block_size
            if self.format.rotates("k"):
                k = q.rotate(k.float())
            if self.format.rotates("v"):
                v = q.rotate(v.float())
            for name, x in (("k", k), ("v", v)):
                codes, scale = q.quant_token(x, self.format.element)
                p[f"{name}.codes"][block, off] = codes
                p[f"{name}.scale"][block, off] = scale
            return
        if self.format.scales == "token4":
            p = self.parts(layer)
            block, off = idx // self.block_size, idx % self.block_size
            for name, x in (("k", self.stored_keys(layer, k)), ("v", v)):
                x = q.rotate(x.float()) if self.format.rotates(name) else x.float()
                codes, scale, low = q.quant_kivi_v(x)
                p[f"{name}.codes"][block, off] = codes
                p[f"{name}.scale"][block, off] = scale
                p[f"{name}.min"][block, off] = low
            return
        self._write_kivi(layer, idx, k, v, positions)

    def stored_keys(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """Keys as the format quantises them before any turning: smoothed (fp32) when it smooths, else ``k``."""
        return k if self.smoothing is None else self.smoothing.smooth(layer, k)

    def _write_kivi(self, layer: int, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    positions: Sequence[int] | torch.Tensor | None = None) -> None:
        plan = self._plan
        if plan is None or plan.rows.numel() != idx.numel():
            self.begin_write(idx, positions)  # a direct caller (no backend plan): one write, every layer alike
            plan = self._plan
            assert plan is not None
        B = self.block_size
        writer = self.residual_writer
        if (plan.all_kept and writer is not None and self.residual.device.type == "cpu" and k.stride(-1) == 1
                and v.stride(-1) == 1 and k.dtype in _WRITER_DTYPES):
            page_k, page_v = self._res_views[layer]
            writer(page_k, page_v, plan.rows, k, v)
        elif bool((keep := plan.rows >= 0).any()):
            dst = plan.rows[keep]
            flat = (self.residual_slots * B, self.kv_heads, self.head_dim)
            self.residual[layer, 0].view(flat)[dst] = k[keep].to(self.residual.dtype)
            self.residual[layer, 1].view(flat)[dst] = v[keep].to(self.residual.dtype)
        if plan.direct:
            # Blocks written whole this step (a prefill's) are read packed by this layer's attention: packed now.
            rows = [torch.tensor(r, device=self.device) for _, r in plan.direct]
            blocks = torch.tensor([block for block, _ in plan.direct], device=self.device)
            kb, vb = torch.stack([k[r] for r in rows]).float(), torch.stack([v[r] for r in rows]).float()
            if self.coded is not None:
                first = torch.tensor([plan.first[block] for block, _ in plan.direct])
                tokens = torch.tensor([self._first_tokens.get(block, -1) for block, _ in plan.direct])
                self.coded.seal(self.kv, [layer], blocks, kb[None], vb[None], first, tokens)
            else:
                self._pack(self.parts(layer), blocks, kb, vb)
        if layer == self.spec.layers - 1:  # the step's last layer: the sealed blocks are now packed everywhere
            if plan.seal:
                # A block whose last row came this step is read from its residual page by every layer of
                # this step: all layers are packed at once, here, in one quantisation of [layers, n, B, H, D].
                pages = torch.tensor([page for _, page in plan.seal], device=self.device)
                blocks = torch.tensor([block for block, _ in plan.seal], device=self.device)
                if self.coded is not None:
                    first = torch.tensor([plan.first[block] for block, _ in plan.seal])
                    tokens = torch.tensor([self._first_tokens.get(block, -1) for block, _ in plan.seal])
                    self.coded.seal(self.kv, range(self.spec.layers), blocks, self.residual[:, 0, pages].float(),
                                    self.residual[:, 1, pages].float(), first, tokens)
                else:
                    self._pack(self.layers_parts(), (slice(None), blocks), self.residual[:, 0, pages].float(),
                               self.residual[:, 1, pages].float())
            for block, _rows in plan.direct:
                self._release(block)
                self._sealed[block] = 1
            for block, page in plan.seal:
                self.res_map[block] = -1
                self._free_pages.append(page)
                self._sealed[block] = 1
            self._plan = None

    def _pack(self, parts: dict[str, torch.Tensor], at: object, kb: torch.Tensor, vb: torch.Tensor) -> None:
        """Quantise whole blocks ``kb``/``vb [..., n, B, H, D]`` (fp32) into ``parts[name][at]``."""
        lead = kb.shape[:-3]  # [..., n]
        flat = kb.flatten(0, len(lead) - 1)  # [N, B, H, D]: each block's B tokens on dim 1
        if self.format.scales == "channel":
            kc, ks, km = q.quant_channel(flat)
            vr = q.rotate(vb) if self.format.rotates("v") else vb
            vc, vs = q.quant_token(vr.flatten(0, -3), self.format.element)
            values = {"v.codes": vc.view(vb.shape), "v.scale": vs.view(vb.shape[:-1])}
        else:
            kc, ks, km = q.quant_kivi_k(flat)
            vc, vs, vm = q.quant_kivi_v(vb)
            values = {"v.codes": vc, "v.scale": vs, "v.min": vm}
        keys = {"k.codes": kc, "k.scale": ks, "k.min": km}
        for name, x in (*keys.items(), *values.items()):
            parts[name][at] = x.view(*lead, *x.shape[1:]) if name in keys else x

    # ---- residual pages (int4) ----------------------------------------------------------------
    def _take_page(self) -> int:
        if not self._free_pages:
            self._reclaim()
        if not self._free_pages:
            raise ConfigError(f"all {self.residual_slots} int4 residual pages are held by open blocks of running "
                              "sequences: run fewer sequences at once or give the store more residual pages")
        return self._free_pages.pop()

    def _reclaim(self) -> None:
        """Give back the pages of open blocks the ledger no longer holds (a finished or preempted
        sequence's partly written tail)."""
        in_use = self.block_in_use
        if in_use is None:
            return
        for block in torch.nonzero(self.res_map >= 0).flatten().tolist():
            if not in_use(block):
                self._release(block)

    def _release(self, block: int) -> None:
        page = int(self.res_map[block])
        if page >= 0:
            self.res_map[block] = -1
            self._free_pages.append(page)

    def open_blocks(self) -> int:
        """Blocks that hold a residual page now (int4)."""
        return int((self.res_map >= 0).sum()) if self.residual_slots else 0

    # ---- whole-block operations (all layers, K and V) ------------------------------------------
    def copy_blocks(self, ops: Iterable[tuple[int, int] | tuple[int, int, int] | _CopyLike]) -> None:
        """Copy-on-write: block ``dst`` becomes a copy of block ``src``, for every layer, K and V.

        Each op is ``(src, dst)`` (whole block), ``(src, dst, slots)`` or the ledger's ``CopyOp``
        (``.src``, ``.dst``, ``.slots``): only the first ``slots`` token slots are copied, which is all a
        forked partial tail holds. All sources are read before any destination is written, so chains
        like ``[(1, 2), (2, 3)]`` copy the *old* contents of block 2 into block 3. Quantised blocks copy
        their bytes (scales included); an open int4 block copies its residual rows into a page of its own.
        """
        norm = [_normalise(op, self.block_size) for op in ops]
        if not norm:
            return
        dst_all = [d for _, d, _ in norm]
        if len(set(dst_all)) != len(dst_all):
            raise ConfigError("copy_blocks got the same destination block twice")
        if not self.plain:
            self._copy_quantised(norm)
            return
        whole = [(s, d) for s, d, n in norm if n == self.block_size]
        part = [(s, d, n) for s, d, n in norm if n < self.block_size]
        # Read every source before writing anything (advanced indexing on the right makes a copy).
        part_data = [self.kv[:, :, s, :n].clone() for s, _, n in part]
        whole_data = self.kv[:, :, _index([s for s, _ in whole], self.device)] if whole else None
        if whole_data is not None:
            self.kv[:, :, _index([d for _, d in whole], self.device)] = whole_data
        for (_, d, n), data in zip(part, part_data, strict=True):
            self.kv[:, :, d, :n] = data

    def _copy_quantised(self, ops: list[tuple[int, int, int]]) -> None:
        B = self.block_size
        src = _index([s for s, _, _ in ops], self.device)
        data = self.kv[:, src].clone()  # every source read first
        residual: list[torch.Tensor | None] = []
        for s, _d, n in ops:
            if not self.residual_slots:
                residual.append(None)
                continue
            page = int(self.res_map[s])
            if page >= 0:
                residual.append(self.residual[:, :, page].clone())
            elif n < B:  # a partial copy of a sealed block: its rows, unquantised, into a page of its own
                rows = torch.arange(B, device=self.device) + s * B
                pages = torch.zeros_like(self.residual[:, :, 0])
                for layer in range(self.spec.layers):
                    k, v = self.read(layer, rows, self.residual.dtype)
                    pages[layer, 0], pages[layer, 1] = k, v
                residual.append(pages)
            else:
                residual.append(None)
        for i, (_s, d, n) in enumerate(ops):
            if self.format.scales in ("token-head", "token4") and n < B:
                self._copy_token_rows(data[:, i], d, n)
            else:
                self.kv[:, d] = data[:, i]
            if self.residual_slots:
                self.attach(d, residual[i])

    def _copy_token_rows(self, src_bytes: torch.Tensor, dst: int, n: int) -> None:
        """The first ``n`` rows of a per-token-scaled block (codes and scales of K and V)."""
        for at, shape, dtype in self.offsets.values():
            row = (shape[1] * shape[2] if len(shape) == 3 else shape[1]) * torch.empty((), dtype=dtype).element_size()
            self.kv[:, dst, at:at + n * row] = src_bytes[:, at:at + n * row]

    def attach(self, block: int, residual: torch.Tensor | None) -> None:
        """Set an int4 block's residual state after its bytes were replaced (copy, swap-in): open with
        ``residual`` (``[layers, 2, block_size, heads, dim]``) as its page, or sealed when None."""
        if not self.residual_slots:
            return
        if residual is None:
            self._release(block)
            self._sealed[block] = 1
            return
        page = int(self.res_map[block])
        if page < 0:
            page = self._take_page()
            self.res_map[block] = page
        self.residual[:, :, page] = residual.to(self.residual.device, self.residual.dtype)
        self._sealed[block] = 0

    def take_blocks(self, blocks: Sequence[int]) -> BlockBytes:
        """Copy ``blocks`` out: every byte of each (``block_view`` rows) and the residual page of each open
        int4 block. What a swap-out or an offload moves."""
        idx = _index(blocks, self.device)
        data = self.block_view[idx]
        residual: list[torch.Tensor | None] = [None] * len(blocks)
        if self.residual_slots:
            for i, b in enumerate(blocks):
                page = int(self.res_map[b])
                if page >= 0:
                    residual[i] = self.residual[:, :, page].clone()
        return BlockBytes(data, residual)

    def put_blocks(self, blocks: Sequence[int], taken: BlockBytes) -> None:
        """Restore :meth:`take_blocks` output into ``blocks`` (which may differ from the original ids)."""
        idx = _index(blocks, self.device)
        expected = (idx.numel(), *self.block_view.shape[1:])
        if tuple(taken.data.shape) != expected or len(taken.residual) != idx.numel():
            raise ConfigError(f"restored blocks have shape {tuple(taken.data.shape)}, expected {expected}")
        view = self.block_view
        view[idx] = taken.data.to(self.device, self.kv.dtype)
        for b, res in zip(blocks, taken.residual, strict=True):
            self.attach(int(b), res)

    def swap_out(self, blocks: Sequence[int]) -> BlockBytes:
        """Copy ``blocks`` (all layers) to host memory (pinned when CUDA is available, for DMA)."""
        taken = self.take_blocks(blocks)
        host = torch.empty(taken.data.shape, dtype=taken.data.dtype, pin_memory=torch.cuda.is_available())
        host.copy_(taken.data, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            # The caller may free or reuse the device blocks as soon as this returns.
            torch.cuda.current_stream(self.device).synchronize()
        return BlockBytes(host, [None if r is None else r.cpu() for r in taken.residual])

    def swap_in(self, host: BlockBytes, blocks: Sequence[int]) -> None:
        """Restore a :meth:`swap_out` buffer into ``blocks`` (which may differ from the original ids)."""
        self.put_blocks(blocks, host)


__all__ = ["BlockBytes", "KVStore", "torch_dtype"]
