"""Block tables: logical token positions -> physical (block, slot), on hand-worked examples."""

from __future__ import annotations

import pytest

from kvledger.core.identity import CacheContext
from kvledger.core.table import BlockTable
from kvledger.errors import LedgerError


@pytest.fixture
def table() -> BlockTable:
    # Logical block 0 lives in physical block 7, logical block 1 in physical block 3.
    return BlockTable(16, [7, 3])


@pytest.mark.parametrize(
    ("position", "expected"),
    [
        (0, (7, 0)),
        (1, (7, 1)),
        (15, (7, 15)),
        (16, (3, 0)),
        (17, (3, 1)),
        (31, (3, 15)),
    ],
)
def test_slot_maps_position_to_physical_block_and_offset(table: BlockTable, position, expected) -> None:
    assert table.slot(position) == expected


def test_flat_slot_of_position_17_is_49(table: BlockTable) -> None:
    # block 3, offset 1: 3 * 16 + 1
    assert table.slot_mapping(17, 18) == [49]


def test_slot_mapping_crosses_block_boundary(table: BlockTable) -> None:
    # positions 14, 15 in block 7 (slots 126, 127), 16, 17 in block 3 (slots 48, 49)
    assert table.slot_mapping(14, 18) == [126, 127, 48, 49]


def test_slot_mapping_whole_table(table: BlockTable) -> None:
    assert table.slot_mapping(0, 32) == list(range(112, 128)) + list(range(48, 64))


def test_slot_mapping_empty_range(table: BlockTable) -> None:
    assert table.slot_mapping(5, 5) == []


def test_slot_mapping_agrees_with_slot() -> None:
    t = BlockTable(4, [9, 0, 5, 2])
    for p in range(16):
        block, offset = t.slot(p)
        assert t.slot_mapping(p, p + 1) == [block * 4 + offset]


@pytest.mark.parametrize("position", [32, 33, 1000])
def test_slot_beyond_table_raises_a_ledger_error(table: BlockTable, position: int) -> None:
    with pytest.raises(LedgerError):
        table.slot(position)


def test_slot_negative_position_raises_a_ledger_error(table: BlockTable) -> None:
    with pytest.raises(LedgerError):
        table.slot(-1)


def test_slot_mapping_beyond_table_raises_a_ledger_error(table: BlockTable) -> None:
    with pytest.raises(LedgerError):
        table.slot_mapping(30, 33)


def test_slot_mapping_negative_start_raises_a_ledger_error(table: BlockTable) -> None:
    # slot(-1) raises LedgerError; slot_mapping must not silently wrap around to the last block
    # (Python's negative list indexing would give block 3, offset 15 -> slot 63).
    with pytest.raises(LedgerError):
        table.slot_mapping(-1, 1)


@pytest.mark.parametrize(("num_tokens", "slack"), [(32, 0), (31, 1), (20, 12), (17, 15)])
def test_tail_slack(table: BlockTable, num_tokens: int, slack: int) -> None:
    assert table.tail_slack(num_tokens) == slack


def test_capacity_and_len(table: BlockTable) -> None:
    assert len(table) == 2
    assert table.capacity() == 32
    empty = BlockTable(16)
    assert len(empty) == 0
    assert empty.capacity() == 0
    with pytest.raises(LedgerError):
        empty.slot(0)


def test_block_size_one() -> None:
    t = BlockTable(1, [4, 2, 8])
    assert [t.slot(p) for p in range(3)] == [(4, 0), (2, 0), (8, 0)]
    assert t.slot_mapping(0, 3) == [4, 2, 8]
    assert t.tail_slack(3) == 0


BS = 4


def test_sequence_state_without_a_family_belongs_to_its_own_request() -> None:
    """A ``SequenceState`` built without ``family`` is its own family (the request id), as documented."""
    from kvledger.core.table import BlockTable  # noqa: PLC0415
    from kvledger.core.types import SequenceState  # noqa: PLC0415
    seq = SequenceState(request_id="r", context=CacheContext(), root=b"", tokens=[1, 2], num_prompt=2,
                        max_new_tokens=3, table=BlockTable(BS, []), promised=0)
    assert seq.family == "r" and seq.limit == 5  # 2 prompt + 3 new


def test_slot_mapping_past_the_table_names_the_position_and_the_blocks() -> None:
    """Two blocks of 4 cover positions 0..7; asking for [0, 9) names position 8 and the 2 blocks."""
    table = BlockTable(BS, [3, 5])
    assert table.slot_mapping(0, 2) == [12, 13]
    with pytest.raises(LedgerError, match=r"^token position 8 is beyond the table's 2 blocks$"):
        table.slot_mapping(0, 9)
