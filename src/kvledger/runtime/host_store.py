"""The host tier's memory: one preallocated host tensor addressed by the scheduler's HostPool ids.

Layout ``[layers, 2 (K, V), host_blocks, block_size, kv_heads, head_dim]``, the device store's layout
with host block ids on dim 2, so host block ``h`` holds one whole-model page exactly like device block
``d``. The scheduler's :class:`~kvledger.scheduler.HostPool` decides which host ids are free; this
class only moves bytes. Pinned when CUDA is present, so device<->host copies can use DMA.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ConfigError
from .kv_store import KVStore


class HostKVStore:
    """Host copies of device KV blocks, for preemption by swap."""

    def __init__(self, device: KVStore, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ConfigError(f"the host store needs a block count >= 0, got {num_blocks!r}")
        self.device = device
        self.num_blocks = num_blocks
        spec = device.spec
        shape = (spec.layers, 2, num_blocks, device.block_size, device.kv_heads, device.head_dim)
        pin = torch.cuda.is_available() and num_blocks > 0
        self.kv = torch.zeros(shape, dtype=device.dtype, pin_memory=pin)
        self.blocks_out = 0  # device -> host block copies so far
        self.blocks_in = 0  # host -> device block copies so far

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

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
        data = self.device.kv[:, :, dev.to(self.device.device)]
        self.kv[:, :, host] = data.to("cpu")
        self.blocks_out += len(pairs)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy host block ``h`` into device block ``d`` for each ``(h, d)``."""
        if not pairs:
            return
        host = self._ids([h for h, _ in pairs], self.num_blocks, "host")
        dev = self._ids([d for _, d in pairs], self.device.num_blocks, "device")
        data = self.kv[:, :, host]
        if self.device.device.type == "cuda":
            data = data.pin_memory()
        self.device.kv[:, :, dev.to(self.device.device)] = data.to(
            self.device.device, non_blocking=self.device.device.type == "cuda")
        self.blocks_in += len(pairs)


__all__ = ["HostKVStore"]
