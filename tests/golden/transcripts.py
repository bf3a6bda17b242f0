"""Known answers for the ledger and the scheduler: fixed-seed episodes of the fuzzers, transcribed.

The fuzzers (``tests/fuzzing.py``) check laws -- conservation, atomic refusals, the full-reservation
promise, an independent model of tokens and prefix hits -- but laws admit many behaviours: a different
victim, one more eviction, a reworded refusal, a block freed one step later all keep them. These
transcripts pin the behaviour itself. For each fixed seed they record, operation by operation (ledger)
or step by step (scheduler, tiers below the pool included), what the call returned or raised (type and
message) and a digest of the whole state after it (every sequence's tokens and block table, reference
counts, the prefix index, free list, pins, leases, promises, the ledger's, the scheduler's and the tiers'
statistics, the step plan).

The pure-Python core runs them (the fuzzers already hold the C part to the same trace).
``tests/data/golden/transcripts.json`` holds the answers; ``tests/test_golden.py`` compares. After a
deliberate change, regenerate and review the diff::

    .venv/bin/python tests/golden/transcripts.py --update
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if __package__ in (None, ""):
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))

from golden_common import Recorder, main, plain  # noqa: E402

import fuzzing  # noqa: E402

GOLDEN = HERE.parent / "data" / "golden" / "transcripts.json"
LEDGER_SEEDS = tuple(range(101, 125))
LEDGER_OPS = 120
SCHEDULER_SEEDS = tuple(range(201, 261))


def digest(value: Any) -> str:
    text = json.dumps(plain(value), sort_keys=True, default=repr)
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def ledger_transcript(seed: int) -> list[Any]:
    lines: list[Any] = []
    seen = [0]

    def observe(ep: fuzzing.LedgerEpisode) -> None:
        new = ep.trace[seen[0]:]
        seen[0] = len(ep.trace)
        lines.append([plain(new), digest([ep.snapshot(), ep.ledger.stats()])])

    with fuzzing.core(None):
        fuzzing.LedgerEpisode(seed, LEDGER_OPS, observe).run()
    return lines


def scheduler_transcript(seed: int) -> dict[str, Any]:
    steps: list[Any] = []

    def observe(s: fuzzing.Scheduler, result: fuzzing.StepResult) -> None:
        plan = result.plan
        shape = None if plan is None else [[w.seq_id, w.start, w.end] for w in plan.prefills] + \
            [w.seq_id for w in plan.decodes]
        steps.append([shape, [f.request.request_id for f in result.finished],
                      [[rid, type(e).__name__, str(e)] for rid, e in result.failed],
                      digest([plan, s.ledger.usage(), s.ledger.stats(), s.preemptions,
                              [[b.seq_id for b in unit] for unit in s.waiting],
                              [[b.seq_id for b in unit] for unit in s.swapped], list(s.running),
                              None if s.host is None else [s.host.usage(), s.host.stats()]])])

    sc = fuzzing.draw_scenario(fuzzing.random.Random(seed))
    with fuzzing.core(None):
        outcome = fuzzing.run_scenario(sc, Counter(), observe)
    return {"scenario": sc.describe(), "outcome": plain(outcome), "steps": steps}


def cases(rec: Recorder) -> None:
    for seed in LEDGER_SEEDS:
        rec(f"ledger seed {seed}", lambda: ledger_transcript(seed), may_raise=False)
    for seed in SCHEDULER_SEEDS:
        rec(f"scheduler seed {seed}", lambda: scheduler_transcript(seed), may_raise=False)


if __name__ == "__main__":
    raise SystemExit(main(cases, GOLDEN))
