"""The lab's view of a hybrid pool: global (full-attention) blocks against window blocks, step by step, on the real
`GroupLedger`, beside what a uniform pool would hold for the same requests.

Requests arrive together and are served first come, first served: a step gives every running request a chunk of
its prompt (``step_tokens``) or one decode token; a request that does not fit waits. Each step's snapshot counts the
blocks the full groups and the sliding groups hold, the retained cache, the free blocks and the promises, with a
uniform pool's blocks (every layer, every token) for the same progress in the same block unit.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..core.groups import GroupLedger, KVCacheGroup
from ..core.sizing.hybrid import group_layout

MAX_STEPS = 600  # bounds the work of one call (every accepted input answers within about a second)


def _int(lo: int, hi: int) -> Any:
    return Annotated[int, Field(strict=True, ge=lo, le=hi)]


class HybridInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    full_layers: _int(1, 64) = 1  # type: ignore[valid-type]
    sliding_layers: _int(0, 128) = 5  # type: ignore[valid-type]
    window: _int(1, 4096) = 32  # type: ignore[valid-type]
    block_size: _int(1, 64) = 8  # type: ignore[valid-type]
    step_tokens: _int(1, 4096) = 32  # type: ignore[valid-type]
    prompt: _int(1, 4096) = 96  # type: ignore[valid-type]
    max_new: _int(1, 512) = 64  # type: ignore[valid-type]
    requests: _int(1, 16) = 4  # type: ignore[valid-type]
    pool_blocks: _int(1, 4096) = 192  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _bounded(self) -> HybridInput:
        steps = self.requests * (-(-self.prompt // self.step_tokens) + self.max_new)
        if steps > MAX_STEPS:
            raise ValueError(f"{self.requests} requests of {self.prompt} + {self.max_new} tokens take up to {steps} "
                             f"steps; the view runs at most {MAX_STEPS} (fewer requests or tokens, or a larger step)")
        return self


def hybrid_view(inp: HybridInput) -> dict[str, Any]:
    """Run the requests on the hybrid pool; one snapshot per step."""
    size, layout = group_layout(inp.full_layers, inp.sliding_layers)
    groups = [KVCacheGroup(kind, n, inp.window if kind == "sliding" else None, 1) for kind, n in layout]
    ledger = GroupLedger(inp.pool_blocks, inp.block_size, groups, step_tokens=inp.step_tokens)
    bs, layers = inp.block_size, inp.full_layers + inp.sliding_layers
    prompts = {f"R{i}": [1000 * (i + 1) + t for t in range(inp.prompt)] for i in range(inp.requests)}
    waiting = list(prompts)
    done: list[str] = []
    snaps: list[dict[str, Any]] = []
    never = ""
    for step in range(MAX_STEPS + 1):
        while waiting:
            d = ledger.admit(waiting[0], prompts[waiting[0]], inp.max_new)
            if d.outcome.value == "never":
                never = f"{waiting[0]}: {d.reason}"
                waiting.clear()
                break
            if not d.admitted:
                break
            waiting.pop(0)
        running = list(ledger.requests)
        if not running:
            break
        for rid in running:
            req = ledger.requests[rid]
            n = 1 if req.computed >= req.prompt_len else min(inp.step_tokens, req.prompt_len - req.computed)
            ledger.schedule(rid, n)
            ledger.confirm(rid, 7 if req.computed + n >= len(req.tokens) else None)
            if req.computed >= req.max_tokens - 1:
                ledger.release(rid)
                done.append(rid)
        usage = ledger.usage()
        held = {"full": 0, "sliding": 0}
        for g, group in enumerate(ledger.groups):
            held[group.kind] += usage["held_by_group"][g]  # type: ignore[index]
        computed = sum(-(-r.computed // bs) for r in ledger.requests.values())
        snaps.append({"step": step + 1, "full": held["full"], "sliding": held["sliding"],
                      "retained": usage["retained"], "free": usage["free"], "promised": usage["promised"],
                      # A uniform pool's blocks of `group size` layer pages each, for the same tokens.
                      "uniform": -(-computed * layers // size), "running": len(ledger.requests),
                      "waiting": len(waiting), "done": len(done)})
    ledger.check()
    peak = max(snaps, key=lambda s: s["full"] + s["sliding"]) if snaps else None
    return {"groups": [{"kind": g.kind, "layers": g.layers, "window": g.window} for g in groups],
            "group_size": size, "padding_layers": len(layout) * size - layers, "pool_blocks": inp.pool_blocks,
            "steps": snaps, "never": never, "finished": done,
            "peak": peak, "peak_uniform": max((s["uniform"] for s in snaps), default=0)}


__all__ = ["HybridInput", "hybrid_view"]
