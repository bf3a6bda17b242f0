"""The host pool and the transfer model below the scheduler (``scheduler/host.py``, ``scheduler/transfers.py``):
block sizes in bytes, what a move or a write-back costs over the link, and the transfer model's refusals."""

from __future__ import annotations

import pytest

from kvledger.core.ledger import KVLedger
from kvledger.core.tiers import TierLedger
from kvledger.errors import ConfigError
from kvledger.scheduler import (
    HostPool,
    StepPlan,
    TransferModel,
)
from kvledger.scheduler.transfers import step_transfer_timing

try:  # the module name pytest gives tests/scheduler/test_scheduler.py depends on its import mode
    from tests.scheduler.test_scheduler import BS, FakeEngine, toks
except ImportError:  # pragma: no cover
    from test_scheduler import BS, FakeEngine, toks


def test_transfer_model_names_link_bps_in_its_error() -> None:
    """A non-positive ``link_Bps`` is reported under its own name."""
    with pytest.raises(ConfigError, match="link_Bps must be a positive number"):
        TransferModel(link_Bps=0)


def test_a_host_pool_keeps_its_block_size_in_bytes() -> None:
    assert HostPool(8, block_bytes=4096).block_bytes == 4096
    assert HostPool(8).block_bytes == 0


def test_moving_no_blocks_takes_no_time() -> None:
    """No blocks, no staging round: zero seconds either way (not one round's overhead, nor a second)."""
    model = TransferModel(link_Bps=1e9, overhead_s=0.5)
    assert model.time_s(0, 4096) == 0.0
    assert model.time_s(0, 4096, "in") == 0.0
    assert model.blocking_time_s(0, 4096) == 0.0


def test_a_writeback_costs_its_bytes_over_the_link() -> None:
    """One write-back of a 1000-byte block over a 1000 B/s link with 0.5 s overhead per round:
    1000 / 1000 + 0.5 = 1.5 s, all exposed when transfers do not overlap."""
    plan = StepPlan(0)
    plan.writeback.append((3, 0))
    link = TransferModel(link_Bps=1000, overhead_s=0.5)
    t = step_transfer_timing(plan, 0.0, lambda slot: link, 1000, BS, overlap=False)
    assert t.blocks == 1
    assert t.total_s == pytest.approx(1.5) and t.exposed_s == pytest.approx(1.5)


def test_write_back_spills_the_fast_tier_when_it_is_one_slot_short() -> None:
    """``writeback_blocks=1`` keeps one host slot free: a host tier of one slot holding one entry is one
    short, so the step spills that entry to the disk tier."""
    from kvledger.scheduler import GenRequest, Scheduler, SchedulerConfig
    tiers = TierLedger([("host", 1), ("disk", 4)])
    s = Scheduler(KVLedger(8, BS), SchedulerConfig(offload_prefixes=True, writeback_blocks=1), host=tiers)
    tiers.demote(0, b"e" * 32, "default")
    tiers.complete()
    tiers.take_ops()
    s.add(GenRequest("a", toks(3, 0), 1))
    plan = s.schedule()
    assert [tiers.tier_name(dst) for _, dst in plan.tier_moves] == ["disk"]
    s.confirm(plan, FakeEngine(s).run(plan))
    assert tiers.tier_name(tiers.index[b"e" * 32]) == "disk"
