"""kvtc's pages: a model's transform-coding tables, and where each layer-head's slot sits in a block's page.

A block of the ``kvtc`` format (``core.sizing.kv_formats``) owns ``layers * layer_block_bytes`` bytes, its page,
stored as the pool stores every format (``kv[layer, block, layer_block_bytes]``, layer after layer). The page is
one run of bytes: first the block's first position (int32, little-endian: keys are coded before RoPE, so reading
them back needs it) and its sink entry (int16, below), then, layer by layer, keys then values, head by head, each
layer-head's slot as wide as the tables give it (``SideCode.slot_bytes``: a busy layer's heads wider, a quiet
one's narrower). So a slot may lie across two layers' parts of the pool; the page, not a layer's part, is the unit
the format fills.

A sequence's first row (the attention sink, which every later query reads) is kept exact, and not in the page:
its K and V at position 0 are a function of its token alone (causal attention there sees only itself, and RoPE at
0 is the identity), so the store keeps each distinct first row once, in a small table of the model's constants
(``SINK_ENTRIES`` rows of every layer, fp32, matched on layer 0's K and V), and a first block's page names its
entry; the block's other 15 rows have the whole slot. Where the table is full a first block holds its sink row at
bf16 inside its own slots instead (entry -1), as every first block did before the table.

The tables (a :class:`TransformTables`: keys' and values' ``SideCode``) are the model's, fitted once per weights
revision from calibration texts apart from every text a contract or a held-out set scores, and ship beside the
package (``kvledger/data/kv_transform/<revision>.pt``; ``python benchmarks/kv_4bit_screen.py --write-tables``
fits them; docs/kv_formats.md, "kvtc").
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.sizing.kv_formats import CODED_SINK_ENTRIES
from ..errors import ConfigError, InvariantError
from .kv_smoothing import calibrated_for
from .kv_transform import HELD_ELEMENT_BYTES, STATE_BYTES, STEP_BYTES, SideCode

TABLES_DIR = Path(__file__).resolve().parent.parent / "data" / "kv_transform"
POSITION_BYTES = 4  # the page's first bytes: the block's first position, int32 little-endian
SINK_INDEX_BYTES = 2  # then its sink entry, int16 little-endian (-1: none, the sink row held in the slots)
HEADER_BYTES = POSITION_BYTES + SINK_INDEX_BYTES
HELD_ROWS = 1  # a sequence's first row (its attention sink) kept at bf16 in the first block's slots (no entry)
SINK_ENTRIES = CODED_SINK_ENTRIES  # distinct first rows kept exact per store (fp32, every layer): 1.5 MB for SmolLM2
# A first row matches an entry when layer 0's K and V agree within this share of the entry's largest value (the
# same token in another batch differs by rounding only); deeper layers then agree within SINK_AGREE, or the model
# is not one whose position-0 rows depend on the token alone, and the store refuses to go on.
SINK_MATCH = 1e-2
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
        self._sink_index = self._flat(torch.arange(POSITION_BYTES, HEADER_BYTES))
        # the sink table: entry e's first row of every layer, [e, layer, k|v, head, dim]; _sink_key: its layer-0
        # K and V, flat, that a new first row is matched on
        self.sink = torch.zeros(SINK_ENTRIES, layers, 2, heads, head_dim)
        self._sink_filled = torch.zeros(SINK_ENTRIES, layers, dtype=torch.bool)
        self._sink_key = torch.zeros(SINK_ENTRIES, 2 * heads * head_dim)
        self.sink_entries = 0

    @property
    def constant_bytes(self) -> int:
        """Bytes the sink table holds beside the pool (a model's constants, like its tables: not per sequence)."""
        return self.sink.numel() * self.sink.element_size()

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

    def entries(self, kv: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Each block's sink entry (-1: none)."""
        raw = kv.view(-1)[self._index(self._sink_index, blocks)].to(torch.int64)  # [n, 2]
        value = raw[:, 0] | (raw[:, 1] << 8)
        return torch.where(value >= 2 ** 15, value - 2 ** 16, value)

    def _entry_for(self, k0: torch.Tensor, v0: torch.Tensor) -> int:
        """The sink entry of a first row whose layer-0 K and V are ``k0``, ``v0`` ``[H, D]``: a matching one, a
        new one, or -1 where the table is full."""
        row = torch.cat((k0.flatten(), v0.flatten())).float().cpu()
        if self.sink_entries:
            keys = self._sink_key[:self.sink_entries]
            gap = (keys - row).abs().amax(1)
            near = (gap <= SINK_MATCH * keys.abs().amax(1).clamp_min(1.0)).nonzero()
            if near.numel():
                return int(near[0])
        if self.sink_entries == SINK_ENTRIES:
            return -1
        e = self.sink_entries
        self._sink_key[e] = row
        self.sink_entries += 1
        return e

    def _keep_sink(self, e: int, layer: int, k0: torch.Tensor, v0: torch.Tensor) -> None:
        """Entry ``e``'s row at ``layer`` (``k0`` before RoPE: at position 0 the same): kept the first time,
        checked against it after."""
        row = torch.stack((k0, v0)).float().cpu()
        if not bool(self._sink_filled[e, layer]):
            self.sink[e, layer] = row
            self._sink_filled[e, layer] = True
            return
        ref = self.sink[e, layer]
        if float((ref - row).abs().max()) > SINK_AGREE * max(1.0, float(ref.abs().max())):
            raise InvariantError(f"kvtc: two first rows equal at layer 0 differ at layer {layer}; this model's "
                                 "position-0 K/V do not depend on the token alone, which kvtc's sink table needs")

    def _groups(self, first: torch.Tensor, entry: torch.Tensor) -> list[tuple[torch.Tensor, int, int, dict]]:
        """(blocks, held rows, skipped rows, layout) for each way a block is laid out."""
        zero = first == 0
        kept = zero & (entry >= 0)
        return [(zero & ~kept, HELD_ROWS, 0, self.first_slots), (kept, 0, 1, self.slots), (~zero, 0, 0, self.slots)]

    def seal(self, kv: torch.Tensor, layers: range | list[int], blocks: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, first: torch.Tensor) -> None:
        """Code whole blocks into their pages: ``k``/``v [len(layers), n, B, H, D]`` (keys after RoPE) of
        ``blocks [n]`` whose first rows sit at positions ``first [n]``."""
        flat = kv.view(-1)
        blocks, first = blocks.long().cpu(), first.long().cpu()
        if bool((first < 0).any()) or bool((first >= 2 ** 31).any()):
            raise ConfigError("kvtc positions must be in [0, 2**31)")
        raw = torch.stack([(first >> s) & 0xFF for s in (0, 8, 16, 24)], 1).to(torch.uint8)
        flat[self._index(self._position, blocks)] = raw.to(kv.device)
        layers = list(layers)
        zero = first == 0
        if 0 in layers:  # layer 0 (always a step's first seal of a block) finds each first block's sink entry
            i0 = layers.index(0)
            entry = torch.tensor([self._entry_for(k[i0, j, 0], v[i0, j, 0]) if bool(zero[j]) else -1
                                  for j in range(blocks.numel())], dtype=torch.long)
            raw = torch.stack([entry & 0xFF, (entry >> 8) & 0xFF], 1).to(torch.uint8)
            flat[self._index(self._sink_index, blocks)] = raw.to(kv.device)
        else:
            entry = torch.where(zero, self.entries(kv, blocks), -1)
        for i, layer in enumerate(layers):
            for j in (zero & (entry >= 0)).nonzero().flatten().tolist():
                self._keep_sink(int(entry[j]), layer, k[i, j, 0], v[i, j, 0])
            pre = self._rope(k[i].cpu(), first, -1.0)
            for side, code, x in (("k", self.tables.keys, pre), ("v", self.tables.values, v[i].cpu())):
                for h in range(self.heads):
                    for mask, n_held, n_skip, lay in self._groups(first, entry):
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
        entry = torch.where(first == 0, self.entries(kv, blocks), -1)
        out = {"k": torch.empty(n, B, H, D, dtype=torch.float64), "v": torch.empty(n, B, H, D, dtype=torch.float64)}
        for s, (side, code) in enumerate((("k", self.tables.keys), ("v", self.tables.values))):
            for h in range(H):
                for mask, n_held, n_skip, lay in self._groups(first, entry):
                    if not bool(mask.any()):
                        continue
                    slots = flat[self._index(lay[side][layer][h], blocks[mask])].cpu()
                    out[side][mask, :, h] = code.decode(layer, h, slots, held=n_held, skip=n_skip).double()
                    if n_skip:  # the sink row from the table (keys before RoPE: at position 0 the same)
                        out[side][mask, 0, h] = self.sink[entry[mask], layer, s, h].double()
        k = self._rope(out["k"], first, 1.0)
        return k.float().to(kv.device), out["v"].float().to(kv.device)


__all__ = ["HEADER_BYTES", "HELD_ROWS", "POSITION_BYTES", "SINK_ENTRIES", "TABLES_DIR", "CodedPages",
           "TransformTables", "for_model", "load_for", "path_for"]
