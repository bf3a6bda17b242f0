"""Comparing answers with the stored known answers of the simulator's tests (this folder's ``*.json``).

``check(name, answer)`` turns ``answer`` into JSON (floats rounded to 12 significant digits, wall-clock
figures replaced by their type) and compares it with ``<name>.json`` here; with
``KVLEDGER_UPDATE_KNOWN_ANSWERS=1`` in the environment it writes the file instead (review the diff).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

ANSWERS = Path(__file__).resolve().parent
UPDATE = os.environ.get("KVLEDGER_UPDATE_KNOWN_ANSWERS") == "1"
TIMED_KEYS = frozenset({"wall_s", "decision_us_p50", "decision_us_p99"})


def canon(obj: Any, digits: int = 12) -> Any:
    """JSON-able, floats rounded to ``digits`` significant digits, timed figures replaced by their type."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, str | int):
        return obj
    if isinstance(obj, float):
        if not math.isfinite(obj):
            return repr(obj)
        return float(f"{obj:.{digits}g}")
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return canon({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}, digits)
    if isinstance(obj, dict):
        return {str(k): (f"<{type(v).__name__}>" if k in TIMED_KEYS else canon(v, digits)) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [canon(v, digits) for v in obj]
    if isinstance(obj, Path):
        return obj.name
    return repr(obj)


def csv_answer(path: Path, digits: int = 12) -> dict[str, Any]:
    """A CSV file as its header and rows, each number rounded as ``canon`` rounds; timed columns starred."""
    with path.open(encoding="utf-8", newline="") as fh:
        rows = list(csv.reader(fh))
    header, body = rows[0], rows[1:]
    out = []
    for row in body:
        cells = []
        for name, cell in zip(header, row, strict=True):
            if name in TIMED_KEYS:
                cells.append("*")
                continue
            try:
                value = float(cell)
            except ValueError:
                cells.append(cell)
                continue
            cells.append(cell if cell.lstrip("-").isdigit() else canon(value, digits))
        out.append(cells)
    return {"header": header, "rows": out}


def json_answer(path: Path, digits: int = 12) -> Any:
    return canon(json.loads(path.read_text(encoding="utf-8")), digits)


def differences(expected: Any, got: Any, where: str = "", limit: int = 12) -> list[str]:
    """Paths where ``got`` differs from ``expected``, with both values (at most ``limit``)."""
    out: list[str] = []

    def walk(a: Any, b: Any, path: str) -> None:
        if len(out) >= limit:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            if list(a) != list(b):
                out.append(f"{path}: keys {list(a)} != {list(b)}")
            for k in a:
                if k in b:
                    walk(a[k], b[k], f"{path}.{k}")
            return
        if isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                out.append(f"{path}: length {len(a)} != {len(b)}")
            for i, (x, y) in enumerate(zip(a, b, strict=False)):
                walk(x, y, f"{path}[{i}]")
            return
        if a != b or type(a) is not type(b):
            out.append(f"{path}: expected {json.dumps(a)[:200]}, got {json.dumps(b)[:200]}")

    walk(expected, got, where)
    return out


def check(name: str, answer: Any, digits: int = 12) -> None:
    got = json.loads(json.dumps(canon(answer, digits)))
    path = ANSWERS / f"{name}.json"
    if UPDATE:
        ANSWERS.mkdir(exist_ok=True)
        path.write_text(json.dumps(got, indent=1, sort_keys=False) + "\n", encoding="utf-8")
        return
    assert path.is_file(), f"no known answer {path.name}: run with KVLEDGER_UPDATE_KNOWN_ANSWERS=1"
    expected = json.loads(path.read_text(encoding="utf-8"))
    diff = differences(expected, got, name)
    assert not diff, (f"{len(diff)}+ difference(s) from the known answer {path.name} (regenerate with "
                      "KVLEDGER_UPDATE_KNOWN_ANSWERS=1 if deliberate):\n" + "\n".join(diff))


