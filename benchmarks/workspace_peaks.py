"""Measured non-KV peaks of the forward step against the planner's workspace formula.

Runs the real runtime's forward pass (SmolLM2-135M by default) alone on synthetic step shapes -- prefill
of T tokens over S sequences, decode of S sequences at a context length -- in each dtype, measures the
step's transient peak (CPU: torch's profiler allocation events; CUDA: max_memory_allocated), and prints
it beside ``workspace_peak_bytes`` for the same (T, S). Writes the raw measurements and the planner's
measured-peaks rows (schema of ``kvledger/data/measured_peaks.json``: model, dtype, tp, max_batched_tokens,
max_seqs, peak_bytes, device, source), then one JSON line.

    .venv/bin/python benchmarks/workspace_peaks.py [--dtypes fp32,bf16] [--grid quick|plan-defaults|plan]
        [--backend auto|native|torch] [--out FILE] [--planner-file src/kvledger/data/measured_peaks.json]

``--grid plan-defaults`` measures the shapes that bound ``kvledger plan --engine kvledger``'s default step
(8,192 tokens and 256 sequences) and a few smaller ones, in a fraction of the full ``plan`` grid's time.
``--planner-file`` replaces that file's rows for the measured model, dtypes and device by the new ones
(the other rows and its ``_about`` stay).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KINETO_LOG_LEVEL", "6")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402

from kvledger.runtime.measure.diagnostics.peaks import measure_forward_peaks, peak_rows  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CONTEXT = 2048  # planner rows keep decode shapes at this context or less (the torch backend gathers them)
GRIDS = {
    "quick": [("prefill", 64, 1, 0), ("prefill", 512, 1, 0), ("prefill", 512, 16, 0), ("decode", 16, 16, 512)],
    # The plan's default step (8,192 tokens, 256 sequences) and smaller shapes a plan may ask for; one long
    # decode context shows whether the attention backend's workspace grows with the context.
    "plan-defaults": [
        ("prefill", 128, 1, 0), ("prefill", 512, 16, 0), ("prefill", 2048, 1, 0), ("prefill", 2048, 64, 0),
        ("prefill", 8192, 256, 0),
        ("decode", 1, 1, CONTEXT), ("decode", 16, 16, CONTEXT), ("decode", 64, 64, CONTEXT),
        ("decode", 256, 256, CONTEXT), ("decode", 16, 16, 8192),
    ],
    "plan": [
        ("prefill", 128, 1, 0), ("prefill", 512, 1, 0), ("prefill", 2048, 1, 0), ("prefill", 4096, 1, 0),
        ("prefill", 512, 16, 0), ("prefill", 2048, 64, 0), ("prefill", 8192, 256, 0),
        ("decode", 1, 1, CONTEXT), ("decode", 16, 16, CONTEXT), ("decode", 64, 64, CONTEXT),
        ("decode", 256, 256, CONTEXT),
        ("decode", 16, 16, 8192), ("decode", 64, 64, 8192),
    ],
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--grid", choices=sorted(GRIDS), default="quick")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="auto", help="attention backend (auto: native kernels where built)")
    ap.add_argument("--out", default=None, help="write the raw measurements and the planner rows here (JSON)")
    ap.add_argument("--planner-file", default=None,
                    help="merge the planner rows into this measured-peaks file (kvledger/data/measured_peaks.json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtypes = [DTYPES[d.strip()] for d in args.dtypes.split(",") if d.strip()]
    load = os.getloadavg()
    t0 = time.perf_counter()
    peaks = measure_forward_peaks(args.model, GRIDS[args.grid], dtypes=dtypes, device=args.device, repeats=1,
                                  progress=lambda line: print(line, file=sys.stderr, flush=True),
                                  backend=args.backend)
    wall = time.perf_counter() - t0
    print(f"{'dtype':5} {'backend':22} {'kind':7} {'tokens':>6} {'seqs':>5} {'ctx':>5} {'measured MiB':>13} "
          f"{'formula MiB':>12} {'measured/formula':>17}")
    for p in peaks:
        print(f"{p.dtype:5} {p.backend:22} {p.kind:7} {p.tokens:6d} {p.seqs:5d} {p.context:5d} "
              f"{p.peak_bytes / 2**20:13.1f} {p.formula_bytes / 2**20:12.1f} {p.ratio:17.2f}")
    cpu = platform.processor() or platform.machine()
    rows = []
    for dtype in dict.fromkeys(p.dtype for p in peaks):  # one source per dtype: its own backend
        mine = [p for p in peaks if p.dtype == dtype]
        source = (f"benchmarks/workspace_peaks.py --grid {args.grid} on {datetime.date.today().isoformat()}: "
                  f"attention {mine[0].backend}, torch {torch.__version__}, {args.threads} threads, "
                  f"{args.device} {cpu}, "
                  f"{'profiler allocation events' if args.device == 'cpu' else 'max_memory_allocated'}; "
                  f"rows from decode shapes at context <= {CONTEXT}")
        rows += peak_rows(mine, source, max_context=CONTEXT)
    result = {"model": args.model, "device": args.device, "grid": args.grid, "backend": args.backend,
              "date": datetime.date.today().isoformat(), "torch": torch.__version__, "wall_s": round(wall, 1),
              "load_average": [round(x, 2) for x in load], "measurements": [p.as_dict() for p in peaks],
              "planner_rows": rows}
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({key: result[key] for key in ("model", "device", "grid", "backend", "date", "torch",
                                                    "load_average", "wall_s")}
                      | {"peaks": rows, "measurements": result["measurements"]}, fh, indent=1)
            fh.write("\n")
    if args.planner_file:
        _merge_rows(args.planner_file, rows)
    print(json.dumps({"benchmark": "workspace_peaks", "model": args.model, "grid": args.grid,
                      "wall_s": result["wall_s"],
                      "load_average": result["load_average"],
                      "max_measured_over_formula": round(max(p.ratio for p in peaks), 3),
                      "min_measured_over_formula": round(min(p.ratio for p in peaks), 3)}))
    return 0


def _merge_rows(path: str, rows: list[dict]) -> None:
    """Replace the file's rows for the measured (model, dtype, device) by ``rows``; keep everything else."""
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    measured = {(r["model"], r["dtype"], r["device"]) for r in rows}
    kept = [r for r in data.get("peaks", []) if (r["model"], r["dtype"], r["device"]) not in measured]
    data["peaks"] = kept + rows
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
        fh.write("\n")


if __name__ == "__main__":
    sys.exit(main())
