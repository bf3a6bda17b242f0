"""kvtc's pages: a model's transform-coding tables, and where each layer-head's slot sits in a block's page.

A block of the ``kvtc`` format (``core.sizing.kv_formats``) owns ``layers * layer_block_bytes`` bytes, its page,
stored as the pool stores every format (``kv[layer, block, layer_block_bytes]``, layer after layer). The page is
one run of bytes: first the block's first position (int32, little-endian: keys are coded before RoPE, so reading
them back needs it) and its first token (int32, below), then, layer by layer, keys then values, head by head, each
layer-head's slot as wide as the tables give it (``SideCode.slot_bytes``: a busy layer's heads wider, a quiet
one's narrower). So a slot may lie across two layers' parts of the pool; the page, not a layer's part, is the unit
the format fills.

A sequence's first row (the attention sink, which every later query reads) is kept exact, and not in the page:
its K and V at position 0 are a function of its token alone (causal attention there sees only itself, and RoPE at
0 is the identity), so a first block's page names the token and the block's other 15 rows have the whole slot.
The rows come from a small cache of that pure function (``SINK_ENTRIES`` tokens, every layer, fp32, least recently
used out first), filled by the seal itself and, for a token it no longer holds, by ``recompute`` (the model runner
runs the one token at position 0). A first block whose token the writer did not give (token -1) holds its sink row
at bf16 inside its own slots instead.

The tables (a :class:`TransformTables`: keys' and values' ``SideCode``) are the model's, fitted once per weights
revision from calibration texts apart from every text a contract or a held-out set scores, and ship beside the
package (``kvledger/data/kv_transform/<revision>.pt``; ``python benchmarks/kv_4bit_screen.py --write-tables``
fits them; docs/kv_formats.md, "kvtc").
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.sizing.kv_formats import FIRST_ROW_CACHE_TOKENS
from ..errors import ConfigError, InvariantError
from .kv_smoothing import calibrated_for
from .kv_transform import HELD_ELEMENT_BYTES, STATE_BYTES, STEP_BYTES, SideCode

TABLES_DIR = Path(__file__).resolve().parent.parent / "data" / "kv_transform"
POSITION_BYTES = 4  # the page's first bytes: the block's first position, int32 little-endian
FIRST_TOKEN_BYTES = 4  # then a first block's token, int32 little-endian (-1: none, the sink row held in the slots)
HEADER_BYTES = POSITION_BYTES + FIRST_TOKEN_BYTES
HELD_ROWS = 1  # a sequence's first row (its attention sink) kept at bf16 in the first block's slots (no token)
SINK_ENTRIES = FIRST_ROW_CACHE_TOKENS  # first tokens whose rows a store's cache keeps (the pool pays for them)
# The same token's first row sealed again (another batch: rounding apart) agrees with the cached one within this
# share of its largest value, or the model's position-0 rows do not depend on the token alone and the store refuses.
SINK_AGREE = 0.25


@dataclass(frozen=True, slots=True)
class TransformTables:
    """One model's kvtc tables: ``keys`` (before RoPE) and ``values``, per layer and KV head."""

    keys: SideCode
    values: SideCode
    source: str = ""

    def check(self, layers: int, heads: int, head_dim: int, block_size: int) -> None:
        for side, code in (("keys", self.keys), ("values", self.values)):
            shape = tuple(code.mu.shape)
            if shape != (layers, heads, head_dim) or code.block_size != block_size:
                raise ConfigError(f"kvtc tables {self.source or ''} hold {side} for {list(shape)} in blocks of "
                                  f"{code.block_size}; this pool is [{layers}, {heads}, {head_dim}] in blocks of "
                                  f"{block_size}")

    def to_file(self, path: str | Path, **meta: Any) -> None:
        """Save (the turns, means and deviations as fp32, the steps and bytes a row exact; the turns' inverses are
        computed again on load, so a read always undoes the turn its write made)."""
        def side(code: SideCode) -> dict[str, Any]:
            d = code.to_dict()
            d.pop("back")
            return {k: v.float() if k in ("mu", "turn", "sigma") else v for k, v in d.items()}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"version": 1, "keys": side(self.keys), "values": side(self.values), "meta": meta}, str(path))

    @classmethod
    def from_file(cls, path: str | Path) -> TransformTables:
        try:
            data = torch.load(str(path), weights_only=True)
            sides = []
            for name in ("keys", "values"):
                d = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                     for k, v in data[name].items()}
                d["back"] = torch.linalg.inv(d["turn"])
                sides.append(SideCode.from_dict(d))
        except (OSError, RuntimeError, KeyError, TypeError, ValueError, EOFError, pickle.UnpicklingError) as exc:
            raise ConfigError(f"kvtc tables {path} are unreadable: {str(exc)[:160]}") from None
        return cls(sides[0], sides[1], str(path))


def path_for(revision: str) -> Path:
    return TABLES_DIR / f"{revision.split(':')[-1]}.pt"


def load_for(revision: str) -> TransformTables:
    """The shipped tables for weights ``revision``, or one ConfigError line saying how to make them."""
    p = path_for(revision)
    if not p.is_file():
        raise ConfigError(f"kvtc needs transform-coding tables fitted for these weights ({revision}); none ship: "
                          "fit them with `python benchmarks/kv_4bit_screen.py --write-tables`")
    return TransformTables.from_file(p)


def for_model(model: Any) -> TransformTables:
    """The tables of a decoder that :func:`~kvledger.runtime.loading.load_decoder` loaded, or one ConfigError line
    (found by weights revision as int4-smooth's constants are: ``kv_smoothing.calibrated_for``)."""
    return calibrated_for(model, "kv_transform", load_for, "kvtc needs the model's transform-coding tables")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class CodedPages:
    """The slot layout of a pool's pages (``num_blocks`` of ``layers * layer_bytes``) and their seal and read.

    ``inv_freq`` is the model's RoPE (half-split, as the model applies it): keys arrive after RoPE, are turned
    back at seal and forward again at read."""

    def __init__(self, tables: TransformTables, layers: int, heads: int, head_dim: int, block_size: int,
                 num_blocks: int, layer_bytes: int, inv_freq: torch.Tensor) -> None:
        tables.check(layers, heads, head_dim, block_size)
        if tuple(inv_freq.shape) != (head_dim // 2,):
            raise ConfigError(f"kvtc needs the model's RoPE frequencies [{head_dim // 2}], got "
                              f"{list(inv_freq.shape)}")
        self.tables = tables
        self.layers, self.heads, self.head_dim, self.block_size = layers, heads, head_dim, block_size
        self.layer_bytes = layer_bytes
        self.inv_freq = inv_freq.detach().double().cpu()
        self._stride = num_blocks * layer_bytes  # one layer of the pool, in bytes
        # slots[side][layer][head]: the page offsets of one slot, as flat pool offsets of block 0; first_slots: the
        # same for a sequence's first block (the sink row held), laid out apart where the tables size it apart
        self.slots, used = self._layout(False)
        self.first_slots, used_first = self._layout(True)
        sink = STEP_BYTES + HELD_ROWS * head_dim * HELD_ELEMENT_BYTES + STATE_BYTES
        narrow = min(int(c.first_slot_bytes.min()) for c in (tables.keys, tables.values))
        if narrow < sink:
            raise ConfigError(f"kvtc tables {tables.source}: a slot of {narrow} bytes cannot hold a sequence's first "
                              f"row at bf16 ({sink} bytes with the step and the coder's state)")
        if max(used, used_first) > layers * layer_bytes:
            raise ConfigError(f"kvtc tables {tables.source} need {max(used, used_first)} bytes a page (position "
                              f"included); the format gives {layers * layer_bytes}")
        self.page_bytes_used = used
        self.first_page_bytes_used = used_first
        self._position = self._flat(torch.arange(POSITION_BYTES))
        self._first_token = self._flat(torch.arange(POSITION_BYTES, HEADER_BYTES))
        # token -> (its first row of every layer [layer, k|v, head, dim], which layers hold it), least recent first
        self._sink: OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        # token -> its first row of every layer [layers, 2, heads, head_dim] (the model runner's); None: none
        self.recompute: Callable[[int], torch.Tensor] | None = None
        self.recomputed = 0  # rows the cache had lost and recompute gave back

    @property
    def constant_bytes(self) -> int:
        """Bytes the sink cache may hold (not per sequence; ``KVSpec.store_constant_bytes`` charges them to the pool
        the store is sized in, and ``KVStore.nbytes`` counts them)."""
        return SINK_ENTRIES * self.layers * 2 * self.heads * self.head_dim * 4

    @property
    def sink_tokens(self) -> list[int]:
        """The first tokens whose rows the cache holds now, least recently used first."""
        return list(self._sink)

    def _layout(self, first: bool) -> tuple[dict[str, list[list[torch.Tensor]]], int]:
        at = HEADER_BYTES
        slots: dict[str, list[list[torch.Tensor]]] = {"k": [], "v": []}
        for layer in range(self.layers):
            for side, code in (("k", self.tables.keys), ("v", self.tables.values)):
                row = []
                for h in range(self.heads):
                    width = int((code.first_slot_bytes if first else code.slot_bytes)[layer, h])
                    row.append(self._flat(torch.arange(at, at + width)))
                    at += width
                slots[side].append(row)
        return slots, at

    def _flat(self, page_offsets: torch.Tensor) -> torch.Tensor:
        """Page offsets -> flat offsets into ``kv.view(-1)`` for block 0 (add ``block * layer_bytes``)."""
        return (page_offsets // self.layer_bytes) * self._stride + page_offsets % self.layer_bytes

    def _index(self, flat0: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        return flat0[None, :] + blocks.long().cpu()[:, None] * self.layer_bytes

    def _rope(self, x: torch.Tensor, first: torch.Tensor, sign: float) -> torch.Tensor:
        """Rows ``x [n, B, H, D]`` of blocks starting at ``first [n]`` turned by RoPE (``sign`` -1: back)."""
        pos = first.double()[:, None] + torch.arange(self.block_size, dtype=torch.float64)[None, :]
        ang = pos[..., None] * self.inv_freq
        ang = torch.cat((ang, ang), dim=-1)[:, :, None, :]  # [n, B, 1, D]
        x = x.double()
        return x * ang.cos() + sign * _rotate_half(x) * ang.sin()

    def positions(self, kv: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        raw = kv.view(-1)[self._index(self._position, blocks)].to(torch.int64)  # [n, 4]
        value = raw[:, 0] | (raw[:, 1] << 8) | (raw[:, 2] << 16) | (raw[:, 3] << 24)
        return torch.where(value >= 2 ** 31, value - 2 ** 32, value)

    def tokens(self, kv: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Each block's first token, as its header names it (-1: none)."""
        raw = kv.view(-1)[self._index(self._first_token, blocks)].to(torch.int64)  # [n, 4]
        value = raw[:, 0] | (raw[:, 1] << 8) | (raw[:, 2] << 16) | (raw[:, 3] << 24)
        return torch.where(value >= 2 ** 31, value - 2 ** 32, value)

    def _entry(self, token: int) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self._sink.get(token)
        if entry is None:
            if len(self._sink) >= SINK_ENTRIES:
                self._sink.popitem(last=False)
            entry = (torch.zeros(self.layers, 2, self.heads, self.head_dim),
                     torch.zeros(self.layers, dtype=torch.bool))
            self._sink[token] = entry
        self._sink.move_to_end(token)
        return entry

    def _keep_sink(self, token: int, layer: int, k0: torch.Tensor, v0: torch.Tensor) -> None:
        """``token``'s first row at ``layer`` (``k0`` before RoPE: at position 0 the same): cached, or checked
        against the cached one."""
        rows, filled = self._entry(token)
        row = torch.stack((k0, v0)).float().cpu()
        if not bool(filled[layer]):
            rows[layer] = row
            filled[layer] = True
            return
        ref = rows[layer]
        if float((ref - row).abs().max()) > SINK_AGREE * max(1.0, float(ref.abs().max())):
            raise InvariantError(f"kvtc: token {token}'s first row differs between two sequences at layer {layer}; "
                                 "this model's position-0 K/V do not depend on the token alone, which kvtc needs")

    def _sink_row(self, token: int, layer: int) -> torch.Tensor:
        """``token``'s first row at ``layer`` ``[2, H, D]``: cached, or recomputed (every layer) and cached."""
        rows, filled = self._entry(token)
        if not bool(filled[layer]):
            if self.recompute is None:
                raise InvariantError(f"kvtc: the first row of token {token} is no longer cached and this store was "
                                     "given no model to recompute it (ModelRunner sets CodedPages.recompute)")
            rows.copy_(self.recompute(token).float().cpu())
            filled.fill_(True)
            self.recomputed += 1
        return rows[layer]

    def _groups(self, first: torch.Tensor, token: torch.Tensor) -> list[tuple[torch.Tensor, int, int, dict]]:
        """(blocks, held rows, skipped rows, layout) for each way a block is laid out."""
        zero = first == 0
        kept = zero & (token >= 0)
        return [(zero & ~kept, HELD_ROWS, 0, self.first_slots), (kept, 0, 1, self.slots), (~zero, 0, 0, self.slots)]

    def seal(self, kv: torch.Tensor, layers: range | list[int], blocks: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, first: torch.Tensor, first_token: torch.Tensor | None = None) -> None:
        """Code whole blocks into their pages: ``k``/``v [len(layers), n, B, H, D]`` (keys after RoPE) of
        ``blocks [n]`` whose first rows sit at positions ``first [n]``; ``first_token [n]``: a first block's
        token (-1 or None: not given, its sink row held in its slots). Layer 0 is always a block's first seal in
        a step: it writes the header, later layers read it."""
        flat = kv.view(-1)
        blocks, first = blocks.long().cpu(), first.long().cpu()
        if bool((first < 0).any()) or bool((first >= 2 ** 31).any()):
            raise ConfigError("kvtc positions must be in [0, 2**31)")
        raw = torch.stack([(first >> s) & 0xFF for s in (0, 8, 16, 24)], 1).to(torch.uint8)
        flat[self._index(self._position, blocks)] = raw.to(kv.device)
        layers = list(layers)
        zero = first == 0
        if 0 in layers:
            given = torch.full_like(first, -1) if first_token is None else first_token.long().cpu()
            token = torch.where(zero, given, -1)
            raw = torch.stack([(token >> s) & 0xFF for s in (0, 8, 16, 24)], 1).to(torch.uint8)
            flat[self._index(self._first_token, blocks)] = raw.to(kv.device)
        else:
            token = torch.where(zero, self.tokens(kv, blocks), -1)
        for i, layer in enumerate(layers):
            for j in (zero & (token >= 0)).nonzero().flatten().tolist():
                self._keep_sink(int(token[j]), layer, k[i, j, 0], v[i, j, 0])
            pre = self._rope(k[i].cpu(), first, -1.0)
            for side, code, x in (("k", self.tables.keys, pre), ("v", self.tables.values, v[i].cpu())):
                for h in range(self.heads):
                    for mask, n_held, n_skip, lay in self._groups(first, token):
                        if not bool(mask.any()):
                            continue
                        out, _, _ = code.encode(layer, h, x[mask][:, :, h], held=n_held, skip=n_skip)
                        flat[self._index(lay[side][layer][h], blocks[mask])] = out.to(kv.device)

    def read(self, kv: torch.Tensor, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sealed ``blocks [n]`` of one layer back as ``(k, v) [n, B, H, D]`` float32, keys after RoPE."""
        flat = kv.view(-1)
        blocks = blocks.long().cpu()
        n, B, H, D = blocks.numel(), self.block_size, self.heads, self.head_dim
        first = self.positions(kv, blocks)
        token = torch.where(first == 0, self.tokens(kv, blocks), -1)
        sink = {t: self._sink_row(t, layer) for t in token[token >= 0].unique().tolist()}
        out = {"k": torch.empty(n, B, H, D, dtype=torch.float64), "v": torch.empty(n, B, H, D, dtype=torch.float64)}
        for s, (side, code) in enumerate((("k", self.tables.keys), ("v", self.tables.values))):
            for h in range(H):
                for mask, n_held, n_skip, lay in self._groups(first, token):
                    if not bool(mask.any()):
                        continue
                    slots = flat[self._index(lay[side][layer][h], blocks[mask])].cpu()
                    out[side][mask, :, h] = code.decode(layer, h, slots, held=n_held, skip=n_skip).double()
                    if n_skip:  # the sink row from the cache (keys before RoPE: at position 0 the same)
                        out[side][mask, 0, h] = torch.stack([sink[int(t)][s, h] for t in token[mask]]).double()
        k = self._rope(out["k"], first, 1.0)
        return k.float().to(kv.device), out["v"].float().to(kv.device)


__all__ = ["FIRST_TOKEN_BYTES", "HEADER_BYTES", "HELD_ROWS", "POSITION_BYTES", "SINK_ENTRIES", "TABLES_DIR",
           "CodedPages", "TransformTables", "for_model", "load_for", "path_for"]
