"""vLLM's own hybrid KV cache allocator, run on a model's layer kinds with no model and no GPU.

Run with the vLLM venv's python (``/tmp/peers-vllm/bin/python``); prints one JSON line per case: vLLM's
kv cache groups (``_get_kv_cache_groups_uniform_page_size``), its block count for the KV budget
(``get_kv_cache_config_from_groups``), the blocks one request of ``max_model_len`` takes from the shared pool
and ``get_max_concurrency_for_kv_cache_config``. ``tests/core/test_hybrid_plan.py`` holds kvledger's planner to
these figures. The vllm config is a stand-in carrying only the fields those functions read.

    python benchmarks/vllm_hybrid_groups.py '{"full": 10, "sliding": 52, "window": 1024, "kv_heads": 16,
        "head_dim": 128, "block_size": 16, "max_model_len": 32768, "max_num_batched_tokens": 8192,
        "concurrent_batches": 1, "kv_budget_bytes": 60000000000}'
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace


def run(case: dict) -> dict:
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.core import kv_cache_utils as u
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout

    common = dict(block_size=case["block_size"], num_kv_heads=case["kv_heads"], head_size=case["head_dim"],
                  dtype=torch.bfloat16)
    full = FullAttentionSpec(**common)
    sliding = SlidingWindowSpec(sliding_window=case["window"], **common)
    # Layer order as the model declares it: `pattern` sliding layers then one global, repeated (Gemma 3), or
    # alternating (gpt-oss); the grouping only counts kinds, so the order changes no figure.
    # State layers (kind "mamba"): vLLM's own Mamba-2 state shapes, one page per request; the case's block size is
    # the raised hybrid one, and `unify_kv_cache_spec_page_size` pads the state page up to the attention page.
    state = None
    if "mamba2" in case:
        m = case["mamba2"]
        shapes = MambaStateShapeCalculator.mamba2_state_shape(
            tp_world_size=1, intermediate_size=m["intermediate_size"], n_groups=m["n_groups"],
            num_heads=m["num_heads"], head_dim=m["head_dim"], state_size=m["state_size"],
            conv_kernel=m["conv_kernel"])
        state = MambaSpec(block_size=case["block_size"], shapes=tuple(shapes),
                          dtypes=(torch.bfloat16, torch.bfloat16))
    specs: dict[str, object] = {}
    for i, kind in enumerate(case["layer_kinds"]):
        specs[f"model.layers.{i}.self_attn"] = {"sliding": sliding, "mamba": state}.get(kind, full)
    state_page = state.page_size_bytes if state is not None else None
    specs = u.unify_kv_cache_spec_page_size(specs)
    layout = KVCacheLayout[case.get("layout", "LBHNC")]
    cfg = SimpleNamespace(
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout, num_gpu_blocks_override=None,
                                     prefix_cache_retention_interval=None, mamba_cache_mode="none"),
        attention_config=SimpleNamespace(hisparse_config=None),
        model_config=SimpleNamespace(max_model_len=case["max_model_len"]),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=case["max_num_batched_tokens"]),
        max_in_flight_tokens=case["concurrent_batches"] * case["max_num_batched_tokens"],
    )
    groups = u._get_kv_cache_groups_uniform_page_size(specs)
    kv_config = u.get_kv_cache_config_from_groups(cfg, groups, case["kv_budget_bytes"])
    per_group = [u.cdiv(g.kv_cache_spec.max_memory_usage_bytes(cfg), g.kv_cache_spec.page_size_bytes)
                 for g in groups]
    return {
        "groups": [[type(g.kv_cache_spec).__name__, len(g.layer_names)] for g in groups],
        "page_size_bytes": full.page_size_bytes,
        **({"state_page_bytes": state_page} if state_page is not None else {}),
        "num_blocks": kv_config.num_blocks,
        "bytes_per_block": u._get_kv_cache_bytes_per_block(groups, layout),
        "blocks_per_request": per_group,
        "max_memory_usage_bytes": u._max_memory_usage_bytes_from_groups(cfg, groups),
        "max_concurrency": u.get_max_concurrency_for_kv_cache_config(cfg, kv_config),
    }


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(json.dumps(run(json.loads(arg))))
