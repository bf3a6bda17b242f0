"""The layers of docs/architecture.md, read from the source: a lower layer never imports a higher one,
the core imports only the standard library (and kvledger's errors and units), the scheduler no tensors,
the runtime and the simulator never each other, the server and the web lab never the simulator, and the
fleet's placement logic (score, view, door) needs no Ray. Every import counts, lazy ones inside functions
too."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "kvledger"

# part -> the kvledger parts it may import (itself always); None: any.
ALLOWED: dict[str, set[str] | None] = {
    "errors": set(),
    "units": {"errors"},
    "jsonsafe": set(),
    "core": {"errors", "units"},
    "scheduler": {"core", "errors", "units"},
    # How an engine is built (torch-free): read by the runtime, the server, the fleet and the CLI.
    "engine_config": {"core", "scheduler", "errors", "units"},
    "runtime": {"core", "scheduler", "engine_config", "errors", "units"},
    # The fleet simulator scores with the fleet's own placement functions (score, view, door: no Ray).
    "sim": {"core", "scheduler", "errors", "units", "jsonsafe", "fleet.score", "fleet.view", "fleet.door"},
    "lab": {"core", "scheduler", "errors", "units"},
    "weblab": {"lab", "core", "scheduler", "errors", "units"},
    "server": {"core", "scheduler", "runtime", "engine_config", "errors", "units"},
    "loadgen": {"core", "scheduler", "sim", "errors", "units"},
    "fleet.score": {"core", "scheduler", "errors", "units"},
    "fleet.view": {"core", "scheduler", "errors", "units", "fleet.score"},
    "fleet.door": {"core", "scheduler", "errors", "units", "fleet.score"},
    "fleet": {"core", "scheduler", "runtime", "server", "engine_config", "errors", "units", "fleet.score", "fleet.view",
              "fleet.door", "fleet"},
    "cli": None,
    "__main__": None,
    "__init__": None,
}
# Third-party packages a part must never import.
FORBIDDEN = {  # (the core: anything outside the standard library, checked apart)
    "scheduler": {"torch", "numpy", "ray", "fastapi", "click", "rich", "transformers"},
    "engine_config": {"torch", "numpy", "ray", "fastapi", "click", "rich", "transformers"},
    "sim": {"torch", "ray", "fastapi", "transformers"},
    "fleet.score": {"ray", "torch"},
    "fleet.view": {"ray", "torch"},
    "fleet.door": {"ray", "torch"},
    "weblab": {"torch", "ray"},
    "lab": {"torch", "ray", "fastapi"},
}


def part_of(module: tuple[str, ...]) -> str:
    """The layer a dotted kvledger module (without the ``kvledger`` prefix) belongs to."""
    if not module:
        return "__init__"
    head = module[0].removesuffix(".py")
    if head == "fleet" and len(module) > 1 and module[1].removesuffix(".py") in ("score", "view", "door"):
        return f"fleet.{module[1].removesuffix('.py')}"
    return head


def imports(path: Path) -> list[tuple[int, tuple[str, ...] | None, str | None]]:
    """(line, kvledger module imported or None, third-party top-level name or None) for every import."""
    rel = path.relative_to(SRC).with_suffix("").parts
    package = rel[:-1] if rel[-1] != "__init__" else rel[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = (*base, *(node.module.split(".") if node.module else ()))
                if not node.module:  # from . import x, y: each name is a module of that package
                    out += [(node.lineno, (*target, a.name), None) for a in node.names]
                else:
                    out.append((node.lineno, target, None))
            elif node.module and node.module.split(".")[0] == "kvledger":
                out.append((node.lineno, tuple(node.module.split(".")[1:]), None))
            elif node.module:
                out.append((node.lineno, None, node.module.split(".")[0]))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")
                if top[0] == "kvledger":
                    out.append((node.lineno, tuple(top[1:]), None))
                else:
                    out.append((node.lineno, None, top[0]))
    return out


def violations() -> list[str]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("").parts
        me = part_of(rel)
        allowed = ALLOWED.get(me, ALLOWED.get(me.split(".")[0]))
        for line, module, third in imports(path):
            where = f"{path.relative_to(SRC.parent.parent)}:{line}"
            if module is not None and allowed is not None:
                other = part_of(module)
                if other != me and other not in allowed and other.split(".")[0] != me:
                    found.append(f"{where}: {me} imports {'.'.join(module) or 'kvledger'} ({other})")
            if third is not None and third in FORBIDDEN.get(me, set()):
                found.append(f"{where}: {me} imports {third}")
            if third is not None and me == "core" and third not in sys.stdlib_module_names:
                found.append(f"{where}: the core imports {third}, which is not the standard library")
    return found


def test_no_layer_imports_above_itself() -> None:
    assert violations() == []


@pytest.mark.parametrize("source,expected", [
    ("src/kvledger/server/x.py", "from ..sim.workloads import load_trace\n"),
    ("src/kvledger/weblab/x.py", "def f():\n    from kvledger.sim import fragmentation\n"),
    ("src/kvledger/core/x.py", "import torch\n"),
    ("src/kvledger/scheduler/x.py", "from ..runtime import engine\n"),
    ("src/kvledger/fleet/score.py", "import ray\n"),
    ("src/kvledger/runtime/x.py", "from ..sim import simulator\n"),
])
def test_the_check_sees_a_forbidden_import(source: str, expected: str, tmp_path, monkeypatch) -> None:
    """Each rule can fail: a planted module that breaks it is reported (lazy imports included)."""
    root = tmp_path / "src" / "kvledger"
    planted = tmp_path / source
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_text(expected, encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "SRC", root)
    assert len(violations()) == 1, violations()


def test_no_two_public_classes_share_a_name() -> None:
    """A class name says what a thing is, once: two public classes of one name in two modules (a routing
    ``Choice`` and a workload's ``Choice``, the ledger's ``Outcome`` and the load client's) read the same in
    a traceback and mean different things."""
    seen: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                seen.setdefault(node.name, []).append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert {name: where for name, where in seen.items() if len(where) > 1} == {}


def test_no_lesson_numbers_in_code() -> None:
    """Names and docstrings say what a thing is; the course's lesson numbers belong to the course."""
    import re

    found = [f"{p.relative_to(SRC)}:{i}" for p in sorted(SRC.rglob("*.py"))
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"\blesson\s*0?\d+\b", line, re.IGNORECASE)]
    assert found == []
