"""The fragmentation study's paged run at the edge of its token ids: every id of a workload must be a
32-bit token id, so a workload of exactly 2**32 tokens (ids 0 .. 2**32 - 1) runs and one more token is
refused. (The guard used to refuse exactly 2**32.)"""

from __future__ import annotations

import pytest

from kvledger.errors import ConfigError
from kvledger.sim.fragmentation import run_paged


def test_a_workload_of_exactly_two_to_the_32_tokens_runs() -> None:
    result = run_paged([(2**31, 2**31)], 16, 16, max_len=10)  # longer than max_len: rejected, not run
    assert result.rejected == 1 and result.completed == 0


def test_one_token_more_is_refused() -> None:
    with pytest.raises(ConfigError, match="distinct 32-bit token ids"):
        run_paged([(2**31, 2**31 + 1)], 16, 16, max_len=10)
