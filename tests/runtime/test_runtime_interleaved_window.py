"""A sliding/global-interleaved model (Gemma 2/3 and gpt-oss style: `layer_types` alternating sliding and full
attention) runs exactly: random-weight Qwen2 and Ministral (Mistral's interleaved family) configs with a window
shorter than every prompt, 16 prompts, greedy,
equal to transformers' eager reference token for token -- batched, with prefix hits, after a fork, and through the
engine under preemption by recompute and by swap; through KV cache groups the same, with n > 1, beams and forks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvledger.core import Request
from kvledger.runtime import ModelRunner, SeqStep, generate_greedy, native
from kvledger.runtime.engine import Engine
from kvledger.runtime.kernels import NativeKernels, TorchKernels
from kvledger.runtime.sampling import SamplingParams
from kvledger.scheduler import SchedulerConfig


@pytest.fixture(params=["torch", "native"])
def path_kind(request: pytest.FixtureRequest) -> str:
    """Both CPU paths: torch attention and layers, or the native kernels (skipped with KVLEDGER_NATIVE=0)."""
    if request.param == "native" and os.environ.get(native.NATIVE_ENV) == "0":
        pytest.skip("KVLEDGER_NATIVE=0: only the pure-torch paths")
    return request.param


def _runner(path: Path, kind: str, **kw: object) -> ModelRunner:
    kernels = NativeKernels() if kind == "native" else TorchKernels()
    return ModelRunner.from_pretrained(path, backend=kind, kernels=kernels, **kw)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def _hf_generate(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]


def _tiny_ministral(path: Path, window: int, seed: int) -> tuple[Path, torch.nn.Module]:
    """Mistral's interleaved family (Ministral): Mistral's weights, `layer_types` alternating the window."""
    from transformers import MinistralConfig, MinistralForCausalLM

    cfg = MinistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=len(LAYERS),
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                          tie_word_embeddings=False, sliding_window=window, layer_types=LAYERS,
                          attn_implementation="eager", bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = MinistralForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # wide random weights, as the other tiny models (clear greedy margins)
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen) if "norm" in name
                    else 0.15 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module", params=[("qwen2", 5), ("qwen2", 8), ("ministral", 6)], ids=lambda p: f"{p[0]}-w{p[1]}")
def interleaved(request: pytest.FixtureRequest, make_tiny, tmp_path_factory: pytest.TempPathFactory):
    kind, window = request.param
    if kind == "ministral":
        path, hf = _tiny_ministral(tmp_path_factory.mktemp("tiny-ministral"), window, seed=27)
    else:
        path, hf = make_tiny("qwen2", seed=21 + window, num_hidden_layers=len(LAYERS), use_sliding_window=True,
                             sliding_window=window, max_window_layers=0, layer_types=LAYERS,
                             attn_implementation="eager")
    assert hf.config.layer_types == LAYERS and hf.config.sliding_window == window
    return window, path, hf


def test_sixteen_prompts_past_the_window_equal_transformers(interleaved, path_kind: str) -> None:
    window, path, hf = interleaved
    runner = _runner(path, path_kind, num_blocks=256, block_size=4)
    assert runner.config.windows == tuple(window if k == "sliding_attention" else None for k in LAYERS)
    base = _prompts([20], seed=30)[0]
    prompts = _prompts([9, 13, 17, 22, 26, 31, 12, 15], seed=31)
    prompts += [base + p[:k] for p, k in zip(prompts, (1, 2, 3, 4, 5, 6, 7, 8), strict=True)]  # shared 20-token head
    assert len(prompts) == 16 and min(map(len, prompts)) > window
    new = 10
    ledger = runner.new_ledger()
    out = generate_greedy(runner, ledger, prompts, new)
    assert out == [_hf_generate(hf, p, new) for p in prompts]
    assert ledger.stats()["prefix_cache"]["hit_blocks"] > 0  # the shared head was served from the cache


def test_a_fork_past_the_window_equals_transformers(interleaved, path_kind: str) -> None:
    """Fork after prefill; the two branches continue from different first tokens, each exact."""
    _, path, hf = interleaved
    runner = _runner(path, path_kind, num_blocks=64, block_size=4)
    ledger = runner.new_ledger()
    prompt, new = _prompts([14], seed=40)[0], 8
    ledger.admit(Request("a", prompt, new)).raise_for_outcome()
    logits = runner.forward([SeqStep.from_sequence(ledger.sequence("a"), 0)])
    first, second = logits[0].topk(2).indices.tolist()
    ledger.fork("a", "b")
    ledger.append_token("a", first)
    ledger.append_token("b", second)
    runner.store.copy_blocks(ledger.take_copies())
    for _ in range(new - 1):
        seqs = [ledger.sequence(r) for r in ("a", "b")]
        logits = runner.forward([SeqStep.from_sequence(s, s.num_tokens - 1) for s in seqs])
        for rid, token in zip(("a", "b"), logits.argmax(-1).tolist(), strict=True):
            ledger.append_token(rid, token)
        runner.store.copy_blocks(ledger.take_copies())
    for rid, head in (("a", first), ("b", second)):
        assert ledger.sequence(rid).tokens[len(prompt) + 1:] == _hf_generate(hf, prompt + [head], new - 1)


PRESSURE = {
    "recompute": dict(num_blocks=16, scheduler_config=SchedulerConfig(
        policy="incremental", on_growth_failure="preempt", recovery="recompute")),
    "swap": dict(num_blocks=16, host_blocks=96, scheduler_config=SchedulerConfig(
        policy="incremental", on_growth_failure="preempt", recovery="swap")),
}


@pytest.mark.parametrize("mode", list(PRESSURE))
def test_engine_under_preemption_equals_transformers(interleaved, mode: str) -> None:
    """16 requests sharing heads in a 16-block pool: they take turns, growth fails, running requests are preempted
    (recomputed, or swapped to the host and back), and every output still equals transformers'."""
    window, path, hf = interleaved
    heads = _prompts([9, 10], seed=50)
    prompts = [heads[i % 2] + p for i, p in enumerate(_prompts([1 + (3 * i) % 7 for i in range(16)], seed=51))]
    assert min(map(len, prompts)) > window
    new = 10
    engine = Engine.from_model(path, block_size=4, **PRESSURE[mode])
    results = engine.generate(prompts, new)
    assert [r.output for r in results] == [_hf_generate(hf, p, new) for p in prompts]
    assert engine.scheduler.preemptions > 0
    if mode == "swap":
        assert engine.stats.swapped_out_blocks > 0 and engine.stats.swapped_in_blocks > 0
    engine.check()
    assert engine.ledger.usage().active == 0


# ---- through KV cache groups: the window layers read their own group's table (runtime/kv_groups.py) ------------


GROUPED = SchedulerConfig(token_budget=64, prefill_chunk=64)


def _grouped_engine(path: Path, kind: str, **kw: object) -> Engine:
    kw.setdefault("scheduler_config", GROUPED)
    engine = Engine.from_model(path, block_size=4, backend=kind, kv_groups=True, **kw)
    layout = engine.runner.layout
    assert layout is not None and engine.ledger.groups is not None
    assert {g.kind for g in layout.groups} == {"full", "sliding"}
    return engine


def test_sixteen_prompts_through_kv_groups_equal_transformers(interleaved, path_kind: str) -> None:
    """The 16 prompts through the engine with one block table per KV cache group: every sliding layer reads its
    group's table, whose blocks before the window are gone, and every output still equals transformers'. The
    second batch's seven prompts with the shared 20-token head are prefix hits every group serves: the full group
    from its blocks, the sliding groups from the last blocks of the window, kept as cache after they left it."""
    window, path, hf = interleaved
    base = _prompts([20], seed=30)[0]
    prompts = _prompts([9, 13, 17, 22, 26, 31, 12, 15], seed=31)
    prompts += [base + p[:k] for p, k in zip(prompts, (1, 2, 3, 4, 5, 6, 7, 8), strict=True)]
    new = 10
    engine = _grouped_engine(path, path_kind, num_blocks=256)
    results = engine.generate(prompts[:9], new) + engine.generate(prompts[9:], new)
    assert [r.output for r in results] == [_hf_generate(hf, p, new) for p in prompts]
    engine.check()
    assert engine.ledger.stats()["prefix_cache"]["hit_blocks"] >= 7 * 5  # the head's 5 blocks, 7 times
    assert engine.ledger.usage().active == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_under_preemption_through_kv_groups_equals_transformers(interleaved, mode: str) -> None:
    """16 requests in a small pool of group pages: growth fails and running requests are preempted -- recomputed,
    or swapped out and back with every group's blocks (a sliding group's window blocks only) -- and every output
    equals transformers'."""
    window, path, hf = interleaved
    heads = _prompts([9, 10], seed=50)
    prompts = [heads[i % 2] + p for i, p in enumerate(_prompts([1 + (3 * i) % 7 for i in range(16)], seed=51))]
    new = 30
    cfg = SchedulerConfig(policy="incremental", on_growth_failure="preempt", recovery=mode, token_budget=16,
                          prefill_chunk=16)
    engine = _grouped_engine(path, "torch", num_blocks=30, host_blocks=96, scheduler_config=cfg)
    results = engine.generate(prompts, new)
    assert [r.output for r in results] == [_hf_generate(hf, p, new) for p in prompts]
    assert engine.scheduler.preemptions > 0
    if mode == "swap":
        assert engine.stats.swapped_out_blocks > 0 and engine.stats.swapped_in_blocks > 0
    else:
        assert engine.stats.swapped_out_blocks == 0
    engine.check()
    assert engine.ledger.usage().active == 0


def test_a_long_generation_gives_the_window_groups_blocks_back_while_it_runs(interleaved) -> None:
    """What a user sees: over a 120-token generation the full-attention group's blocks grow with the sequence but
    each sliding group holds only the few blocks its window covers, so the pool in use is well below what the same
    sequence holds with every layer global -- measured while the engine runs, step by step."""
    window, path, hf = interleaved
    prompt, new = _prompts([24], seed=60)[0], 120
    engine = _grouped_engine(path, "torch", num_blocks=256)
    groups = engine.runner.layout.groups
    page = engine.spec.block_bytes  # one group's page: `size` layers
    seen: list[tuple[int, list[int]]] = []

    def sample(_: object) -> None:
        seq = engine.ledger.sequences()
        if seq:
            seen.append((len(engine.ledger.sequence(seq[0]).table.blocks), engine.ledger.groups.held_by_group()))

    engine.step_observers.append(sample)
    [result] = engine.generate([prompt], new)
    assert result.output == _hf_generate(hf, prompt, new)
    bound = -(-(window - 1 + 1) // 4) + 1  # a decode step's window: ceil((W - 1 + 1) / block) + 1 blocks
    full_blocks, held = seen[-1]
    assert full_blocks == -(-(len(prompt) + new - 1) // 4)  # 36 blocks: the full group keeps every one
    assert all(h <= bound for h in held) and len(held) == len(groups) - 1
    in_use = (full_blocks + sum(held)) * page
    uniform = full_blocks * engine.runner.config.num_layers * engine.spec.layer_block_bytes
    assert in_use < 0.6 * uniform  # 2 of 5 layers are global: the window layers' old pages went back
    # ... and not only at the end: once past the window, the sliding groups never held more than their bound.
    assert max(h for _, hs in seen[len(seen) // 4:] for h in hs) <= bound


def _branch_prompts(window: int) -> list[list[int]]:
    heads = _prompts([11], seed=70)
    prompts = [heads[0] + p if i % 2 else p for i, p in enumerate(_prompts([9, 10, 12, 14, 11, 10, 15, 13], seed=71))]
    assert min(map(len, prompts)) > window
    return prompts


def test_n_greedy_branches_through_kv_groups_equal_transformers(interleaved, path_kind: str) -> None:
    """8 prompts with n=3 greedy branches through the KV cache groups: the branches share the full group's prompt
    blocks (its partial tail copied on write) and each writes its own window; every branch's output equals
    transformers' greedy run of its prompt alone."""
    window, path, hf = interleaved
    prompts = _branch_prompts(window)
    engine = _grouped_engine(path, path_kind, num_blocks=256)
    results = engine.generate(prompts, 10, SamplingParams(n=3))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.outputs == [_hf_generate(hf, prompt, 10)] * 3
    assert engine.ledger.stats()["lifetimes"]["forks"] >= 16  # two branches forked per request
    engine.check()
    assert engine.ledger.usage().active == 0


@pytest.mark.parametrize("mode", ["roomy", "recompute", "swap"])
def test_seeded_branches_and_beams_through_kv_groups_equal_the_uniform_pool(interleaved, mode: str) -> None:
    """Seeded sampling (branch i draws from (seed, i, position)) and beam search (the beams fork after every step:
    each group's window blocks shared, a partial tail copied on write) through the KV cache groups give exactly the
    uniform pool's outputs (exact against transformers in the tests above and in test_engine.py) -- roomy with
    n=3 / width 3, and with n=2 / width 2 in a pool of 52 group pages where families are preempted whole and
    recomputed, or swapped out with every branch's group blocks and back."""
    window, path, hf = interleaved
    prompts = _branch_prompts(window)
    if mode == "roomy":
        kw: dict = dict(num_blocks=256)
        prompts, width, new = prompts[:6], 3, 12
    else:
        kw = dict(num_blocks=52, host_blocks=200, scheduler_config=SchedulerConfig(
            policy="incremental", on_growth_failure="preempt", recovery=mode, token_budget=16, prefill_chunk=16))
        width, new = 2, 30
    preempted = 0
    for sampling in (SamplingParams(temperature=1.0, seed=11, n=width), SamplingParams(beam_width=width)):
        grouped = _grouped_engine(path, "torch", **kw)
        got = grouped.generate(prompts, new, sampling)
        uniform = Engine.from_model(path, block_size=4, backend="torch", num_blocks=256).generate(prompts, new,
                                                                                                  sampling)
        assert [r.outputs for r in got] == [r.outputs for r in uniform]
        if sampling.beam:
            # (summed fp32 log-probabilities of ~80: a recompute's chunking moves the last bits)
            assert [x for r in got for x in r.scores] == pytest.approx([x for r in uniform for x in r.scores],
                                                                        rel=1e-6)
            assert grouped.ledger.stats()["lifetimes"]["forks"] > 0
        preempted += grouped.scheduler.preemptions
        if mode == "swap":
            assert (grouped.stats.swapped_out_blocks > 0) == (grouped.scheduler.preemptions > 0)
        grouped.check()
        assert grouped.ledger.usage().active == 0
    assert (preempted > 0) == (mode != "roomy")


def test_a_fork_through_kv_groups_equals_transformers(interleaved, path_kind: str) -> None:
    """A fork after k generated tokens on the KV cache groups: the two branches continue from different forced
    tokens (the best and the second best), each through its own windows after the shared ones, and each equals
    transformers' greedy run of its own sequence."""
    window, path, hf = interleaved
    engine = _grouped_engine(path, path_kind, num_blocks=128)
    runner, ledger = engine.runner, engine.ledger
    bs = ledger.block_size
    done: dict[str, int] = {"a": 0}  # positions whose KV each sequence has written

    def step(rids: list[str]) -> torch.Tensor:
        steps = []
        for rid in rids:
            seq = ledger.sequence(rid)
            start, end = done[rid], seq.num_tokens
            tables = ledger.group_tables(rid, start, end)
            steps.append(SeqStep(seq.tokens[start:end], start, list(tables[0]),
                                 [tables[0][p // bs] * bs + p % bs for p in range(start, end)], tables))
        runner.store.copy_blocks(ledger.take_copies())
        logits = runner.forward(steps)
        for rid in rids:
            done[rid] = ledger.sequence(rid).num_tokens
            ledger.mark_computed(rid, done[rid])
        return logits

    prompt, k, new = _prompts([13], seed=80)[0], 5, 8
    ledger.admit(Request("a", prompt, k + new)).raise_for_outcome()
    for _ in range(k):
        ledger.append_token("a", int(step(["a"])[0].argmax()))
    logits = step(["a"])[0]
    first, second = logits.topk(2).indices.tolist()
    ledger.fork("a", "b")
    done["b"] = done["a"]
    ledger.check()
    assert ledger.groups.seqs["a"].tables == ledger.groups.seqs["b"].tables  # every group's blocks shared
    ledger.append_token("a", first)
    ledger.append_token("b", second)
    for _ in range(new - 1):
        logits = step(["a", "b"])
        for rid, token in zip(("a", "b"), logits.argmax(-1).tolist(), strict=True):
            ledger.append_token(rid, token)
        ledger.check()
    assert ledger.counters.copies > 0
    head = ledger.sequence("a").tokens[:len(prompt) + k]
    for rid, forced in (("a", first), ("b", second)):
        assert ledger.sequence(rid).tokens[len(head) + 1:] == _hf_generate(hf, head + [forced], new - 1)
    ledger.release("a")
    ledger.release("b")
    ledger.check()
    assert ledger.usage().active == 0
