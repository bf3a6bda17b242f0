"""Free-running greedy agreement with the fp32 ids on the 32 peer prompts, per KV format (issue 36's int8 target:
mean common prefix within 10% of bf16's).

Each format's engine (SmolLM2-135M, fp32 compute, 16-token blocks) generates 128 greedy tokens for every prompt of
``../shared/peers/workload.json``, free-running (its own tokens fed back), and is compared with
``reference_outputs_fp32.json``: prompts identical in all 128 tokens, and the mean length of the common prefix.
Figures per prompt set as in ``kv_quality.py`` (``tune``, ``heldout``, ``all``).

Usage: python benchmarks/kv_free_running.py [--formats bf16,int8,int8-token] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from kvledger.runtime.engine import Engine, resolve_model  # noqa: E402

PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers"
SETS = ("tune", "heldout", "all")


def in_set(i: int, name: str) -> bool:
    return name == "all" or ((i // 2) % 2 == 0) == (name == "tune")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--formats", default="bf16,int8,int8-token")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peers", default=str(PEERS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    peers = Path(args.peers)
    prompts = [r["ids"] for r in json.loads((peers / "workload.json").read_text())["requests"]]
    ref = json.loads((peers / "reference_outputs_fp32.json").read_text())["outputs"]
    new = len(ref[0])
    ckpt = resolve_model(args.model)
    out: dict[str, object] = {"model": args.model, "new_tokens": new, "load_average_at_start": os.getloadavg()[0],
                              "formats": {}}
    for fmt in [f.strip() for f in args.formats.split(",") if f.strip()]:
        t = time.perf_counter()
        blocks = sum(-(-(len(p) + new) // 16) for p in prompts) + 8
        engine = Engine.from_model(ckpt, num_blocks=blocks, kv_dtype=fmt, allow_untested_kv=True)
        ids = [r.outputs[0] for r in engine.generate(prompts, new)]
        prefix = [common_prefix(a, b) for a, b in zip(ids, ref, strict=True)]
        row = {}
        for s in SETS:
            sel = [i for i in range(len(prompts)) if in_set(i, s)]
            row[s] = {"identical": sum(prefix[i] == new for i in sel), "prompts": len(sel),
                      "mean_common_prefix": round(sum(prefix[i] for i in sel) / len(sel), 2)}
        row["seconds"] = round(time.perf_counter() - t, 1)
        out["formats"][fmt] = row  # type: ignore[index]
        print(f"{fmt:>14}: " + "; ".join(f"{s} {row[s]['identical']}/{row[s]['prompts']} identical, mean common "
                                         f"prefix {row[s]['mean_common_prefix']}" for s in SETS), flush=True)
        del engine
    out["load_average_at_end"] = os.getloadavg()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
