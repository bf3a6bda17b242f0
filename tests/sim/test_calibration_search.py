"""The simplex search behind `kvledger calibrate`'s fit (calibrate._nelder_mead).

The fit refines (peak FLOP/s, bandwidth, overheads, attention efficiency) with the standard Nelder-Mead
method. Its loss has flat stretches: when every measured step is memory-bound, the peak FLOP/s stops
mattering past some value. There the standard method takes the reflected point unless expanding strictly
improves on it, so a fitted rate stops where the data stop constraining it instead of running on further
at every tie -- the calibrated profile a user gets must not drift with the search's tie-breaking.
"""

from __future__ import annotations

import pytest

from kvledger.sim.calibrate import _nelder_mead


def test_the_search_finds_the_minimum_of_a_smooth_loss() -> None:
    """A shifted quadratic bowl in three parameters: the minimum and its value, from an offset start."""
    def bowl(x: list[float]) -> float:
        return (x[0] - 1.0) ** 2 + 2 * (x[1] + 0.5) ** 2 + 0.5 * (x[2] - 3.0) ** 2 + 0.25

    value, x = _nelder_mead(bowl, [0.0, 0.0, 0.0], [0.3, 0.3, 0.3])
    assert value == pytest.approx(0.25, abs=1e-9)
    assert x == pytest.approx([1.0, -0.5, 3.0], abs=1e-4)


def test_on_a_flat_stretch_the_search_stops_where_the_loss_stops_falling() -> None:
    """max(x, 0) is flat for x <= 0. From x = 1 with a step of 1 the reflection lands on 0 (loss 0) and the
    expansion on -1 (loss 0 too): no strict gain, so the reflection is kept and the answer is x = 0, the
    edge of the flat stretch, not a point beyond it."""
    value, x = _nelder_mead(lambda p: max(p[0], 0.0), [1.0], [1.0])
    assert (value, x) == (0.0, [0.0])
    # The same with a second, well-determined parameter: it is fitted, the flat one stays at the edge.
    value, x = _nelder_mead(lambda p: max(p[0], 0.0) + (p[1] - 0.5) ** 2, [1.0, 0.5], [1.0, 0.25])
    assert (value, x) == (0.0, [0.0, 0.5])
