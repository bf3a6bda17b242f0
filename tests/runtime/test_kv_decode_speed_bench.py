"""benchmarks/kv_decode_speed.py: the paired ratio it reports beside the fastest-of ratio (each repetition's own
fp32-over-format decode time, as first quartile, median, third quartile). Nothing here is timed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "kv_decode_speed.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("kv_decode_speed_under_test", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _times(one: list[float], n: list[float]) -> dict[str, list[tuple[float, float]]]:
    """(wall, cpu) pairs: wall is the figure given, cpu twice it."""
    return {"one": [(x, 2 * x) for x in one], "n": [(x, 2 * x) for x in n]}


def test_each_repetition_is_its_own_ratio_and_the_median_sits_between_the_quartiles(bench) -> None:
    # decode times (n - one): fp32 10, 10, 10, 10, 10; the format 5, 10, 8, 20, 4 -> ratios 2, 1, 1.25, 0.5, 2.5
    base = _times([1, 2, 3, 4, 5], [11, 12, 13, 14, 15])
    other = _times([1, 1, 1, 1, 1], [6, 11, 9, 21, 5])
    q1, med, q3 = bench.paired_ratio(base, other, 0)
    assert med == 1.25  # the median of the repetitions' own ratios
    assert (q1, q3) == (0.75, 2.25)  # statistics.quantiles' exclusive method over [0.5, 1, 1.25, 2, 2.5]
    assert bench.paired_ratio(base, other, 1) == [q1, med, q3]  # the CPU clock alike (both doubled)
    # the fastest-of ratio would read 10 / 4 = 2.5: pairing is what keeps a lucky repetition from deciding


def test_too_few_repetitions_or_a_non_positive_decode_time_give_none(bench) -> None:
    assert bench.paired_ratio(_times([1], [2]), _times([1], [3]), 0) is None
    assert bench.paired_ratio(_times([1, 1], [2, 2]), _times([1, 3], [3, 3]), 0) is None
