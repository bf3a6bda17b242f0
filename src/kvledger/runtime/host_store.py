"""The bytes of the tiers below the device pool: host memory and a file on disk, addressed by tier slots.

A tier slot holds one whole device block **as bytes**: :class:`BlockRows` reads the block out of every
tensor of the device store that is indexed by block (by default the store's ``kv`` on its ``block_dim``:
values, and for quantised formats their scales and minimums, all in one byte layout; a store may name
more per-block tensors in ``store.block_tensors()``, a list of ``(tensor, block dim)``) and concatenates
their raw bytes; an int4 store's open block also carries its unquantised residual page (and a flag), so
the residual travels with the block and is re-attached on the way back. A tier moves a block whatever its
format, and a block that goes down and comes back is bit-identical.

* :class:`MemoryTier` -- one ``uint8`` tensor of ``[slots, block_bytes]`` (pinned when CUDA is present, so
  device <-> host copies are DMA on a copy stream);
* :class:`FileTier` -- a file of ``slots x block_bytes`` (created in ``directory`` and unlinked at once, so
  nothing is left behind), read and written with ``pread`` / ``pwrite``; optionally each block is stored
  losslessly compressed (:data:`CODECS`: ``zlib``), which saves bytes on the link, not slots.

The scheduler's :class:`~kvledger.core.tiers.TierLedger` decides which slots are free; :class:`TierStores`
maps its global slot ids to these stores. Nothing here decides anything.
"""

from __future__ import annotations

import os
import tempfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.registry import Registry
from ..errors import ConfigError
from .kv_store import BlockBytes, KVStore

# ---- a block as bytes ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Part:
    tensor: torch.Tensor
    dim: int
    offset: int  # byte offset of this tensor's share of a block within a row
    nbytes: int  # bytes of one block of this tensor
    shape: tuple[int, ...]  # one block of this tensor (the tensor's shape without its block dim)


class BlockRows:
    """Copies whole device blocks to and from ``uint8`` rows of :attr:`nbytes` (all layers, K and V, and any
    per-block metadata a format keeps), with no dtype conversion."""

    def __init__(self, store: KVStore) -> None:
        named = getattr(store, "block_tensors", None)
        pairs: Sequence[tuple[torch.Tensor, int]] = named() if callable(named) else \
            [(store.kv, getattr(store, "block_dim", 2))]
        parts = []
        offset = 0
        for tensor, dim in pairs:
            if tensor.shape[dim] != store.num_blocks:
                raise ConfigError(f"a block tensor has {tensor.shape[dim]} blocks on dim {dim}, the store "
                                  f"{store.num_blocks}")
            shape = tuple(s for i, s in enumerate(tensor.shape) if i != dim)
            nbytes = int(np.prod(shape)) * tensor.element_size()
            parts.append(_Part(tensor, dim, offset, nbytes, shape))
            offset += nbytes
        self.store = store
        self.residual: _Part | None = None  # an int4 store's residual page of an open block, and a flag
        if getattr(store, "residual_slots", 0):
            page = store.residual[:, :, 0]
            offset = -(-offset // 8) * 8  # the flag and the page start 8-byte aligned
            self.flag_offset = offset
            offset += 8
            self.residual = _Part(store.residual, 2, offset, page.numel() * page.element_size(), tuple(page.shape))
            offset += self.residual.nbytes
        self.parts = tuple(parts)
        self.nbytes = offset
        self.device = store.kv.device
        self.num_blocks = store.num_blocks

    def read(self, block: int, row: torch.Tensor, non_blocking: bool = False) -> None:
        """Device block ``block`` -> ``row`` (a ``uint8`` tensor of :attr:`nbytes`, usually on the host)."""
        for p in self.parts:
            dst = row[p.offset:p.offset + p.nbytes].view(p.tensor.dtype).view(p.shape)
            dst.copy_(p.tensor.select(p.dim, block), non_blocking=non_blocking)
        r = self.residual
        if r is not None:
            page = int(self.store.res_map[block])
            row[self.flag_offset] = 1 if page >= 0 else 0
            if page >= 0:
                dst = row[r.offset:r.offset + r.nbytes].view(r.tensor.dtype).view(r.shape)
                dst.copy_(r.tensor.select(r.dim, page), non_blocking=non_blocking)

    def write(self, block: int, row: torch.Tensor, non_blocking: bool = False) -> None:
        """``row`` -> device block ``block`` (an open int4 block gets its residual page back)."""
        for p in self.parts:
            src = row[p.offset:p.offset + p.nbytes].view(p.tensor.dtype).view(p.shape)
            p.tensor.select(p.dim, block).copy_(src, non_blocking=non_blocking)
        r = self.residual
        if r is not None:
            is_open = bool(row[self.flag_offset].item())
            page = row[r.offset:r.offset + r.nbytes].view(r.tensor.dtype).view(r.shape) if is_open else None
            self.store.attach(block, page)

    def snapshot(self, block: int) -> bytes:
        """The block's bytes (for tests and checks)."""
        row = torch.empty(self.nbytes, dtype=torch.uint8)
        self.read(block, row)
        return row.numpy().tobytes()


# ---- codecs ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Codec:
    """Lossless: ``decode(encode(b)) == b`` for every byte string."""

    name: str
    encode: Callable[[bytes | memoryview], bytes]
    decode: Callable[[bytes], bytes]
    help: str


CODECS: Registry[Codec] = Registry("tier compression")
CODECS.register("none", Codec("none", bytes, bytes, "store the block's bytes as they are"))
# Level 1: KV is mostly high-entropy mantissa bits; higher levels cost far more CPU for little gain.
CODECS.register("zlib", Codec("zlib", lambda b: zlib.compress(b, 1), zlib.decompress,
                              "zlib (deflate, level 1) from the standard library"))


def codec(name: str) -> Codec:
    found = CODECS.get(name)
    if found is None:
        raise ConfigError(f"unknown tier compression {name!r}; known: {', '.join(CODECS)}")
    return found


# ---- tiers -------------------------------------------------------------------------------------------


class MemoryTier:
    """Host memory: ``[slots, block_bytes]`` bytes, pinned when CUDA is present."""

    kind = "host"

    def __init__(self, slots: int, block_bytes: int) -> None:
        _check_size(slots, block_bytes)
        self.slots = slots
        self.block_bytes = block_bytes
        pin = torch.cuda.is_available() and slots > 0
        self.data = torch.empty((slots, block_bytes), dtype=torch.uint8, pin_memory=pin)
        self.bytes_written = self.bytes_read = 0

    @property
    def nbytes(self) -> int:
        return self.slots * self.block_bytes

    def row(self, slot: int) -> torch.Tensor:
        """The slot's bytes, in place: device copies go straight here (no staging needed)."""
        return self.data[slot]

    def write(self, slot: int, row: torch.Tensor) -> None:
        self.data[slot].copy_(row)
        self.bytes_written += self.block_bytes

    def read(self, slot: int, row: torch.Tensor) -> None:
        row.copy_(self.data[slot])
        self.bytes_read += self.block_bytes

    def close(self) -> None:
        pass


class FileTier:
    """A file of ``slots x block_bytes``; each block stored raw or compressed by ``compression``."""

    kind = "disk"

    def __init__(self, slots: int, block_bytes: int, directory: str | os.PathLike[str] | None = None,
                 compression: str = "none") -> None:
        _check_size(slots, block_bytes)
        self.slots = slots
        self.block_bytes = block_bytes
        self.codec = codec(compression)
        folder = Path(directory) if directory is not None else Path(tempfile.gettempdir())
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix="kvledger-tier-", suffix=".kv", dir=folder)
        except OSError as exc:
            raise ConfigError(f"cannot create the disk tier's file in {folder}: {exc}") from None
        os.unlink(path)  # anonymous from now on: the space is returned when the file is closed
        self.fd = fd
        self.path = f"{path} (unlinked)"
        self.stored = np.zeros(max(slots, 1), dtype=np.int64)  # bytes stored per slot (compressed size)
        self.bytes_raw = self.bytes_stored = self.bytes_read = 0

    @property
    def nbytes(self) -> int:
        return self.slots * self.block_bytes

    def write(self, slot: int, row: torch.Tensor) -> None:
        view = memoryview(row.numpy())
        data: bytes | memoryview = view
        if self.codec.name != "none":
            packed = self.codec.encode(view)
            if len(packed) < self.block_bytes:
                data = packed
        written = os.pwrite(self.fd, data, slot * self.block_bytes)
        if written != len(data):
            raise OSError(f"disk tier: short write ({written} of {len(data)} bytes)")
        self.stored[slot] = len(data)
        self.bytes_raw += self.block_bytes
        self.bytes_stored += len(data)

    def read(self, slot: int, row: torch.Tensor) -> None:
        size = int(self.stored[slot])
        offset = slot * self.block_bytes
        out = row.numpy()
        if size == self.block_bytes:
            got = os.preadv(self.fd, [memoryview(out)], offset)
            if got != size:
                raise OSError(f"disk tier: short read ({got} of {size} bytes)")
        else:
            packed = os.pread(self.fd, size, offset)
            if len(packed) != size:
                raise OSError(f"disk tier: short read ({len(packed)} of {size} bytes)")
            raw = self.codec.decode(packed)
            if len(raw) != self.block_bytes:
                raise OSError(f"disk tier: slot {slot} decompressed to {len(raw)} bytes, not {self.block_bytes}")
            out[:] = np.frombuffer(raw, dtype=np.uint8)
        self.bytes_read += size

    @property
    def ratio(self) -> float | None:
        """Raw bytes per stored byte over every write so far (None before any)."""
        return self.bytes_raw / self.bytes_stored if self.bytes_stored else None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- interpreter shutdown
            pass


def _check_size(slots: object, block_bytes: object) -> None:
    for name, value in (("slots", slots), ("block bytes", block_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"a tier needs {name} >= 0, got {value!r}")


class TierStores:
    """The byte stores of every tier, in the tier ledger's order; global slot ids as the ledger's."""

    def __init__(self, device: KVStore, names: Sequence[str], sizes: Sequence[int], *,
                 disk_dir: str | os.PathLike[str] | None = None, compression: str = "none") -> None:
        self.device = device
        self.blocks = BlockRows(device)
        self.names = tuple(names)
        self.bases = tuple(sum(sizes[:i]) for i in range(len(sizes)))
        self.tiers: list[MemoryTier | FileTier] = []
        for name, size in zip(names, sizes, strict=True):
            if name == "host":
                self.tiers.append(MemoryTier(size, self.blocks.nbytes))
            elif name == "disk":
                self.tiers.append(FileTier(size, self.blocks.nbytes, disk_dir, compression))
            else:
                raise ConfigError(f"no byte store for a tier named {name!r} (host, disk)")
        self.num_blocks = sum(sizes)

    def locate(self, slot: int) -> tuple[MemoryTier | FileTier, int]:
        """The store holding global slot ``slot`` and the slot within it."""
        if not 0 <= slot < self.num_blocks:
            raise ConfigError(f"tier slot {slot} is outside [0, {self.num_blocks})")
        i = len(self.bases) - 1
        while self.bases[i] > slot:
            i -= 1
        return self.tiers[i], slot - self.bases[i]

    def tier_name(self, slot: int) -> str:
        return self.locate(slot)[0].kind

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tiers)

    @property
    def host(self) -> MemoryTier | None:
        return next((t for t in self.tiers if isinstance(t, MemoryTier)), None)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, t in zip(self.names, self.tiers, strict=True):
            entry: dict[str, Any] = {"slots": t.slots, "bytes": t.nbytes, "block_bytes": t.block_bytes}
            if isinstance(t, FileTier):
                entry.update(compression=t.codec.name, bytes_raw=t.bytes_raw, bytes_stored=t.bytes_stored,
                             compression_ratio=t.ratio)
            out[name] = entry
        return out

    def close(self) -> None:
        for t in self.tiers:
            t.close()


# ---- the one-tier swap store of earlier versions ---------------------------------------------------------
# The engine uses TierStores; this stays for callers that swap whole stores directly.


class HostKVStore:
    """Host copies of device KV blocks, for preemption by swap."""

    def __init__(self, device: KVStore, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ConfigError(f"the host store needs a block count >= 0, got {num_blocks!r}")
        self.device = device
        self.num_blocks = num_blocks
        shape = list(device.kv.shape)
        shape[device.block_dim] = num_blocks
        pin = torch.cuda.is_available() and num_blocks > 0
        self.kv = torch.zeros(shape, dtype=device.kv.dtype, pin_memory=pin)
        self.block_dim = device.block_dim
        self.residual: dict[int, torch.Tensor] = {}  # host block -> residual page of an open int4 block
        self.blocks_out = 0  # device -> host block copies so far
        self.blocks_in = 0  # host -> device block copies so far

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + sum(r.numel() * r.element_size()
                                                              for r in self.residual.values())

    def _ids(self, ids: Sequence[int], limit: int, what: str) -> torch.Tensor:
        if ids and not 0 <= min(ids) <= max(ids) < limit:
            raise ConfigError(f"{what} block ids must be in [0, {limit}), got {min(ids)}..{max(ids)}")
        return torch.as_tensor(list(ids), dtype=torch.long)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device block ``d`` into host block ``h`` for each ``(d, h)`` (all layers, K and V).
        Returns once the copies are complete, so the device blocks may be reused right after."""
        if not pairs:
            return
        dev = self._ids([d for d, _ in pairs], self.device.num_blocks, "device")
        host = self._ids([h for _, h in pairs], self.num_blocks, "host")
        # One gather on the device, one transfer, one scatter into the host pool.
        taken = self.device.take_blocks(dev.tolist())
        self.kv.movedim(self.block_dim, 0)[host] = taken.data.to("cpu")
        for (_, h), res in zip(pairs, taken.residual, strict=True):
            if res is None:
                self.residual.pop(h, None)
            else:
                self.residual[h] = res.to("cpu")
        self.blocks_out += len(pairs)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy host block ``h`` into device block ``d`` for each ``(h, d)``."""
        if not pairs:
            return
        host = self._ids([h for h, _ in pairs], self.num_blocks, "host")
        dev = self._ids([d for _, d in pairs], self.device.num_blocks, "device")
        data = self.kv.movedim(self.block_dim, 0)[host]
        if self.device.device.type == "cuda":
            data = data.pin_memory()
        data = data.to(self.device.device, non_blocking=self.device.device.type == "cuda")
        self.device.put_blocks(dev.tolist(), BlockBytes(data, [self.residual.get(h) for h, _ in pairs]))
        self.blocks_in += len(pairs)


__all__ = ["CODECS", "BlockRows", "Codec", "FileTier", "HostKVStore", "MemoryTier", "TierStores", "codec"]
