"""kvledger's on-disk cache: where it is, what it holds, and clearing it (`kvledger cache`).

One folder (``$KVLEDGER_CACHE``, else ``$XDG_CACHE_HOME/kvledger``, else ``~/.cache/kvledger``), shared by
every clone, venv and reinstall on the machine:

- ``models/gguf-<16 hex>/``: a GGUF converted to fp32 safetensors (runtime/weights.py), named by the GGUF's
  sha256, so the same GGUF anywhere is converted once; ``models/gguf-hashes.json`` remembers each GGUF's
  hash by (path, size, mtime) so a warm load does not re-read the file.
- ``<name>-<16 hex>/``: a conversion by kvledger before the content-addressed layout (keyed by the GGUF's
  path, size and mtime: one copy per venv and reinstall). Never read now; ``--clear`` removes them.
- ``quality/`` (records, reports, the weights' hashes), ``cpu-local.json`` (the calibrated profile) and
  ``native/`` (the native kernels of a read-only install): a user's measurements, kept unless ``--all``.

The standard library only, so `kvledger cache` answers without importing torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CACHE_ENV = "KVLEDGER_CACHE"
MODELS_DIR = "models"
SOURCE_FILE = "kvledger-source.json"
HASHES_FILE = "gguf-hashes.json"
_MAX_HASHES = 256  # remembered GGUF hashes; entries whose file is gone are dropped first

# Kinds that `kvledger cache --clear` removes; every other known kind needs `--all`.
MODEL = "converted model"
MODEL_PARTIAL = "unfinished conversion"
MODEL_OLD = "old-layout model"
MODEL_HASHES = "GGUF hash file"
MODEL_KINDS = frozenset({MODEL, MODEL_PARTIAL, MODEL_OLD, MODEL_HASHES})
OTHER = "other"  # not kvledger's: listed, never removed
_OLD_MODEL = re.compile(r".+-[0-9a-f]{16}$")
_QUALITY = {"records": "quality records", "reports": "quality reports", "revisions.json": "quality hashes"}


def cache_root() -> Path:
    """Where converted weights live: ``$KVLEDGER_CACHE``, else ``$XDG_CACHE_HOME/kvledger``, else
    ``~/.cache/kvledger``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvledger"


def model_key(sha256: str) -> str:
    """The folder name of a converted GGUF: its content hash, not its path, so clones share it."""
    return f"gguf-{sha256[:16]}"


# ---- the GGUF's content hash --------------------------------------------------------------------
def file_sha256(path: Path, root: Path | None = None) -> str:
    """sha256 of ``path``'s bytes, remembered in ``<root>/models/gguf-hashes.json`` by (path, size, mtime_ns):
    hashing a 98 MB GGUF takes ~0.1 s and a 5 GB one seconds, the lookup well under a millisecond."""
    root = cache_root() if root is None else root
    memo_file = root / MODELS_DIR / HASHES_FILE
    st = path.stat()
    key = str(path.resolve())
    memo = _read_json(memo_file)
    hit = memo.get(key)
    if isinstance(hit, dict) and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns \
            and isinstance(hit.get("sha256"), str) and len(hit["sha256"]) == 64:
        return str(hit["sha256"])
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    memo = {k: v for k, v in memo.items() if k != key and os.path.exists(k)}
    memo = dict(list(memo.items())[-(_MAX_HASHES - 1):])
    memo[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    try:
        _write_json_atomic(memo_file, memo)
    except OSError:
        pass  # a read-only cache only costs hashing again next time
    return digest


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---- one converted model --------------------------------------------------------------------------
def model_problem(folder: Path, sha256: str | None = None) -> str | None:
    """Why ``folder`` is not a complete conversion (of the GGUF with ``sha256`` when given), else None.

    A conversion writes its file list with sizes last, so a folder copied in part, truncated by a full
    disk or edited by hand is caught by a few stat calls, without reading the weights."""
    source = _read_json(folder / SOURCE_FILE)
    if not source:
        return f"no readable {SOURCE_FILE} (an interrupted conversion?)"
    if sha256 is not None and source.get("sha256") != sha256:
        return "it was converted from another GGUF"
    files = source.get("files")
    if not isinstance(files, dict) or "config.json" not in files:
        return f"{SOURCE_FILE} lists no files"
    for name, size in files.items():
        try:
            actual = (folder / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual:,} bytes, not {size:,} (truncated or changed)"
    return None


def write_source(folder: Path, sha256: str, gguf: Path) -> None:
    """The record that makes ``folder`` a complete conversion: the GGUF's hash and every file's size."""
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != SOURCE_FILE}
    st = gguf.stat()
    record = {"sha256": sha256, "gguf": str(gguf.resolve()), "gguf_name": gguf.name, "size": st.st_size,
              "files": files}
    (folder / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")


def discard(folder: Path) -> None:
    """Remove a broken entry: renamed aside first, so no reader ever sees it half deleted."""
    aside = folder.with_name(f".discard-{folder.name}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        folder.rename(aside)
    except FileNotFoundError:
        return  # another process got there first
    shutil.rmtree(aside, ignore_errors=True)


# ---- the whole cache -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CacheEntry:
    """One thing in the cache: what it is, where, how many bytes, and a word about it."""

    kind: str
    path: Path
    bytes: int
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "path": str(self.path)}


def _size(path: Path) -> int:
    """Bytes under ``path`` (symlinks not followed; a hard-linked file counted once)."""
    try:
        st = path.lstat()
    except OSError:
        return 0
    if not path.is_dir() or path.is_symlink():
        return st.st_size
    seen: set[tuple[int, int]] = set()
    total = 0
    for folder, _dirs, names in os.walk(path):
        for name in names:
            try:
                s = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            if (s.st_dev, s.st_ino) not in seen:
                seen.add((s.st_dev, s.st_ino))
                total += s.st_size
    return total


def _model_entry(folder: Path) -> CacheEntry:
    if folder.name.startswith("."):  # .convert-* being written (or left by a killed process), .discard-*
        return CacheEntry(MODEL_PARTIAL, folder, _size(folder), "an unfinished or abandoned conversion")
    problem = model_problem(folder)
    if problem is not None:
        return CacheEntry(MODEL_PARTIAL, folder, _size(folder), f"{problem}; converted again on next use")
    name = _read_json(folder / SOURCE_FILE).get("gguf_name", "?")
    return CacheEntry(MODEL, folder, _size(folder), f"{name} as fp32 safetensors")


def scan_cache(root: Path | None = None) -> list[CacheEntry]:
    """Everything in the cache root, each with its kind; empty when the root does not exist."""
    root = cache_root() if root is None else root
    entries: list[CacheEntry] = []
    if root.is_dir():
        for p in sorted(root.iterdir()):
            entries.extend(_classify(root, p))
    profile = _profile_path()
    if profile.is_file() and profile.parent.resolve() != root.resolve():
        entries.append(CacheEntry("calibration profile", profile, _size(profile), "`--gpu cpu-local` reads it"))
    return entries


def _classify(root: Path, p: Path) -> list[CacheEntry]:
    if p.name == MODELS_DIR and p.is_dir() and not p.is_symlink():
        out = []
        for q in sorted(p.iterdir()):
            if q.name == HASHES_FILE or (q.name.startswith(f".{HASHES_FILE}.") and q.is_file()):
                out.append(CacheEntry(MODEL_HASHES, q, _size(q), "GGUF hashes by path, size and mtime"))
            elif q.is_dir() and not q.is_symlink():
                out.append(_model_entry(q))
            else:
                out.append(CacheEntry(OTHER, q, _size(q), "not kvledger's; kept"))
        return out
    if p.name == "quality" and p.is_dir():
        return [CacheEntry(_QUALITY.get(q.name, "quality, other"), q, _size(q)) for q in sorted(p.iterdir())]
    if p.name == "cpu-local.json" and p.is_file():
        return [CacheEntry("calibration profile", p, _size(p), "`--gpu cpu-local` reads it")]
    if p.name == "native" and p.is_dir():
        return [CacheEntry("native kernels", p, _size(p), "rebuilt when needed")]
    if p.is_dir() and not p.is_symlink() and ((p / SOURCE_FILE).is_file() or _OLD_MODEL.match(p.name)) \
            and not p.name.startswith("."):
        return [CacheEntry(MODEL_OLD, p, _size(p), "keyed by the GGUF's path (one per venv); no longer read")]
    if p.is_dir() and p.name.startswith(".convert-"):
        return [CacheEntry(MODEL_PARTIAL, p, _size(p), "an unfinished conversion (old layout)")]
    return [CacheEntry(OTHER, p, _size(p), "not kvledger's; kept")]


def _profile_path() -> Path:
    """The calibrated cpu-local profile's path, computed as sim/cost_model.py does (it ignores XDG)."""
    base = os.environ.get(CACHE_ENV)
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "kvledger") / "cpu-local.json"


def clear_cache(root: Path | None = None, everything: bool = False) -> tuple[list[CacheEntry], list[CacheEntry]]:
    """Remove the converted models (and with ``everything``, every other kvledger entry too; a file that
    is not kvledger's is never removed). Returns (removed, kept)."""
    root = cache_root() if root is None else root
    removed: list[CacheEntry] = []
    kept: list[CacheEntry] = []
    for entry in scan_cache(root):
        if entry.kind == OTHER or not (everything or entry.kind in MODEL_KINDS):
            kept.append(entry)
            continue
        if entry.path.is_dir() and not entry.path.is_symlink():
            shutil.rmtree(entry.path)
        else:
            entry.path.unlink(missing_ok=True)
        removed.append(entry)
    for folder in (root / MODELS_DIR, root / "quality", root):
        try:
            folder.rmdir()  # only when empty
        except OSError:
            pass
    return removed, kept


__all__ = ["CACHE_ENV", "MODEL_KINDS", "CacheEntry", "cache_root", "clear_cache", "file_sha256", "model_key",
           "model_problem", "scan_cache"]
