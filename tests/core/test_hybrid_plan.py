"""Hybrid KV cache groups in the planner: Gemma 3 (5 sliding 1,024 : 1 global) and gpt-oss (1:1, window 128) at a
32k context, by hand, against vLLM's own allocator, and through `plan` / `admit`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvledger.core.sizing.geometry import KVSpec
from kvledger.core.sizing.hybrid import group_layout, hybrid_plan, is_hybrid, sliding_blocks
from kvledger.core.sizing.models import load_model_config

ROOT = Path(__file__).resolve().parents[2]
GEMMA3 = ROOT / "examples" / "configs" / "gemma-3-27b.json"
GPT_OSS = ROOT / "examples" / "configs" / "gpt-oss-120b.json"
BUDGET = 40_000_000_000  # KV bytes on one rank
CTX = 32768
STEP = 8192  # vLLM's max_num_batched_tokens on an H100, one batch in flight

# vLLM 0.32's own functions (benchmarks/vllm_hybrid_groups.py, run with the vLLM CPU venv) on these layer kinds,
# 40e9 KV bytes, block 16, max_model_len 32768, max_num_batched_tokens 8192, no async scheduling.
VLLM = {
    "gemma3": {"groups": [9, 9, 9, 9, 8, 8, 10], "num_blocks": 30517, "bytes_per_block": 1310720,
               "blocks_per_request": [577] * 6 + [2048], "max_memory_usage_bytes": 7222067200,
               "max_concurrency": 5.538475499092559},
    "gpt-oss": {"groups": [18, 18], "num_blocks": 67816, "bytes_per_block": 589824,
                "blocks_per_request": [521, 2048], "max_memory_usage_bytes": 1515257856,
                "max_concurrency": 26.39782016348774},
}


def _spec(path: Path) -> KVSpec:
    return KVSpec.from_hf_config(json.loads(path.read_text()))


def test_gemma3_hybrid_arithmetic_by_hand() -> None:
    spec = _spec(GEMMA3)
    assert (spec.layers, spec.sliding_layers, spec.sliding_window) == (62, 52, 1024)  # globals at 5, 11, ..., 59
    page = 16 * 16 * 128 * 2 * 2  # 16 tokens x 16 KV heads x 128 x (K, V) x bf16 = 128 KiB per layer and block
    assert spec.layer_block_bytes == page == 131072
    plan = hybrid_plan(spec, BUDGET, CTX, STEP)
    # 10 global layers set the group size: 52 sliding layers make ceil(52/10) = 6 groups (9,9,9,9,8,8), 8 padding.
    assert plan.group_size == 10 and plan.padding_layers == 8
    assert [g.layers for g in plan.groups] == [9, 9, 9, 9, 8, 8, 10]
    assert plan.block_bytes == 10 * page
    # A sliding group keeps W - 1 = 1,023 tokens beside an 8,192-token step: ceil(9,215 / 16) + 1 = 577 blocks;
    # the global group all 32,768 tokens: 2,048 blocks.
    assert sliding_blocks(1024, 16, CTX, STEP) == 577
    assert plan.blocks_per_request == 6 * 577 + 2048 == 5510
    assert plan.kv_bytes_per_request == 5510 * 10 * page == 7_222_067_200
    # The uniform pool charges 62 layers x 2,048 blocks: 16.6 GB, 2.3x more.
    assert plan.uniform_bytes_per_request == 2048 * 62 * page == 16_642_998_272
    assert plan.pool_blocks == BUDGET // (10 * page) == 30517
    assert plan.uniform_pool_blocks == BUDGET // (62 * page) == 4922
    assert plan.max_concurrency == pytest.approx(30517 / 5510)
    assert plan.uniform_max_concurrency == pytest.approx(4922 / 2048)
    # What the layers really hold, without padding: 52 x 577 + 10 x 2,048 pages.
    assert plan.exact_bytes_per_request == (52 * 577 + 10 * 2048) * page
    kinds = plan.by_kind()
    assert kinds["sliding"] == {"groups": 6, "layers": 52, "blocks_per_request": 3462,
                                "kv_bytes_per_request": 3462 * 10 * page}
    assert kinds["full"]["kv_bytes_per_request"] == 2048 * 10 * page


def test_gpt_oss_hybrid_arithmetic_by_hand() -> None:
    spec = _spec(GPT_OSS)
    assert (spec.layers, spec.sliding_layers, spec.sliding_window) == (36, 18, 128)
    page = 16 * 8 * 64 * 2 * 2  # 32 KiB
    plan = hybrid_plan(spec, BUDGET, CTX, STEP)
    assert plan.group_size == 18 and plan.padding_layers == 0
    assert sliding_blocks(128, 16, CTX, STEP) == -(-(127 + 8192) // 16) + 1 == 521
    assert plan.blocks_per_request == 521 + 2048
    assert plan.kv_bytes_per_request == (521 + 2048) * 18 * page == 1_515_257_856
    assert plan.pool_blocks == BUDGET // (18 * page) == 67816
    assert plan.max_concurrency == pytest.approx(67816 / 2569)
    assert plan.uniform_max_concurrency == pytest.approx((BUDGET // (36 * page)) / 2048)


@pytest.mark.parametrize(("name", "path"), [("gemma3", GEMMA3), ("gpt-oss", GPT_OSS)])
def test_matches_vllm_hybrid_allocator(name: str, path: Path) -> None:
    """Within 1% of vLLM's figures (recorded from its code): in fact equal."""
    want = VLLM[name]
    plan = hybrid_plan(_spec(path), BUDGET, CTX, STEP)
    assert sorted(g.layers for g in plan.groups) == sorted(want["groups"])
    assert plan.pool_blocks == want["num_blocks"]
    assert plan.block_bytes == want["bytes_per_block"]
    assert sorted(g.blocks_per_request for g in plan.groups) == sorted(want["blocks_per_request"])
    assert plan.kv_bytes_per_request == pytest.approx(want["max_memory_usage_bytes"], rel=0.01)
    assert plan.max_concurrency == pytest.approx(want["max_concurrency"], rel=0.01)
    assert plan.kv_bytes_per_request == want["max_memory_usage_bytes"]


VLLM_PY = Path(os.environ.get("KVLEDGER_VLLM_PY", "/tmp/peers-vllm/bin/python"))


@pytest.mark.skipif(not VLLM_PY.exists(), reason="no vLLM venv (KVLEDGER_VLLM_PY) to run vLLM's allocator")
def test_recorded_figures_are_vllms_own() -> None:
    """The recorded figures are what vLLM's code computes now (and with two batches in flight, async scheduling)."""
    cases = []
    for name, kinds, window, heads, dim in (("gemma3", (["sliding"] * 5 + ["full"]) * 10 + ["sliding"] * 2, 1024,
                                             16, 128),
                                            ("gpt-oss", ["sliding", "full"] * 18, 128, 8, 64)):
        for batches in (1, 2):
            cases.append((name, batches, {"layer_kinds": kinds, "window": window, "kv_heads": heads, "head_dim": dim,
                                          "block_size": 16, "max_model_len": CTX, "max_num_batched_tokens": STEP,
                                          "concurrent_batches": batches, "kv_budget_bytes": BUDGET}))
    out = subprocess.run([str(VLLM_PY), str(ROOT / "benchmarks" / "vllm_hybrid_groups.py"),
                          *(json.dumps(c) for _, _, c in cases)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert out.returncode == 0, out.stderr[-2000:]
    got = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    for (name, batches, _case), vllm in zip(cases, got, strict=True):
        spec = _spec(GEMMA3 if name == "gemma3" else GPT_OSS)
        plan = hybrid_plan(spec, BUDGET, CTX, STEP * batches)
        if batches == 1:
            assert {k: vllm[k] for k in VLLM[name] if k != "groups"} == {k: v for k, v in VLLM[name].items()
                                                                           if k != "groups"}
        assert plan.kv_bytes_per_request == vllm["max_memory_usage_bytes"], (name, batches)
        assert plan.max_concurrency == pytest.approx(vllm["max_concurrency"], rel=1e-12), (name, batches)


def test_group_layout_rules() -> None:
    assert group_layout(10, 52)[0] == 10
    assert group_layout(13, 12) == (13, [("sliding", 12), ("full", 13)])  # under 1.5x: the larger count, one pad
    assert group_layout(0, 30) == (30, [("sliding", 30)])  # every layer slides (Mistral 7B): one group
    assert not is_hybrid(KVSpec.from_hf_config(load_model_config("llama-3.1-8b")))
    assert is_hybrid(KVSpec.from_hf_config(load_model_config("gemma-2-9b")))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvledger", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200"})


def test_plan_reports_groups_and_concurrency() -> None:
    out = _cli("plan", "--model", str(GEMMA3), "--pool", f"{BUDGET}B", "--max-model-len", str(CTX),
               "--max-num-batched-tokens", str(STEP), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    hybrid = data["hybrid"]
    assert hybrid["kv_bytes_per_request"] == VLLM["gemma3"]["max_memory_usage_bytes"]
    assert hybrid["max_concurrency"] == round(VLLM["gemma3"]["max_concurrency"], 2) == 5.54
    assert hybrid["uniform"]["max_concurrency"] == data["max_concurrency_for_context"] == 2.4
    assert hybrid["by_kind"]["sliding"]["layers"] == 52 and hybrid["by_kind"]["full"]["layers"] == 10
    text = _cli("plan", "--model", str(GPT_OSS), "--pool", f"{BUDGET}B", "--max-model-len", str(CTX),
                "--max-num-batched-tokens", str(STEP))
    assert text.returncode == 0, text.stderr
    assert "maximum concurrency for 32,768 tokens per request: 26.40x hybrid vs 16.56x uniform" in text.stdout
    uniform = _cli("plan", "--model", "llama-3.1-8b", "--pool", "10GiB", "--json")
    assert "hybrid" not in json.loads(uniform.stdout)


def test_plan_no_refusal_note_when_the_hybrid_pool_holds_one_request() -> None:
    """vLLM starts when one request fits the hybrid pool, though not a uniform one: no 'refuses to start' note."""
    out = _cli("plan", "--model", str(GEMMA3), "--gpu", "h100", "--max-model-len", str(CTX))
    assert out.returncode == 0, out.stderr
    assert "0.72x" in out.stdout and "1.65x hybrid" in out.stdout
    assert "refuses to start" not in out.stdout


def test_admit_reports_the_hybrid_pool() -> None:
    out = _cli("admit", "--model", str(GEMMA3), "--pool", "40GB", "--requests", "4", "--prompt", "30000",
               "--max-new", "2768", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["hybrid"]["kv_bytes_per_request"] == 7_222_067_200
    assert data["hybrid"]["uniform"]["blocks_per_request"] == data["blocks_per_request"] == 2048
