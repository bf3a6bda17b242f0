"""Quantised KV formats through the engine: prefix sharing, copy-on-write, swap and recompute work unchanged
on compressed blocks; a block's identity names its format; and the quality gate (records, contracts)."""

from __future__ import annotations

import json

import pytest
import torch

from kvledger.core import CacheContext
from kvledger.core.sizing.kv_formats import quantized_formats
from kvledger.errors import ConfigError
from kvledger.runtime.engine import Engine, kv_spec_for, resolve_model
from kvledger.runtime.measure.quality_records import (
    find_record,
    load_contract,
    parse_contract,
    require_record,
    save_record,
    weights_revision,
)
from kvledger.runtime.sampling import SamplingParams
from kvledger.scheduler import SchedulerConfig

BS = 4
NEW = 8
QUANTISED = ["fp8-scaled", "int8", "int8-token", "int8-hadamard", "int4", "int4-hadamard"]
MODES = {
    "roomy": dict(num_blocks=200),
    "recompute": dict(num_blocks=14, scheduler_config=SchedulerConfig(
        policy="incremental", on_growth_failure="preempt", recovery="recompute")),
    "swap": dict(num_blocks=14, host_blocks=64, scheduler_config=SchedulerConfig(
        policy="incremental", on_growth_failure="preempt", recovery="swap")),
}


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    heads = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 5, 0)]
    return [heads[i % 3] + torch.randint(0, 256, (1 + (3 * i) % 7,), generator=gen).tolist() for i in range(count)]


def _engine(path, fmt: str, mode: str, **extra) -> Engine:
    return Engine.from_model(path, block_size=BS, kv_dtype=fmt, allow_untested_kv=True, **MODES[mode], **extra)


def _clean(engine: Engine) -> None:
    engine.check()
    u = engine.ledger.usage()
    assert (u.active, u.promised, u.sequences) == (0, 0, 0)
    if engine.scheduler.host is not None:
        assert engine.scheduler.host.num_used == 0


@pytest.fixture(scope="module")
def references(tiny_llama):
    """Per format: greedy outputs of 12 requests in a roomy pool, one at a time (no sharing, no batching)."""
    path, _ = tiny_llama
    prompts = _prompts(12)
    refs = {}
    for fmt in QUANTISED:
        engine = _engine(path, fmt, "roomy", prefix_caching=False)
        refs[fmt] = [engine.generate([p], NEW)[0].output for p in prompts]
        _clean(engine)
    return prompts, refs


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("fmt", QUANTISED)
def test_sharing_swap_and_recompute_give_the_tokens_of_a_lone_run(tiny_llama, references, fmt: str,
                                                                   mode: str) -> None:
    """12 concurrent requests with shared prefixes (full blocks shared, a prompt's tail blocks copied),
    under pressure preempted by recompute or swapped out and back: every request's greedy tokens equal its
    run alone without sharing, in the same format.

    int4 is held to 90% of the tokens, not all: a block shared by requests holds the codes of whichever
    computed it, and K/V computed in a different batch shape differ in the last float bit, which a 4-bit code
    (16 levels over a block's range per channel) can round across; one code moves a logit enough to flip a
    near tie of the tiny random model. int8 and fp8 (and the bit-identical swap at the store level) are exact."""
    path, _ = tiny_llama
    prompts, refs = references
    engine = _engine(path, fmt, mode)
    first = engine.generate(prompts[:1], NEW)  # written prefix blocks the others then hit
    rest = engine.generate(prompts[1:], NEW)
    outputs = [r.output for r in first + rest]
    if fmt == "int4":
        same = sum(a == b for got, ref in zip(outputs, refs[fmt], strict=True) for a, b in zip(got, ref, strict=True))
        assert same >= 0.9 * len(prompts) * NEW and all(len(o) == NEW for o in outputs)
    else:
        assert outputs == refs[fmt]
    assert sum(r.cached_prompt_tokens for r in rest) > 0
    if mode != "roomy":
        assert engine.scheduler.preemptions > 0
    if mode == "swap":
        assert engine.stats.swapped_out_blocks > 0 and engine.stats.swapped_in_blocks > 0
    if engine.spec.format.has_residual:
        assert engine.scheduler.config.max_running <= engine.runner.store.residual_slots <= 32
    _clean(engine)


@pytest.mark.parametrize("fmt", QUANTISED)
def test_forked_branches_copy_compressed_tails_on_write(tiny_llama, fmt: str) -> None:
    """n=4 sampling shares the prompt's partial tail block copy-on-write: each branch equals its own run."""
    path, _ = tiny_llama
    prompt = _prompts(1, seed=3)[0]
    params = SamplingParams(temperature=1.0, seed=11, n=4)
    engine = _engine(path, fmt, "roomy")
    many = engine.generate([prompt], NEW, params)[0]
    assert engine.stats.copies > 0
    for branch in range(4):
        alone = _engine(path, fmt, "roomy").generate([prompt], NEW, SamplingParams(temperature=1.0, seed=11, n=4))
        assert alone[0].outputs[branch] == many.outputs[branch]
        break  # one repetition suffices: determinism of the whole request
    assert len({tuple(o) for o in many.outputs}) > 1
    _clean(engine)


def test_a_compressed_blocks_context_names_its_format(tiny_llama) -> None:
    path, _ = tiny_llama
    engine = _engine(path, "int4", "roomy")
    _, _, ctx = engine.check_request([1, 2, 3, 4, 5], 2)
    assert ctx.kv_dtype == engine.spec.kv_format_id
    assert ctx.kv_dtype.startswith("int4:kivi,k=asym/channel/group4") and "residual=fp32/4" in ctx.kv_dtype
    other = CacheContext(trust_group=ctx.trust_group, model=ctx.model, kv_dtype=kv_spec_for(
        engine.checkpoint, torch.float32, "int8", BS).kv_format_id)
    assert other.root_digest() != ctx.root_digest()  # same tokens, other format: never the same block


def test_the_int8_schemes_choose_the_fp32_caches_tokens_for_the_first_greedy_steps(tiny_llama) -> None:
    """Scaling keys per channel (int8), per token (int8-token) or turning them first (int8-hadamard) keeps the
    engine's greedy choices: the first 3 tokens of 6 prompts equal those of an fp32 cache."""
    path, _ = tiny_llama
    prompts = _prompts(6, seed=7)
    want = [r.output for r in _engine(path, "fp32", "roomy").generate(prompts, 3)]
    for fmt in ("int8", "int8-token", "int8-hadamard"):
        engine = _engine(path, fmt, "roomy")
        assert [r.output for r in engine.generate(prompts, 3)] == want, fmt
        _clean(engine)


# ---- the quality gate ----------------------------------------------------------------------------------------
def test_the_engine_refuses_a_quantised_format_without_a_record(tiny_llama, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVLEDGER_CACHE", str(tmp_path))
    path, _ = tiny_llama
    with pytest.raises(ConfigError, match=r"no passing quality record .*`kvledger quality .*--allow-untested-kv"):
        Engine.from_model(path, block_size=BS, num_blocks=32, kv_dtype="int8")
    assert Engine.from_model(path, block_size=BS, num_blocks=32, kv_dtype="int8", allow_untested_kv=True)
    assert Engine.from_model(path, block_size=BS, num_blocks=32, kv_dtype="bf16")  # not quantised: no gate


def test_a_passing_record_for_the_weights_and_format_lets_the_engine_serve(tiny_llama, tmp_path,
                                                                          monkeypatch) -> None:
    monkeypatch.setenv("KVLEDGER_CACHE", str(tmp_path))
    path, _ = tiny_llama
    ckpt = resolve_model(path)
    spec = kv_spec_for(ckpt, torch.float32, "int8", BS)
    report = {"model": str(path), "weights_revision": weights_revision(ckpt), "format": "int8",
              "kv_format": spec.kv_format_id, "passed": True, "cases": [], "contract": {},
              "protocol": {"complete": True}, "held_out": {"cases": [{"prompt": 0}]}, "verdict": []}
    saved = save_record(report)
    assert saved.parent == tmp_path / "quality" / "records"
    assert find_record(report["weights_revision"], spec.kv_format_id)[0] == saved
    assert Engine.from_model(path, block_size=BS, num_blocks=32, kv_dtype="int8").spec.kv_dtype == "int8"
    # The former name is the same format: the same record serves it.
    assert Engine.from_model(path, block_size=BS, num_blocks=32, kv_dtype="int8-channel").spec.kv_dtype == "int8"
    # The record names the exact format: int8 in other blocks is the same format; int4 is not covered.
    with pytest.raises(ConfigError, match="int4"):
        Engine.from_model(path, block_size=BS, num_blocks=32, kv_dtype="int4")
    with pytest.raises(ConfigError, match="only a report that meets"):
        save_record({**report, "passed": False})
    # The record protocol: the full texts and the held-out prompts, every held-out clause of the contract scored.
    with pytest.raises(ConfigError, match="full protocol"):
        save_record({**report, "protocol": {"complete": False}})
    with pytest.raises(ConfigError, match="held-out prompts scored"):
        save_record({**report, "held_out": None})
    clause = {"metric": "kl_vs_bf16", "max": 2.0}
    with pytest.raises(ConfigError, match="not scored: kl_vs_bf16"):
        save_record({**report, "contract": {"held_out": [clause]}})
    assert save_record({**report, "contract": {"held_out": [clause]}, "verdict": [
        {"metric": "kl_vs_bf16", "set": "held-out prompts", "ok": True}]}).is_file()
    saved.write_text("{not json")  # a damaged record authorises nothing
    with pytest.raises(ConfigError, match="no passing quality record"):
        require_record(spec, ckpt, "tiny")


def test_contracts_ship_for_every_quantised_format_and_bad_ones_are_one_clear_error(tmp_path) -> None:
    assert "int8-channel" not in quantized_formats()  # a former name, not a format of its own
    for fmt in quantized_formats():
        contract = load_contract(fmt)
        assert contract.format == fmt and contract.thresholds
    int8 = {t.metric: t for t in load_contract("int8").thresholds}
    assert int8["ppl_rel_change"].max == 0.005 and int8["greedy_agreement"].min == 0.95  # the target
    with pytest.raises(ConfigError, match="exactly one of max or min"):
        parse_contract({"format": "int8", "thresholds": [{"metric": "kl_mean", "agg": "max"}]}, "x")
    with pytest.raises(ConfigError, match="metric"):
        parse_contract({"format": "int8", "thresholds": [{"metric": "vibes", "agg": "max", "max": 1}]}, "x")
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"format": "int4", "thresholds": [{"metric": "kl_mean", "agg": "max", "max": 1}]}))
    with pytest.raises(ConfigError, match="is for int4, not int8"):
        load_contract("int8", bad)
