"""One replica assembly (``scheduler.replica.Replica``): the ledger, the tiers below its pool, the scheduler
and the driver, wired in one place for the engine, the simulators, the lab and the greedy loop."""

from __future__ import annotations

import ast
from pathlib import Path

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger
from kvledger.core.observe import EventLog
from kvledger.scheduler import ConstantExecutor, GenRequest, SchedulerConfig
from kvledger.scheduler.replica import Replica, tier_ledger

SRC = Path(__file__).resolve().parents[2] / "src" / "kvledger"


def test_the_pieces_are_wired_to_each_other() -> None:
    events = EventLog()
    config = SchedulerConfig(policy="full", max_running=2, recovery="swap")
    replica = Replica.assemble(16, 4, config, eviction="priority", prefix_caching=False, host_blocks=3,
                               disk_blocks=5, events=events)
    ledger, sched = replica.ledger, replica.scheduler
    assert (ledger.pool.num_blocks, ledger.block_size, ledger.prefix_caching) == (16, 4, False)
    assert type(ledger.pool.retained).__name__ == "PriorityPolicy" and ledger.events is events
    assert sched.ledger is ledger and sched.host is replica.tiers and sched.config is config
    assert (replica.tiers.names, replica.tiers.sizes) == (("host", "disk"), (3, 5))
    assert replica.driver is None
    driver = replica.drive(ConstantExecutor(), check_every=1, keep_records=True)
    assert replica.driver is driver and driver.scheduler is sched
    driver.submit(GenRequest("a", (1, 2, 3, 4, 5), 3, CacheContext()))
    driver.run(max_steps=50)
    assert [r.finish_reason for r in driver.records] == ["length"] and ledger.usage().active == 0
    ledger.check()


def test_tiers_only_when_asked_and_a_ledger_the_caller_owns() -> None:
    assert tier_ledger() is None and Replica.assemble(8, 4).tiers is None
    assert tier_ledger(0, 2).names == ("disk",)
    ledger = KVLedger(8, 4)
    around = Replica.around(ledger)
    assert around.ledger is ledger and around.scheduler.ledger is ledger and around.tiers is None


def test_only_the_replica_builds_a_scheduler_or_a_driver() -> None:
    """Every other module gets its scheduler and driver from ``Replica`` (one wiring, not five)."""
    builders = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "replica.py" and path.parent.name == "scheduler":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("Scheduler",
                                                                                                   "Driver"):
                builders.append(f"{path.relative_to(SRC)}:{node.lineno} {node.func.id}")
    assert builders == []
