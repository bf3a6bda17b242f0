"""vLLM v1's KVCacheManager on the n4 and evict schedules of ``ledger_ops.py`` (run with a vllm venv's python).

``ledger_ops.py --vllm-python PATH`` runs this script with that python for its ``n4`` and ``evict`` cases
(its ``base`` case uses ``../shared/peers/vllm_lifecycle.py`` as it stands); vLLM is never a dependency
of kvledger. The schedule comes from ``ledger_ops.py`` as a JSON file -- sizes, and the step at which
each request was admitted there -- so vLLM's manager sees the identical schedule: every running
sequence grows by one token per step and finished ones are freed, as in ``vllm_lifecycle.py``, whose
timing this copies (wall time of the whole loop, Request creation and its block hashing included).

* ``n4``: each request is four sequences sampled from one prompt. vLLM's engine fans ``n=4`` out into
  four child requests with the same prompt; the second to fourth hit the first one's cached full
  blocks, each gets its own partial tail, and each grows with its own tokens.
* ``evict``: every prompt unique, the pool at twice the working set, so a warm cache evicts on every
  new block.

Prints one JSON line: ``us_per_request`` among its keys.
Usage: python vllm_ledger_cases.py SCHEDULE.json
"""

import json
import random
import sys
import time

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request


def main(path: str) -> int:
    cfg_in = json.loads(open(path).read())
    bs, nblk, branches = cfg_in["block_size"], cfg_in["pool_blocks"], cfg_in["branches"]
    prompt_len, out_len, shared = cfg_in["prompt"], cfg_in["max_new"], cfg_in["shared"]
    admit_at: list[int] = cfg_in["admit_at"]  # step of each request's admission in ledger_ops.py
    nreq = len(admit_at)

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    cfg = KVCacheConfig(num_blocks=nblk, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])
    mgr = KVCacheManager(cfg, max_model_len=8192, scheduler_block_size=bs, hash_block_size=bs,
                         enable_caching=True, log_stats=True)
    hasher = get_request_block_hasher(bs, hash_fn)

    rng = random.Random(cfg_in["seed"])
    prefixes = [[rng.randrange(32000) for _ in range(shared)] for _ in range(cfg_in["prefixes"])]
    prompts = []
    for i in range(nreq):
        if cfg_in["share"] and i % 2 == 0:
            p = prefixes[rng.randrange(len(prefixes))] + [rng.randrange(32000) for _ in range(prompt_len - shared)]
        else:
            p = [rng.randrange(32000) for _ in range(prompt_len)]
        prompts.append(p)
    outs = [[rng.randrange(32000) for _ in range(out_len)] for _ in range(64)]
    sp = SamplingParams(max_tokens=out_len)

    t0 = time.perf_counter()
    running = []  # [request, produced, output row]
    nxt = steps = hit_tokens = 0
    while nxt < nreq or running:
        while nxt < nreq and admit_at[nxt] <= steps:
            for b in range(branches):
                r = Request(f"{nxt}/{b}", prompts[nxt], sp, None, block_hasher=hasher)
                blocks, ncomp, *_ = mgr.get_computed_blocks(r)
                got = mgr.allocate_slots(r, prompt_len - ncomp, ncomp, blocks)
                assert got is not None, "pool exhausted at admission"
                hit_tokens += ncomp
                r.num_computed_tokens = prompt_len
                running.append([r, 0, (nxt + b) % 64])
            nxt += 1
        still = []
        for item in running:
            r, produced, o = item
            r.append_output_token_ids(outs[o][produced])
            got = mgr.allocate_slots(r, 1)
            assert got is not None, "pool exhausted at growth"
            r.num_computed_tokens += 1
            item[1] = produced + 1
            if item[1] >= out_len:
                mgr.free(r)
            else:
                still.append(item)
        running = still
        steps += 1
    el = time.perf_counter() - t0
    print(json.dumps({"system": "vllm-v1-KVCacheManager", "case": cfg_in["case"], "requests": nreq,
                      "branches": branches, "pool_blocks": nblk, "steps": steps, "seconds": round(el, 3),
                      "us_per_request": round(el / nreq * 1e6, 1), "hit_tokens": hit_tokens}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
