"""Token selection: greedy, seeded temperature / top-k / top-p sampling, and beam candidates.

Determinism. A sampled token depends only on the logits of its position and on the key
``(seed, branch, position)``: the uniform number that picks the token is a counter-based hash of that
key (:func:`uniform`), never the state of a shared generator. So a request sampled alone, in a batch
of any size, or preempted (recomputed or swapped) and resumed produces the same tokens, and branch
``i`` of an ``n = 4`` request equals a single-branch run given branch index ``i`` with the same seed.
The filter (temperature, top-k, top-p) is applied to one row in float64 after sorting it, so it does
not depend on the batch either.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core import checks
from ..errors import ConfigError

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens.

    ``temperature == 0`` is greedy (argmax; ``top_k``/``top_p``/``seed`` are then irrelevant).
    ``n`` parallel samples share the prompt's KV blocks (forks with copy-on-write tails); branch ``i``
    draws from ``(seed, i, position)``. ``beam_width > 1`` is beam search: deterministic, ``n`` and the
    sampling knobs must stay at their defaults. ``seed=None`` draws a seed at submission (reported in
    the result, so the run can be repeated).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    n: int = 1
    beam_width: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        for name in ("top_k", "n", "beam_width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "top_k" else 1):
                raise ConfigError(f"{name} must be an integer >= {0 if name == 'top_k' else 1}, got {value!r}")
        if self.seed is not None:
            checks.count(self.seed, "seed", minimum=None)
        if self.beam_width > 1 and (self.n != 1 or self.temperature != 0):
            raise ConfigError("beam search is deterministic: use it with n=1 and temperature=0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 and self.beam_width == 1

    @property
    def beam(self) -> bool:
        return self.beam_width > 1


def _mix(x: int) -> int:
    """SplitMix64's finaliser: a bijective 64-bit mix with full avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, branch: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on ``(seed, branch, position)``."""
    h = _mix(seed & _MASK64)
    h = _mix(h ^ (branch & _MASK64))
    h = _mix(h ^ (position & _MASK64))
    return (h >> 11) * (1.0 / (1 << 53))


def filtered_distribution(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_ids, probs)`` of the tokens that survive temperature, top-k and top-p, most likely
    first (ties by token id), probabilities in float64 summing to 1."""
    x = logits.detach().to(torch.float64) / params.temperature
    vocab = x.shape[-1]
    if params.top_k and params.top_k < vocab:
        # topk's order among equal values is unspecified: keep the top-k set, then sort it stably.
        vals, idx = torch.topk(x, params.top_k)
        order = torch.sort(idx).indices
        vals, idx = vals[order], idx[order]
        vals, perm = torch.sort(vals, descending=True, stable=True)
        idx = idx[perm]
    else:
        vals, idx = torch.sort(x, descending=True, stable=True)
    probs = torch.softmax(vals, dim=-1)
    if params.top_p < 1.0:
        cum = torch.cumsum(probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the most likely token).
        keep = int(torch.searchsorted(cum, torch.tensor([params.top_p], dtype=torch.float64)).item()) + 1
        keep = min(max(keep, 1), probs.numel())
        probs, idx = probs[:keep], idx[:keep]
        probs = probs / probs.sum()
    return idx, probs


def sample_token(logits: torch.Tensor, params: SamplingParams, seed: int, branch: int, position: int) -> int:
    """The token at ``position`` of branch ``branch`` from one row of logits ``[vocab]``."""
    if params.temperature == 0:
        return int(torch.argmax(logits).item())
    idx, probs = filtered_distribution(logits, params)
    u = uniform(seed, branch, position)
    cum = torch.cumsum(probs, dim=-1)
    j = int(torch.searchsorted(cum, torch.tensor([u], dtype=torch.float64), right=True).item())
    return int(idx[min(j, idx.numel() - 1)].item())


def sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], keys: Sequence[tuple[int, int, int]],
) -> list[int]:
    """One token per row of ``logits`` ``[rows, vocab]``; ``keys[i]`` is row i's (seed, branch,
    position). Greedy rows share one argmax call."""
    out = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    if greedy:
        rows = logits if len(greedy) == len(params) else logits[torch.tensor(greedy)]
        for i, token in zip(greedy, torch.argmax(rows, dim=-1).tolist(), strict=True):
            out[i] = int(token)
    for i, p in enumerate(params):
        if p.temperature != 0:
            out[i] = sample_token(logits[i], p, *keys[i])
    return out


def beam_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities a beam search scores with: log-softmax in float64 (rows or one row)."""
    return torch.log_softmax(logits.detach().to(torch.float64), dim=-1)


def top_candidates(logprobs: torch.Tensor, k: int) -> list[tuple[float, int]]:
    """The ``k`` best ``(logprob, token)`` of one row, best first, ties by token id."""
    k = min(k, logprobs.numel())
    vals, idx = torch.topk(logprobs, k)
    pairs = sorted(zip(vals.tolist(), idx.tolist(), strict=True), key=lambda p: (-p[0], p[1]))
    return [(float(v), int(t)) for v, t in pairs]


__all__ = ["SamplingParams", "beam_logprobs", "filtered_distribution", "sample_rows", "sample_token",
           "top_candidates", "uniform"]
