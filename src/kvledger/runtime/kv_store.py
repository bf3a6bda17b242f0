"""The physical KV cache of one rank: a single preallocated tensor laid out by a :class:`KVSpec`.

Layout: ``[layers, 2 (K, V), num_blocks, block_size, kv_heads_per_rank, head_dim]``. Block ``b`` of the
ledger is index ``b`` on dim 2 of every layer, so one ledger block id addresses a whole-model page,
exactly the uniform page the block pool charges for. A token slot is ``block * block_size + offset``
(``BlockTable.slot_mapping``); within one layer the cache is viewed as ``[num_slots, heads, dim]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from ..core.geometry import KVSpec
from ..errors import ConfigError

# KVSpec short dtype names -> torch storage dtypes. int8 needs per-block scales the runtime does not
# keep, so it is refused rather than silently truncated.
_TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def torch_dtype(kv_dtype: str) -> torch.dtype:
    """The torch dtype that stores a KVSpec dtype name."""
    try:
        return _TORCH_DTYPES[kv_dtype]
    except KeyError:
        known = ", ".join(_TORCH_DTYPES)
        raise ConfigError(f"KV dtype {kv_dtype!r} is not supported by the runtime (use {known})") from None


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


class KVStore:
    """All K/V pages of one rank in one tensor. Block ids and slots come from the ledger's tables."""

    def __init__(self, spec: KVSpec, num_blocks: int, device: str | torch.device = "cpu") -> None:
        if spec.attention == "mla":
            raise ConfigError("the runtime KV store holds K and V heads; MLA latent caches are not supported")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ConfigError(f"the KV store needs at least one block, got {num_blocks!r}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        self.kv_heads = spec.kv_heads_per_rank
        self.head_dim = spec.head_dim
        self.dtype = torch_dtype(spec.kv_dtype)
        self.device = torch.device(device)
        shape = (spec.layers, 2, num_blocks, self.block_size, self.kv_heads, self.head_dim)
        # Zero-filled so unwritten slots are finite: a kernel reading a padded tail never sees NaN.
        self.kv = torch.zeros(shape, dtype=self.dtype, device=self.device)

    # ---- sizes ------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes the pool occupies; by construction ``spec.block_bytes * num_blocks``."""
        return self.kv.numel() * self.kv.element_size()

    # ---- per-layer views ----------------------------------------------------------------------
    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer as ``[num_slots, kv_heads, head_dim]`` views (no copy)."""
        kv = self.kv[layer]
        shape = (self.num_slots, self.kv_heads, self.head_dim)
        return kv[0].view(shape), kv[1].view(shape)

    def blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer as ``[num_blocks, block_size, kv_heads, head_dim]`` views (no copy): the
        shape paged kernels walk block by block."""
        kv = self.kv[layer]
        return kv[0], kv[1]

    def read(
        self, layer: int, slots: torch.Tensor, dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at flat ``slots`` (any index shape ``S``) as ``dtype``: ``[*S, kv_heads, head_dim]``.

        Every read that leaves the store in another dtype goes through here (and through the native
        kernels' row loader): a compressed format (per-block scales) dequantises in these two places."""
        kc, vc = self.layer(layer)
        return kc[slots].to(dtype), vc[slots].to(dtype)

    def write(
        self, layer: int, slots: Sequence[int] | torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    ) -> None:
        """Store ``k``/``v`` (``[n, kv_heads, head_dim]``) for ``n`` tokens at flat ``slots``."""
        idx = _index(slots, self.device)
        if k.shape != v.shape or k.shape[0] != idx.numel() or k.shape[1:] != (self.kv_heads, self.head_dim):
            raise ConfigError(
                f"write of K {tuple(k.shape)} / V {tuple(v.shape)} through {idx.numel()} slots does not "
                f"match [n, {self.kv_heads}, {self.head_dim}]")
        kc, vc = self.layer(layer)
        # Index assignment (not index_copy_) because CPU has no index_copy for float8 dtypes.
        kc[idx] = k.to(self.dtype)
        vc[idx] = v.to(self.dtype)

    def gather(
        self, layer: int, blocks: Sequence[int] | torch.Tensor, num_tokens: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a block table, token-contiguous: ``[num_tokens, kv_heads, head_dim]`` each.

        ``num_tokens`` trims the unused tail of the last block (default: every slot of the table).
        """
        idx = _index(blocks, self.device)
        kv = self.kv[layer][:, idx].flatten(1, 2)  # [2, len(blocks) * block_size, heads, dim]
        if num_tokens is not None:
            if num_tokens > kv.shape[1]:
                raise ConfigError(
                    f"{num_tokens} tokens do not fit in {idx.numel()} blocks of {self.block_size}")
            kv = kv[:, :num_tokens]
        if dtype is not None:
            kv = kv.to(dtype)
        return kv[0], kv[1]

    # ---- whole-block operations (all layers, K and V) ------------------------------------------
    def copy_blocks(self, ops: Iterable[tuple[int, int] | tuple[int, int, int] | _CopyLike]) -> None:
        """Copy-on-write: block ``dst`` becomes a copy of block ``src``, for every layer, K and V.

        Each op is ``(src, dst)`` (whole block), ``(src, dst, slots)`` or the ledger's ``CopyOp``
        (``.src``, ``.dst``, ``.slots``): only the first ``slots`` token slots are copied, which is all a
        forked partial tail holds. All sources are read before any destination is written, so chains
        like ``[(1, 2), (2, 3)]`` copy the *old* contents of block 2 into block 3.
        """
        norm = [_normalise(op, self.block_size) for op in ops]
        if not norm:
            return
        dst_all = [d for _, d, _ in norm]
        if len(set(dst_all)) != len(dst_all):
            raise ConfigError("copy_blocks got the same destination block twice")
        whole = [(s, d) for s, d, n in norm if n == self.block_size]
        part = [(s, d, n) for s, d, n in norm if n < self.block_size]
        # Read every source before writing anything (advanced indexing on the right makes a copy).
        part_data = [self.kv[:, :, s, :n].clone() for s, _, n in part]
        whole_data = self.kv[:, :, _index([s for s, _ in whole], self.device)] if whole else None
        if whole_data is not None:
            self.kv[:, :, _index([d for _, d in whole], self.device)] = whole_data
        for (_, d, n), data in zip(part, part_data, strict=True):
            self.kv[:, :, d, :n] = data

    def swap_out(self, blocks: Sequence[int]) -> torch.Tensor:
        """Copy ``blocks`` (all layers) to host memory: ``[layers, 2, len(blocks), block_size, heads, dim]``.

        The host buffer is pinned when CUDA is available so the device-to-host copy can use DMA.
        """
        idx = _index(blocks, self.device)
        shape = (self.spec.layers, 2, idx.numel(), self.block_size, self.kv_heads, self.head_dim)
        host = torch.empty(shape, dtype=self.dtype, pin_memory=torch.cuda.is_available())
        host.copy_(self.kv[:, :, idx], non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            # The caller may free or reuse the device blocks as soon as this returns.
            torch.cuda.current_stream(self.device).synchronize()
        return host

    def swap_in(self, host: torch.Tensor, blocks: Sequence[int]) -> None:
        """Restore a :meth:`swap_out` buffer into ``blocks`` (which may differ from the original ids)."""
        idx = _index(blocks, self.device)
        expected = (self.spec.layers, 2, idx.numel(), self.block_size, self.kv_heads, self.head_dim)
        if tuple(host.shape) != expected:
            raise ConfigError(f"swap_in buffer has shape {tuple(host.shape)}, expected {expected}")
        self.kv[:, :, idx] = host.to(self.device, self.dtype, non_blocking=host.is_pinned())


__all__ = ["KVStore", "torch_dtype"]
