"""The diagnosis as a versioned JSON document, a timeline PNG and a findings table.

Schema ``kvledger.diagnosis`` version 1 (``SCHEMA_VERSION``); a consumer checks ``schema`` and
``schema_version`` and ignores keys it does not know. Top-level keys:

``schema``, ``schema_version``, ``created``, ``versions`` (kvledger, torch, python), ``device``, ``model``,
``workload`` (name, sha256 of the canonical request list, sizes), ``sampling`` (every N steps, peaks on),
``injected`` (what was injected on purpose, if anything), ``findings`` (each: ``kind``, ``bytes``,
``steps`` [first, last], ``summary``, ``requests``, ``evidence``), ``ledgers`` (the four ledgers at the
baseline and at the end), ``series`` (one row per snapshot: step, time, running requests, the attribution
and the headline figures of each ledger), ``steps`` (one row per engine step: shape, peak, request
events), ``peak_model`` (the steady-state fit of step peaks) and ``notes`` (the ownership-versus-allocation
observation, in words).
"""

from __future__ import annotations

import datetime as _dt
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from ....units import format_bytes
from .reconcile import Diagnosis
from .snapshot import MemorySnapshot

SCHEMA = "kvledger.diagnosis"
SCHEMA_VERSION = 1

# Stacked bands of the timeline, bottom to top, with their colours.
BANDS = (
    ("weights", "weights (and packed copies)", "#4c72b0"),
    ("kv_live", "KV live", "#dd8452"),
    ("kv_orphaned", "KV held for no live owner", "#8b0000"),
    ("kv_retained", "KV retained (prefix cache)", "#f2b880"),
    ("kv_promised", "KV free, promised", "#c9a0dc"),
    ("kv_free", "KV free", "#e6e6e6"),
    ("other_tensors", "other tensors", "#55a868"),
    ("allocator_other", "allocator, not tensors", "#8c8c8c"),
    ("allocator_cache", "allocator cache", "#c44e52"),
    ("runtime", "runtime and libraries (at baseline)", "#d0d0e8"),
    ("external", "external (growth outside the allocator)", "#8172b3"),
)
FINDING_COLOURS = {"retained_tensors": "#55a868", "cached_reservation": "#c44e52", "logical_pool_leak": "#dd8452",
                   "external_allocation": "#8172b3", "transient_peak": "#937860"}


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


def _series_row(s: MemorySnapshot) -> dict[str, Any]:
    p = s.pool
    row: dict[str, Any] = {"step": s.step, "time_s": round(s.time_s, 4), "running": len(s.running),
                           "attribution": s.attribution(),
                           "tensors": {o: sum(d.values()) for o, d in s.tensors.owners.items()},
                           "unregistered_bytes": s.tensors.unregistered_bytes(),
                           "allocator": {"allocated": s.allocator.allocated, "reserved": s.allocator.reserved,
                                         "cached": s.allocator.cached},
                           "device_used": s.device_stats.used}
    if p is not None:
        row["pool"] = {k: getattr(p, k) * p.block_bytes for k in ("active", "retained", "free", "promised", "deferred")}
        row["pool"]["orphan_bytes"] = p.orphan_blocks * p.block_bytes
    return row


def document(diagnosis: Diagnosis, *, model: dict[str, Any], device: dict[str, Any], workload: dict[str, Any],
             sampling: dict[str, Any], injected: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The versioned diagnosis document."""
    import torch

    snaps = diagnosis.snapshots
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "versions": {"kvledger": _version("kvledger"), "torch": torch.__version__,
                     "python": platform.python_version()},
        "device": device,
        "model": model,
        "workload": workload,
        "sampling": sampling,
        "injected": injected or [],
        "findings": [f.as_dict() for f in diagnosis.findings],
        "ledgers": {"baseline": snaps[0].ledgers(), "end": snaps[-1].ledgers()},
        "attribution": {"baseline": snaps[0].attribution(), "end": snaps[-1].attribution()},
        "series": [_series_row(s) for s in snaps],
        "steps": [r.as_dict() for r in diagnosis.steps],
        "peak_model": diagnosis.peak_model,
        "notes": diagnosis.notes,
    }


def bands(snaps: list[MemorySnapshot]) -> tuple[list[int], dict[str, list[int]]]:
    """The timeline's x (steps; the baseline is step -1) and its stacked bands in bytes."""
    xs = [s.step if s.step is not None else i - 1 for i, s in enumerate(snaps)]
    base_outside = snaps[0].attribution()["outside_allocator"]
    out: dict[str, list[int]] = {key: [] for key, _, _ in BANDS}
    for s in snaps:
        a = s.attribution()
        for key in ("weights", "kv_live", "kv_orphaned", "kv_retained", "kv_promised", "kv_free", "other_tensors",
                    "allocator_other", "allocator_cache"):
            out[key].append(max(0, a[key]))
        outside = a["outside_allocator"]
        out["runtime"].append(max(0, min(outside, base_outside)))
        out["external"].append(max(0, outside - base_outside))
    return xs, out


def timeline_png(diagnosis: Diagnosis, path: str | Path, title: str = "") -> Path:
    """Stacked bytes over steps (the four ledgers' partition of the device's bytes) with the findings
    marked, and the per-step transient peaks against the fitted steady state below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .reconcile import PeakModel

    snaps = diagnosis.snapshots
    xs, ys = bands(snaps)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    gib = float(1 << 30)
    top.stackplot(xs, *[[v / gib for v in ys[key]] for key, _, _ in BANDS],
                  labels=[label for _, label, _ in BANDS], colors=[c for _, _, c in BANDS], alpha=0.9)
    used = [s.device_stats.used / gib for s in snaps]
    top.plot(xs, used, color="black", linewidth=1.2, label="device / process bytes")
    ymax = max(used + [1e-9]) * 1.08
    for i, f in enumerate(diagnosis.findings):
        colour = FINDING_COLOURS.get(f.kind, "black")
        lo, hi = f.steps
        if hi - lo <= 3:  # an event: shade its steps; a lasting state is marked where it began
            top.axvspan(lo - 0.5, hi + 0.5, color=colour, alpha=0.15)
        top.axvline(lo, color=colour, linestyle="--", linewidth=1)
        top.annotate(f"{f.kind.replace('_', ' ')}: {format_bytes(f.bytes)}", (lo, ymax * (0.97 - 0.06 * (i % 6))),
                     fontsize=8, color=colour, ha="left", va="top")
    top.set_ylim(0, ymax)
    top.set_ylabel("GiB")
    top.set_title(title or "where the memory is, step by step")
    top.legend(loc="lower left", fontsize=7, ncol=3, framealpha=0.85)
    measured = [(r.step, r.peak_bytes) for r in diagnosis.steps if r.peak_bytes is not None]
    if measured:
        bottom.bar([s for s, _ in measured], [p / (1 << 20) for _, p in measured], color="#937860", width=0.8,
                   label="step peak above its start")
        pm = diagnosis.peak_model
        if pm:
            model = PeakModel(list(pm["coefficients"].values()), pm["fitted_on_steps"], pm["outlier_steps"])
            exp = [(r.step, model.expected(r.shape)) for r in diagnosis.steps if r.peak_bytes is not None]
            bottom.plot([s for s, _ in exp], [e / (1 << 20) for _, e in exp], color="black", linewidth=1,
                        marker=".", markersize=3, label="expected from the step's shape")
        bottom.legend(fontsize=7, loc="upper right")
    bottom.set_ylabel("MiB")
    bottom.set_xlabel("engine step")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def findings_table(diagnosis: Diagnosis) -> Any:
    """A rich table: one row per finding."""
    from rich.table import Table

    t = Table(title="findings" if diagnosis.findings else "findings: none (a clean run)")
    for col in ("kind", "bytes", "steps", "what the ledgers show"):
        t.add_column(col, overflow="fold")
    for f in diagnosis.findings:
        t.add_row(f.kind, format_bytes(f.bytes), f"{f.steps[0]}..{f.steps[1]}", f.summary)
    return t


def attribution_table(diagnosis: Diagnosis) -> Any:
    from rich.table import Table

    first, last = diagnosis.snapshots[0].attribution(), diagnosis.snapshots[-1].attribution()
    t = Table(title="where the bytes are (baseline -> end)")
    for col in ("part", "baseline", "end", "change"):
        t.add_column(col, justify="right" if col != "part" else "left")
    for key in first:
        t.add_row(key, format_bytes(first[key]), format_bytes(last[key]), format_bytes(last[key] - first[key]))
    return t


__all__ = ["BANDS", "SCHEMA", "SCHEMA_VERSION", "attribution_table", "bands", "document", "findings_table",
           "timeline_png"]
