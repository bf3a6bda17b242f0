"""Small helpers every command shares (JSON output, bounded text-file reading). Imports only the stdlib."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ..torch_setup import prepare_torch  # noqa: F401 -- the engine commands import it from here

MAX_INPUT_BYTES = 256 * 2**20  # the largest requests file, trace or config a command reads


def emit_json(data: Any) -> None:
    """One JSON object on stdout (non-finite floats become null)."""
    from ..jsonsafe import finite

    sys.stdout.write(json.dumps(finite(data), indent=2, default=str) + "\n")


def console(stderr: bool = False) -> Any:
    """A rich console; piped or captured output gets a wide page so that tables keep one row per line."""
    from rich.console import Console

    con = Console(stderr=stderr)
    return con if con.is_terminal else Console(stderr=stderr, width=200)


def read_text(path: str | Path, what: str, limit: int = MAX_INPUT_BYTES) -> str:
    """A UTF-8 text file, or one ConfigError naming the file (missing, unreadable, too large, binary)."""
    from ..errors import ConfigError

    p = Path(path)
    try:
        if not p.is_file():
            raise ConfigError(f"no {what} at {p}")
        if p.stat().st_size > limit:
            raise ConfigError(f"{what} {p} is larger than {limit // 2**20} MiB")
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {p}: {exc.strerror or exc}") from None
    if b"\x00" in raw[:65536]:
        raise ConfigError(f"{what} {p} is a binary file, not text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{p}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x})") from None


__all__ = ["MAX_INPUT_BYTES", "console", "emit_json", "read_text"]
