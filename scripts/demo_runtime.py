"""The runtime part of `make demo`: real text from the bundled SmolLM2-135M-Instruct, with every KV
block accounted for by the ledger.

Five chat requests share one system prompt (prefix sharing: its full blocks are stored once), one of
them samples three answers at once (n = 3: forked branches share the prompt, copy-on-write on the
partial tail), and the pool is deliberately too small for all of them to grow at once under the
incremental policy, so the scheduler preempts a request (recompute) and resumes it later with exactly
the tokens it would have produced anyway. The ledger is printed at the end.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # shared cores: spinning OpenMP threads starve each other
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from kvledger.runtime.engine import Engine, resolve_model  # noqa: E402
from kvledger.runtime.sampling import SamplingParams  # noqa: E402
from kvledger.scheduler import SchedulerConfig  # noqa: E402

SYSTEM = ("You are a helpful assistant for inference engineers. Answer in one short sentence, "
          "plainly, without lists.")
QUESTIONS = [
    "What is the capital of France?",
    "Why do language models cache keys and values?",
    "What does a GPU do well?",
    "Name one planet in the solar system.",
]
SAMPLED = "Suggest a name for a cat."
POOL_BLOCKS = 14  # the prompts fit; their growth does not, all at once


def main() -> int:
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    t0 = time.perf_counter()
    ckpt = resolve_model("smollm2-135m")  # converts the GGUF once into the user cache, and says so
    tok = AutoTokenizer.from_pretrained(str(ckpt.path))
    config = SchedulerConfig(policy="incremental", on_growth_failure="preempt", victim="latest",
                             recovery="recompute", watermark=0.0)
    engine = Engine.from_model(ckpt, num_blocks=POOL_BLOCKS, block_size=16, scheduler_config=config)

    def chat(question: str) -> list[int]:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tok(text, add_special_tokens=False).input_ids)

    stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
    # The greedy answers run their whole 32-token allowance (no stop token), so their growth -- and the
    # preemption it forces -- does not depend on where the model happens to stop; they are shown up to
    # their first end-of-text token.
    handles = [engine.submit(chat(q), 32, SamplingParams(), request_id=f"q{i}") for i, q in enumerate(QUESTIONS)]
    sampled = engine.submit(chat(SAMPLED), 16, SamplingParams(temperature=0.8, top_p=0.95, seed=5, n=3),
                            stop_token_ids=stop, request_id="cat")
    prompt_len = len(chat(QUESTIONS[0]))
    print(f"model: {ckpt.path.name}; {len(QUESTIONS) + 1} requests, prompts ~{prompt_len} tokens sharing a "
          f"{len(chat(''))}-token chat prefix; pool {POOL_BLOCKS} blocks of 16 tokens "
          f"({engine.spec.block_bytes // 1024} KiB each)")
    engine.run_until_idle()
    for q, h in zip(QUESTIONS, handles, strict=True):
        out = h.result().output
        if stop and stop[0] in out:
            out = out[: out.index(stop[0])]
        print(f"\n> {q}\n  {tok.decode(out, skip_special_tokens=True).strip()}")
    r = sampled.result()
    print(f"\n> {SAMPLED} (n=3, seed 5)")
    for branch in r.outputs:
        print(f"  - {tok.decode(branch, skip_special_tokens=True).strip()}")

    s = engine.summary()
    u, life = s["usage"], s["lifetimes"]
    engine.check()
    print(f"\nledger: {u['total']} blocks = {u['free']} free + {u['active']} active + {u['retained']} retained "
          f"(cached prefixes, evictable); {u['promised']} promised")
    print(f"  prefix hit rate {s['prefix_hit_rate']:.0%}; preemptions {s['preemptions']}; forks {life['forks']}; "
          f"copy-on-write copies {life['copies']}; evictions {life['evictions']}; leases outstanding "
          f"{engine.ledger.outstanding_leases()}")
    print(f"  conservation checked: free + active + retained == total, nothing promised or leased after the run "
          f"({time.perf_counter() - t0:.0f} s)")
    if s["preemptions"] < 1:
        print("  note: no preemption happened this time (the pool was big enough for this run)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
