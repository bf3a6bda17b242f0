"""The host tier (lesson 07): a bounded pool of host blocks with its own ledger, and the transfer model.

Host blocks hold KV copied out of the device pool; they are recoverable state for swapped requests.
Conservation: ``free + used == total``. Transfers are batched per step through a pinned staging buffer
of ``staging_blocks``: a batch larger than the buffer takes several rounds, each paying the fixed
overhead. Whether a transfer overlaps compute is a flag, never an assumption: when ``overlap`` is False
the step waits for the transfer (a synchronisation point before the request can run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError, InvariantError, LedgerError


@dataclass(frozen=True, slots=True)
class TransferModel:
    link_Bps: float = 25e9  # effective host<->device bandwidth per direction, bytes/s
    overhead_s: float = 20e-6  # fixed cost per transfer round (launch, sync, DMA setup)
    staging_blocks: int = 64  # pinned staging buffer, in blocks
    overlap: bool = False  # True only if the executor really overlaps copies with compute

    def __post_init__(self) -> None:
        if self.link_Bps <= 0 or self.overhead_s < 0 or self.staging_blocks < 1:
            raise ConfigError("transfer model needs link_Bps > 0, overhead_s >= 0, staging_blocks >= 1")

    def time_s(self, blocks: int, block_bytes: int) -> float:
        """Seconds to move ``blocks`` one way: bytes / bandwidth + one overhead per staging round."""
        if blocks <= 0:
            return 0.0
        rounds = math.ceil(blocks / self.staging_blocks)
        return blocks * block_bytes / self.link_Bps + rounds * self.overhead_s

    def blocking_time_s(self, blocks: int, block_bytes: int) -> float:
        """What the step waits for: all of it without overlap, only the fixed costs with overlap."""
        t = self.time_s(blocks, block_bytes)
        if self.overlap:
            return math.ceil(blocks / self.staging_blocks) * self.overhead_s if blocks else 0.0
        return t


class HostPool:
    """Host blocks: a free list and the count in use. O(1) per block."""

    def __init__(self, num_blocks: int, block_bytes: int = 0) -> None:
        if num_blocks < 0:
            raise ConfigError("host pool size must be >= 0")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise LedgerError(f"host pool exhausted: {n} blocks wanted, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise InvariantError(f"host block {b} freed but not in use")
            self._used.remove(b)
            self._free.append(b)

    def check(self) -> None:
        if len(self._free) + len(self._used) != self.num_blocks or set(self._free) & self._used:
            raise InvariantError("host pool conservation broken: free + used != total")
