"""Every `kvledger ...` command in the README's shell blocks runs as written from a fresh copy: in a temporary
folder holding what a clone has (examples/), each with a timeout, exit status 0 and no traceback. A command
that serves until Ctrl-C or runs for minutes is listed below with its reason (KVLEDGER_README_LONG=1 runs the
long ones too); a listed command the README no longer has fails the test, so the list stays true."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvledger

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TIMEOUT_S = 60
LONG = os.environ.get("KVLEDGER_README_LONG") == "1"

# (how the command starts, why it is not run here, whether KVLEDGER_README_LONG=1 runs it)
NOT_RUN = [
    ("kvledger lab --open", "serves the lab until Ctrl-C (tests/lab runs it)", False),
    ("kvledger serve --model", "an HTTP server until Ctrl-C (tests/server runs it)", False),
    ("kvledger watch --events", "needs a running vLLM (tests/integrations runs it on a fake publisher)", False),
    ("kvledger calibrate --out r/cpu.json", "long run: times the real runtime on this CPU (about a minute)", True),
    ("kvledger serve-trace --trace examples/mooncake.jsonl", "long run: SmolLM2 replays 32 requests (minutes)", True),
    ("kvledger simulate --trace examples/mooncake.jsonl --limit 32 --scale",
     "reads r/cpu.json, written by the calibrate above (a long run)", True),
    ("kvledger compare r/sim r/real", "reads r/real, written by the serve-trace above (a long run)", True),
]


def readme_commands() -> list[str]:
    """The `kvledger` commands of the README's sh/bash blocks, continuation lines joined, comments dropped."""
    text = README.read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"^```(?:sh|bash|shell)\n(.*?)^```", text, flags=re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0] == "kvledger":
                commands.append(shlex.join(words))
    return commands


def _skip(command: str) -> tuple[str, bool] | None:
    for start, reason, long_run in NOT_RUN:
        if command.startswith(start):
            return reason, long_run
    return None


def test_the_readme_has_commands_and_every_listed_exception_is_one_of_them() -> None:
    commands = readme_commands()
    assert len(commands) >= 10
    unused = [start for start, _, _ in NOT_RUN if not any(c.startswith(start) for c in commands)]
    assert not unused, f"NOT_RUN lists commands the README no longer has: {unused}"


@pytest.fixture(scope="module")
def fresh_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with what a fresh clone gives a newcomer for these commands."""
    folder = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "examples", folder / "examples")
    return folder


@pytest.mark.parametrize("command", readme_commands(), ids=lambda c: re.sub(r"[^\w.=,-]+", "_", c[9:])[:70])
def test_a_readme_command_runs_as_written(command: str, fresh_copy: Path) -> None:
    skip = _skip(command)
    if skip is not None and not (LONG and skip[1]):
        pytest.skip(skip[0])
    exe = Path(sys.executable).with_name("kvledger")
    argv = [str(exe) if exe.exists() else "kvledger", *shlex.split(command)[1:]]
    env = dict(os.environ, PYTHONPATH=str(Path(kvledger.__file__).resolve().parents[1]), COLUMNS="120")
    proc = subprocess.run(argv, cwd=fresh_copy, capture_output=True, text=True, env=env, check=False,
                          timeout=None if skip else TIMEOUT_S)
    assert proc.returncode == 0, f"{command}\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr
    if argv[1] == "compare":  # the recipe compares like with like: no difference in device, model, policy or pool
        assert "warning" not in proc.stderr, proc.stderr
