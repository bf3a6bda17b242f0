"""Reconciliation: compare the four ledgers over a run and name each difference with its evidence.

Five causes (``FINDING_KINDS``):

* ``retained_tensors`` -- storages nobody registered that appeared during the run and are still alive
  after every request running when they appeared has finished (their owner ended; something -- a
  callback, a cache -- still holds them). Bytes: the storages' bytes.
* ``cached_reservation`` -- the allocator's cache (reserved - allocated; on glibc, free bytes in the
  arenas) grew by more than the steps in between needed. An allocator keeps what a step's temporaries
  took -- that much is the transient peak's, and explained -- so between two samples the unexplained
  growth is ``growth - the largest step peak in between``. Bytes: that unexplained growth; it is named
  only if at least ``min_bytes`` of it is still held at the end (``held_at_end``: later allocations may
  reuse part of a cache). ``trend`` says whether the cache was still growing over the last samples.
* ``logical_pool_leak`` -- KV blocks held for no live owner: a ledger sequence the scheduler does not run,
  or a lease no step in flight owns, present in at least ``leak_min_samples`` samples. Bytes: the blocks
  only orphans hold x block bytes (promised blocks are listed apart: they hold capacity, not memory).
* ``external_allocation`` -- device (or process) bytes outside every tensor and outside the allocator's
  cache grew between two samples: another library, a stray numpy array, NCCL/cuBLAS workspaces. Bytes: the
  jump, named only if at least ``min_bytes`` of it is still held at the end. On CPU the evidence splits it
  into bytes inside malloc (not a tensor) and outside malloc (mmap, another allocator).
* ``transient_peak`` -- a step whose peak is above what its shape explains: the steady state is a
  robust linear fit of the measured peaks on the step shapes (new tokens, sequences, context tokens), and
  a step whose peak exceeds the fit by ``peak_min_bytes`` and ``peak_factor`` x the fit is named, with
  its shape. Bytes: measured - expected.

A jump must be at least ``min_bytes`` between two samples to count; the run's first interval (from the
baseline to the first step) is a warm-up -- first-use kernels, caches, arena growth -- and needs
``warmup_factor`` x that. A clean run names nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ....core import checks
from ....errors import ConfigError
from ....units import format_bytes
from .peaks import StepShape
from .snapshot import MemorySnapshot

FINDING_KINDS = ("retained_tensors", "cached_reservation", "logical_pool_leak", "external_allocation",
                 "transient_peak")
MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class Thresholds:
    min_bytes: int = 16 * MiB  # a cache or external jump between two samples
    warmup_factor: float = 3.0  # the first interval needs this x min_bytes
    retained_min_bytes: int = 1 * MiB
    retained_min_samples: int = 2  # alive in at least this many samples after its owners ended
    leak_min_samples: int = 2
    peak_min_bytes: int = 16 * MiB
    peak_factor: float = 0.5  # ... and above (1 + peak_factor) x the expected peak

    def __post_init__(self) -> None:
        for name in ("min_bytes", "retained_min_bytes", "peak_min_bytes"):
            checks.size(getattr(self, name), f"threshold {name}")
        for name in ("retained_min_samples", "leak_min_samples"):
            checks.count(getattr(self, name), f"threshold {name}", 1)
        if not (self.warmup_factor >= 1 and self.peak_factor >= 0):
            raise ConfigError("warmup_factor must be >= 1 and peak_factor >= 0")


@dataclass(slots=True)
class Finding:
    """One named cause: its kind, bytes, the steps it spans, the requests involved and the evidence."""

    kind: str
    bytes: int
    steps: tuple[int, int]  # first and last engine step of the evidence
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "bytes": self.bytes, "steps": list(self.steps), "summary": self.summary,
                "requests": self.requests, "evidence": self.evidence}


@dataclass(slots=True)
class Diagnosis:
    """The findings of a run, the sampled series they came from, and the seed's warning as observed."""

    findings: list[Finding]
    snapshots: list[MemorySnapshot]
    steps: list[Any]  # StepRecord
    peak_model: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def kinds(self) -> list[str]:
        return [f.kind for f in self.findings]

    def by_kind(self, kind: str) -> list[Finding]:
        return [f for f in self.findings if f.kind == kind]


# ---- helpers ------------------------------------------------------------------------------------------------


def _requests_between(steps: Sequence[Any], first: int, last: int) -> list[str]:
    """Requests running at any step in ``[first, last]`` (sorted, for "while r17-r30 were running")."""
    out: set[str] = set()
    for r in steps:
        if first <= r.step <= last:
            out.update(r.running)
            out.update(r.finished)
    return sorted(out, key=_natural)


def _natural(rid: str) -> tuple[Any, ...]:
    import re

    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", rid))


def _span(rids: list[str], limit: int = 6) -> str:
    if not rids:
        return "no request"
    if len(rids) <= limit:
        return ", ".join(rids)
    return f"{', '.join(rids[:limit - 1])}, ... {rids[-1]} ({len(rids)} requests)"


def unattributed(s: MemorySnapshot) -> int:
    """Device (process) bytes outside every tensor and outside the allocator's cache."""
    tensors = s.tensors.total(s.device)
    if s.allocator.backend == "cuda":
        return s.device_stats.used - max(tensors, s.allocator.allocated) - s.allocator.cached
    return s.device_stats.used - tensors - s.allocator.cached


# ---- the steady state of step peaks --------------------------------------------------------------------------


def _features(shape: StepShape) -> list[float]:
    return [1.0, float(shape.tokens), float(shape.seqs), float(shape.context_tokens), float(shape.prefill_tokens)]


@dataclass(slots=True)
class PeakModel:
    """peak ~ c0 + c1 tokens + c2 seqs + c3 context tokens + c4 prefill tokens, fitted robustly."""

    coef: list[float]
    fitted_on: int
    outliers: list[int]

    def expected(self, shape: StepShape) -> int:
        return max(0, int(sum(c * x for c, x in zip(self.coef, _features(shape), strict=True))))

    def as_dict(self) -> dict[str, Any]:
        names = ("intercept", "per_token", "per_sequence", "per_context_token", "per_prefill_token")
        return {"model": "peak = " + " + ".join(names), "coefficients": dict(zip(names, self.coef, strict=True)),
                "fitted_on_steps": self.fitted_on, "outlier_steps": self.outliers}


def fit_peaks(records: Sequence[Any], th: Thresholds) -> PeakModel | None:
    """Least squares over the measured steps, refitted without the steps the fit cannot explain."""
    rows = [r for r in records if r.peak_bytes is not None and r.shape.seqs > 0]
    if not rows:
        return None
    keep = list(range(len(rows)))
    coef = [0.0] * 5
    for _ in range(4):
        x = torch.tensor([_features(rows[i].shape) for i in keep], dtype=torch.float64)
        y = torch.tensor([[float(rows[i].peak_bytes)] for i in keep], dtype=torch.float64)
        # Minimum-norm least squares (gelsd): exact where there are fewer distinct shapes than terms.
        coef = torch.linalg.lstsq(x, y, driver="gelsd").solution[:, 0].tolist()
        model = PeakModel(coef, len(keep), [])
        nxt = [i for i in range(len(rows)) if not _outlier(rows[i].peak_bytes, model.expected(rows[i].shape), th)]
        if nxt == keep or not nxt:
            break
        keep = nxt
    model = PeakModel(coef, len(keep), [])
    model.outliers = [r.step for r in rows if _outlier(r.peak_bytes, model.expected(r.shape), th)]
    return model


def _outlier(peak: int, expected: int, th: Thresholds) -> bool:
    excess = peak - expected
    return excess >= th.peak_min_bytes and excess >= th.peak_factor * expected


# ---- the reconciliation ---------------------------------------------------------------------------------------


def reconcile(snapshots: Sequence[MemorySnapshot], steps: Sequence[Any], th: Thresholds | None = None) -> Diagnosis:
    """Name the causes in a sampled run (``snapshots[0]`` is the baseline taken before the workload)."""
    th = th or Thresholds()
    if len(snapshots) < 2:
        raise ConfigError("a diagnosis needs at least two snapshots (a baseline and one after a step)")
    model = fit_peaks(steps, th)
    findings: list[Finding] = []
    findings += _retained(snapshots, steps, th)
    findings += _pool_leaks(snapshots, steps, th)
    findings += _jumps(snapshots, steps, th, model)
    findings += _peaks(steps, model, th)
    findings.sort(key=lambda f: (f.steps[0], FINDING_KINDS.index(f.kind)))
    notes = ownership_vs_allocation(snapshots, steps)
    return Diagnosis(findings, list(snapshots), list(steps), model.as_dict() if model else {}, notes)


def _retained(snaps: Sequence[MemorySnapshot], steps: Sequence[Any], th: Thresholds) -> list[Finding]:
    from .tensors import describe_holders

    base = snaps[0].tensors.unregistered
    last = snaps[-1]
    first_seen: dict[Any, int] = {}
    for i, s in enumerate(snaps):
        for key in s.tensors.unregistered:
            first_seen.setdefault(key, i)
    finish_step: dict[str, int] = {}
    for r in steps:
        for rid in r.finished:
            finish_step[rid] = r.step
    def owners_at(i: int) -> list[str]:
        """Requests that ran in the steps leading to sample ``i`` (running or finished there)."""
        lo = snaps[i - 1].step if i > 0 and snaps[i - 1].step is not None else -1
        hi = snaps[i].step if snaps[i].step is not None else lo
        return _requests_between(steps, lo + 1, hi) or sorted(snaps[i].running, key=_natural)

    groups: dict[int, list[Any]] = {}
    for key, info in last.tensors.unregistered.items():
        if key in base or key not in first_seen:
            continue
        i = first_seen[key]
        owners = owners_at(i)
        if not owners or any(rid not in finish_step for rid in owners):
            continue  # no request owned it, or one of them is still running: not ended
        ended = max(finish_step[rid] for rid in owners)
        alive_after = sum(1 for s in snaps[i:]
                          if s.step is not None and s.step >= ended and key in s.tensors.unregistered)
        if alive_after < th.retained_min_samples:
            continue
        groups.setdefault(i, []).append(info)
    out = []
    for i, infos in sorted(groups.items()):
        total = sum(s.nbytes for s in infos)
        if total < th.retained_min_bytes:
            continue
        owners = owners_at(i)
        ended = max(finish_step[rid] for rid in owners)
        top = sorted(infos, key=lambda s: -s.nbytes)[:5]
        storages = []
        for s in top:
            row = s.as_dict()
            t = s.tensor() if s.tensor is not None else None
            if t is not None:
                row["held_by"] = describe_holders(t)
            storages.append(row)
        first = snaps[i].step if snaps[i].step is not None else -1
        last_step = last.step if last.step is not None else first
        out.append(Finding(
            "retained_tensors", total, (first, last_step),
            f"{format_bytes(total)} in {len(infos)} tensor storage(s) first seen after step {first}, while "
            f"{_span(owners)} ran; all of them finished by step {ended}, the storages are still alive at step "
            f"{last_step}",
            {"storages": len(infos), "largest": storages, "first_seen_step": first, "owners_finished_step": ended},
            owners))
    return out


def _pool_leaks(snaps: Sequence[MemorySnapshot], steps: Sequence[Any], th: Thresholds) -> list[Finding]:
    seen: dict[str, list[int]] = {}
    for i, s in enumerate(snaps):
        if s.pool is None:
            continue
        for o in s.pool.orphans:
            seen.setdefault(o.ident, []).append(i)
    last = snaps[-1]
    if last.pool is None:
        return []
    orphans = [o for o in last.pool.orphans if len(seen.get(o.ident, ())) >= th.leak_min_samples]
    if not orphans:
        return []
    bb = last.pool.block_bytes
    blocks = {b for o in orphans for b in o.blocks}
    promised = sum(o.promised for o in orphans)
    first = min(snaps[seen[o.ident][0]].step or 0 for o in orphans)
    last_step = last.step if last.step is not None else first
    rows = []
    for o in orphans:
        row = o.as_dict(bb)
        row["first_seen_step"] = snaps[seen[o.ident][0]].step
        row["age_steps"] = last_step - (row["first_seen_step"] or 0)
        rows.append(row)
    names = ", ".join(f"{o.kind} {o.ident} (owner {o.owner}, group {o.trust_group})" for o in orphans[:4])
    return [Finding(
        "logical_pool_leak", len(blocks) * bb, (first, last_step),
        f"{len(blocks)} KV blocks ({format_bytes(len(blocks) * bb)}) held for no live owner since step {first}: "
        f"{names}" + (f"; {promised} promised blocks more" if promised else "")
        + " -- the scheduler does not run them and no step in flight holds them, so nothing will release them",
        {"orphans": rows, "blocks": len(blocks), "promised_blocks": promised, "block_bytes": bb},
        sorted({o.owner for o in orphans if o.kind == "sequence"}, key=_natural))]


def _interval_peak(steps: Sequence[Any], lo: int, hi: int, model: PeakModel | None) -> int:
    """The largest step peak in ``(lo, hi]`` (measured, or the fit's expectation for unmeasured steps)."""
    best = 0
    for r in steps:
        if lo < r.step <= hi:
            if r.peak_bytes is not None:
                best = max(best, r.peak_bytes)
            elif model is not None:
                best = max(best, model.expected(r.shape))
    return best


def _jumps(snaps: Sequence[MemorySnapshot], steps: Sequence[Any], th: Thresholds,
           model: PeakModel | None) -> list[Finding]:
    out: list[Finding] = []
    cache = [s.allocator.cached for s in snaps]
    ext = [unattributed(s) for s in snaps]
    final = len(snaps) - 1
    for i in range(1, len(snaps)):
        a, b = snaps[i - 1], snaps[i]
        lo = a.step if a.step is not None else -1
        hi = b.step if b.step is not None else lo
        need = th.min_bytes * (th.warmup_factor if i == 1 else 1.0)
        peak = _interval_peak(steps, lo, hi, model)
        grew = cache[i] - cache[i - 1]
        unexplained = grew - peak
        held = min(unexplained, cache[final] - cache[i - 1])
        if unexplained >= need and held >= need:
            tail = cache[-4:]
            trend = "growing" if len(tail) >= 2 and all(y > x for x, y in zip(tail, tail[1:], strict=False)) \
                else "stable"
            reqs = _requests_between(steps, lo + 1, hi)
            what = "reserved - allocated" if b.allocator.backend == "cuda" else "free bytes in the arenas"
            out.append(Finding(
                "cached_reservation", unexplained, (lo + 1, hi),
                f"the allocator's cache grew by {format_bytes(grew)} between step {lo} and step {hi} "
                f"({b.allocator.backend}: {what}),"
                f" {format_bytes(unexplained)} more than the largest step peak in between ({format_bytes(peak)}); "
                f"{format_bytes(held)} of it is still held at the end ({trend}), while {_span(reqs)} ran",
                {"cache_before": cache[i - 1], "cache_after": cache[i], "cache_end": cache[final],
                 "held_at_end": held, "largest_step_peak": peak, "trend": trend, "backend": b.allocator.backend,
                 "allocator_before": a.allocator.as_dict(), "allocator_after": b.allocator.as_dict()}, reqs))
        grew = ext[i] - ext[i - 1]
        held = min(grew, ext[final] - ext[i - 1])
        if grew >= need and held >= need:
            reqs = _requests_between(steps, lo + 1, hi)
            evidence: dict[str, Any] = {"outside_before": ext[i - 1], "outside_after": ext[i],
                                        "outside_end": ext[final], "device_used_before": a.device_stats.used,
                                        "device_used_after": b.device_stats.used,
                                        "tensor_bytes_delta": b.tensors.total(b.device) - a.tensors.total(a.device),
                                        "backend": b.device_stats.backend}
            where = ""
            if b.allocator.backend == "glibc":
                inside = ((b.allocator.allocated - b.tensors.total("cpu"))
                          - (a.allocator.allocated - a.tensors.total("cpu")))
                inside = max(0, min(grew, inside))
                evidence.update({"inside_malloc_not_tensors": inside, "outside_malloc": grew - inside})
                where = (f" ({format_bytes(inside)} allocated through malloc but in no tensor, "
                         f"{format_bytes(grew - inside)} outside malloc)")
            evidence["held_at_end"] = held
            out.append(Finding(
                "external_allocation", grew, (lo + 1, hi),
                f"{format_bytes(grew)} of {'device' if b.device == 'cuda' else 'process'} memory appeared outside "
                f"every tensor and outside the allocator's cache between step {lo} and step {hi}{where}; "
                f"{format_bytes(held)} is still held at the end, while {_span(reqs)} ran",
                evidence, reqs))
    return out


def _peaks(steps: Sequence[Any], model: PeakModel | None, th: Thresholds) -> list[Finding]:
    if model is None:
        return []
    measured = [r for r in steps if r.peak_bytes is not None]
    decode = sorted(r.peak_bytes for r in measured if r.shape.kind == "decode")
    steady = decode[len(decode) // 2] if decode else None
    out = []
    for r in measured:
        if r.step not in model.outliers:
            continue
        expected = model.expected(r.shape)
        excess = r.peak_bytes - expected
        out.append(Finding(
            "transient_peak", excess, (r.step, r.step),
            f"step {r.step} ({r.shape.kind}: {r.shape.tokens} tokens, {r.shape.seqs} sequences, "
            f"{r.shape.context_tokens} context tokens) peaked at {format_bytes(r.peak_bytes)} above its start, "
            f"{format_bytes(excess)} more than its shape explains ({format_bytes(expected)})",
            {"step_shape": r.shape.as_dict(), "peak_bytes": r.peak_bytes, "expected_bytes": expected,
             "steady_decode_peak_bytes": steady}, sorted(r.running, key=_natural)))
    return out


# ---- the seed's warning ------------------------------------------------------------------------------------------


def ownership_vs_allocation(snaps: Sequence[MemorySnapshot], steps: Sequence[Any]) -> list[str]:
    """Where requests finished and their blocks went back to the pool, say what the allocator and the
    device did meanwhile (the largest such interval): ownership moved, allocation did not."""
    best: tuple[int, int, int] | None = None
    for i in range(1, len(snaps)):
        a, b = snaps[i - 1], snaps[i]
        if a.pool is None or b.pool is None:
            continue
        freed = (a.pool.active - b.pool.active) * a.pool.block_bytes
        if freed > 0 and (best is None or freed > best[0]):
            best = (freed, i - 1, i)
    if best is None:
        return []
    freed, i, j = best
    a, b = snaps[i], snaps[j]
    lo, hi = a.step, b.step
    done = sorted({rid for r in steps if lo is not None and hi is not None and lo < r.step <= hi for rid in r.finished},
                  key=_natural)
    kv_delta = b.tensors.owner_bytes("kv/device") - a.tensors.owner_bytes("kv/device")
    return [
        f"between step {lo} and step {hi}, {_span(done)} finished: the pool's active blocks fell by "
        f"{format_bytes(freed)} (to the free list or the prefix cache), while the KV store tensor changed by "
        f"{format_bytes(kv_delta)}, the allocator's allocated bytes by "
        f"{format_bytes(b.allocator.allocated - a.allocator.allocated)} and its reserved bytes by "
        f"{format_bytes(b.allocator.reserved - a.allocator.reserved)}, and the device by "
        f"{format_bytes(b.device_stats.used - a.device_stats.used)}. Returning a block to the free list changes "
        f"who owns it, not what is allocated: the KV pool is one tensor allocated up front, and the next request "
        f"reuses the block without asking the allocator or the device for anything. The device's figure alone "
        f"cannot say whether request memory was reclaimed; the pool ledger can."]


__all__ = ["FINDING_KINDS", "Diagnosis", "Finding", "PeakModel", "Thresholds", "fit_peaks", "ownership_vs_allocation",
           "reconcile", "unattributed"]
