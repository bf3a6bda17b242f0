"""One percentile definition (kvledger.scheduler.metrics.percentile) for every report: the simulator, the
engine's metrics, the load client and the plots. A second implementation once drifted in rounding
(plots truncated the position with int(), the others used floor), so the source is checked too."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvledger import loadgen
from kvledger.scheduler import metrics
from kvledger.sim import plots, simulator

SRC = Path(__file__).resolve().parents[1] / "src" / "kvledger"


def test_every_report_uses_the_scheduler_percentile() -> None:
    assert loadgen.percentile is metrics.percentile
    assert plots.percentile is metrics.percentile
    assert simulator.percentile is metrics.percentile
    assert metrics.percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)


def test_no_other_percentile_is_defined() -> None:
    pattern = re.compile(r"def _?(percentile|pct|quantile_of)\(\s*(xs|values)")
    found = [str(p.relative_to(SRC)) for p in sorted(SRC.rglob("*.py"))
             for line in p.read_text(encoding="utf-8").splitlines() if pattern.search(line)]
    assert found == ["scheduler/metrics.py"], found
