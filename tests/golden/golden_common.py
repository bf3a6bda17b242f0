"""The recorder behind the golden files: run a case, turn its answer (or its error) into plain JSON, and
compare a whole run against the committed file, or rewrite it with ``--update``."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any


def plain(value: Any) -> Any:
    """JSON-able form of an answer; dataclasses keep their class name so a changed type shows."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # Private fields are memos (a context's root digest once someone asked): they depend on history.
        return {"__class__": type(value).__name__,
                **{f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                   if not f.name.startswith("_")}}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((plain(v) for v in value), key=repr)
    if isinstance(value, BaseException):
        return {"error": type(value).__name__, "message": str(value)}
    if isinstance(value, bytes | bytearray):
        return {"__bytes__": bytes(value).hex()}
    text = repr(value)
    if " at 0x" in text:  # an address changes from run to run: keep the type only
        return {"__type__": type(value).__name__}
    return {"__repr__": text}


class Recorder:
    """Collects ``key -> answer``; an answer that raises is recorded as its error's type and message."""

    def __init__(self) -> None:
        self.answers: dict[str, Any] = {}

    def __call__(self, key: str, fn: Callable[[], Any], *, may_raise: bool = True) -> None:
        """Record ``fn()``; with ``may_raise=False`` an error is a broken case, not an answer."""
        if key in self.answers:
            raise KeyError(f"case {key!r} recorded twice")
        try:
            value = plain(fn())
        except Exception as exc:  # noqa: BLE001 -- the error is the answer
            if not may_raise:
                raise
            value = plain(exc)
        self.answers[key] = value


def record(cases: Callable[[Recorder], None]) -> dict[str, Any]:
    rec = Recorder()
    cases(rec)
    # Through JSON and back, so that a fresh run compares equal to what the file loads as.
    return json.loads(json.dumps(rec.answers))


def dump(answers: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in answers.items()]
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n", encoding="utf-8")


def differences(expected: dict[str, Any], got: dict[str, Any], limit: int = 8) -> list[str]:
    """The first `limit` cases that differ, each with both answers (shortened)."""
    out = []
    for key in [*expected, *(k for k in got if k not in expected)]:
        a, b = expected.get(key, "<missing>"), got.get(key, "<missing>")
        if a != b:
            out.append(f"{key}:\n  expected {json.dumps(a, sort_keys=True)[:600]}\n"
                       f"  got      {json.dumps(b, sort_keys=True)[:600]}")
            if len(out) >= limit:
                break
    return out


def main(cases: Callable[[Recorder], None], path: Path) -> int:
    p = argparse.ArgumentParser(description="Compare the known answers with the committed golden file.")
    p.add_argument("--update", action="store_true", help=f"rewrite {path.name} from this run")
    args = p.parse_args()
    got = record(cases)
    if args.update:
        dump(got, path)
        print(f"wrote {len(got)} cases to {path}")
        return 0
    expected = json.loads(path.read_text(encoding="utf-8"))
    diff = differences(expected, got)
    print("\n".join(diff) if diff else f"all {len(got)} cases agree with {path}")
    return 1 if diff else 0
