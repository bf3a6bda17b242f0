"""The eviction study of issue 38: every registered eviction policy against the offline references, per
trace and cache size, plus TTFT at a fixed load in the simulator. ``benchmarks/eviction_study.py`` is the
one command; docs/studies.md section (e) has the figures.

Cache-level figures come from the model of :mod:`kvledger.sim.optimal` (requests one at a time, the real
ledger evicting with each policy; Belady and the cost-aware bound on the same access sequence). Hit rate
is hit prompt tokens over all prompt tokens; saved prefill time sums, over requests, the cost model's
prefill time of the hit prefix. TTFT comes from the full simulator (the real scheduler, concurrency, the
H100's step times) with the same policy.

Traces without prefix information (Azure's, ShareGPT's length tables) get a stated, seeded sharing model
(:func:`with_conversations`): a new conversation opens with one of a few system prompts (Zipf
popularity); a follow-up extends a recent conversation's prompt and answer with the request's own
length of new text. Mooncake's hash ids already carry its sharing.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..core.eviction import policy_names
from ..errors import ConfigError
from ..workloads import SimRequest
from ..workloads.requests import Prompt
from .optimal import Accesses, accesses_from_requests, belady, cost_bound, replay_policy


@dataclass(frozen=True, slots=True)
class SharingModel:
    """How :func:`with_conversations` shares prefixes: ``followup`` of the requests continue one of the
    ``window`` most recent conversations; new ones open with one of ``system_prompts`` prompts of
    ``system_tokens`` tokens, the k-th most popular drawn with weight 1/k; a conversation longer than
    ``max_tokens`` is not continued."""

    followup: float = 0.5
    window: int = 32
    system_prompts: int = 8
    system_tokens: int = 1024
    max_tokens: int = 32768
    seed: int = 0


FRESH_BASE = 1 << 31  # fresh token ids (below the 2**32 limit), one run per stretch, above the traces' own


def with_conversations(requests: Sequence[SimRequest], model: SharingModel = SharingModel()) -> list[SimRequest]:
    """``requests`` with prompts rebuilt by the sharing model (lengths grow by the conversation's history;
    arrivals, outputs and ids kept)."""
    rng = random.Random(model.seed)
    weights = [1.0 / (k + 1) for k in range(model.system_prompts)]
    systems = [((FRESH_BASE - (k + 1) * model.system_tokens), model.system_tokens) for k in range(model.system_prompts)]
    nxt = FRESH_BASE
    open_convs: list[list[tuple[int, int]]] = []  # runs of each recent conversation (prompt + answer)
    out = []
    for r in requests:
        runs: list[tuple[int, int]]
        if open_convs and rng.random() < model.followup:
            i = rng.randrange(len(open_convs))
            runs = list(open_convs.pop(i))
        else:
            runs = [systems[rng.choices(range(model.system_prompts), weights)[0]]]
        runs.append((nxt, r.prompt_len))
        nxt += r.prompt_len
        prompt = Prompt(runs)
        out.append(replace(r, prompt_tokens=prompt))
        history = runs + [(nxt, max(r.output_len, 1))]
        nxt += max(r.output_len, 1)
        if sum(n for _, n in history) <= model.max_tokens:
            open_convs.append(history)
            if len(open_convs) > model.window:
                open_convs.pop(0)
    return out


@dataclass(slots=True)
class SizeRow:
    """One cache size: each policy's and each reference's hit rate and saved prefill time."""

    capacity: int
    hit_rate: dict[str, float] = field(default_factory=dict)
    saved_s: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class TraceStudy:
    name: str
    block_size: int
    requests: int
    dropped: int
    prompt_tokens: int
    unbounded_hit_rate: float
    rows: list[SizeRow]
    ttft: dict[str, dict[str, float]] = field(default_factory=dict)  # policy -> p50/p90 seconds, hit rate
    ttft_setup: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "block_size": self.block_size, "requests": self.requests,
                "dropped": self.dropped, "prompt_tokens": self.prompt_tokens,
                "unbounded_hit_rate": self.unbounded_hit_rate,
                "sizes": [{"capacity": r.capacity, "hit_rate": r.hit_rate, "saved_s": r.saved_s} for r in self.rows],
                "ttft": self.ttft, "ttft_setup": self.ttft_setup}


def _unbounded(acc: Accesses) -> int:
    seen: set[Any] = set()
    hits = 0
    for chain in acc.chains:
        h = 0
        while h < len(chain) and chain[h] in seen:
            h += 1
        hits += h
        seen.update(chain)
    return hits * acc.block_size


def study_trace(name: str, requests: Sequence[SimRequest], block_size: int, capacities: Sequence[int],
                block_cost: Callable[[int], float], policies: Sequence[str] | None = None,
                progress: Callable[[str], None] | None = None) -> TraceStudy:
    """Cache-level figures of one trace: every policy and both references at every capacity. Requests
    whose prompt (with one output token) does not fit the smallest capacity are dropped (counted)."""
    policies = list(policies or policy_names())
    smallest = min(capacities)
    kept = [r for r in requests if -(-(r.prompt_len + 1) // block_size) <= smallest]
    if not kept:
        raise ConfigError(f"{name}: no request fits a cache of {smallest} blocks")
    acc = accesses_from_requests(kept, block_size)
    longest = max(len(c) for c in acc.chains)
    costs = [block_cost(d) for d in range(longest)]
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    total = acc.total_tokens
    study = TraceStudy(name, block_size, len(kept), len(requests) - len(kept), total, _unbounded(acc) / total, [])
    prompts = [(r.prompt_tokens.tolist(), r.trust_group) for r in kept]
    bounds = {b.capacity: b for b in cost_bound(acc, capacities, costs)}
    for cap in sorted(capacities):
        row = SizeRow(cap)
        best = belady(acc, cap)
        row.hit_rate["belady"] = best.hit_rate(acc)
        row.saved_s["belady"] = sum(prefix[h] for h in best.hits)
        bound = bounds[cap]
        row.saved_s["bound_upper"] = bound.upper
        row.saved_s["bound_lower"] = max(bound.lower, row.saved_s["belady"])
        for policy in policies:
            if progress is not None:
                progress(f"{name}: {cap} blocks, {policy}")
            res = replay_policy(prompts, block_size, cap, policy, block_cost=block_cost)
            row.hit_rate[policy] = res.hit_rate(acc)
            row.saved_s[policy] = sum(prefix[h] for h in res.hits)
            row.saved_s["bound_lower"] = max(row.saved_s["bound_lower"], row.saved_s[policy])
        study.rows.append(row)
    return study


def verdict(study: TraceStudy, policy: str, hit_share: float = 0.95, saved_share: float = 0.90
            ) -> list[dict[str, Any]]:
    """Per capacity: the policy's share of Belady's hit rate and of the bound's saved time (upper and
    lower), and whether it meets the targets (against the upper bound, the conservative reading)."""
    out = []
    for row in study.rows:
        b = row.hit_rate["belady"]
        hit = row.hit_rate[policy] / b if b else 1.0
        up, low = row.saved_s["bound_upper"], row.saved_s["bound_lower"]
        saved = row.saved_s[policy]
        out.append({"capacity": row.capacity, "hit_share": hit,
                    "saved_share_upper": saved / up if up else 1.0,
                    "saved_share_lower": saved / low if low else 1.0,
                    "meets": hit >= hit_share and (saved / up if up else 1.0) >= saved_share})
    return out


def plot_study(study: TraceStudy, path: str) -> None:
    """Hit rate and saved prefill time against cache size: one line per policy, the references dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = [r.capacity for r in study.rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    names = [k for k in study.rows[0].hit_rate if k != "belady"]
    for n in names:
        ax1.plot(caps, [100 * r.hit_rate[n] for r in study.rows], marker="o", ms=3, label=n)
        ax2.plot(caps, [r.saved_s[n] for r in study.rows], marker="o", ms=3, label=n)
    ax1.plot(caps, [100 * r.hit_rate["belady"] for r in study.rows], "k--", lw=2, label="Belady (optimum)")
    ax1.axhline(100 * study.unbounded_hit_rate, color="grey", ls=":", label="unbounded cache")
    ax2.plot(caps, [r.saved_s["belady"] for r in study.rows], "k--", lw=2, label="Belady's schedule")
    ax2.fill_between(caps, [r.saved_s["bound_lower"] for r in study.rows],
                     [r.saved_s["bound_upper"] for r in study.rows], color="grey", alpha=0.25,
                     label="cost-aware optimum lies here")
    for ax, label in ((ax1, "hit rate (% of prompt tokens)"), (ax2, "saved prefill time (s)")):
        ax.set_xscale("log")
        ax.set_xlabel(f"cache size ({study.block_size}-token blocks)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    fig.suptitle(f"{study.name}: {study.requests} requests, one at a time (eviction study, issue 38)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["SharingModel", "SizeRow", "TraceStudy", "plot_study", "study_trace", "verdict", "with_conversations"]
