"""Running the CLI in process, for the tests of every command: ``run`` calls ``kvledger``'s ``main`` with
the arguments and returns its exit code and captured output; ``one_error_line`` checks the one-line error
rule (one non-empty stderr line starting ``kvledger: error: ``) and returns that line."""

from __future__ import annotations

import pytest

from kvledger.cli.main import main


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("kvledger: error: ")
    return lines[0]
