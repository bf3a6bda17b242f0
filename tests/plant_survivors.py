"""Plant, one at a time, the seven one-line bugs that once survived the suite (issue 9, "Tests that can
fail") and check that the deterministic suite fails on each -- every time, not on some seeds.

Each plant patches a copy of ``src/`` in a temporary directory (the work tree is never touched) and runs
pytest on the ledger and scheduler tests with that copy first on ``PYTHONPATH``. The short randomised
fuzz is left out, so whatever fails is a derandomised test that fails on every run. Run it as::

    .venv/bin/python tests/plant_survivors.py            # all seven
    .venv/bin/python tests/plant_survivors.py --only min_waste --runs 2

It prints, per plant, how many tests failed and which; it exits 1 if any plant survives.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Plant:
    """One bug: each ``(old, new)`` edit replaces a line found exactly once in ``path``. A plant has
    more than one edit only where the code computes the same decision twice (a fast path and the
    general one), so the bug is the same one wherever the decision is taken."""

    name: str
    what: str
    path: str  # relative to src/kvledger
    edits: tuple[tuple[str, str], ...]


PLANTS = (
    Plant("never_ignores_lookahead", "the 'never fits' rule ignores lookahead", "core/admission.py",
          (("longest = -(-(prompt_len + request.max_new_tokens + request.lookahead) // bs)",
            "longest = -(-(prompt_len + request.max_new_tokens) // bs)"),)),
    Plant("trim_not_repromised", "trimmed draft blocks are not promised again", "core/ledger.py",
          (("repromise = max(0, min(len(extra), seq.reserved_blocks - len(blocks) - seq.promised))",
            "repromise = 0"),)),
    Plant("field_without_length", "context field values encoded without their length", "core/identity.py",
          (('return b"s" + _U64.pack(len(data)) + data', 'return b"s" + data'),)),
    Plant("no_personalisation", "the root digest's personalisation removed", "core/identity.py",
          (("digest_size=DIGEST_BYTES, person=ROOT_PERSON)", "digest_size=DIGEST_BYTES)"),)),
    # The victim is picked by pick_victim() outside a growth pass and by VictimQueue inside one.
    Plant("victim_tie_break_flipped", "victim ties go to the earliest admitted", "scheduler/victims.py",
          (("if best is None or k <= best:", "if best is None or k < best:"),
           ("self._heap = [(key(ledger, brs), -brs[0].admitted_order, rid)",
            "self._heap = [(key(ledger, brs), brs[0].admitted_order, rid)"))),
    # waste() has a one-branch fast path and the general family formula.
    Plant("min_waste_differently", "min_waste adds held blocks and replay instead of multiplying",
          "scheduler/victims.py",
          (("held_blocks(ledger, branches) * replay_tokens(ledger, branches)",
            "held_blocks(ledger, branches) + replay_tokens(ledger, branches)"),
           ("return len(blocks) * (len(br.tokens) - kept * ledger.block_size)",
            "return len(blocks) + (len(br.tokens) - kept * ledger.block_size)"))),
    Plant("grower_retries_after_swap", "the grower retries right after a swap", "scheduler/growth.py",
          (("        sched.defer(br)\n        return False\n    return True",
            "        return True\n    return True"),)),
)

TESTS = [
    "tests/core/test_ledger.py", "tests/core/test_ledger_audit.py", "tests/core/test_ledger_cache_controls.py",
    "tests/core/test_ledger_defects.py", "tests/core/test_ledger_family.py",
    "tests/core/test_ledger_state_machine.py", "tests/core/test_lifetimes.py", "tests/core/test_eviction.py",
    "tests/core/test_identity.py", "tests/core/test_identity_known_answers.py", "tests/core/test_isolation.py",
    "tests/scheduler/test_scheduler.py", "tests/scheduler/test_scheduler_defects.py",
    "tests/scheduler/test_scheduler_props.py", "tests/scheduler/test_scheduler_beam.py",
    "tests/scheduler/test_scheduler_victims.py", "tests/scheduler/test_scheduler_shared_prefill.py",
    "tests/core/test_ledger_quota.py", "tests/scheduler/test_scheduler_quota.py", "tests/scheduler/test_driver.py",
    "tests/test_fuzz_regressions.py", "tests/scheduler/test_admission_policies.py",
]


def plant_tree(plant: Plant, into: Path) -> Path:
    src = into / "src"
    shutil.copytree(REPO / "src", src, ignore=shutil.ignore_patterns("__pycache__", "_build", "*.so"))
    target = src / "kvledger" / plant.path
    text = target.read_text()
    for old, new in plant.edits:
        if text.count(old) != 1:
            raise SystemExit(f"{plant.name}: {old!r} is not found exactly once in {plant.path}; "
                             f"update tests/plant_survivors.py")
        text = text.replace(old, new)
    target.write_text(text)
    return src


def run_plant(plant: Plant, extra: list[str]) -> tuple[int, list[str]]:
    with tempfile.TemporaryDirectory(prefix=f"plant-{plant.name}-") as tmp:
        src = plant_tree(plant, Path(tmp))
        env = dict(os.environ, PYTHONPATH=str(src), KVLEDGER_NATIVE="0")
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "--no-header", *TESTS, *extra],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    failed = [line.split(" ", 2)[1] for line in proc.stdout.splitlines() if line.startswith("FAILED ")]
    return proc.returncode, failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", choices=[p.name for p in PLANTS])
    ap.add_argument("--runs", type=int, default=1, help="runs per plant (each must fail)")
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args(argv)
    survivors = []
    for plant in PLANTS:
        if args.only and plant.name not in args.only:
            continue
        outcomes = [run_plant(plant, args.pytest_args) for _ in range(args.runs)]
        caught = [rc != 0 and bool(failed) for rc, failed in outcomes]
        fails = [len(failed) for _, failed in outcomes]
        status = "caught" if all(caught) else f"SURVIVED in {caught.count(False)} of {args.runs} runs"
        print(f"{plant.name:26s} {status}: {fails} tests failed -- {plant.what}", flush=True)
        for name in sorted(set(outcomes[0][1]))[:6]:
            print(f"    {name}", flush=True)
        if not all(caught):
            survivors.append(plant.name)
    if survivors:
        print(f"survived: {', '.join(survivors)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
