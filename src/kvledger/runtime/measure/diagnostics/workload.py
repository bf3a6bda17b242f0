"""Workloads for a diagnosis: requests that arrive at given engine steps, so a run is deterministic.

Arrivals are counted in engine steps, not seconds: the same workload gives the same steps, the same
request events and the same workload hash on any machine. The built-in workload has waves of requests of
varied prompt and output lengths in two trust groups, some sharing a prefix, so a run admits, grows,
finishes and returns blocks to the free list while later waves are still coming.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ....errors import ConfigError


@dataclass(frozen=True, slots=True)
class WorkItem:
    arrival_step: int
    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    trust_group: str = "default"


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    items: tuple[WorkItem, ...]

    def __post_init__(self) -> None:
        if not self.items:
            raise ConfigError(f"workload {self.name!r} has no requests")
        ids = [i.request_id for i in self.items]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"workload {self.name!r} repeats a request id")

    @property
    def digest(self) -> str:
        """SHA-256 of the canonical request list: equal workloads, equal hashes."""
        rows = [[i.arrival_step, i.request_id, list(i.prompt), i.max_new_tokens, i.trust_group] for i in self.items]
        return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()

    def summary(self) -> dict[str, Any]:
        prompts = [len(i.prompt) for i in self.items]
        outs = [i.max_new_tokens for i in self.items]
        return {"name": self.name, "requests": len(self.items), "sha256": self.digest,
                "prompt_tokens": {"min": min(prompts), "max": max(prompts), "total": sum(prompts)},
                "max_new_tokens": {"min": min(outs), "max": max(outs), "total": sum(outs)},
                "trust_groups": sorted({i.trust_group for i in self.items}),
                "last_arrival_step": max(i.arrival_step for i in self.items)}


def default_workload(requests: int = 12, *, vocab: int = 49152, seed: int = 0, max_prompt: int = 320,
                     max_new: int = 40, wave: int = 4, wave_gap: int = 12) -> Workload:
    """``requests`` requests in waves of ``wave`` every ``wave_gap`` steps; prompts of 16..``max_prompt`` tokens
    (every third one longer than 64 tokens starts with a shared 64-token prefix), outputs of 8..``max_new`` tokens,
    alternating between trust groups ``tenant-a`` and ``tenant-b``. Token ids are pseudo-random in ``[16, vocab)``."""
    if requests < 1 or wave < 1 or wave_gap < 0 or max_prompt < 16 or max_new < 1:
        raise ConfigError("the default workload needs requests >= 1, wave >= 1, max_prompt >= 16, max_new >= 1")
    rng = random.Random(seed)
    shared = tuple(rng.randrange(16, vocab) for _ in range(64))
    items = []
    for i in range(requests):
        length = rng.randint(16, max_prompt)
        body = tuple(rng.randrange(16, vocab) for _ in range(length))
        prompt = shared + body[:length - 64] if i % 3 == 0 and length > 64 else body
        items.append(WorkItem((i // wave) * wave_gap, f"r{i}", prompt, rng.randint(min(8, max_new), max_new),
                              "tenant-a" if i % 2 == 0 else "tenant-b"))
    return Workload(f"default-{requests}", tuple(items))


def run_workload(engine: Any, workload: Workload, *, max_steps: int = 100_000,
                 on_step: Callable[[int], None] | None = None) -> list[Any]:
    """Submit each request when the engine reaches its arrival step (greedy sampling), step until every
    request has finished, and return the results in workload order."""
    from ...sampling import SamplingParams

    pending = sorted(workload.items, key=lambda i: i.arrival_step)
    handles = []
    steps = 0
    greedy = SamplingParams()
    while pending or engine.has_work():
        while pending and pending[0].arrival_step <= steps:
            item = pending.pop(0)
            handles.append(engine.submit(list(item.prompt), item.max_new_tokens, greedy,
                                         request_id=item.request_id, trust_group=item.trust_group))
        engine.step()
        steps += 1
        if on_step is not None:
            on_step(steps)
        if steps >= max_steps:
            raise ConfigError(f"the workload did not finish within {max_steps} steps")
    return [h.result() for h in handles]


def workload_from_lengths(name: str, rows: Sequence[tuple[int, int, int, str, Sequence[int] | None]], *,
                          vocab: int, seed: int = 0) -> Workload:
    """A workload from ``(arrival_step, prompt_len, max_new, trust_group, block_keys)`` rows (a trace
    slice): prompts are pseudo-random ids, equal ``block_keys`` prefixes give equal token prefixes in
    16-token chunks so the prefix cache sees the trace's sharing."""
    items = []
    for i, (step, plen, out, group, keys) in enumerate(rows):
        if plen < 1 or out < 1:
            raise ConfigError(f"request {i}: prompt and output lengths must be >= 1")
        tokens: list[int] = []
        for key in keys or ():
            if len(tokens) >= plen:
                break
            chunk = random.Random(f"{seed}:{key}")
            tokens.extend(chunk.randrange(16, vocab) for _ in range(16))
        rng = random.Random(f"{seed}:{name}:{i}")
        while len(tokens) < plen:
            tokens.append(rng.randrange(16, vocab))
        items.append(WorkItem(step, f"t{i}", tuple(tokens[:plen]), out, group))
    return Workload(name, tuple(items))


__all__ = ["WorkItem", "Workload", "default_workload", "run_workload", "workload_from_lengths"]
