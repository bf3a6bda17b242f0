"""Fixed-size state groups (Mamba-2 / linear-attention layers) in the hybrid planner: a small Granite-4.0-H-style
config (10 Mamba-2 : 2 attention layers) at a 32k context, by hand, against vLLM 0.32's own functions, and through
`plan` / `admit`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvledger.core.sizing.geometry import KVSpec, state_geometry
from kvledger.core.sizing.hybrid import hybrid_block_size, hybrid_plan, is_hybrid

ROOT = Path(__file__).resolve().parents[2]
GRANITE = ROOT / "examples" / "configs" / "granite-4-h-small-style.json"
BUDGET = 4_000_000_000
CTX = 32768
STEP = 8192

# vLLM 0.32 (benchmarks/vllm_hybrid_groups.py run with /work/main/.venv-vllm's python, block size 528): its Mamba-2
# state shapes (MambaStateShapeCalculator), MambaSpec page, unify_kv_cache_spec_page_size padding, grouping, block
# count and concurrency on these layers, 4e9 KV bytes, max_model_len 32768, mamba_cache_mode "none".
VLLM = {"groups": [["MambaSpec", 2]] * 5 + [["FullAttentionSpec", 2]], "page_size_bytes": 540672,
        "state_page_bytes": 538112, "num_blocks": 3699, "bytes_per_block": 1081344,
        "blocks_per_request": [1, 1, 1, 1, 1, 63], "max_memory_usage_bytes": 73531392,
        "max_concurrency": 54.39705882352941}


def _cfg() -> dict:
    return json.loads(GRANITE.read_text())


def test_state_geometry_by_hand() -> None:
    spec = KVSpec.from_hf_config(_cfg())
    state = state_geometry(_cfg())
    assert state is not None and is_hybrid(spec, state) and not is_hybrid(spec)
    assert (state.kind, state.layers, spec.layers, spec.sliding_layers) == ("mamba", 10, 12, 0)
    # conv state: (d_conv - 1) x (expand x hidden + 2 x groups x d_state); SSM state: heads x head dim x d_state.
    assert state.conv_shape == (3, 2 * 1024 + 2 * 1 * 128) == (3, 2304)
    assert state.ssm_shape == (32, 64, 128)
    assert state.layer_state_bytes == (3 * 2304 + 32 * 64 * 128) * 2 == 538_112 == VLLM["state_page_bytes"]
    # tp=2 splits the conv width and the heads; the single group is replicated on both ranks.
    half = state_geometry(_cfg(), tp=2)
    assert half is not None and half.conv_shape == (3, (2048 + 2 * 2 * 128) // 2) and half.ssm_shape == (16, 64, 128)
    assert state_geometry({"layer_types": ["full_attention"] * 4}) is None


def test_linear_attention_state_geometry() -> None:
    """Qwen3-Next's gated delta net (3 linear_attention : 1 full_attention): the shapes vLLM 0.32's
    MambaStateShapeCalculator.gated_delta_net_state_shape(1, 16, 32, 128, 128, 4) gives, ((3, 8192), (32, 128, 128))."""
    cfg = {"torch_dtype": "bfloat16", "hidden_size": 2048, "num_hidden_layers": 8,
           "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
           "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
           "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
    state = state_geometry(cfg)
    assert state is not None and (state.kind, state.layers) == ("linear_attention", 6)
    assert (state.conv_shape, state.ssm_shape) == ((3, 2 * 16 * 128 + 32 * 128), (32, 128, 128))
    assert state.layer_state_bytes == (3 * 8192 + 32 * 128 * 128) * 2 == 1_097_728


def test_state_groups_arithmetic_by_hand() -> None:
    spec, state = KVSpec.from_hf_config(_cfg()), state_geometry(_cfg())
    per_token = 4 * 64 * 2 * 2  # one attention layer: 4 KV heads x 64 x (K, V) x bf16 = 1 KiB per token
    # The block grows until one attention page holds a layer's state: 16 x ceil(538,112 / (16 x 1,024)) = 528.
    assert hybrid_block_size(spec, state) == 16 * -(-538_112 // (16 * per_token)) == 528
    page = 528 * per_token
    assert page == VLLM["page_size_bytes"] == 540_672  # the state page padded by 2,560 bytes (0.48%)
    plan = hybrid_plan(spec, BUDGET, CTX, STEP, state)
    # 2 attention layers set the group size: 10 state layers make 5 groups of 2, no padding.
    assert (plan.group_size, plan.padding_layers, plan.block_size) == (2, 0, 528)
    assert plan.block_bytes == 2 * page == VLLM["bytes_per_block"]
    kinds = plan.by_kind()
    # The full group: ceil(32,768 / 528) = 63 blocks; each state group one block, whatever the length.
    assert kinds["full"]["blocks_per_request"] == 63
    assert kinds["state"] == {"groups": 5, "layers": 10, "blocks_per_request": 5,
                              "kv_bytes_per_request": 5 * 2 * page}
    assert plan.blocks_per_request == 68
    assert plan.kv_bytes_per_request == 68 * 2 * page == VLLM["max_memory_usage_bytes"]
    assert plan.exact_bytes_per_request == 63 * 2 * page + 10 * 538_112
    assert plan.pool_blocks == BUDGET // (2 * page) == VLLM["num_blocks"]
    assert plan.max_concurrency == pytest.approx(3699 / 68) == pytest.approx(VLLM["max_concurrency"], rel=1e-12)
    # The uniform pool charges all 12 layers per token in 16-token blocks: 2,048 blocks of 192 KiB a request.
    assert plan.uniform_pool_blocks == BUDGET // (12 * 16 * per_token) == 20345
    assert plan.uniform_max_concurrency == pytest.approx(20345 / 2048)
    # A state group's figure does not grow with the request; the full group's does.
    short = hybrid_plan(spec, BUDGET, 528, STEP, state).by_kind()
    assert short["state"]["blocks_per_request"] == 5 and short["full"]["blocks_per_request"] == 1


VLLM_PY = Path(os.environ.get("KVLEDGER_VLLM_PY", "/tmp/peers-vllm/bin/python"))


@pytest.mark.skipif(not VLLM_PY.exists(), reason="no vLLM venv (KVLEDGER_VLLM_PY) to run vLLM's allocator")
def test_recorded_figures_are_vllms_own() -> None:
    case = {"layer_kinds": (["mamba"] * 5 + ["full"]) * 2, "window": 128, "kv_heads": 4, "head_dim": 64,
            "block_size": 528, "max_model_len": CTX, "max_num_batched_tokens": STEP, "concurrent_batches": 1,
            "kv_budget_bytes": BUDGET, "mamba2": {"intermediate_size": 2048, "n_groups": 1, "num_heads": 32,
                                                  "head_dim": 64, "state_size": 128, "conv_kernel": 4}}
    out = subprocess.run([str(VLLM_PY), str(ROOT / "benchmarks" / "vllm_hybrid_groups.py"), json.dumps(case)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert out.returncode == 0, out.stderr[-2000:]
    got = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert got == [VLLM]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvledger", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200"})


def test_plan_and_admit_report_state_groups() -> None:
    out = _cli("plan", "--model", str(GRANITE), "--pool", f"{BUDGET}B", "--max-model-len", str(CTX),
               "--max-num-batched-tokens", str(STEP), "--json")
    assert out.returncode == 0, out.stderr
    hybrid = json.loads(out.stdout)["hybrid"]
    assert hybrid["block_size"] == 528
    assert hybrid["by_kind"]["state"]["layers"] == 10 and hybrid["by_kind"]["full"]["layers"] == 2
    assert hybrid["kv_bytes_per_request"] == VLLM["max_memory_usage_bytes"]
    assert hybrid["max_concurrency"] == 54.4 and hybrid["uniform"]["max_concurrency"] == 9.93
    text = _cli("plan", "--model", str(GRANITE), "--pool", f"{BUDGET}B", "--max-model-len", str(CTX))
    assert text.returncode == 0, text.stderr
    assert "state: 10 layers in 5 group(s), 5 blocks" in text.stdout
    assert "54.40x hybrid vs 9.93x uniform" in text.stdout
    # The weight plan counts the Mamba-2 mixers (tests/core/test_state_layer_weights.py): --gpu alone sizes the pool.
    gpu = _cli("plan", "--model", str(GRANITE), "--gpu", "h100", "--max-model-len", str(CTX), "--json")
    assert gpu.returncode == 0, gpu.stderr
    planned = json.loads(gpu.stdout)
    assert planned["parameters"] == 249_526_720 and planned["hybrid"]["by_kind"]["state"]["layers"] == 10
    admit = _cli("admit", "--model", str(GRANITE), "--pool", f"{BUDGET}B", "--requests", "4", "--prompt", "30000",
                 "--max-new", "2768", "--json")
    assert admit.returncode == 0, admit.stderr
    assert json.loads(admit.stdout)["hybrid"]["by_kind"]["state"]["blocks_per_request"] == 5
