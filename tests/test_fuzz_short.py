"""The short randomised fuzz that runs inside ``make test``: the only part of the suite that is not
derandomised. Each run draws a new base seed (or takes ``KVLEDGER_FUZZ_SEED``), runs each part of
``tests/fuzzing.py`` for a few seconds (``KVLEDGER_FUZZ_SECONDS``, default 4; or a fixed number of
episodes with ``KVLEDGER_FUZZ_EPISODES``), and reports its seed and operation counts at the end of the
session (the scheduler's line also counts the transfers it failed on purpose and in how many episodes).
A failure names the failing episode's seed and the one command that replays it, e.g.::

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


def _episodes(text: str) -> dict[str, int]:
    """``KVLEDGER_FUZZ_EPISODES``: ``N`` for every part, or ``ledger=20,threads=1,scheduler=40``. With a
    fixed seed this makes the run deterministic but for thread interleavings (``make mutation``)."""
    if not text:
        return {}
    if "=" not in text:
        return dict.fromkeys(fuzzing.PARTS, int(text))
    return {k.strip(): int(v) for k, v in (item.split("=") for item in text.split(","))}


EPISODES = _episodes(os.environ.get("KVLEDGER_FUZZ_EPISODES", ""))
BASE_SEED = int(os.environ.get("KVLEDGER_FUZZ_SEED") or random.SystemRandom().randrange(2**32))
SUMMARY: list[str] = []  # printed by tests/conftest.py at the end of the session


@pytest.mark.parametrize("part", fuzzing.PARTS)
def test_short_randomised_fuzz(part: str) -> None:
    episodes = EPISODES.get(part)
    if EPISODES and episodes is None:
        pytest.skip(f"KVLEDGER_FUZZ_EPISODES names no episodes of {part}")
    seconds = SECONDS if episodes is None else float("inf")
    try:
        result = fuzzing.run_part(part, BASE_SEED, seconds, episodes)
    except fuzzing.FuzzFailure as exc:
        SUMMARY.append(f"fuzz {part} FAILED with base seed {BASE_SEED}")
        pytest.fail(str(exc), pytrace=False)
    SUMMARY.append(result.line())
    assert result.episodes >= 1 and result.ops > 0
    if part == "scheduler" and result.episodes >= 60:
        # About 3 in 10 scheduler episodes fail transfers: 60 without one would be a fuzz that stopped
        # drawing them (odds 0.7**60, about 5e-10).
        assert result.counts["fault episodes"] > 0, "no scheduler episode failed a transfer"
