"""The host tier's memory: one preallocated host tensor addressed by the scheduler's HostPool ids.

Layout: the device store's pool with the block id on dim 1 (plain formats:
``[layers, 2 (K, V), host_blocks, block_size, kv_heads, head_dim]``; quantised formats:
``[layers, host_blocks, layer_block_bytes]``), so host block ``h`` holds one whole-model page, every byte of
it (codes, scales, minimums), exactly like device block ``d``. An open int4 block (a partly written tail)
also carries its unquantised residual page, kept beside the host block. The scheduler's
:class:`~kvledger.scheduler.HostPool` decides which host ids are free; this class only moves bytes. Pinned
when CUDA is present, so device<->host copies can use DMA.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ConfigError
from .kv_store import BlockBytes, KVStore


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


__all__ = ["HostKVStore"]
