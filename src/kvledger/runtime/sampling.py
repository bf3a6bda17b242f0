"""Token selection: greedy, seeded temperature / top-k / top-p sampling, and beam candidates.

Determinism. A sampled token depends only on the logits of its position and on the key
``(seed, branch, position)``: the uniform number that picks the token is a counter-based hash of that
key (:func:`uniform`), never the state of a shared generator. So a request sampled alone, in a batch
of any size, or preempted (recomputed or swapped) and resumed produces the same tokens, and branch
``i`` of an ``n = 4`` request equals a single-branch run given branch index ``i`` with the same seed.
The filter (temperature, top-k, top-p) is applied to one row in float64 after sorting it, so it does
not depend on the batch either.

Before selection, a request's logits processors run on its row (:func:`process_logits`, vectorised over
the rows that have any), in vLLM's order: a structured output's grammar mask, ``min_tokens`` (stop
tokens masked until that many tokens are out), ``logit_bias``, then the penalties --
``repetition_penalty`` (Hugging Face's: over prompt and output, a positive logit divided by it, a
negative one multiplied), ``frequency_penalty`` (minus the penalty times the token's count in the
output) and ``presence_penalty`` (minus the penalty once a token is in the output). Log-probabilities
(:func:`token_logprobs`) are vLLM's default ``raw_logprobs``: the log-softmax of the model's own logits,
before any processor, penalty, temperature or top-k/top-p.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

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
    logprobs: int | None = None  # report each sampled token's logprob and this many top alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token but the first (the prompt computed whole)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # stop tokens are masked until this many tokens are out
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits
    # Structured output: an object with ``restrict(logits_row, branch, output_tokens)`` that masks, in place,
    # the tokens its grammar forbids after the branch's output so far (the server's JSON constraint).
    constraint: Any = None

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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError(f"{name} must be None or an integer >= 0, got {value!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and -2 <= value <= 2):
                raise ConfigError(f"{name} must be in [-2, 2], got {value!r}")
        if not (isinstance(self.repetition_penalty, int | float) and math.isfinite(self.repetition_penalty)
                and self.repetition_penalty > 0):
            raise ConfigError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ConfigError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        try:
            bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        except (TypeError, ValueError):
            raise ConfigError("logit_bias must be (token id, bias) pairs") from None
        if any(t < 0 or not math.isfinite(b) for t, b in bias):
            raise ConfigError("logit_bias needs token ids >= 0 and finite biases")
        object.__setattr__(self, "logit_bias", bias)
        if self.constraint is not None and not callable(getattr(self.constraint, "restrict", None)):
            raise ConfigError("constraint must have a restrict(logits, branch, output) method")
        if self.beam_width > 1 and self.processed:
            raise ConfigError("beam search takes no penalties, min_tokens or logit_bias")

    @property
    def processed(self) -> bool:
        """Whether a logits processor (penalties, min_tokens, logit_bias) changes this request's row."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.logit_bias or self.constraint is not None)

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


class TokenLogprobs(NamedTuple):
    """One position's log-probabilities: the chosen (or given) token's and the ``k`` most likely
    ``(token, logprob)`` pairs, best first, ties by token id (vLLM's raw logprobs, float64)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class RowContext(NamedTuple):
    """What a row's processors read: the sequence's tokens so far (prompt and output, the scheduler's
    own list: read, never kept), where the output starts and ends, and the request's stop tokens."""

    tokens: Sequence[int]
    prompt_len: int
    end: int  # tokens[:end] are computed: the output so far is tokens[prompt_len:end]
    stop_token_ids: frozenset[int] = frozenset()
    branch: int = 0


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                   contexts: Sequence[RowContext]) -> torch.Tensor:
    """The rows' logits after their processors (a copy when any row has one; ``logits`` itself
    otherwise): min_tokens, logit_bias, repetition, frequency and presence penalties, in vLLM's order,
    one batched operation each over the rows that use it."""
    rows = [i for i, p in enumerate(params) if p.processed]
    if not rows:
        return logits
    out = logits.clone()
    vocab = out.shape[-1]
    dev = out.device
    for i in rows:  # a grammar's mask first (it reads the branch's output, not the logits)
        p, c = params[i], contexts[i]
        if p.constraint is not None:
            p.constraint.restrict(out[i], c.branch, c.tokens[c.prompt_len:c.end])
    mask_r: list[int] = []
    mask_t: list[int] = []
    bias_r: list[int] = []
    bias_t: list[int] = []
    bias_v: list[float] = []
    for i in rows:
        p, c = params[i], contexts[i]
        if p.min_tokens and c.end - c.prompt_len < p.min_tokens:
            stops = [t for t in c.stop_token_ids if t < vocab]
            mask_r += [i] * len(stops)
            mask_t += stops
        for t, b in p.logit_bias:
            if t < vocab:
                bias_r.append(i)
                bias_t.append(t)
                bias_v.append(b)
    if mask_r:
        out[torch.tensor(mask_r, device=dev), torch.tensor(mask_t, device=dev)] = -math.inf
    if bias_r:
        out.index_put_((torch.tensor(bias_r, device=dev), torch.tensor(bias_t, device=dev)),
                       torch.tensor(bias_v, dtype=out.dtype, device=dev), accumulate=True)
    pen = [i for i in rows if params[i].repetition_penalty != 1.0 or params[i].frequency_penalty
           or params[i].presence_penalty]
    if pen:
        index = torch.tensor(pen, device=dev)
        # Counts of each token in the output so far, and whether it is anywhere in prompt or output.
        out_r = [k for k, i in enumerate(pen) for _ in range(contexts[i].end - contexts[i].prompt_len)]
        out_t = [t for i in pen for t in contexts[i].tokens[contexts[i].prompt_len:contexts[i].end]]
        counts = torch.zeros(len(pen), vocab, dtype=out.dtype, device=dev)
        if out_r:
            counts.index_put_((torch.tensor(out_r, device=dev), torch.tensor(out_t, device=dev)),
                              torch.ones(len(out_t), dtype=out.dtype, device=dev), accumulate=True)
        sub = out[index]
        rep = torch.tensor([params[i].repetition_penalty for i in pen], dtype=out.dtype, device=dev)
        if bool((rep != 1.0).any()):
            seen = counts > 0
            pr_r = [k for k, i in enumerate(pen) for _ in range(contexts[i].prompt_len)]
            pr_t = [t for i in pen for t in contexts[i].tokens[:contexts[i].prompt_len]]
            if pr_r:
                seen[torch.tensor(pr_r, device=dev), torch.tensor(pr_t, device=dev)] = True
            factor = torch.where(seen, rep[:, None], torch.ones_like(sub))
            sub = torch.where(sub > 0, sub / factor, sub * factor)
        freq = torch.tensor([params[i].frequency_penalty for i in pen], dtype=out.dtype, device=dev)
        pres = torch.tensor([params[i].presence_penalty for i in pen], dtype=out.dtype, device=dev)
        sub = sub - freq[:, None] * counts - pres[:, None] * (counts > 0).to(out.dtype)
        out[index] = sub
    if mask_r:
        # min_tokens may mask the only tokens a grammar still allows (a complete JSON answer's end tokens):
        # such a row keeps the grammar's mask alone rather than leave nothing to sample.
        for i in sorted(set(mask_r)):
            if not bool(torch.isfinite(out[i]).any()):
                out[i] = logits[i]
                p, c = params[i], contexts[i]
                if p.constraint is not None:
                    p.constraint.restrict(out[i], c.branch, c.tokens[c.prompt_len:c.end])
    return out


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: Sequence[int]) -> list[TokenLogprobs]:
    """Row i's log-softmax (float64, of the logits as given) at ``tokens[i]`` with its ``k[i]`` best."""
    lp = torch.log_softmax(logits.detach().to(torch.float64), dim=-1)
    chosen = lp.gather(1, torch.tensor(list(tokens), device=lp.device)[:, None])[:, 0].tolist()
    return [TokenLogprobs(int(t), float(v), tuple((tok, v) for v, tok in top_candidates(lp[i], ki)) if ki else ())
            for i, (t, v, ki) in enumerate(zip(tokens, chosen, k, strict=True))]


def beam_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities a beam search scores with: log-softmax in float64 (rows or one row)."""
    return torch.log_softmax(logits.detach().to(torch.float64), dim=-1)


def top_candidates(logprobs: torch.Tensor, k: int) -> list[tuple[float, int]]:
    """The ``k`` best ``(logprob, token)`` of one row, best first, ties by token id."""
    k = min(k, logprobs.numel())
    vals, idx = torch.topk(logprobs, k)
    pairs = sorted(zip(vals.tolist(), idx.tolist(), strict=True), key=lambda p: (-p[0], p[1]))
    return [(float(v), int(t)) for v, t in pairs]


__all__ = ["RowContext", "SamplingParams", "TokenLogprobs", "beam_logprobs", "filtered_distribution",
           "process_logits", "sample_rows", "sample_token", "token_logprobs", "top_candidates", "uniform"]
