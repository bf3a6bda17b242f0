"""Measured non-KV peaks of the forward step against the planner's workspace formula.

Runs the real runtime's forward pass (SmolLM2-135M by default) alone on synthetic step shapes -- prefill
of T tokens over S sequences, decode of S sequences at a context length -- in each dtype, measures the
step's transient peak (CPU: torch's profiler allocation events; CUDA: max_memory_allocated), and prints
it beside ``workspace_peak_bytes`` for the same (T, S). Writes the raw measurements and the planner's
measured-peaks rows (schema of ``kvledger/data/measured_peaks.json``: model, dtype, tp, max_batched_tokens,
max_seqs, peak_bytes, device, source), then one JSON line.

    .venv/bin/python benchmarks/workspace_peaks.py [--dtypes fp32,bf16] [--grid quick|plan] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KINETO_LOG_LEVEL", "6")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402

from kvledger.runtime.diagnostics.peaks import measure_forward_peaks, peak_rows  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CONTEXT = 2048  # decode shapes attend over this many tokens (the reference backend gathers them)
GRIDS = {
    "quick": [("prefill", 64, 1, 0), ("prefill", 512, 1, 0), ("prefill", 512, 16, 0), ("decode", 16, 16, 512)],
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
    ap.add_argument("--out", default=None, help="write the raw measurements and the planner rows here (JSON)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtypes = [DTYPES[d.strip()] for d in args.dtypes.split(",") if d.strip()]
    load = os.getloadavg()
    t0 = time.perf_counter()
    peaks = measure_forward_peaks(args.model, GRIDS[args.grid], dtypes=dtypes, device=args.device, repeats=1,
                                  progress=lambda line: print(line, file=sys.stderr, flush=True))
    wall = time.perf_counter() - t0
    print(f"{'dtype':5} {'kind':7} {'tokens':>6} {'seqs':>5} {'ctx':>5} {'measured MiB':>13} {'formula MiB':>12} "
          f"{'measured/formula':>17}")
    for p in peaks:
        print(f"{p.dtype:5} {p.kind:7} {p.tokens:6d} {p.seqs:5d} {p.context:5d} {p.peak_bytes / 2**20:13.1f} "
              f"{p.formula_bytes / 2**20:12.1f} {p.ratio:17.2f}")
    source = (f"benchmarks/workspace_peaks.py --grid {args.grid} (torch {torch.__version__}, "
              f"{'profiler allocation events' if args.device == 'cpu' else 'max_memory_allocated'}; "
              f"rows from decode shapes at context <= {CONTEXT})")
    rows = peak_rows(peaks, source, max_context=CONTEXT)
    result = {"model": args.model, "device": args.device, "grid": args.grid, "wall_s": round(wall, 1),
              "load_average": [round(x, 2) for x in load], "measurements": [p.as_dict() for p in peaks],
              "planner_rows": rows}
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"peaks": rows, "measurements": result["measurements"], "load_average": result["load_average"],
                       "wall_s": result["wall_s"]}, fh, indent=1)
            fh.write("\n")
    print(json.dumps({"benchmark": "workspace_peaks", "model": args.model, "grid": args.grid,
                      "wall_s": result["wall_s"],
                      "load_average": result["load_average"],
                      "max_measured_over_formula": round(max(p.ratio for p in peaks), 3),
                      "min_measured_over_formula": round(min(p.ratio for p in peaks), 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
