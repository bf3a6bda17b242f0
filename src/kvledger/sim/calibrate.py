"""Fitting a DeviceProfile to measured step times (the pure-Python half of `kvledger calibrate`).

The measuring half -- loading the bundled SmolLM2 into the torch runtime and timing real forward steps --
lives in the CLI face (``kvledger.cli.sim_cmds``), so that this layer never imports torch. Here:

* ``CALIBRATION_SHAPES``: the batch shapes timed (prefill chunks and decode batches);
* ``fit_profile``: the profile whose roofline best explains the measurements. With both efficiencies
  fixed at 1 the fitted ``peak_flops`` and ``mem_bandwidth_Bps`` *are* the effective rates:

      t_i ~= max((L_i + A_i / attention_efficiency) / peak_flops, B_i / mem_bandwidth_Bps)
             + step_overhead_s + seq_overhead_s x sequences_i

  L_i (projection FLOPs), A_i (attention FLOPs) and B_i come from the same CostModel the simulator uses,
  so the fit is consistent with how the profile will be read. The fit minimises the squared log error
  (relative error): a refined grid of the two rates for each candidate overhead, then a simplex
  refinement of all five parameters -- no numpy or scipy needed. The attention term matters on a CPU:
  paged attention runs at about a twelfth of the projections' FLOP rate on an AVX2 core, and without it
  the fit's rms error was 16-17% (a 64-token chunk over 256 cached tokens 30% slower than fitted, big
  mixed batches 20% faster), with it about 4%;
* ``fit_link``: one tier's link, per direction, from transfers of several sizes timed on the real
  transfer path (``kvledger.runtime.measure.links``)::

      t(n blocks) ~= fixed_s + n x block_bytes / bandwidth

  by least squares on the relative error (each point weighted by 1 / t, so small transfers -- where the
  fixed cost shows -- count as much as large ones); ``fixed_s`` is kept >= 0. ``fit_links`` turns a
  whole measurement into the profile's ``links`` and a report with every point and the fit error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .cost_model import CPU_LOCAL, CostModel, DeviceProfile


@dataclass(frozen=True, slots=True)
class Shape:
    """One timed step: prefill entries (new_tokens, context_before) and decode contexts."""

    name: str
    prefill: tuple[tuple[int, int], ...] = ()
    decode: tuple[int, ...] = ()


CALIBRATION_SHAPES: tuple[Shape, ...] = (
    Shape("decode x1 @128", decode=(128,)),
    Shape("decode x4 @128", decode=(128,) * 4),
    Shape("decode x16 @128", decode=(128,) * 16),
    Shape("decode x8 @512", decode=(512,) * 8),
    Shape("prefill 16", prefill=((16, 0),)),
    Shape("prefill 64", prefill=((64, 0),)),
    Shape("prefill 256", prefill=((256, 0),)),
    Shape("prefill 2x64", prefill=((64, 0),) * 2),
    Shape("prefill 64 @256", prefill=((64, 256),)),
    Shape("mixed 32 + decode x4", prefill=((32, 0),), decode=(128,) * 4),
    # Saturated engines run big mixed batches: without these the fit only knows small steps.
    Shape("decode x32 @128", decode=(128,) * 32),
    Shape("mixed 4x48 + decode x16", prefill=((48, 0),) * 4, decode=(96,) * 16),
)


@dataclass(frozen=True, slots=True)
class Measurement:
    shape: Shape
    seconds: float  # median wall time of the step


def _rates(cost: CostModel, shapes: Sequence[Shape]) -> list[tuple[float, float, int, float]]:
    """Per shape: (projection FLOPs, bytes, sequences, attention FLOPs)."""
    out = []
    for s in shapes:
        b = cost.breakdown(list(s.prefill), list(s.decode))
        out.append((float(b.linear_flops), float(b.bytes_moved), len(s.prefill) + len(s.decode),
                    float(b.attention_flops)))
    return out


def _predict(row: tuple[float, float, int, float], p: float, w: float, o: float, q: float, a: float) -> float:
    f, b, n, att = row
    return max((f + att / a) / p, b / w) + o + q * n


def _loss(fb: list[tuple[float, float, int, float]], times: list[float], p: float, w: float, o: float,
          q: float = 0.0, a: float = 1.0) -> float:
    total = 0.0
    for row, t in zip(fb, times, strict=True):
        total += math.log(_predict(row, p, w, o, q, a) / t) ** 2
    return total


def _nelder_mead(f, x0: list[float], steps: list[float], iterations: int = 600) -> tuple[float, list[float]]:
    """Minimise ``f`` from ``x0`` (the standard simplex method; five parameters, a few hundred steps)."""
    pts = [list(x0)] + [[x + (steps[i] if j == i else 0.0) for j, x in enumerate(x0)] for i in range(len(x0))]
    vals = [f(x) for x in pts]
    for _ in range(iterations):
        order = sorted(range(len(pts)), key=vals.__getitem__)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < 1e-12:
            break
        centre = [sum(x[j] for x in pts[:-1]) / (len(pts) - 1) for j in range(len(x0))]
        worst = pts[-1]
        refl = [c + (c - w) for c, w in zip(centre, worst, strict=True)]
        fr = f(refl)
        if fr < vals[0]:
            exp = [c + 2 * (c - w) for c, w in zip(centre, worst, strict=True)]
            fe = f(exp)
            pts[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = refl, fr
        else:
            con = [c + 0.5 * (w - c) for c, w in zip(centre, worst, strict=True)]
            fc = f(con)
            if fc < vals[-1]:
                pts[-1], vals[-1] = con, fc
            else:  # shrink towards the best point
                pts = [pts[0]] + [[b + 0.5 * (x - b) for b, x in zip(pts[0], pt, strict=True)] for pt in pts[1:]]
                vals = [vals[0]] + [f(x) for x in pts[1:]]
    i = min(range(len(pts)), key=vals.__getitem__)
    return vals[i], pts[i]


def fit_profile(cost: CostModel, measurements: Sequence[Measurement], *, host_link_Bps: float,
                transfer_overhead_s: float, name: str = CPU_LOCAL, source: str = "",
                links: dict[str, dict[str, Any]] | None = None) -> tuple[DeviceProfile, dict[str, Any]]:
    """Fit (peak_flops, mem_bandwidth_Bps, step_overhead_s, seq_overhead_s, attention_efficiency) with the
    other efficiencies 1: a grid over the first four (attention priced like any FLOP), then a simplex
    refinement of all five from the grid's best, started at several attention efficiencies.
    ``cost`` gives each shape's FLOPs and bytes (its own profile is not used); ``links`` (from
    :func:`fit_links`) go into the profile as they are. Returns the profile and a fit report."""
    if len(measurements) < 3:
        raise ConfigError("calibration needs at least 3 measured shapes")
    times = [m.seconds for m in measurements]
    if any(not t > 0 for t in times):
        raise ConfigError("measured step times must be positive")
    fb = _rates(cost, [m.shape for m in measurements])
    # Starting points: the most compute-heavy and the most memory-heavy shape alone.
    p0 = max(f / t for (f, _b, _n, _a), t in zip(fb, times, strict=True))
    w0 = max(b / t for (_f, b, _n, _a), t in zip(fb, times, strict=True))
    best = (math.inf, p0, w0, 0.0, 0.0)
    t_min = min(times)
    q_max = min(t / n for (_f, _b, n, _a), t in zip(fb, times, strict=True) if n) if any(r[2] for r in fb) else 0.0
    for kq in range(6):
        q = q_max * 0.9 * kq / 5
        for k in range(24):
            o = t_min * 0.95 * k / 23
            lp, lw, span = math.log(p0), math.log(w0), math.log(1e3)
            local = (math.inf, p0, w0)
            for _round in range(4):
                grid = [(lp + span * (i / 12 - 0.5), lw + span * (j / 12 - 0.5)) for i in range(13)
                        for j in range(13)]
                for a, c in grid:
                    loss = _loss(fb, times, math.exp(a), math.exp(c), o, q)
                    if loss < local[0]:
                        local = (loss, math.exp(a), math.exp(c))
                lp, lw, span = math.log(local[1]), math.log(local[2]), span / 6
            if local[0] < best[0]:
                best = (local[0], local[1], local[2], o, q)
    loss, p, w, o, q = best
    a = 1.0
    # The refinement, in log rates and overheads scaled to the shortest step; out-of-range points (an
    # attention efficiency above 1, a negative overhead) are priced as their nearest valid point plus a
    # penalty, so the simplex stays inside.
    def unpack(x: list[float]) -> tuple[float, float, float, float, float]:
        return (math.exp(x[0]), math.exp(x[1]), max(x[2], 0.0) * t_min, max(x[3], 0.0) * t_min,
                math.exp(min(x[4], 0.0)))

    def objective(x: list[float]) -> float:
        pp, ww, oo, qq, aa = unpack(x)
        outside = max(-x[2], 0.0) + max(-x[3], 0.0) + max(x[4], 0.0)
        return _loss(fb, times, pp, ww, oo, qq, aa) + outside * outside

    for a0 in (1.0, 0.3, 0.1, 0.03):
        _, x = _nelder_mead(objective, [math.log(p), math.log(w), o / t_min, q / t_min, math.log(a0)],
                            [0.3, 0.3, 0.1, 0.01, 1.0])
        fitted = unpack(x)
        got = _loss(fb, times, *fitted)
        if got < loss:
            loss, (p, w, o, q, a) = got, fitted
    profile = DeviceProfile(name=name, peak_flops=p, mem_bandwidth_Bps=w, flops_efficiency=1.0,
                            bw_efficiency=1.0, step_overhead_s=o, seq_overhead_s=q, host_link_Bps=host_link_Bps,
                            transfer_overhead_s=transfer_overhead_s, links=dict(links or {}),
                            attention_efficiency=a,
                            source=source or "kvledger calibrate: fitted to measured runtime steps")
    rows = []
    for m, row in zip(measurements, fb, strict=True):
        pred = _predict(row, p, w, o, q, a)
        rows.append({"shape": m.shape.name, "measured_s": m.seconds, "predicted_s": pred,
                     "error": pred / m.seconds - 1, "flops": row[0] + row[3], "attention_flops": row[3],
                     "bytes": row[1]})
    report = {"rms_log_error": math.sqrt(loss / len(times)), "points": rows}
    report.update(fit_quality(report))
    return profile, report


LoggedStep = tuple[Sequence[tuple[int, int]], Sequence[int], float]  # (prefill entries, decode contexts, s)


def step_measurements(steps: Sequence[LoggedStep], *, limit: int = 400, seed: int = 0) -> list[Measurement]:
    """Measurements from steps a real engine ran during a replay: each step, with its prefill entries
    ``(new_tokens, context_before)``, its decode contexts and its wall time, is a shape of its own.
    Fitting a profile to them (in situ) prices steps at the speed the machine had *during* that replay,
    so a simulator run with it checks the loop (scheduling, batching, queueing) rather than how far the
    machine's speed moved since ``kvledger calibrate``. Steps without work are skipped; at most ``limit``
    are kept, drawn at random with ``seed`` (the fit is pure Python: 150 steps took about 12 s here)."""
    import random

    if isinstance(limit, bool) or not isinstance(limit, int) or not 3 <= limit <= 10_000:
        raise ConfigError(f"step_measurements: limit must be an integer in 3..10000, got {limit!r}")
    picked: list[Measurement] = []
    for i, (prefill, decode, seconds) in enumerate(steps):
        if not prefill and not decode:
            continue
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds < math.inf:
            raise ConfigError(f"step {i}: its time must be a positive number of seconds, got {seconds!r}")
        shape = Shape(f"step {i}", prefill=tuple((int(n), int(c)) for n, c in prefill),
                      decode=tuple(int(c) for c in decode))
        picked.append(Measurement(shape, float(seconds)))
    if len(picked) < 3:
        raise ConfigError(f"fitting needs at least 3 steps with work, got {len(picked)}")
    if len(picked) > limit:
        keep = sorted(random.Random(seed).sample(range(len(picked)), limit))
        picked = [picked[i] for i in keep]
    return picked


# A fit is poor when its typical error passes ~22% (rms of log ratios 0.2) or any one shape is off by half.
POOR_FIT_RMS_LOG = 0.2
POOR_FIT_MAX_ERROR = 0.5


def fit_quality(report: dict[str, Any]) -> dict[str, Any]:
    """How well a fit explains its measurements: rms error (as a percentage), the worst shape and its error,
    and `poor` with advice when the error passes POOR_FIT_RMS_LOG or POOR_FIT_MAX_ERROR."""
    points = report.get("points") or []
    if not points:
        raise ConfigError("a fit report needs at least one point")
    worst = max(points, key=lambda p: abs(p["error"]))
    rms = float(report["rms_log_error"])
    poor = rms > POOR_FIT_RMS_LOG or abs(worst["error"]) > POOR_FIT_MAX_ERROR
    advice = ""
    if poor:
        advice = (f"the fit is poor: rms error {100 * (math.exp(rms) - 1):.0f}%, worst {worst['shape']} off by "
                  f"{100 * worst['error']:+.0f}%; step times on this machine were probably disturbed by other load "
                  "-- rerun on a quieter machine or with more --repeats before trusting cpu-local timings")
    return {"rms_error_pct": 100 * (math.exp(rms) - 1), "worst_shape": worst["shape"],
            "worst_error_pct": 100 * worst["error"], "poor": poor, "advice": advice}


# ---- links to the tiers ----------------------------------------------------------------------------


def fit_link(points: Sequence[tuple[int, float]]) -> tuple[float, float, float]:
    """``(fixed_s, bandwidth_Bps, rms relative error)`` of ``t = fixed_s + nbytes / bandwidth`` over
    ``(nbytes, seconds)`` points (at least two distinct sizes, positive times)."""
    pts = [(float(x), float(t)) for x, t in points]
    if len({x for x, _ in pts}) < 2 or any(not t > 0 or x <= 0 for x, t in pts):
        raise ConfigError("fitting a link needs positive times at two or more transfer sizes")
    # Minimise sum(((a + b x) / t - 1)^2): weighted linear least squares with weights 1 / t.
    sw2 = sum(1 / t**2 for _, t in pts)
    sxw2 = sum(x / t**2 for x, t in pts)
    sx2w2 = sum(x * x / t**2 for x, t in pts)
    sw = sum(1 / t for _, t in pts)
    sxw = sum(x / t for x, t in pts)
    det = sw2 * sx2w2 - sxw2 * sxw2
    a = (sw * sx2w2 - sxw * sxw2) / det if det else 0.0
    b = (sw2 * sxw - sxw2 * sw) / det if det else 0.0
    if a < 0 or b <= 0:  # no fixed cost measurable: the best line through the origin
        a = 0.0
        b = sxw / sx2w2
    rms = math.sqrt(sum(((a + b * x) / t - 1) ** 2 for x, t in pts) / len(pts))
    return a, 1.0 / b, rms


def fit_links(measured: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Per tier of a :func:`kvledger.runtime.measure.links.measure_links` result: the profile's ``links`` entry
    (``out_Bps``, ``out_overhead_s``, ``in_Bps``, ``in_overhead_s`` and each direction's fit error) and a
    report with every point, measured against fitted."""
    block_bytes = int(measured["block_bytes"])
    links: dict[str, dict[str, Any]] = {}
    report: dict[str, Any] = {}
    for tier, entry in measured["tiers"].items():
        link: dict[str, Any] = {}
        rows = []
        for direction in ("out", "in"):
            pts = [(n * block_bytes, t) for n, t in entry["points"][direction]]
            fixed, bw, rms = fit_link(pts)
            link[f"{direction}_Bps"] = bw
            link[f"{direction}_overhead_s"] = fixed
            link[f"{direction}_fit_rms_error_pct"] = 100 * rms
            for (n, t), (x, _) in zip(entry["points"][direction], pts, strict=True):
                pred = fixed + x / bw
                rows.append({"direction": direction, "blocks": n, "bytes": x, "measured_s": t, "fitted_s": pred,
                             "error": pred / t - 1})
        if "compression_ratio" in entry:
            link["compression"] = entry.get("compression", "none")
            link["compression_ratio"] = entry["compression_ratio"]
        links[tier] = link
        report[tier] = {"points": rows, **{k: v for k, v in link.items()}}
    return links, report


__all__ = ["CALIBRATION_SHAPES", "fit_link", "fit_links",
           "POOR_FIT_MAX_ERROR", "POOR_FIT_RMS_LOG", "LoggedStep", "Measurement", "Shape", "fit_profile",
           "fit_quality", "step_measurements"]
