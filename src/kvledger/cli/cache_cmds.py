"""`kvledger cache`: what kvledger keeps outside the clone, and clearing it (huggingface-cli's scan-cache and
delete-cache, for kvledger's one folder). Imports the standard library's cache module only: no torch."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import click

from .options import epilog

# The order a clear names what it removed: the models first, then what only --all removes.
_ORDER = ["converted model", "old-layout model", "unfinished conversion", "GGUF hash file", "calibration profile",
          "quality records", "quality reports", "quality hashes", "quality, other", "native kernels", "other"]


@click.command("cache", epilog=epilog(
    "kvledger cache                       # what is cached where, with sizes",
    "kvledger cache --clear               # remove the converted models only",
    "kvledger cache --clear --all         # also calibration profile, quality records, native kernels",
))
@click.option("--clear", is_flag=True,
              help="Remove the converted models (GGUF to safetensors, ~517 MB for SmolLM2); the next real-model "
                   "run converts again. Calibration profile and quality records are kept.")
@click.option("--all", "everything", is_flag=True,
              help="With --clear: remove everything kvledger keeps there (calibration profile, quality records "
                   "and reports, native kernels too). Files that are not kvledger's are never removed.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def cache_cmd(clear: bool, everything: bool, as_json: bool) -> None:
    """List or clear kvledger's cache, shared by every clone: $KVLEDGER_CACHE, $XDG_CACHE_HOME/kvledger or
    ~/.cache/kvledger."""
    from ..cachedir import cache_root, clear_cache, scan_cache

    if everything and not clear:
        raise click.UsageError("--all goes with --clear (`kvledger cache` alone already lists everything)")
    root = cache_root()
    if clear:
        removed, kept = clear_cache(root, everything=everything)
        freed = sum(e.bytes for e in removed)
        if as_json:
            _emit({"root": str(root), "removed": [e.to_dict() for e in removed], "removed_bytes": freed,
                   "kept": [e.to_dict() for e in kept]})
            return
        counts = Counter(e.kind for e in removed)
        what = ", ".join(f"{counts[kind]} {kind}{'' if counts[kind] == 1 or kind.endswith('s') else 's'}"
                         for kind in sorted(counts, key=_ORDER.index)) or "nothing"
        click.echo(f"removed {what} from {root}: {_bytes(freed)} freed")
        mine = [e for e in kept if e.kind != "other"]
        if mine:
            click.echo(f"kept {', '.join(sorted({e.kind for e in mine}))} ({_bytes(sum(e.bytes for e in mine))}); "
                       "`kvledger cache --clear --all` removes them too")
        if len(mine) < len(kept):
            click.echo(f"left {len(kept) - len(mine)} file(s) that are not kvledger's in {root}")
        return
    entries = scan_cache(root)
    total = sum(e.bytes for e in entries)
    if as_json:
        _emit({"root": str(root), "entries": [e.to_dict() for e in entries], "total_bytes": total})
        return
    if not entries:
        click.echo(f"nothing cached in {root}")
        return
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title=f"kvledger cache: {root}")
    t.add_column("kind", no_wrap=True)
    t.add_column("path", no_wrap=True)
    t.add_column("size", justify="right", no_wrap=True)
    t.add_column("about", overflow="fold")
    for e in entries:
        t.add_row(e.kind, _short(e.path, root), _bytes(e.bytes), e.detail)
    con.print(t)
    con.print(f"{_bytes(total)} in all. `kvledger cache --clear` removes the converted models "
              "(`make clean-cache` does the same); `--clear --all` everything above.")


def _short(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def _bytes(n: int) -> str:
    from ..units import format_bytes

    return format_bytes(n)


def _emit(data: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")
