"""Report folders: the same layout for a simulated run (`simulate`) and a real one (`serve-trace`).

    write_report(result, folder)            one simulated run: metrics.json, requests.csv, steps.csv, *.png
    write_run_report(summary, rows, folder) one real run: metrics.json, requests.csv, latency_cdf.png
    write_sweep(runs, folder)               a grid: comparison.csv/json, sweep plots and one folder per run
    write_fragmentation(results, folder)    the fragmentation study: fragmentation.csv/json and a stacked bar
    compare_reports(a, b)                   headline metrics of two report folders side by side

Latency-throughput answers live here too: `saturation` (is a run overloaded), `comparison_row` (one point
of a throughput-latency curve), `keeps_up` (did a run serve what was offered) and `best_under_slo` (the
highest load that meets a TTFT/TPOT target while keeping up). Every percentile is the scheduler's
(`kvledger.scheduler.metrics.percentile` / `distribution`): one definition for every report.
Plots are drawn by `kvledger.sim.plots` (matplotlib, imported only when drawing).
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
from ..jsonsafe import finite
from ..scheduler.metrics import distribution, percentile  # the one definition of both
from .fragmentation import FragResult
from .simulator import SimResult, Timeline

# Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention",
# SOSP 2023, Figure 2 (arXiv:2309.06180, page 2): average share of KV cache memory, in %, for Orca with
# three reservation policies and vLLM during the experiment of section 6.2. Read from the figure's bar
# labels in the paper's text layer; vLLM's bar labels token states only.
PAPER_FIG2 = {
    "max": {"token_states": 0.204, "reservation": 0.133, "internal": 0.573, "external": 0.089},
    "pow2": {"token_states": 0.268, "reservation": 0.179, "internal": 0.136, "external": 0.416},
    "oracle": {"token_states": 0.382, "reservation": 0.252, "internal": 0.366, "external": 0.0},
    "paged": {"token_states": 0.963},
}
PAPER_FIG2_SOURCE = ("Kwon et al., SOSP 2023 (PagedAttention), Figure 2, arXiv:2309.06180 p. 2: Orca (Max), "
                     "Orca (Pow2), Orca (Oracle) and vLLM bar labels")

COMPARISON_COLUMNS = ("throughput_tok_s", "throughput_req_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
                      "tpot_p99_s", "e2e_p99_s", "preemptions", "prefix_hit_rate", "token_states", "peak_running",
                      "completed", "requests", "pool_blocks", "wall_s")
SATURATION_SERVED_RATIO = 0.95  # served below 95% of offered ...
SATURATION_TTFT_GROWTH = 2.0  # ... while late requests wait over twice as long for a first token as early ones
# A load meets an SLO only if the run served at least this share of the offered rate. Served counts the drain
# after the last arrival, so a short run understates it: the rule errs towards naming a lower rate, never one
# the deployment did not serve.
SLO_MIN_SERVED_RATIO = 0.95
REQUEST_COLUMNS = ("request_id", "trust_group", "arrival_s", "prompt_len", "output_len", "n", "admitted_s",
                   "first_token_s", "finish_s", "generated", "preemptions", "hit_tokens", "finish_reason",
                   "ttft_s", "tpot_s", "e2e_s")


def _folder(path: str | Path) -> Path:
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create report folder {folder}: {exc.strerror or exc}") from None
    return folder


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return str(obj)


def _write_json(path: Path, data: Any) -> None:
    try:
        path.write_text(json.dumps(finite(data), indent=2, default=_json_default) + "\n", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None


def _write_csv(path: Path, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    try:
        with path.open("w", newline="", encoding="utf-8") as fh:
            w = csv.DictWriter(fh, fieldnames=list(columns), extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None


# ---- load answers ----------------------------------------------------------------------------------


def saturation(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Is a run overloaded? From its per-request rows (arrival_s, first_token_s, finish_s, finish_reason).

    offered = (N - 1) / (last arrival - first arrival); served = completed / (last finish - first arrival).
    Saturated when served < 95% of offered AND the median TTFT of the last quarter of arrivals is more than
    twice that of the first quarter (a queue that keeps growing), or when requests were left unfinished.
    """
    reqs = sorted((r for r in rows if not str(r.get("finish_reason") or "").startswith("never")),
                  key=lambda r: r["arrival_s"])
    out: dict[str, Any] = {"offered_req_s": None, "served_req_s": None, "ttft_early_s": None, "ttft_late_s": None,
                           "saturated": False, "reason": ""}
    if len(reqs) < 2:
        return out
    first, last = reqs[0]["arrival_s"], reqs[-1]["arrival_s"]
    done = [r for r in reqs if str(r.get("finish_reason")) in ("length", "stop")]
    finishes = [r["finish_s"] for r in reqs if r.get("finish_s") is not None]
    offered = (len(reqs) - 1) / (last - first) if last > first else None
    makespan = (max(finishes) - first) if finishes else None
    served = len(done) / makespan if makespan else None
    q = max(1, len(reqs) // 4)
    early = [r["first_token_s"] - r["arrival_s"] for r in reqs[:q] if r.get("first_token_s") is not None]
    late = [r["first_token_s"] - r["arrival_s"] for r in reqs[-q:] if r.get("first_token_s") is not None]
    e50, l50 = percentile(early, 50), percentile(late, 50)
    out.update(offered_req_s=offered, served_req_s=served, ttft_early_s=e50, ttft_late_s=l50)
    unfinished = len(reqs) - len(done)
    if offered and served is not None and served < SATURATION_SERVED_RATIO * offered and e50 is not None \
            and l50 is not None and l50 > SATURATION_TTFT_GROWTH * e50:
        out.update(saturated=True, reason=f"served {served:.2f} of {offered:.2f} req/s offered; median TTFT grew "
                                          f"from {e50 * 1e3:.0f} ms to {l50 * 1e3:.0f} ms")
    elif unfinished:
        out.update(saturated=True, reason=f"{unfinished} request(s) did not complete")
    return out


def _rows_of(result: SimResult) -> list[dict[str, Any]]:
    return [r.to_row() for r in result.requests]


def comparison_row(values: dict[str, Any], result: SimResult) -> dict[str, Any]:
    """The flat row of a sweep table: the swept values, the headline metrics and the load answers."""
    s = result.summary()
    sat = saturation(_rows_of(result))
    return {**{k: values[k] for k in values},
            "throughput_tok_s": s["throughput_tok_s"], "throughput_req_s": s["throughput_req_s"],
            "offered_req_s": sat["offered_req_s"], "served_req_s": sat["served_req_s"],
            "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p90_s": s["ttft_s"]["p90"], "ttft_p99_s": s["ttft_s"]["p99"],
            "tpot_p50_s": s["tpot_s"]["p50"], "tpot_p90_s": s["tpot_s"]["p90"], "tpot_p99_s": s["tpot_s"]["p99"],
            "e2e_p99_s": s["e2e_s"]["p99"], "saturated": sat["saturated"], "saturation": sat["reason"],
            "keeps_up": keeps_up(sat),
            "preemptions": sum(s["preemptions"].values()), "prefix_hit_rate": s["prefix_hit_rate"],
            "token_states": s["memory_time_avg"]["tokens"], "peak_running": s["peak_running"],
            "completed": s["completed"], "requests": s["requests"], "pool_blocks": s["pool_blocks"],
            "wall_s": s["wall_s"]}


def keeps_up(row: dict[str, Any]) -> bool:
    """Whether a run served at least ``SLO_MIN_SERVED_RATIO`` of the rate offered to it (``served_req_s`` and
    ``offered_req_s`` as :func:`saturation` computes them). A run without an offered rate (one request, or
    every request arriving at once) has none to keep up with."""
    offered, served = row.get("offered_req_s"), row.get("served_req_s")
    if offered is None:
        return True
    return served is not None and served >= SLO_MIN_SERVED_RATIO * offered


def meets_latency(row: dict[str, Any], *, ttft_s: float | None = None, tpot_s: float | None = None,
                  pct: int = 90) -> bool:
    """Whether a sweep row's p``pct`` TTFT and TPOT meet the targets (seconds; None: no target)."""
    if pct not in (50, 90, 99):
        raise ConfigError(f"SLO percentile must be 50, 90 or 99, got {pct!r}")
    for target, col in ((ttft_s, f"ttft_p{pct}_s"), (tpot_s, f"tpot_p{pct}_s")):
        if target is not None and (row.get(col) is None or row[col] > target):
            return False
    return True


def best_under_slo(rows: Sequence[dict[str, Any]], key: str, *, ttft_s: float | None = None,
                   tpot_s: float | None = None, pct: int = 90) -> dict[str, Any] | None:
    """The row with the highest `key` value that meets the SLO: not saturated, serving at least
    ``SLO_MIN_SERVED_RATIO`` of the offered rate (:func:`keeps_up`), and with p`pct` TTFT and TPOT within the
    targets (seconds); None when no row does."""
    if pct not in (50, 90, 99):
        raise ConfigError(f"SLO percentile must be 50, 90 or 99, got {pct!r}")

    def ok(row: dict[str, Any]) -> bool:
        return not row.get("saturated") and keeps_up(row) and meets_latency(row, ttft_s=ttft_s, tpot_s=tpot_s,
                                                                             pct=pct)

    good = [r for r in rows if ok(r) and isinstance(r.get(key), int | float)]
    return max(good, key=lambda r: r[key]) if good else None


# ---- one simulated run -----------------------------------------------------------------------------


def write_report(result: SimResult, folder: str | Path, *, plots: bool = True,
                 prefix_bound: dict[str, Any] | None = None) -> dict[str, Path]:
    """Write one simulated run's report; returns the files written by name."""
    out = _folder(folder)
    files = {"metrics": out / "metrics.json", "requests": out / "requests.csv", "steps": out / "steps.csv"}
    summary = result.summary()
    rows = _rows_of(result)
    summary["source"] = "simulator"
    summary["saturation"] = saturation(rows)
    summary["prefix_bound"] = prefix_bound
    summary["config"] = result.config.to_dict()
    summary["profile"] = result.deployment.profile.to_dict()
    summary["inventory"] = result.deployment.inventory
    _write_json(files["metrics"], summary)
    _write_csv(files["requests"], rows, list(rows[0]) if rows else list(REQUEST_COLUMNS))
    try:
        with files["steps"].open("w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh)
            w.writerow(Timeline.COLUMNS)
            w.writerows(result.timeline.rows())
    except OSError as exc:
        raise ConfigError(f"cannot write {files['steps']}: {exc.strerror or exc}") from None
    if plots:
        from .plots import plot_run

        files.update(plot_run(result, out, prefix_bound=prefix_bound))
    return files


def write_fleet_report(result: Any, folder: str | Path) -> dict[str, Path]:
    """Write one fleet simulation's report: metrics.json (the fleet's summary, with the TTFT percentiles also
    under ``ttft_s`` as `compare` reads them, the configuration and each replica's counters) and replicas.csv."""
    out = _folder(folder)
    files = {"metrics": out / "metrics.json", "replicas": out / "replicas.csv"}
    s = result.summary
    summary = {**s, "source": "fleet simulator", "wall_s": result.wall_s,
               "ttft_s": {"mean": s["ttft_mean_s"], "p50": s["ttft_p50_s"], "p90": s["ttft_p90_s"],
                          "p99": s["ttft_p99_s"]},
               "config": result.config.sim.to_dict(), "per_replica": result.per_replica}
    _write_json(files["metrics"], summary)
    rows = result.per_replica
    _write_csv(files["replicas"], rows, list(rows[0]) if rows else ["replica"])
    return files


# ---- one real run (serve-trace) ---------------------------------------------------------------------


def run_summary(rows: Sequence[dict[str, Any]], *, wall_s: float, extra: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    """The headline metrics of a run from its per-request rows, with the simulator's keys and definitions
    (TTFT from arrival, TPOT per branch after the first token, linear-interpolated percentiles)."""
    done = [r for r in rows if r.get("finish_reason") in ("length", "stop")]
    first = min((r["arrival_s"] for r in rows), default=0.0)
    last = max((r["finish_s"] for r in rows if r.get("finish_s") is not None), default=first)
    span = max(last - first, 1e-12)
    out_tokens = sum(r.get("generated") or 0 for r in rows)
    reasons: dict[str, int] = {}
    for r in rows:
        key = str(r.get("finish_reason") or "unfinished").split(":", 1)[0]
        reasons[key] = reasons.get(key, 0) + 1
    prompt = sum(r["prompt_len"] for r in rows)
    hit = sum(r.get("hit_tokens") or 0 for r in rows)
    return {
        "requests": len(rows), "completed": len(done), "finish_reasons": reasons, "duration_s": span,
        "throughput_tok_s": out_tokens / span, "throughput_req_s": len(done) / span, "output_tokens": out_tokens,
        "ttft_s": distribution([r["ttft_s"] for r in rows if r.get("ttft_s") is not None]),
        "tpot_s": distribution([r["tpot_s"] for r in rows if r.get("tpot_s") is not None]),
        "e2e_s": distribution([r["e2e_s"] for r in done if r.get("e2e_s") is not None]),
        "prompt_tokens": prompt, "prefix_hit_tokens": hit, "prefix_hit_rate": hit / prompt if prompt else 0.0,
        "saturation": saturation(rows), "wall_s": wall_s, **(extra or {}),
    }


def write_run_report(summary: dict[str, Any], rows: Sequence[dict[str, Any]], folder: str | Path, *,
                     plots: bool = True) -> dict[str, Path]:
    """Write a real run's report in the simulator's layout (metrics.json, requests.csv, latency_cdf.png)."""
    out = _folder(folder)
    files = {"metrics": out / "metrics.json", "requests": out / "requests.csv"}
    _write_json(files["metrics"], summary)
    _write_csv(files["requests"], rows, REQUEST_COLUMNS)
    if plots:
        from .plots import plot_latency_cdf

        files["latency_png"] = plot_latency_cdf(rows, out, title=str(summary.get("title", "real run")))
    return files


_METRICS_LIMIT = 64 * 2**20  # bytes of a report's metrics.json that compare_reports reads


def _load_report(folder: str | Path) -> dict[str, Any]:
    """A report folder's metrics.json, refused in one line when missing, too large or not a report."""
    path = Path(folder) / "metrics.json"
    try:  # the size first: a huge file is refused before it is read, and named as too large
        raw = path.read_text(encoding="utf-8") if path.stat().st_size <= _METRICS_LIMIT else None
    except OSError:
        raise ConfigError(f"no report at {folder} (metrics.json is missing)") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a kvledger report (not UTF-8 text)") from None
    if raw is None:
        raise ConfigError(f"{path} is larger than 64 MiB")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise ConfigError(f"{path} is not a kvledger report (not valid JSON)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a kvledger report")
    return data


def device_class(device: Any) -> str:
    """CPU or GPU: a cpu-local profile or a run on the CPU, else a catalogue GPU or a CUDA device."""
    return "CPU" if str(device).lower().startswith("cpu") else "GPU"


def run_setup(data: dict[str, Any]) -> dict[str, Any]:
    """What a report says about the setup it measured: device, model, policy and pool (None when unsaid).
    serve-trace runs on the CPU; reports it wrote before it named its device are read as such."""
    cfg = data.get("config") if isinstance(data.get("config"), dict) else {}
    mem = data.get("memory") if isinstance(data.get("memory"), dict) else {}
    device = data.get("device") or data.get("gpu") or cfg.get("gpu")
    if device is None and data.get("source") == "runtime":
        device = "cpu"
    pool = data.get("pool_blocks") or mem.get("pool_blocks")
    block = data.get("block_size") or mem.get("block_size")
    return {"device": device, "model": data.get("model") or cfg.get("model"),
            "policy": data.get("policy") or cfg.get("policy"),
            "pool": f"{pool:,} blocks x {block} tokens" if isinstance(pool, int) and isinstance(block, int) else None}


def setup_differences(a: str | Path, b: str | Path) -> list[tuple[str, Any, Any]]:
    """(what, in a, in b) for each of device, model, policy and pool that both reports name and that differ
    (a cpu-local simulation and a CPU run share their device): their ratios then measure the setups."""
    sa, sb = run_setup(_load_report(a)), run_setup(_load_report(b))

    def key(what: str, value: Any) -> str:  # the calibrated cpu-local profile is the CPU a run used
        text = str(value).lower()
        return "cpu" if what == "device" and device_class(text) == "CPU" else text

    return [(k, sa[k], sb[k]) for k in sa if sa[k] is not None and sb[k] is not None and key(k, sa[k]) != key(k, sb[k])]


def compare_reports(a: str | Path, b: str | Path) -> list[tuple[str, Any, Any]]:
    """(metric, value in a, value in b) for the headline metrics of two report folders."""
    data = [_load_report(a), _load_report(b)]
    rows: list[tuple[str, Any, Any]] = [("source", data[0].get("source"), data[1].get("source"))]
    for key in ("requests", "completed", "throughput_tok_s", "throughput_req_s", "prefix_hit_rate"):
        rows.append((key, data[0].get(key), data[1].get(key)))
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        for pct in ("p50", "p90", "p99"):
            rows.append((f"{key[:-2]}_{pct}_s", (data[0].get(key) or {}).get(pct), (data[1].get(key) or {}).get(pct)))
    rows.append(("saturated", (data[0].get("saturation") or {}).get("saturated"),
                 (data[1].get("saturation") or {}).get("saturated")))
    return rows


# ---- sweeps ----------------------------------------------------------------------------------------


def _slug(values: dict[str, Any]) -> str:
    text = "_".join(f"{k}-{v}" for k, v in values.items()) or "base"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:120]


def write_sweep(runs: Sequence[tuple[dict[str, Any], SimResult]], folder: str | Path, *,
                per_run_plots: bool = False, slo: dict[str, Any] | None = None,
                rows: Sequence[dict[str, Any]] | None = None) -> dict[str, Path]:
    """comparison.csv/json, one sub-folder per run and the sweep plots: line charts of the
    throughput-latency curve for a numeric sweep key, bars otherwise."""
    out = _folder(folder)
    rows = list(rows) if rows is not None else [comparison_row(v, r) for v, r in runs]
    files = {"comparison_csv": out / "comparison.csv", "comparison_json": out / "comparison.json"}
    _write_csv(files["comparison_csv"], rows, list(rows[0]) if rows else ["empty"])
    _write_json(files["comparison_json"], {"rows": rows, "slo": slo})
    for values, result in runs:
        write_report(result, out / _slug(values), plots=per_run_plots)
    if rows:
        from .plots import plot_sweep

        keys = [k for k in runs[0][0]] if runs else []
        files.update(plot_sweep(rows, keys, out, slo=slo))
    return files


# ---- fragmentation ---------------------------------------------------------------------------------


def write_fragmentation(results: Sequence[FragResult], folder: str | Path, *, plots: bool = True
                        ) -> dict[str, Path]:
    out = _folder(folder)
    rows = [r.to_dict() for r in results]
    for row in rows:  # only the paper's verified figures, for the rows the paper measured
        paper = PAPER_FIG2.get(row["mode"]) if row["mode"] != "paged" or row["block_size"] == 16 else None
        row["paper_token_states"] = None if paper is None else paper["token_states"]
    files = {"fragmentation_csv": out / "fragmentation.csv", "fragmentation_json": out / "fragmentation.json"}
    _write_csv(files["fragmentation_csv"], rows, list(rows[0]) if rows else ["empty"])
    _write_json(files["fragmentation_json"], {"rows": rows, "paper_source": PAPER_FIG2_SOURCE})
    if plots and rows:
        from .plots import plot_fragmentation

        files["fragmentation_png"] = plot_fragmentation(rows, out)
    return files


__all__ = ["COMPARISON_COLUMNS", "PAPER_FIG2", "PAPER_FIG2_SOURCE", "REQUEST_COLUMNS", "SLO_MIN_SERVED_RATIO",
           "best_under_slo", "compare_reports", "comparison_row", "device_class", "keeps_up", "meets_latency",
           "run_setup", "run_summary", "saturation", "setup_differences", "write_fleet_report",
           "write_fragmentation", "write_report", "write_run_report", "write_sweep"]
