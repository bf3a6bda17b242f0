"""Plots for reports, drawn for a design document: titled, latencies in milliseconds, percentiles marked,
line charts for numeric sweeps. matplotlib (Agg backend) is imported inside each function.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..scheduler.metrics import percentile
from .fragmentation import FIG2_KEYS
from .simulator import BREAKDOWN_KEYS, SimResult

BREAKDOWN_LABELS = {"tokens": "token states", "slack": "tail slack", "promised": "promised (unmaterialised)",
                    "deferred": "leased / in transit", "retained": "retained cache", "free": "free"}
BREAKDOWN_COLORS = {"tokens": "#2b8cbe", "slack": "#a6bddb", "promised": "#fdae6b", "deferred": "#e6550d",
                    "retained": "#74c476", "free": "#eeeeee"}
AXIS_LABELS = {"rate": "offered rate (requests / s)", "speedup": "replay speed-up (x)"}
PCT_STYLES = {50: ("p50", "-", "o"), 90: ("p90", "--", "s"), 99: ("p99", ":", "^")}
DPI = 120


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    _plt().close(fig)
    return path


def _downsample(n: int, limit: int = 4000) -> range:
    return range(0, n, max(1, n // limit))


def plot_latency_cdf(rows: Sequence[dict[str, Any]], out: Path, *, title: str) -> Path:
    """TTFT and TPOT CDFs in milliseconds with p50/p90/p99 marked."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        xs = sorted(1e3 * v for v in (r.get(key) for r in rows) if v is not None)
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], color="#2b8cbe")
            for q, (name, style, _marker) in PCT_STYLES.items():
                v = percentile(xs, q)
                ax.axvline(v, linestyle=style, color="#555555", linewidth=1)
                ax.annotate(f"{name} {v:,.0f} ms", (v, q / 100), textcoords="offset points", xytext=(4, -10),
                            fontsize=7)
            if key == "ttft_s" and xs[-1] > 100 * max(xs[0], 1e-6):
                ax.set_xscale("log")
        ax.set(xlabel=f"{label} (ms)", ylabel="fraction of requests", ylim=(0, 1.02), title=f"{label} distribution")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    return _save(fig, out / "latency_cdf.png")


def plot_run(result: SimResult, out: Path, *, prefix_bound: dict[str, Any] | None = None) -> dict[str, Path]:
    plt = _plt()
    files: dict[str, Path] = {}
    tl = result.timeline
    idx = _downsample(len(tl))
    t = [tl.t_s[i] for i in idx]
    title = f"{result.config.model} on {result.deployment.profile.name}, tp={result.config.tp}, " \
            f"{result.config.policy}, block {result.config.block_size}"

    fig, ax = plt.subplots(figsize=(10, 4.5))
    pool = result.pool_slots
    if t:
        stacks = [[getattr(tl, k)[i] / pool for i in idx] for k in BREAKDOWN_KEYS]
        ax.stackplot(t, *stacks, labels=[BREAKDOWN_LABELS[k] for k in BREAKDOWN_KEYS],
                     colors=[BREAKDOWN_COLORS[k] for k in BREAKDOWN_KEYS], step="post")
    ax.set(xlabel="simulated time (s)", ylabel="share of the KV pool", ylim=(0, 1), title=f"Pool occupancy: {title}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    files["occupancy_png"] = _save(fig, out / "occupancy.png")

    files["latency_png"] = plot_latency_cdf([r.to_row() for r in result.requests], out, title=title)

    fig, ax = plt.subplots(figsize=(10, 3.5))
    if t:
        ax.step(t, [tl.running[i] for i in idx], where="post", label="running sequences")
        ax.step(t, [tl.waiting[i] for i in idx], where="post", label="waiting (handed to the scheduler)", alpha=0.6)
    ax.set(xlabel="simulated time (s)", ylabel="sequences", title=f"Admitted concurrency: {title}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    files["concurrency_png"] = _save(fig, out / "concurrency.png")

    fig, ax = plt.subplots(figsize=(10, 3.5))
    admitted = [r for r in result.requests if r.admitted_s is not None]
    if admitted:
        end = max(r.admitted_s for r in admitted) or 1.0
        buckets = 60
        width = end / buckets if end > 0 else 1.0
        hit, total = [0] * (buckets + 1), [0] * (buckets + 1)
        for r in admitted:
            b = min(int(r.admitted_s / width), buckets)
            hit[b] += r.hit_tokens
            total[b] += r.prompt_len
        xs = [(b + 0.5) * width for b in range(buckets + 1) if total[b]]
        ax.plot(xs, [hit[b] / total[b] for b in range(buckets + 1) if total[b]], marker=".", label="per interval")
        cum_h = cum_t = 0
        cum = []
        for b in range(buckets + 1):
            cum_h += hit[b]
            cum_t += total[b]
            if total[b]:
                cum.append(cum_h / cum_t)
        ax.plot(xs, cum, linestyle="--", label="cumulative")
    if prefix_bound is not None:
        ax.axhline(prefix_bound["bound"], color="#d62728", linestyle="-.",
                   label=f"bound with an unbounded cache ({100 * prefix_bound['bound']:.1f}%)")
    ax.legend(fontsize=8)
    ax.set(xlabel="simulated time (s)", ylabel="prompt tokens hit", ylim=(0, 1), title=f"Prefix hit rate: {title}")
    ax.grid(alpha=0.3)
    files["hit_rate_png"] = _save(fig, out / "hit_rate.png")
    return files


def _numeric(rows: Sequence[dict[str, Any]], key: str) -> bool:
    return all(isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool) for r in rows)


def plot_sweep(rows: list[dict[str, Any]], keys: list[str], out: Path, *, slo: dict[str, Any] | None = None
               ) -> dict[str, Path]:
    """A single numeric sweep key: the throughput-latency curve as line charts (served vs offered rate,
    TTFT and TPOT percentiles in ms, saturated runs marked). Otherwise horizontal bars per run."""
    plt = _plt()
    if len(keys) == 1 and _numeric(rows, keys[0]):
        key = keys[0]
        order = sorted(rows, key=lambda r: r[key])
        x = [r[key] for r in order]
        sat = [bool(r.get("saturated")) for r in order]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        ax = axes[0]
        offered = [r.get("offered_req_s") for r in order]
        served = [r.get("served_req_s") for r in order]
        if all(v is not None for v in offered):
            ax.plot(x, offered, linestyle="--", color="#999999", label="offered")
        ax.plot(x, [v if v is not None else float("nan") for v in served], marker="o", color="#2b8cbe",
                label="served")
        ax.set(xlabel=key, ylabel="requests / s", title="Served vs offered load")
        for ax_, col, label in ((axes[1], "ttft", "TTFT"), (axes[2], "tpot", "TPOT")):
            for q, (name, style, marker) in PCT_STYLES.items():
                ys = [1e3 * r[f"{col}_p{q}_s"] if r.get(f"{col}_p{q}_s") is not None else float("nan") for r in order]
                ax_.plot(x, ys, linestyle=style, marker=marker, label=name)
            values = [1e3 * r[f"{col}_p{q}_s"] for r in order for q in PCT_STYLES if r.get(f"{col}_p{q}_s")]
            if values and min(values) > 0 and max(values) / min(values) >= 100:
                ax_.set_yscale("log")  # a saturated run's queueing delay dwarfs the unloaded latencies
            target = (slo or {}).get(f"{col}_s")
            if target is not None:
                ax_.axhline(1e3 * target, color="#d62728", linewidth=1, label=f"SLO {1e3 * target:,.0f} ms")
            ax_.set(xlabel=key, ylabel=f"{label} (ms)", title=f"{label} percentiles")
        xlabel = AXIS_LABELS.get(key, key)
        for ax_ in axes:
            ax_.set_xlabel(xlabel)
            if min(x) > 0 and max(x) / min(x) >= 8:
                from matplotlib.ticker import NullFormatter

                ax_.set_xscale("log")
                ax_.set_xticks(x, [f"{v:g}" for v in x])
                ax_.xaxis.set_minor_formatter(NullFormatter())
            xs_sat = [xv for xv, s in zip(x, sat, strict=True) if s]
            for xv in xs_sat:
                ax_.axvline(xv, color="#d62728", alpha=0.3, linewidth=6)
            if xs_sat:
                ax_.plot([], [], color="#d62728", label="saturated run")
            ax_.grid(alpha=0.3)
            ax_.legend(fontsize=8)
        best = (slo or {}).get("best")
        fig.suptitle(f"Throughput-latency curve over {key}" + (f"; highest {key} meeting the SLO: {best}"
                                                                 if best is not None else ""), fontsize=10)
        return {"sweep_png": _save(fig, out / "sweep.png")}

    labels = [", ".join(f"{k}={row[k]}" for k in keys) for row in rows]
    metrics = (("throughput_tok_s", "output tokens / s", 1.0), ("ttft_p99_s", "p99 TTFT (ms)", 1e3),
               ("tpot_p50_s", "p50 TPOT (ms)", 1e3), ("preemptions", "preemptions", 1.0))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 0.35 * len(rows) + 2.5))
    for ax, (key, label, scale) in zip(axes, metrics, strict=True):
        vals = [row[key] * scale if row.get(key) is not None else 0 for row in rows]
        ax.barh(range(len(rows)), vals, color=["#d62728" if r.get("saturated") else "#2b8cbe" for r in rows])
        ax.set_yticks(range(len(rows)), labels if ax is axes[0] else [""] * len(rows), fontsize=8)
        ax.invert_yaxis()
        ax.set_title(label, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle("Sweep (red: saturated run)", fontsize=10)
    return {"sweep_png": _save(fig, out / "sweep.png")}


def plot_fragmentation(rows: list[dict[str, Any]], out: Path) -> Path:
    plt = _plt()
    colors = {"token_states": "#2b8cbe", "reservation": "#fdae6b", "internal": "#e6550d", "external": "#bdbdbd"}
    names = {"token_states": "token states", "reservation": "reservation", "internal": "internal fragmentation",
             "external": "external fragmentation & free"}
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 2))
    left = [0.0] * len(rows)
    for key in FIG2_KEYS:
        vals = [row[key] for row in rows]
        ax.barh(range(len(rows)), vals, left=left, color=colors[key], label=names[key])
        left = [a + b for a, b in zip(left, vals, strict=True)]
    for i, row in enumerate(rows):
        if row.get("paper_token_states") is not None:
            ax.plot([row["paper_token_states"]], [i], marker="|", markersize=18, color="black")
    ax.set_yticks(range(len(rows)), [row["label"] for row in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set(xlim=(0, 1), xlabel="share of KV memory (black tick: token states in PagedAttention's Figure 2)",
           title="Where KV memory goes (cf. Kwon et al., SOSP 2023, Figure 2)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return _save(fig, out / "fragmentation.png")


__all__ = ["BREAKDOWN_COLORS", "BREAKDOWN_LABELS", "plot_fragmentation", "plot_latency_cdf", "plot_run",
           "plot_sweep"]
