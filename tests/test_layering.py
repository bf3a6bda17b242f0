"""The layers of docs/architecture.md, read from the source: a lower layer never imports a higher one,
the core imports only the standard library (and kvledger's errors and units), the scheduler no tensors,
the runtime and the simulator never each other, the server and the web lab never the simulator, the
placement package (score, view, door) needs no Ray and nothing of the Ray fleet, workloads sit below the
simulator and the server, the runtime's measuring room sits on top of the rest of the runtime, and the core's
two halves stay apart (its sizing reads of the ledger only the registry type and the cache identity; the
ledger never reads its sizing). Every import counts, lazy ones inside functions too."""

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
    # Where kvledger's cache is and what it holds (converted models, records): read by the runtime and the CLI.
    "cachedir": set(),
    # How a process that runs the engine sets torch up (OpenMP waits, threads): the CLI and the engine process.
    "torch_setup": set(),
    "core": {"errors", "units"},
    "scheduler": {"core", "errors", "units"},
    # How an engine is built (torch-free): read by the runtime, the server, the fleet and the CLI.
    "engine_config": {"core", "scheduler", "errors", "units"},
    # Requests with arrival times (trace readers, the one sniffer, generators): below the simulator and the server.
    "workloads": {"core", "errors", "units"},
    # Where a request goes in a fleet (score, view, door): beside the scheduler, no Ray, nothing of fleet/.
    "placement": {"core", "errors", "units"},
    "runtime": {"core", "scheduler", "engine_config", "errors", "units", "cachedir"},
    # The measuring room (diagnostics, quality, links, corpus) on top of the rest of the runtime.
    "runtime.measure": {"core", "scheduler", "engine_config", "errors", "units", "runtime", "cachedir"},
    # The fleet simulator scores with the placement package, as the live fleet does.
    "sim": {"core", "scheduler", "errors", "units", "jsonsafe", "placement", "workloads"},
    "lab": {"core", "scheduler", "errors", "units"},
    "weblab": {"lab", "core", "scheduler", "errors", "units"},
    "server": {"core", "scheduler", "runtime", "engine_config", "workloads", "errors", "units", "torch_setup"},
    "loadgen": {"core", "scheduler", "workloads", "errors", "units"},
    # The Ray faces: Ray Serve deployments and request router over the placement package.
    "fleet": {"core", "scheduler", "runtime", "server", "engine_config", "errors", "units", "placement"},
    # Bridges to engines we do not run (vLLM's events, vLLM's scheduler): optional, read by the CLI only,
    # never by the core; the scheduler's admission policies (vLLM's `predicted`) are pure Python.
    "integrations": {"core", "scheduler", "placement", "errors", "units"},
    "cli": None,
    "__main__": None,
    "__init__": None,
}
# Third-party packages a part must never import.
FORBIDDEN = {  # (the core, workloads and placement: anything outside the standard library, checked apart)
    "scheduler": {"torch", "numpy", "ray", "fastapi", "click", "rich", "transformers"},
    "engine_config": {"torch", "numpy", "ray", "fastapi", "click", "rich", "transformers"},
    "sim": {"torch", "ray", "fastapi", "transformers"},
    "weblab": {"torch", "ray"},
    "lab": {"torch", "ray", "fastapi"},
}
# Parts that import the standard library only.
STDLIB_ONLY = {"core", "workloads", "placement", "cachedir"}
# What the rest of the runtime may import from its measuring room: the engine checks a quantised KV format's
# quality record before it runs one. (file, kvledger module)
# int4-smooth's calibrated key constants and kvtc's tables are found by the weights' revision, as the records are
# (one lookup for both: kv_smoothing.calibrated_for).
MEASURE_READERS = {("runtime/engine.py", ("runtime", "measure", "quality_records")),
                   ("runtime/kv_smoothing.py", ("runtime", "measure", "quality_records"))}

# The core's two halves: sizing (core/sizing/: formats, geometry, weights, engines, GPUs, models, inventory,
# capacity, the contiguous allocator) and the ledger (the rest of core/). Of the ledger half, sizing reads only
# the generic registry type (the KV formats' registry), the shared input validators (`core/checks.py`) and the
# cache identity (`KVSpec.cache_context`); the ledger half reads nothing of sizing (the core's `__init__`
# re-exports `KVSpec`, above both).
SIZING = ("core", "sizing")
SIZING_READS_OF_THE_LEDGER = {("core", "registry"), ("core", "identity"), ("core", "checks")}


def core_half_violation(rel: tuple[str, ...], module: tuple[str, ...]) -> str | None:
    """Why an import inside the core crosses between its halves, or None. ``rel`` is the importing file's
    module path, ``module`` the imported one (both without the ``kvledger`` prefix)."""
    if rel[:1] != ("core",) or module[:1] != ("core",) or rel == ("core", "__init__"):
        return None
    mine, theirs = rel[:2] == SIZING, module[:2] == SIZING
    if mine and not theirs and module not in SIZING_READS_OF_THE_LEDGER and module != ("core",):
        return f"the core's sizing imports its ledger ({'.'.join(module)})"
    if mine and module == ("core",):
        return "the core's sizing imports the core package (its ledger)"
    if not mine and theirs:
        return f"the core's ledger imports its sizing ({'.'.join(module)})"
    return None


def part_of(module: tuple[str, ...]) -> str:
    """The layer a dotted kvledger module (without the ``kvledger`` prefix) belongs to."""
    if not module:
        return "__init__"
    head = module[0].removesuffix(".py")
    if head == "runtime" and len(module) > 1 and module[1].removesuffix(".py") == "measure":
        return "runtime.measure"
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
                elif me == "runtime" and other == "runtime.measure" \
                        and (path.relative_to(SRC).as_posix(), module) not in MEASURE_READERS:
                    found.append(f"{where}: the runtime imports its measuring room ({'.'.join(module)})")
            crossing = core_half_violation(rel, module) if module is not None else None
            if crossing:
                found.append(f"{where}: {crossing}")
            if third is not None and third in FORBIDDEN.get(me, set()):
                found.append(f"{where}: {me} imports {third}")
            if third is not None and me in STDLIB_ONLY and third not in sys.stdlib_module_names:
                found.append(f"{where}: {me} imports {third}, which is not the standard library")
    return found


def test_no_layer_imports_above_itself() -> None:
    assert violations() == []


@pytest.mark.parametrize("source,expected", [
    ("src/kvledger/server/x.py", "from ..sim.simulator import Simulator\n"),
    ("src/kvledger/weblab/x.py", "def f():\n    from kvledger.sim import fragmentation\n"),
    ("src/kvledger/core/x.py", "import torch\n"),
    ("src/kvledger/scheduler/x.py", "from ..runtime import engine\n"),
    ("src/kvledger/placement/score.py", "import ray\n"),
    ("src/kvledger/placement/view.py", "from ..fleet import serve\n"),
    ("src/kvledger/placement/door.py", "import numpy\n"),
    ("src/kvledger/workloads/x.py", "def f():\n    from kvledger.sim import simulator\n"),
    ("src/kvledger/workloads/x.py", "from ..runtime import engine\n"),
    ("src/kvledger/sim/x.py", "from ..fleet import spec\n"),
    ("src/kvledger/loadgen.py", "from .sim import simulator\n"),
    ("src/kvledger/runtime/x.py", "from .measure import corpus\n"),
    ("src/kvledger/runtime/engine.py", "from .measure.diagnostics import run\n"),
    ("src/kvledger/runtime/measure/x.py", "from ...sim import simulator\n"),
    ("src/kvledger/runtime/x.py", "from ..sim import simulator\n"),
    ("src/kvledger/core/x.py", "from .sizing.geometry import KVSpec\n"),
    ("src/kvledger/core/pool.py", "def f():\n    from kvledger.core.sizing import gpus\n"),
    ("src/kvledger/core/sizing/x.py", "from ..ledger import KVLedger\n"),
    ("src/kvledger/core/sizing/x.py", "from .. import KVLedger\n"),
    ("src/kvledger/scheduler/x.py", "def f():\n    from ..integrations import vllm_events\n"),
    ("src/kvledger/placement/x.py", "from ..integrations.vllm_watch import MirrorReplica\n"),
    ("src/kvledger/integrations/x.py", "from ..runtime import engine\n"),
])
def test_the_check_sees_a_forbidden_import(source: str, expected: str, tmp_path, monkeypatch) -> None:
    """Each rule can fail: a planted module that breaks it is reported (lazy imports included)."""
    root = tmp_path / "src" / "kvledger"
    planted = tmp_path / source
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_text(expected, encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "SRC", root)
    assert len(violations()) == 1, violations()


def test_the_sizing_half_reads_of_the_ledger_just_what_the_rule_allows() -> None:
    """The allowance states what sizing really imports of the ledger half, no more: each allowed module is
    imported by some sizing module (an allowance nothing uses would hide a rule that could be tighter)."""
    used = {module for path in sorted((SRC / "core" / "sizing").glob("*.py")) for _, module, _ in imports(path)
            if module is not None and module[:1] == ("core",) and module[:2] != SIZING}
    assert used == SIZING_READS_OF_THE_LEDGER


def test_the_engine_may_read_its_quality_records() -> None:
    """The imports the runtime makes from its measuring room are allowed (and only they): the engine's record
    check and the lookup of a model's calibrated artefacts (int4-smooth's constants, kvtc's tables), both found by
    the weights' revision."""
    assert MEASURE_READERS == {("runtime/engine.py", ("runtime", "measure", "quality_records")),
                               ("runtime/kv_smoothing.py", ("runtime", "measure", "quality_records"))}
    assert all((SRC / path).is_file() and (SRC.joinpath(*module[:-1]) / f"{module[-1]}.py").is_file()
               for path, module in MEASURE_READERS)


def test_a_simulation_touches_neither_ray_nor_its_environment() -> None:
    """The fleet simulator places requests with the placement package: importing it loads no Ray, no torch and
    not the Ray fleet, whose import sets Ray's environment."""
    import os
    import subprocess

    code = ("import os, sys, kvledger.placement.score, kvledger.placement.view, kvledger.placement.door, "
            "kvledger.sim.fleet, kvledger.workloads; "
            "print(sorted(m for m in ('ray', 'torch', 'kvledger.fleet') if m in sys.modules), "
            "os.environ.get('RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER'))")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] None"


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


def context_builders(root: Path = SRC) -> list[str]:
    """Every place that builds a ``CacheContext`` itself (a call of the class by name): only its one
    builder, ``core/identity.py``'s ``request_context``, may."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute))
                    and (node.func.id if isinstance(node.func, ast.Name) else node.func.attr) == "CacheContext"):
                found.append(f"{rel}:{node.lineno}")
    return found


def test_a_requests_cache_identity_has_one_builder() -> None:
    """Engines, simulators, the fleet, the labs and the diagnostics all build a request's cache identity
    through ``request_context`` (directly, or through ``KVSpec.cache_context`` with the KV format id), so
    their digests agree; only that builder calls ``CacheContext`` itself."""
    assert context_builders() == ["core/identity.py:" + str(_builder_call_line())]


def _builder_call_line() -> int:
    tree = ast.parse((SRC / "core" / "identity.py").read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "request_context")
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "CacheContext"]
    return calls[0].lineno


def test_the_builder_check_sees_a_second_builder(tmp_path: Path) -> None:
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "identity.py").write_text("def request_context():\n    return CacheContext()\n")
    (tmp_path / "lab.py").write_text("from x import identity\nctx = identity.CacheContext(trust_group='g')\n")
    assert context_builders(tmp_path) == ["core/identity.py:2", "lab.py:2"]
