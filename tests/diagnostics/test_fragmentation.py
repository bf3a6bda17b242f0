"""Fragmentation measured three ways on real tensors: the seed's three forms of unusable capacity come out
as separate rows -- tail slack (paged), contiguous-hole failures (max-sized in a fixed arena) and the
framework allocator's reserved - allocated -- from one workload."""

from __future__ import annotations

import pytest

from kvledger.core import KVSpec
from kvledger.errors import ConfigError
from kvledger.runtime.measure.diagnostics.fragmentation import (
    WAYS,
    FirstFit,
    FragRequest,
    run_way,
    table_rows,
    variable_workload,
)

# A tiny geometry: 2 layers x 2 (K, V) x 1 head x 8 dims x 4 bytes = 128 bytes per token, blocks of 4 tokens.
CFG = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 1, "num_key_value_heads": 1,
       "hidden_size": 8, "intermediate_size": 16, "vocab_size": 32, "torch_dtype": "float32"}
SPEC = KVSpec.from_hf_config(CFG, kv_dtype="fp32", block_size=4)


def test_first_fit_places_first_and_merges_holes():
    fit = FirstFit(100)
    a, b, c = fit.allocate(30), fit.allocate(30), fit.allocate(30)
    assert (a, b, c) == (0, 30, 60) and fit.free_total == 10
    fit.free(a, 30)
    fit.free(c, 30)
    assert fit.holes == [(0, 30), (60, 40)]
    assert fit.allocate(50) is None and fit.free_total == 70  # 70 free, no hole of 50: a contiguous-hole failure
    fit.free(b, 30)
    assert fit.holes == [(0, 100)]


def test_tail_slack_is_the_ledgers_last_block_arithmetic():
    # One request: 6-token prompt, 3 tokens generated, blocks of 4. Step 1 (prefill + first token): 7 tokens
    # in 2 blocks, 1 slack slot; step 2: 8 tokens, 0; step 3: 9 tokens in 3 blocks, 3 slack slots.
    reqs = [FragRequest("a", 6, 4, 3)]
    r = run_way("paged", reqs, SPEC, 64 * SPEC.bytes_per_token, hf_config=CFG)
    assert r.steps == 3 and r.finished == 1
    bpt = SPEC.bytes_per_token
    assert r.tail_slack_bytes == pytest.approx((1 + 0 + 3) * bpt / 3)
    assert r.token_state_bytes == pytest.approx((7 + 8 + 9) * bpt / 3)
    assert r.held_bytes == pytest.approx((2 + 2 + 3) * SPEC.block_bytes / 3)
    assert r.hole_failures == 0


def test_grow_holds_exactly_the_token_states():
    reqs = variable_workload(6, seed=3, max_prompt=40, max_new=24)
    r = run_way("grow", reqs, SPEC, 400 * SPEC.bytes_per_token, hf_config=CFG)
    assert r.finished == 6 and r.held_bytes == pytest.approx(r.token_state_bytes) and r.tail_slack_bytes == 0


def test_max_sized_tensors_meet_contiguous_hole_failures():
    # Capacity 100 tokens. a (40), b (30) and c (30) fill it; a and c finish after their prefill step and
    # leave holes of 40 and 30 around b: d needs 50 -- 70 tokens are free, no hole holds 50.
    reqs = [FragRequest("a", 39, 1, 1), FragRequest("b", 10, 20, 20), FragRequest("c", 29, 1, 1),
            FragRequest("d", 49, 1, 1)]
    r = run_way("max", reqs, SPEC, 100 * SPEC.bytes_per_token, hf_config=CFG)
    assert r.finished == 4
    assert r.hole_failures >= 1 and r.hole_failure_free_bytes >= 50 * SPEC.bytes_per_token
    assert r.reserved_unused_bytes > 0  # b reserved 30 tokens it fills one per step


def test_the_table_has_the_three_forms_as_separate_rows():
    reqs = variable_workload(8, seed=1, max_prompt=40, max_new=24)
    results = [run_way(w, reqs, SPEC, 300 * SPEC.bytes_per_token, hf_config=CFG) for w in WAYS]
    names = [name for name, _ in table_rows(results)]
    assert any(n.startswith("(1) tail slack") for n in names)
    assert any(n.startswith("(2) contiguous-hole failures") for n in names)
    assert any(n.startswith("(3) allocator fragmentation") for n in names)
    assert "token-state bytes (mean)" in names and "process / device bytes above start, largest" in names
    assert all(r.finished == 8 for r in results)


def test_bad_input():
    with pytest.raises(ConfigError):
        run_way("bogus", [], SPEC, 1000, hf_config=CFG)
    with pytest.raises(ConfigError, match="never fit"):
        run_way("paged", [FragRequest("big", 500, 16, 1)], SPEC, 100 * SPEC.bytes_per_token, hf_config=CFG)
    with pytest.raises(ConfigError):
        variable_workload(0)
