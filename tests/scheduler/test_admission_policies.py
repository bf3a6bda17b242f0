"""The admission policies' reserve rules (``scheduler/policies.py``): the output-length quantiles a
predicted reservation learns from finished requests, and what it reserves for a request part-way through."""

from __future__ import annotations

import pytest

from kvledger.scheduler import (
    SchedulerConfig,
)
from kvledger.scheduler.policies import OutputLengthTracker, reserve_tokens


def test_output_length_quantiles_are_the_nearest_rank_of_what_finished() -> None:
    lengths = OutputLengthTracker()
    with pytest.raises(ValueError, match="^no output lengths observed yet$"):
        lengths.quantile(0.5)
    for n in (40, 10, 30, 20):
        lengths.observe(n)
    # Nearest rank: the smallest length with at least q of them at or below it.
    assert [lengths.quantile(q) for q in (0.0, 0.25, 0.26, 0.5, 0.75, 0.9, 1.0)] == [10, 10, 20, 20, 30, 40, 40]
    assert lengths.quantile(1.5) == 40 and lengths.quantile(-1.0) == 10  # clamped to what was seen


def test_predicted_reserves_the_quantile_minus_what_was_already_generated() -> None:
    """Median of 10, 20, 30, 40 is 20 once 2 requests have finished; before that, the whole allowance."""
    cfg = SchedulerConfig(policy="predicted", predicted_quantile=0.5, predicted_min_samples=2)
    lengths = OutputLengthTracker()
    lengths.observe(10)
    assert reserve_tokens(cfg, lengths, 100, 100) == 100  # one sample: not enough to predict
    for n in (20, 30, 40):
        lengths.observe(n)
    assert reserve_tokens(cfg, lengths, 100, 100) == 20  # a first admission
    assert reserve_tokens(cfg, lengths, 100, 85) == 5  # re-admitted after 15 tokens: 20 - 15 more
    assert reserve_tokens(cfg, lengths, 100, 75) == 1  # already past the prediction: the next token only
    assert reserve_tokens(cfg, lengths, 12, 12) == 12  # never more than the request may still generate
    assert reserve_tokens(cfg, lengths, 100, 0) == 0
