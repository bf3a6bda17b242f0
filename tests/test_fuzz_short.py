"""The short randomised fuzz that runs inside ``make test``: the only part of the suite that is not
derandomised. Each run draws a new base seed (or takes ``KVLEDGER_FUZZ_SEED``), runs each part of
``tests/fuzzing.py`` for a few seconds (``KVLEDGER_FUZZ_SECONDS``, default 4; or a fixed number of
episodes with ``KVLEDGER_FUZZ_EPISODES``), and reports its seed and operation counts at the end of the
session. A failure names the failing episode's seed and the one command that replays it, e.g.::

    .venv/bin/python tests/fuzzing.py --part scheduler --seed 8812734411 --episodes 1 --ops 0

The long search is ``make fuzz``.
"""

from __future__ import annotations

import os
import random

import pytest

try:  # the module name pytest gives tests/fuzzing.py depends on its import mode
    from tests import fuzzing
except ImportError:  # pragma: no cover
    import fuzzing

SECONDS = float(os.environ.get("KVLEDGER_FUZZ_SECONDS", "4"))
EPISODES = int(os.environ["KVLEDGER_FUZZ_EPISODES"]) if os.environ.get("KVLEDGER_FUZZ_EPISODES") else None
BASE_SEED = int(os.environ.get("KVLEDGER_FUZZ_SEED") or random.SystemRandom().randrange(2**32))
SUMMARY: list[str] = []  # printed by tests/conftest.py at the end of the session


@pytest.mark.parametrize("part", fuzzing.PARTS)
def test_short_randomised_fuzz(part: str) -> None:
    seconds = SECONDS if EPISODES is None else float("inf")
    try:
        result = fuzzing.run_part(part, BASE_SEED, seconds, EPISODES)
    except fuzzing.FuzzFailure as exc:
        SUMMARY.append(f"fuzz {part} FAILED with base seed {BASE_SEED}")
        pytest.fail(str(exc), pytrace=False)
    SUMMARY.append(result.line())
    assert result.episodes >= 1 and result.ops > 0
