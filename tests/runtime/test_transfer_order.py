"""The order of one step's transfers, read back byte for byte.

``runtime/transfer.py`` (after ``scheduler/transfers.py``) runs a step's transfers in three phases:

    A  demote                  evicted device blocks out, before anything writes them
    B  promote, swap_in        blocks coming up from a tier
    C  tier_moves, writeback,  entries one tier down, then retained blocks copied down; swap-outs
       swap_out

Two places are vacated and reused inside one step, and the order is what keeps their bytes right:

* a **device block** the pool evicts is read out by its demotion (A) and written by a promotion or a
  swap-in (B) into that same block;
* a **host slot** whose entry a tier move carries to disk (C, moves) is written by the write-back that
  took the slot (C, write-backs, after the moves).

A tier slot a promotion reads is *drained* by the tier ledger until the step completes, so no transfer of
the same step writes it (A before B would otherwise overwrite it before it is read); the next step may
reuse it. The step here is decided by the real :class:`TierLedger` (the slots it hands out are asserted,
so the reuse is the ledger's, not the test's), carried out by the real :class:`TransferEngine` on a real
:class:`KVStore` with a host and a disk tier, and every device block and every tier slot is then compared
byte for byte with what must be there. Each block's bytes are a pattern of its own; an int4 block that
is open carries a residual page with a pattern of its own too."""

from __future__ import annotations

import pytest
import torch

from kvledger.core import KVSpec
from kvledger.core.tiers import TierLedger
from kvledger.runtime import KVStore
from kvledger.runtime.host_store import BlockRows, MemoryTier, TierStores
from kvledger.runtime.transfer import TransferEngine
from kvledger.scheduler import StepPlan

BLOCKS = 8
GROUP = "tenant"


class Patterns:
    """Distinct recognisable contents, one per tag: the bytes of a block as a tier row holds them."""

    def __init__(self, rows: BlockRows) -> None:
        self.rows = rows
        self.kv_bytes = sum(p.nbytes for p in rows.parts)

    def opens(self, tag: int) -> bool:
        return self.rows.residual is not None and tag % 2 == 1  # int4: odd tags are open blocks

    def row(self, tag: int) -> torch.Tensor:
        row = torch.zeros(self.rows.nbytes, dtype=torch.uint8)
        row[:self.kv_bytes] = (torch.arange(self.kv_bytes) * 7 + tag * 53) % 256
        if self.opens(tag):
            r = self.rows.residual
            assert r is not None
            row[self.rows.flag_offset] = 1
            page = torch.arange(r.nbytes // 4, dtype=torch.float32) + 1000.0 * tag  # fp32 residual
            row[r.offset:r.offset + r.nbytes] = page.view(torch.uint8)
        return row

    def meaning(self, row: torch.Tensor) -> tuple[bytes, bytes | None]:
        """What a row says: the block's bytes, and its residual page if it is open (else None). Bytes a
        sealed block does not use (its residual area, alignment padding) carry no meaning."""
        data = row[:self.kv_bytes].numpy().tobytes()
        r = self.rows.residual
        if r is None or not int(row[self.rows.flag_offset]):
            return data, None
        return data, row[r.offset:r.offset + r.nbytes].numpy().tobytes()

    def of(self, tag: int) -> tuple[bytes, bytes | None]:
        return self.meaning(self.row(tag))


class Rig:
    """A device store, its host and disk tiers, the tier ledger that decides, and the engine that moves."""

    def __init__(self, fmt: str, mode: str, tmp_path) -> None:
        spec = KVSpec(2, 2, 8, kv_dtype=fmt, block_size=4, residual_dtype="fp32")
        self.store = KVStore(spec, BLOCKS, residual_slots=BLOCKS)
        self.ledger = TierLedger([("host", 2), ("disk", 5)])
        self.stores = TierStores(self.store, self.ledger.names, self.ledger.sizes, disk_dir=tmp_path)
        # staging_blocks=1: every disk batch of two takes two staging rounds through the same row.
        self.engine = TransferEngine(self.stores, staging_blocks=1, overlap=mode != "serial")
        self.mode = mode
        self.rows = self.stores.blocks
        self.pat = Patterns(self.rows)

    def put_device(self, block: int, tag: int) -> None:
        self.rows.write(block, self.pat.row(tag))

    def device(self, block: int) -> tuple[bytes, bytes | None]:
        row = torch.zeros(self.rows.nbytes, dtype=torch.uint8)
        self.rows.read(block, row)
        return self.pat.meaning(row)

    def slot(self, slot: int) -> tuple[bytes, bytes | None]:
        tier, local = self.stores.locate(slot)
        if isinstance(tier, MemoryTier):
            return self.pat.meaning(tier.row(local).clone())
        row = torch.zeros(self.rows.nbytes, dtype=torch.uint8)
        tier.read(local, row)
        return self.pat.meaning(row)

    def plan(self, step: int, **lists: list[tuple[int, int]]) -> StepPlan:
        """The step's plan: the ledger's own demote / move / writeback ops (as the scheduler files them),
        plus the promotions and swaps given."""
        plan = StepPlan(step, **lists)
        files = {"demote": plan.demote, "move": plan.tier_moves, "writeback": plan.writeback}
        for op in self.ledger.take_ops():
            files[op.kind].append((op.src, op.dst))
        return plan

    def run(self, plan: StepPlan) -> None:
        if self.mode == "run_now":
            self.engine.run_now(plan)
        else:  # A (and B when the step reads it) in this thread, the rest on the worker
            batch = self.engine.start(plan, inbound_needed=self.mode != "worker")
            batch.wait()
            assert batch.error is None, batch.error
        self.ledger.complete()  # the step is confirmed: written slots readable, drained slots free

    def check(self, device: dict[int, int], tiers: dict[int, int]) -> None:
        """Every device block and every listed tier slot holds exactly the pattern of its tag."""
        for block, tag in device.items():
            assert self.device(block) == self.pat.of(tag), f"device block {block}: not the bytes of pattern {tag}"
        for slot, tag in tiers.items():
            assert self.slot(slot) == self.pat.of(tag), f"tier slot {slot}: not the bytes of pattern {tag}"
        if self.store.residual_slots:
            for block, tag in device.items():  # an open block's page belongs to it alone
                assert (int(self.store.res_map[block]) >= 0) == self.pat.opens(tag)


MODES = ["run_now", "inline", "worker", "serial"]  # inline: B runs before compute; worker: B queued with C


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_one_steps_demotions_promotions_swaps_moves_and_write_backs_land_byte_for_byte(fmt, mode, tmp_path) -> None:
    rig = Rig(fmt, mode, tmp_path)
    ledger = rig.ledger
    for b in range(BLOCKS):
        rig.put_device(b, b)
    device = {b: b for b in range(BLOCKS)}

    # Step 0: write back retained prefix blocks 1 (A) and 2 (B) to the host; preempt the request on block 3 by swap.
    assert ledger.demote(1, b"A", GROUP, urgent=False) == 0
    assert ledger.demote(2, b"B", GROUP, urgent=False) == 1
    held = ledger.hold(1)
    assert held == [2]  # the host is full: the swapped block goes to disk
    rig.run(rig.plan(0, swap_out=[(3, 2)]))
    tiers = {0: 1, 1: 2, 2: 3}
    rig.check(device, tiers)
    for b, tag in ((1, 11), (2, 12), (3, 13)):  # the device moves on: those blocks now hold other data
        rig.put_device(b, tag)
        device[b] = tag

    # Step 1. The pool evicts blocks 5 and 6 (prefix blocks C and D no write-back reached: urgent demotions)
    # and reuses them at once: 5 for prefix A promoted from the host, 6 for the swapped request's block.
    promoted = ledger.lookup([b"A"], 0, GROUP)
    assert promoted == [0]
    ledger.take(promoted)
    c, d = ledger.demote(5, b"C", GROUP), ledger.demote(6, b"D", GROUP)
    assert (c, d) == (3, 4)  # to disk: host slot 0 drains (its promotion reads it this step), slot 1 is cached
    # A write-back of retained block 7 (E): the host has no free slot, so its least recently used entry (B,
    # slot 1) moves to disk and E takes slot 1 -- vacated and reused within the step.
    assert ledger.demote(7, b"E", GROUP, urgent=False) == 1
    swap = ledger.hold(1)  # the request on block 4 is preempted by swap
    plan = rig.plan(1, promote=[(0, 5)], swap_in=[(2, 6)], swap_out=[(4, swap[0])])
    assert plan.demote == [(5, 3), (6, 4)] and plan.tier_moves == [(1, 5)] and plan.writeback == [(7, 1)]
    assert swap == [6]
    moved_from = {src for src, _ in plan.tier_moves}
    assert moved_from & {dst for _, dst in plan.writeback}, "the write-back reuses the moved entry's slot"
    assert {b for b, _ in plan.demote} == {d for _, d in plan.promote + plan.swap_in}, "demoted blocks are reused"
    rig.run(plan)
    ledger.free(held)  # the restored request's host copy (at confirm, as the scheduler does)
    device.update({5: 1, 6: 3})  # A promoted into 5; the swapped block restored into 6; 4 and 7 stay
    tiers.update({3: 5, 4: 6, 5: 2, 1: 7, 6: 4})  # C, D demoted; B moved down; E written back; 4 swapped out
    rig.check(device, tiers)  # host slot 0 (drained, not yet reused) still holds A's bytes too

    # Step 2: the host slot the promotion vacated is free now, and the next urgent demotion (block 0, F)
    # takes it; block 0 is reused in the same step by prefix C promoted from disk.
    taken = ledger.lookup([b"C"], 0, GROUP)
    assert taken == [3]
    ledger.take(taken)
    assert ledger.demote(0, b"F", GROUP) == 0
    plan = rig.plan(2, promote=[(3, 0)])
    assert plan.demote == [(0, 0)]
    rig.run(plan)
    device[0] = 5
    tiers[0] = 0
    rig.check(device, tiers)
    ledger.check()
    assert ledger.index == {b"B": 5, b"D": 4, b"E": 1, b"F": 0}
    rig.engine.close()


def test_a_slot_a_promotion_reads_is_not_handed_to_a_transfer_of_the_same_step() -> None:
    """Why demotions (A) may run before promotions (B): the ledger drains a promoted slot until the step
    completes, so an urgent demotion of the same step never writes it, even when it is the only host slot."""
    ledger = TierLedger([("host", 1), ("disk", 1)])
    assert ledger.demote(9, b"A", GROUP) == 0
    ledger.take_ops()
    ledger.complete()
    ledger.take(ledger.lookup([b"A"], 0, GROUP))
    assert ledger.demote(3, b"B", GROUP) == 1  # disk, not the draining host slot
    assert ledger.demote(4, b"C", GROUP) is None  # nothing else: dropped rather than overwrite slot 0
    ledger.take_ops()
    ledger.complete()
    assert ledger.demote(5, b"D", GROUP) == 0  # after the step, the vacated slot is reused
