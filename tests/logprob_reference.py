"""Teacher-forced references for log-probabilities, through the runtime on a fresh runner over an engine's
weights, with a float64 log-softmax and no code shared with the serving path's logprobs: :func:`stepwise`
(the prompt's prefill, then one decode step per forced token: the step shapes the engine ran, so equal to
its logprobs within 1e-5) and :func:`teacher_forced` (one prefill over the whole sequence, its last
layer read by a hook: a different GEMM blocking, fp32 noise of up to ~3e-5 in a decode step's logprob).
"""

from __future__ import annotations

from typing import Any

import torch

from kvledger.runtime.model import ModelRunner, SeqStep


def _slots(table: list[int], start: int, end: int, bs: int) -> list[int]:
    return [table[p // bs] * bs + p % bs for p in range(start, end)]


@torch.inference_mode()
def stepwise(engine: Any, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """``[len(forced), vocab]`` float64 log-softmax before each forced token: the prompt's prefill, then
    one decode step per forced token (teacher forcing with the engine's own step shapes)."""
    bs = engine.spec.block_size
    blocks = -(-(len(prompt) + len(forced)) // bs) + 1
    runner = ModelRunner(engine.runner.model, engine.spec, blocks)
    table = list(range(blocks))
    rows = [runner.forward([SeqStep(prompt, 0, table, _slots(table, 0, len(prompt), bs))])[0]]
    for i, t in enumerate(forced[:-1]):
        p = len(prompt) + i
        rows.append(runner.forward([SeqStep([t], p, table, _slots(table, p, p + 1, bs))])[0])
    return torch.log_softmax(torch.stack(rows).double(), dim=-1)


@torch.inference_mode()
def teacher_forced(engine: Any, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]`` float64 log-softmax at every position of one prefill over ``ids``."""
    model, spec = engine.runner.model, engine.spec
    bs = spec.block_size
    blocks = -(-len(ids) // bs) + 1
    runner = ModelRunner(model, spec, blocks)
    table = list(range(blocks))
    captured: dict[str, torch.Tensor] = {}

    def hook(_mod: Any, _inp: Any, out: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, pending = out
        captured["h"] = (x + pending).clone() if pending is not None else x.clone()

    handle = model.layers[-1].register_forward_hook(hook)
    try:
        runner.forward([SeqStep(ids, 0, table, _slots(table, 0, len(ids), bs))])
    finally:
        handle.remove()
    logits = model.lm_head(model.norm(captured["h"])).float()
    return torch.log_softmax(logits.double(), dim=-1)
