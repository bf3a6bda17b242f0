"""Quality contracts and the record store: which quantised KV formats were measured good enough, for which weights.

A *contract* is a small JSON file of thresholds, one per metric, each with how it aggregates over the cases
of a report (every text kind at every context length)::

    {"format": "int8", "thresholds": [
        {"metric": "ppl_rel_change", "agg": "max", "max": 0.005},
        {"metric": "greedy_agreement", "agg": "mean", "min": 0.95}, ...]}

Defaults ship per format in ``kvledger/data/quality/contracts/``. A *record* is a report that met its
contract, stored as JSON with the model, the weights revision (a content hash of the weights' source file),
the exact format identity (``KVSpec.kv_format_id``), the kvledger version, the contract and the figures.
Records live in the user's cache (``$KVLEDGER_CACHE/quality/records``, else ``~/.cache/kvledger/...``) and,
for the bundled model, ship with the package (``kvledger/data/quality/records/``).

The engine refuses a quantised format unless a record matches its weights revision and format identity
(:func:`require_record`), with one line saying how to produce one, or ``allow_untested_kv``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from ...core.sizing.geometry import KVSpec
from ...errors import ConfigError
from ..weights import Checkpoint, cache_root

DATA = Path(__file__).resolve().parents[2] / "data" / "quality"
SHIPPED_RECORDS = DATA / "records"
CONTRACTS = DATA / "contracts"
AGGREGATIONS = ("max", "mean", "min")
MAX_JSON = 4 * 2**20  # contract and record files are small; refuse anything larger


def kvledger_version() -> str:
    try:
        return metadata.version("kvledger")
    except metadata.PackageNotFoundError:
        return "unknown"


def user_records() -> Path:
    return cache_root() / "quality" / "records"


# ---- weights revision ------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def weights_revision(ckpt: Checkpoint) -> str:
    """A content hash of the weights: the GGUF a converted checkpoint came from, else its safetensors
    files. Cached by path, size and mtime, so it is computed once per file."""
    source = ckpt.path / "kvledger-source.json"
    files: list[Path] = []
    if source.is_file():
        try:
            record = json.loads(source.read_text())
            sha, gguf = record.get("sha256"), Path(record["gguf"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            sha, gguf = None, None
        if isinstance(sha, str) and len(sha) == 64:  # the shared cache names the GGUF by its hash: no re-read,
            return f"sha256:{sha[:16]}"             # and the clone it was converted from may be gone
        if gguf is not None and gguf.is_file():
            files = [gguf]
    if not files:
        files = ckpt.files
    if not files:
        raise ConfigError(f"{ckpt.path} has no weight files to identify")
    cache_file = cache_root() / "quality" / "revisions.json"
    try:
        cache = json.loads(cache_file.read_text()) if cache_file.is_file() else {}
    except (OSError, ValueError):
        cache = {}
    parts = []
    dirty = False
    for f in files:
        st = f.stat()
        key = f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        digest = cache.get(key) if isinstance(cache, dict) else None
        if not isinstance(digest, str):
            digest, dirty = _sha256(f), True
            cache[key] = digest
        parts.append(digest)
    if dirty:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
            tmp.replace(cache_file)
        except OSError:
            pass  # a read-only cache only costs recomputing the hash next time
    combined = parts[0] if len(parts) == 1 else hashlib.sha256("".join(parts).encode()).hexdigest()
    return f"sha256:{combined[:16]}"


# ---- contracts --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Threshold:
    metric: str
    agg: str
    max: float | None = None
    min: float | None = None

    def check(self, value: float) -> bool:
        return (self.max is None or value <= self.max) and (self.min is None or value >= self.min)

    def describe(self) -> str:
        bound = f"<= {self.max:g}" if self.max is not None else f">= {self.min:g}"
        return f"{self.agg} {self.metric} {bound}"


@dataclass(frozen=True, slots=True)
class Contract:
    format: str
    thresholds: tuple[Threshold, ...]
    source: str
    held_out: tuple[Threshold, ...] = ()  # on the held-out summary (pooled figures, ratios to bf16's)

    def to_dict(self) -> dict[str, Any]:
        def rows(ts: tuple[Threshold, ...]) -> list[dict[str, Any]]:
            return [{k: v for k, v in (("metric", t.metric), ("agg", t.agg), ("max", t.max), ("min", t.min))
                     if v is not None} for t in ts]

        out = {"format": self.format, "thresholds": rows(self.thresholds), "source": self.source}
        if self.held_out:
            out["held_out"] = rows(self.held_out)
        return out


METRICS = ("ppl_rel_change", "kl_mean", "attn_rel_err", "greedy_agreement")
# Clauses on the held-out set as a whole (keys of ``report['held_out']['summary']``): pooled perplexity change,
# KL pooled as a multiple of a bf16 cache's, free-running mean common prefix as a fraction of bf16's.
HELD_OUT_METRICS = ("ppl_rel_change_pooled", "kl_vs_bf16", "common_prefix_vs_bf16")


def _read_json(path: Path, what: str) -> Any:
    try:
        if path.stat().st_size > MAX_JSON:
            raise ConfigError(f"{what} {path} is larger than {MAX_JSON // 2**20} MiB")
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{what} {path} is not valid JSON: {str(exc)[:120]}") from None


def parse_contract(data: Any, source: str) -> Contract:
    if not isinstance(data, dict) or not isinstance(data.get("thresholds"), list) or not data["thresholds"]:
        raise ConfigError(f"contract {source}: needs a non-empty 'thresholds' list")
    out = _thresholds(data["thresholds"], source, METRICS, "threshold")
    held = data.get("held_out", [])
    if not isinstance(held, list):
        raise ConfigError(f"contract {source}: 'held_out' must be a list of thresholds")
    held_out = _thresholds([{"agg": "pooled", **t} if isinstance(t, dict) else t for t in held], source,
                           HELD_OUT_METRICS, "held_out threshold", ("pooled",))
    fmt = data.get("format")
    if not isinstance(fmt, str):
        raise ConfigError(f"contract {source}: needs a 'format' name")
    return Contract(fmt, tuple(out), source, tuple(held_out))


def _thresholds(items: list[Any], source: str, metrics: tuple[str, ...], what: str,
                aggs: tuple[str, ...] = AGGREGATIONS) -> list[Threshold]:
    out = []
    for i, t in enumerate(items):
        if not isinstance(t, dict) or t.get("metric") not in metrics or t.get("agg") not in aggs:
            raise ConfigError(f"contract {source}: {what} {i} needs a metric ({', '.join(metrics)}) and an agg "
                              f"({', '.join(aggs)})")
        bounds = {}
        for key in ("max", "min"):
            v = t.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or v != v
                                  or abs(v) > 1e9):
                raise ConfigError(f"contract {source}: {what} {i} {key} must be a finite number")
            bounds[key] = None if v is None else float(v)
        if (bounds["max"] is None) == (bounds["min"] is None):
            raise ConfigError(f"contract {source}: {what} {i} needs exactly one of max or min")
        out.append(Threshold(t["metric"], t["agg"], bounds["max"], bounds["min"]))
    return out


def load_contract(fmt: str, path: str | os.PathLike[str] | None = None) -> Contract:
    """The contract in ``path``, or the one shipped for format ``fmt``."""
    if path is not None:
        p = Path(path)
        contract = parse_contract(_read_json(p, "contract"), str(p))
        if contract.format != fmt:
            raise ConfigError(f"contract {p} is for {contract.format}, not {fmt}")
        return contract
    p = CONTRACTS / f"{fmt}.json"
    if not p.is_file():
        raise ConfigError(f"no contract ships for KV format {fmt!r}; give one with --contract FILE")
    return parse_contract(_read_json(p, "contract"), f"kvledger/data/quality/contracts/{fmt}.json")


def evaluate(contract: Contract, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each threshold against the report's cases: the aggregated value and whether it holds."""
    out = []
    for t in contract.thresholds:
        values = [float(c[t.metric]) for c in cases]
        if t.agg == "max":
            value = max(values)
        elif t.agg == "min":
            value = min(values)
        else:
            value = sum(values) / len(values)
        out.append({"threshold": t.describe(), "metric": t.metric, "agg": t.agg, "value": value, "ok": t.check(value)})
    return out


# ---- records ----------------------------------------------------------------------------------------
def _records(folder: Path) -> list[tuple[Path, dict[str, Any]]]:
    if not folder.is_dir():
        return []
    out = []
    for p in sorted(folder.glob("*.json")):
        try:
            data = _read_json(p, "quality record")
        except ConfigError:
            continue  # a damaged record never authorises anything
        if isinstance(data, dict) and data.get("passed") is True:
            out.append((p, data))
    return out


def calibration_digest(kv_dtype: str, revision: str) -> str | None:
    """The sha256 (first 16 hex digits) of the calibrated file a format reads for these weights -- kvtc's tables,
    int4-smooth's constants -- or None for a format that reads none (or whose file is missing: then it cannot run).
    A record names it, so tables fitted again are never vouched for by a record of the old ones."""
    from ...core.sizing.kv_formats import get_kv_format

    fmt = get_kv_format(kv_dtype)
    if fmt.scales == "coded":
        from ..kv_transform_pages import path_for
    elif fmt.smooth:
        from ..kv_smoothing import path_for
    else:
        return None
    path = path_for(revision)
    return _sha256(path)[:16] if path.is_file() else None


def find_record(revision: str, format_id: str, calibration: str | None = None) -> tuple[Path, dict[str, Any]] | None:
    """A passing record for these weights, this exact format and the calibrated file it reads (``calibration``:
    :func:`calibration_digest`): the user's first, then the shipped ones."""
    for folder in (user_records(), SHIPPED_RECORDS):
        for path, data in _records(folder):
            if (data.get("weights_revision") == revision and data.get("kv_format") == format_id
                    and data.get("calibration") == calibration):
                return path, data
    return None


def require_any_record(gguf: Path, kv_dtype: str, model_name: str) -> None:
    """Refuse ``kv_dtype`` for the weights in ``gguf`` before they are converted (a minute on first use) when no
    passing record names these weights and this format at all: :func:`require_record` decides on the exact format
    identity once the model is loaded; this only spares the conversion when its answer is already known to be no."""
    from ...core.sizing.kv_formats import get_kv_format
    from ..weights import file_sha256

    try:
        fmt = get_kv_format(kv_dtype)
    except ConfigError:
        return  # not a format name (``auto``, a dtype): the engine's own checks answer it
    if not fmt.quantized:
        return
    revision = f"sha256:{file_sha256(gguf)[:16]}"
    for folder in (user_records(), SHIPPED_RECORDS):
        for _, data in _records(folder):
            fid = data.get("kv_format")
            if data.get("weights_revision") == revision and isinstance(fid, str) and fid.split(":")[0] == fmt.name:
                return
    raise ConfigError(f"KV format {fmt.name} has no passing quality record for {model_name or gguf} (weights "
                      f"{revision}): {_how_to_record(fmt.name, model_name or str(gguf))}")


def _how_to_record(fmt: str, model: str, block_size: int = 16) -> str:
    """What a refusal tells the user to do (one wording for every refusal of an unrecorded format)."""
    return (f"measure it with `kvledger quality --model {model} --kv-cache-dtype {fmt}"
            + (f" --block-size {block_size}" if block_size != 16 else "")
            + "` (a passing report is recorded), or pass --allow-untested-kv / allow_untested_kv=True")


HELD_OUT_SET = "held-out prompts"  # the ``set`` of a verdict judged on the held-out prompts


def record_blocker(report: dict[str, Any]) -> str | None:
    """Why a judged report may not become a record, or None when it may: it must meet its contract on the full
    protocol (every text kind, a short and a long context, 128 greedy tokens) and on held-out prompts, with
    every held-out clause of its contract scored -- a format is never vouched for by the texts alone."""
    if report.get("passed") is not True:
        return "only a report that meets its contract is recorded"
    protocol = report.get("protocol")
    if not isinstance(protocol, dict) or protocol.get("complete") is not True:
        return ("a record needs the full protocol (prose, code and chat at <= 512 and >= 2,048 tokens, 128 greedy "
                "tokens)")
    held = report.get("held_out")
    if not isinstance(held, dict) or not held.get("cases"):
        return ("a record needs the held-out prompts scored (the bundled slice, or --held-out FILE; not "
                "--no-held-out)")
    contract = report.get("contract") or {}
    judged = {v.get("metric") for v in report.get("verdict", ()) if v.get("set") == HELD_OUT_SET}
    missing = [t.get("metric") for t in contract.get("held_out", ()) if t.get("metric") not in judged]
    if missing:
        return f"a record needs every held-out clause of its contract scored; not scored: {', '.join(missing)}"
    return None


def save_record(report: dict[str, Any], folder: Path | None = None) -> Path:
    """Store a judged report as a record, if :func:`record_blocker` finds nothing against it."""
    blocker = record_blocker(report)
    if blocker is not None:
        raise ConfigError(blocker)
    folder = user_records() if folder is None else folder
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{report['format']}-{report['weights_revision'].split(':')[-1]}-{int(time.time())}.json"
    keys = ("model", "weights_revision", "format", "kv_format", "calibration", "kvledger_version", "contract",
            "verdict", "summary", "cases", "texts", "passed", "protocol", "measured_at", "held_out", "verdict_line")
    record = {k: report[k] for k in keys if k in report}
    path = folder / name
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)
    return path


def require_record(spec: KVSpec, ckpt: Checkpoint | None, model_name: str) -> tuple[Path, dict[str, Any]]:
    """The passing record that allows serving ``spec``'s quantised format with ``ckpt``'s weights, or one
    :class:`ConfigError` line saying how to get one."""
    fmt = spec.kv_dtype
    how = _how_to_record(fmt, model_name or "<model>", spec.block_size)
    if ckpt is None:
        raise ConfigError(f"KV format {fmt} is quantised and the engine cannot identify its weights to find a "
                          f"quality record: {how}")
    revision = weights_revision(ckpt)
    calibration = calibration_digest(fmt, revision)
    found = find_record(revision, spec.kv_format_id, calibration)
    if found is None:
        tables = f", calibration {calibration}" if calibration else ""
        raise ConfigError(f"KV format {fmt} ({spec.kv_format_id}) has no passing quality record for "
                          f"{model_name or ckpt.path} (weights {revision}{tables}): {how}")
    return found


__all__ = ["CONTRACTS", "HELD_OUT_SET", "METRICS", "SHIPPED_RECORDS", "Contract", "Threshold", "calibration_digest",
           "evaluate",
           "find_record", "kvledger_version", "load_contract", "parse_contract", "record_blocker", "require_any_record",
           "require_record", "save_record", "user_records", "weights_revision"]
