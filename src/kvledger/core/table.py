"""Block tables: a sequence's logical token positions mapped to physical (block, slot) pairs."""

from __future__ import annotations

from ..errors import LedgerError


class BlockTable:
    """Logical block *i* of a sequence lives in physical block ``blocks[i]``.

    Token position ``p`` is stored at slot ``p % block_size`` of ``blocks[p // block_size]``; the flat
    slot index ``block * block_size + offset`` is what a paged-attention kernel writes through.
    """

    __slots__ = ("block_size", "blocks")

    def __init__(self, block_size: int, blocks: list[int] | None = None) -> None:
        self.block_size = block_size
        self.blocks: list[int] = blocks if blocks is not None else []

    def __len__(self) -> int:
        return len(self.blocks)

    def slot(self, position: int) -> tuple[int, int]:
        """(physical block, offset in block) of a token position."""
        if position < 0:
            raise LedgerError(f"negative token position {position}")
        block, offset = divmod(position, self.block_size)
        if block >= len(self.blocks):
            raise LedgerError(f"token position {position} is beyond the table's {len(self.blocks)} blocks")
        return self.blocks[block], offset

    def slot_mapping(self, start: int, end: int) -> list[int]:
        """Flat slot indices for token positions ``[start, end)``."""
        if start < 0 or end < start:
            raise LedgerError(f"bad token range [{start}, {end})")
        if end > len(self.blocks) * self.block_size:
            raise LedgerError(f"token position {end - 1} is beyond the table's {len(self.blocks)} blocks")
        bs = self.block_size
        blocks = self.blocks
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def capacity(self) -> int:
        """Token slots the table's blocks hold (materialised blocks only)."""
        return len(self.blocks) * self.block_size

    def tail_slack(self, num_tokens: int) -> int:
        """Slots charged but unused in the tail block: the whole block is charged regardless."""
        return self.capacity() - num_tokens
