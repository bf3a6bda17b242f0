"""Report folders for simulations: JSON metrics, per-request CSV, per-step CSV and PNG plots.

    write_report(result, folder)            one run: metrics.json, requests.csv, steps.csv, *.png
    write_sweep(runs, folder)               a grid: comparison.csv, comparison.json, sweep_*.png and one
                                            sub-folder per run
    write_fragmentation(results, folder)    the lesson-06 study: fragmentation.csv/json and a stacked bar

matplotlib is imported inside the plotting functions (Agg backend, no display needed).
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .fragmentation import FIG2_KEYS, PAPER_TOKEN_STATES, FragResult
from .simulator import BREAKDOWN_KEYS, SimResult, Timeline

BREAKDOWN_LABELS = {"tokens": "token states", "slack": "tail slack", "promised": "promised (unmaterialised)",
                    "deferred": "leased / in transit", "retained": "retained cache", "free": "free"}
BREAKDOWN_COLORS = {"tokens": "#2b8cbe", "slack": "#a6bddb", "promised": "#fdae6b", "deferred": "#e6550d",
                    "retained": "#74c476", "free": "#eeeeee"}
COMPARISON_COLUMNS = ("throughput_tok_s", "throughput_req_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
                      "tpot_p99_s", "e2e_p99_s", "preemptions", "prefix_hit_rate", "token_states", "peak_running",
                      "completed", "requests", "pool_blocks", "wall_s")


def _folder(path: str | Path) -> Path:
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create report folder {folder}: {exc}") from None
    return folder


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return str(obj)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, default=_json_default) + "\n", encoding="utf-8")


def comparison_row(values: dict[str, Any], result: SimResult) -> dict[str, Any]:
    """The flat row of a sweep table: the swept values, then the headline metrics."""
    s = result.summary()
    return {**{k: values[k] for k in values},
            "throughput_tok_s": s["throughput_tok_s"], "throughput_req_s": s["throughput_req_s"],
            "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p99_s": s["ttft_s"]["p99"],
            "tpot_p50_s": s["tpot_s"]["p50"], "tpot_p99_s": s["tpot_s"]["p99"], "e2e_p99_s": s["e2e_s"]["p99"],
            "preemptions": sum(s["preemptions"].values()), "prefix_hit_rate": s["prefix_hit_rate"],
            "token_states": s["memory_time_avg"]["tokens"], "peak_running": s["peak_running"],
            "completed": s["completed"], "requests": s["requests"], "pool_blocks": s["pool_blocks"],
            "wall_s": s["wall_s"]}


# ---- one run ---------------------------------------------------------------------------------------


def write_report(result: SimResult, folder: str | Path, *, plots: bool = True) -> dict[str, Path]:
    """Write one run's report; returns the files written by name."""
    out = _folder(folder)
    files = {"metrics": out / "metrics.json", "requests": out / "requests.csv", "steps": out / "steps.csv"}
    summary = result.summary()
    summary["config"] = result.config.to_dict()
    summary["profile"] = result.deployment.profile.to_dict()
    summary["inventory"] = result.deployment.inventory
    _write_json(files["metrics"], summary)
    with files["requests"].open("w", newline="", encoding="utf-8") as fh:
        rows = [r.to_row() for r in result.requests]
        cols = list(rows[0]) if rows else ["request_id"]
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    with files["steps"].open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(Timeline.COLUMNS)
        w.writerows(result.timeline.rows())
    if plots:
        files.update(plot_run(result, out))
    return files


def _downsample(n: int, limit: int = 4000) -> range:
    return range(0, n, max(1, n // limit))


def plot_run(result: SimResult, out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files: dict[str, Path] = {}
    tl = result.timeline
    idx = _downsample(len(tl))
    t = [tl.t_s[i] for i in idx]
    title = f"{result.config.model} on {result.deployment.profile.name}, tp={result.config.tp}, " \
            f"{result.config.policy}, block {result.config.block_size}"

    # Pool occupancy breakdown (stacked), as fractions of the pool.
    pool = result.pool_slots
    fig, ax = plt.subplots(figsize=(10, 4.5))
    if t:
        stacks = [[getattr(tl, k)[i] / pool for i in idx] for k in BREAKDOWN_KEYS]
        ax.stackplot(t, *stacks, labels=[BREAKDOWN_LABELS[k] for k in BREAKDOWN_KEYS],
                     colors=[BREAKDOWN_COLORS[k] for k in BREAKDOWN_KEYS], step="post")
    ax.set(xlabel="simulated time (s)", ylabel="share of the KV pool", ylim=(0, 1), title=f"Pool occupancy: {title}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    files["occupancy_png"] = out / "occupancy.png"
    fig.savefig(files["occupancy_png"], dpi=110)
    plt.close(fig)

    # Latency CDFs.
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "ttft_s", "TTFT (s)"), (axes[1], "tpot_s", "TPOT (s)")):
        xs = sorted(v for v in (getattr(r, key) for r in result.requests) if v is not None)
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))])
            if key == "ttft_s" and xs[-1] > 100 * max(xs[0], 1e-9):
                ax.set_xscale("log")
        ax.set(xlabel=label, ylabel="fraction of requests", ylim=(0, 1.01), title=f"{label.split()[0]} CDF")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    files["latency_png"] = out / "latency_cdf.png"
    fig.savefig(files["latency_png"], dpi=110)
    plt.close(fig)

    # Admitted concurrency and the queue over time.
    fig, ax = plt.subplots(figsize=(10, 3.5))
    if t:
        ax.step(t, [tl.running[i] for i in idx], where="post", label="running sequences")
        ax.step(t, [tl.waiting[i] for i in idx], where="post", label="waiting (handed to the scheduler)",
                alpha=0.6)
    ax.set(xlabel="simulated time (s)", ylabel="sequences", title=f"Admitted concurrency: {title}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    files["concurrency_png"] = out / "concurrency.png"
    fig.savefig(files["concurrency_png"], dpi=110)
    plt.close(fig)

    # Prefix hit rate over time (per admission-time bucket).
    fig, ax = plt.subplots(figsize=(10, 3.5))
    admitted = [r for r in result.requests if r.admitted_s is not None]
    if admitted:
        end = max(r.admitted_s for r in admitted) or 1.0
        buckets = 60
        width = end / buckets if end > 0 else 1.0
        hit = [0] * (buckets + 1)
        total = [0] * (buckets + 1)
        for r in admitted:
            b = min(int(r.admitted_s / width), buckets)
            hit[b] += r.hit_tokens
            total[b] += r.prompt_len
        xs = [(b + 0.5) * width for b in range(buckets + 1) if total[b]]
        ys = [hit[b] / total[b] for b in range(buckets + 1) if total[b]]
        ax.plot(xs, ys, marker=".")
        cum_h = cum_t = 0
        cum = []
        for b in range(buckets + 1):
            cum_h += hit[b]
            cum_t += total[b]
            if total[b]:
                cum.append(cum_h / cum_t)
        ax.plot(xs, cum, linestyle="--", label="cumulative")
        ax.legend(fontsize=8)
    ax.set(xlabel="simulated time (s)", ylabel="prompt tokens hit", ylim=(0, 1), title=f"Prefix hit rate: {title}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    files["hit_rate_png"] = out / "hit_rate.png"
    fig.savefig(files["hit_rate_png"], dpi=110)
    plt.close(fig)
    return files


# ---- sweeps ----------------------------------------------------------------------------------------


def _slug(values: dict[str, Any]) -> str:
    text = "_".join(f"{k}-{v}" for k, v in values.items()) or "base"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:120]


def write_sweep(runs: Sequence[tuple[dict[str, Any], SimResult]], folder: str | Path, *,
                per_run_plots: bool = False) -> dict[str, Path]:
    out = _folder(folder)
    rows = [comparison_row(v, r) for v, r in runs]
    files = {"comparison_csv": out / "comparison.csv", "comparison_json": out / "comparison.json"}
    with files["comparison_csv"].open("w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["empty"])
        w.writeheader()
        w.writerows(rows)
    _write_json(files["comparison_json"], rows)
    for values, result in runs:
        write_report(result, out / _slug(values), plots=per_run_plots)
    if rows:
        files.update(plot_sweep(rows, [list(v) for v, _ in runs][0], out))
    return files


def plot_sweep(rows: list[dict[str, Any]], keys: list[str], out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [", ".join(f"{k}={row[k]}" for k in keys) for row in rows]
    metrics = (("throughput_tok_s", "output tokens / s"), ("ttft_p99_s", "p99 TTFT (s)"),
               ("tpot_p50_s", "p50 TPOT (s)"), ("preemptions", "preemptions"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 0.35 * len(rows) + 2.5))
    for ax, (key, label) in zip(axes, metrics, strict=True):
        vals = [row[key] if row[key] is not None else 0 for row in rows]
        ax.barh(range(len(rows)), vals, color="#2b8cbe")
        ax.set_yticks(range(len(rows)), labels if ax is axes[0] else [""] * len(rows), fontsize=8)
        ax.invert_yaxis()
        ax.set_title(label, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path = out / "sweep.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"sweep_png": path}


# ---- fragmentation ---------------------------------------------------------------------------------


def write_fragmentation(results: Sequence[FragResult], folder: str | Path, *, plots: bool = True
                        ) -> dict[str, Path]:
    out = _folder(folder)
    rows = [r.to_dict() for r in results]
    files = {"fragmentation_csv": out / "fragmentation.csv", "fragmentation_json": out / "fragmentation.json"}
    with files["fragmentation_csv"].open("w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    _write_json(files["fragmentation_json"], rows)
    if plots and rows:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        colors = {"token_states": "#2b8cbe", "reservation": "#fdae6b", "internal": "#e6550d",
                  "external": "#bdbdbd"}
        names = {"token_states": "token states", "reservation": "reservation",
                 "internal": "internal fragmentation", "external": "external fragmentation & free"}
        fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 2))
        left = [0.0] * len(rows)
        for key in FIG2_KEYS:
            vals = [row[key] for row in rows]
            ax.barh(range(len(rows)), vals, left=left, color=colors[key], label=names[key])
            left = [a + b for a, b in zip(left, vals, strict=True)]
        for i, row in enumerate(rows):
            paper = PAPER_TOKEN_STATES.get(row["mode"])
            if paper is not None and (row["mode"] != "paged" or row["block_size"] == 16):
                ax.plot([paper], [i], marker="|", markersize=18, color="black")
        ax.set_yticks(range(len(rows)), [row["label"] for row in rows], fontsize=8)
        ax.invert_yaxis()
        ax.set(xlim=(0, 1), xlabel="share of KV memory (black tick: the paper's token states)",
               title="Where KV memory goes (cf. PagedAttention, Fig. 2)")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        fig.tight_layout()
        files["fragmentation_png"] = out / "fragmentation.png"
        fig.savefig(files["fragmentation_png"], dpi=110)
        plt.close(fig)
    return files


__all__ = ["BREAKDOWN_LABELS", "COMPARISON_COLUMNS", "comparison_row", "plot_run", "plot_sweep",
           "write_fragmentation", "write_report", "write_sweep"]
