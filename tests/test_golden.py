"""The planner's figures and the ledger's and scheduler's behaviour on fixed inputs equal the committed
known answers (``tests/data/golden/``). A difference names the first cases that changed, with both
answers; after a deliberate change regenerate with ``.venv/bin/python tests/golden/<name>.py --update``
and review the diff."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
sys.path.insert(0, str(GOLDEN_DIR))
sys.path.insert(0, str(GOLDEN_DIR.parent))

import golden_common as common  # noqa: E402


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"golden_{name}", GOLDEN_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["planner", "transcripts", "refusals"])
def test_known_answers_unchanged(name: str) -> None:
    module = _load(name)
    expected = json.loads(module.GOLDEN.read_text(encoding="utf-8"))
    got = common.record(module.cases)
    diff = common.differences(expected, got)
    assert not diff, f"{len(diff)}+ {name} case(s) changed (regenerate with tests/golden/{name}.py --update " \
                     "if deliberate):\n" + "\n".join(diff)


def test_a_changed_answer_is_reported() -> None:
    """The comparison can fail, and says where: one figure changed in one case."""
    expected = {"a": [1, 2, {"x": 3}], "b": {"error": "ConfigError", "message": "m"}}
    got = json.loads(json.dumps(expected))
    got["a"][2]["x"] = 4
    diff = common.differences(expected, got)
    assert len(diff) == 1 and diff[0].startswith("a:") and '"x": 4' in diff[0]
    assert common.differences(expected, {"a": expected["a"]})[0].startswith("b:")


def test_the_planner_refuses_with_typed_errors_only() -> None:
    """Every error among the planner's known answers is a ConfigError (or its DoesNotFit): what the CLI
    turns into one line on stderr. A TypeError here was a crash a user would have seen as a traceback."""
    import kvledger.core.sizing.inventory as inventory
    from kvledger.errors import ConfigError

    module = _load("planner")
    typed = {cls.__name__ for cls in (ConfigError, inventory.DoesNotFit)}
    errors = {k: v for k, v in json.loads(module.GOLDEN.read_text(encoding="utf-8")).items()
              if isinstance(v, dict) and set(v) == {"error", "message"}}
    assert len(errors) > 1000  # the corpus does reach the refusals
    assert {k: v for k, v in errors.items() if v["error"] not in typed} == {}


def test_no_entry_point_crashes_untyped_or_corrupts_the_ledger() -> None:
    """Among the refusals' known answers: every error is one of kvledger's typed errors, and ``check()``
    passed after every call. (Before they were recorded, ``TierLedger.free([s, s])`` corrupted the free
    list, ``demote`` cached an entry with no trust group, and ``spill`` / ``free_in`` / ``blocks_for``
    raised IndexError or TypeError.)"""
    import kvledger.errors as errors

    text = (GOLDEN_DIR.parent / "data" / "golden" / "refusals.json").read_text(encoding="utf-8")
    assert "check failed" not in text
    typed = {n for n in dir(errors) if n.endswith("Error") and isinstance(getattr(errors, n), type)}
    found = set(re.findall(r'"error": "(\w+)"', text))
    assert found and found <= typed, found - typed
    # Bad arguments are the caller's mistake: never the type that says kvledger broke its own law (a freed
    # slot that was never held raised InvariantError before).
    assert "InvariantError" not in found
