"""vLLM's CPU build on the shared peer workload (../shared/peers: SmolLM2-135M fp32, 32 prompts as token ids,
greedy, 128 tokens each, EOS ignored), with vLLM's own KV cache manager or kvledger's
(``--scheduler-cls kvledger.integrations.vllm.Scheduler``). Prints one JSON line: prompts identical to the
committed fp32 reference, prefix-cached prompt tokens (vLLM's ``num_cached_tokens``), preemptions (vLLM's
``vllm:num_preemptions``), wall time, the load average.

Memory pressure: ``--blocks N`` sets ``num_gpu_blocks_override`` (a pool too small for all 32 at once).

usage (the vLLM venv's python; kvledger on PYTHONPATH or installed):
    OMP_NUM_THREADS=2 PEERS_DIR=../shared/peers PEERS_MODEL_DIR=/tmp/peers-smol \\
      python benchmarks/vllm_peer_workload.py --scheduler kvledger --admission full [--blocks 40]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheduler", choices=("vllm", "kvledger"), default="kvledger")
    ap.add_argument("--admission", choices=("full", "incremental", "predicted"), default="full")
    ap.add_argument("--blocks", type=int, default=None, help="num_gpu_blocks_override (memory pressure)")
    ap.add_argument("--check", action="store_true", help="kvledger: KVLedger.check() after every step")
    ap.add_argument("--peers", default=os.environ.get("PEERS_DIR", "../shared/peers"))
    ap.add_argument("--model", default=os.environ.get("PEERS_MODEL_DIR", "/tmp/peers-smol"))
    args = ap.parse_args()
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, args.peers)
    from common import REFERENCE_FP32, load_workload  # the peers' own loader checks the prompts' digest
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    wl, prompts = load_workload(None)
    kwargs: dict = {}
    if args.scheduler == "kvledger":
        kwargs["scheduler_cls"] = "kvledger.integrations.vllm.Scheduler"
        kwargs["additional_config"] = {"kvledger": {"admission": args.admission, "check": args.check}}
    if args.blocks:
        kwargs["num_gpu_blocks_override"] = args.blocks
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, max_num_seqs=32, max_model_len=1024, seed=0,
              enable_prefix_caching=True, disable_log_stats=False, **kwargs)
    startup = time.perf_counter() - t0
    sp = SamplingParams(temperature=0, max_tokens=wl["max_new_tokens"], ignore_eos=True)
    load0 = os.getloadavg()
    t = time.perf_counter()
    res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    secs = time.perf_counter() - t
    outs = [list(r.outputs[0].token_ids) for r in res]
    ref = json.loads(REFERENCE_FP32.read_text())["outputs"]
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    cc = llm.llm_engine.vllm_config.cache_config
    print(json.dumps({
        "scheduler": args.scheduler, "admission": args.admission if args.scheduler == "kvledger" else None,
        "kv_blocks": cc.num_gpu_blocks, "block_size": cc.block_size,
        "identical_to_reference": sum(a == b for a, b in zip(outs, ref, strict=True)), "prompts": len(outs),
        "prefix_cached_tokens": sum(r.num_cached_tokens or 0 for r in res),
        "preemptions": metrics.get("vllm:num_preemptions"),
        "seconds": round(secs, 2), "tok_s": round(sum(map(len, outs)) / secs, 1), "startup_s": round(startup, 1),
        "loadavg_start": [round(x, 2) for x in load0], "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }))


if __name__ == "__main__":
    main()
