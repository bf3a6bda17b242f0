"""Fitting transform-coded KV tables (:mod:`kvledger.runtime.kv_transform`) on calibration rows: the basis, the
coefficients' models, the base step, and one step shared by many heads weighed by what their errors cost.

A head's rows ``x [N, D]`` are centred on their mean, whitened by ``M^1/2`` where ``M`` is what an error costs
(keys: the second moment of the queries that read them; values: the Gram matrix of the ``o_proj`` columns that read
them), so the metric becomes the plain squared error, and turned onto the whitened rows' principal axes (the KLT:
uncorrelated coefficients). Each coefficient's model is a zero-mean Gaussian or Laplacian of its calibration
deviation, whichever codes the calibration coefficients in fewer bits at the base step. Why one uniform step,
entropy-coded: at ~4.6 bits a coefficient a fixed-rate scalar grid loses to it (for a Gaussian the error at equal
rate is pi e / 6 against sqrt(3) pi / 2 times sigma^2 4^-R), and a coefficient much smaller than the step codes as 0
at almost no bits, so the water-filling happens by itself.

Fits are dicts (``mu``, ``T``, ``Ti``, ``sigma``, ``laplace``, ``base``, ``nbytes``, ``bs``): what
``SideCode.from_heads`` stacks. The driver that taps a model's rows and measures each layer's cost is
``benchmarks/kv_4bit_screen.py`` today.
"""

from __future__ import annotations

import math

import torch

from .kv_transform import HELD_ELEMENT_BYTES, STATE_BYTES, STEP_BYTES

FLUSH_BYTES = STATE_BYTES  # what the coder adds to the modelled bits (its final state), for modelled searches
MIN_PROB = 2.0 ** -24  # a symbol's least modelled probability (the coder's leaky floor is of this order)


def metric_root(metric: torch.Tensor, floor: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M^1/2, M^-1/2)`` of a symmetric positive semi-definite ``metric [D, D]`` (float64), its eigenvalues
    floored at ``floor`` times the largest so the inverse stays finite."""
    e, v = torch.linalg.eigh(metric.double())
    e = e.clamp_min(e.max() * floor)
    return (v * e.sqrt()) @ v.T, (v * e.rsqrt()) @ v.T


def whitened_klt(x: torch.Tensor, metric: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One head's rows ``x [N, D]`` centred on their mean, whitened by ``M^1/2`` and turned onto the whitened rows'
    principal axes: ``(mu, T, Ti, y)`` in float64 with ``y = (x - mu) T`` (uncorrelated coefficients) and ``x = y Ti
    + mu``."""
    x = x.double()
    mu = x.mean(0)
    w, wi = metric_root(metric)
    z = (x - mu) @ w
    _, u = torch.linalg.eigh(z.T @ z / len(z))
    t, ti = w @ u, u.T @ wi
    return mu, t, ti, (x - mu) @ t


def symbol_bits(k: torch.Tensor, step: torch.Tensor, sigma: torch.Tensor, laplace: torch.Tensor) -> torch.Tensor:
    """Bits a range coder spends on integer symbols ``k`` (a coefficient quantised to ``k * step``) under a zero-mean
    Gaussian (or, where ``laplace``, Laplacian) of deviation ``sigma``: ``-log2 P(bin)``, the bin ``step`` wide
    around ``k * step``, floored at :data:`MIN_PROB`. Broadcasts; float64."""
    k, step, sigma = k.double().abs(), step.double(), sigma.double().clamp_min(1e-12)
    # Gaussian: P = Phi((k + 1/2) step / sigma) - Phi((k - 1/2) step / sigma), by erfc for the tails' sake
    a = ((k - 0.5).clamp_min(0) * step / sigma) / math.sqrt(2)
    b = ((k + 0.5) * step / sigma) / math.sqrt(2)
    pg = torch.where(k == 0, torch.special.erf(b), 0.5 * (torch.special.erfc(a) - torch.special.erfc(b)))
    # Laplacian of scale beta = sigma / sqrt 2: P(0) = 1 - e^(-step / 2 beta), else e^(-(k - 1/2) step / beta) (1 -
    # e^(-step / beta)) / 2, in logs
    beta = sigma / math.sqrt(2)
    lp0 = torch.log(-torch.expm1(-step / (2 * beta)))
    lpk = math.log(0.5) - (k - 0.5) * step / beta + torch.log(-torch.expm1(-step / beta))
    lpl = torch.where(k == 0, lp0, lpk)
    lp = torch.where(laplace, lpl, torch.log(pg.clamp_min(MIN_PROB)))
    return -lp.clamp_min(math.log(MIN_PROB)) / math.log(2)


def fit_transform_ec(x: torch.Tensor, metric: torch.Tensor, nbytes: int, bs: int = 16) -> dict:
    """Entropy-coded transform coding of one head's rows ``x [N, D]``: :func:`fit_transform`'s basis (centred,
    whitened by ``metric``, turned onto the principal axes), each coefficient's model (Gaussian or Laplacian,
    whichever codes the calibration coefficients in fewer bits at the base step, with their deviation) and the
    base step (the one at which the calibration rows' modelled bits fill ``nbytes`` a row less a block's step byte
    and flush, on average). Returns ``mu``, ``T``, ``Ti``, ``sigma [D]``, ``laplace [D]`` (bool), ``base`` (0-d),
    ``nbytes`` and ``bs``."""
    mu, t, ti, y = whitened_klt(x, metric)
    sigma = y.std(0).clamp_min(1e-9)
    target = (nbytes - (STEP_BYTES + FLUSH_BYTES) / bs) * 8  # bits a row
    lo, hi = torch.tensor(1e-6, dtype=torch.float64), sigma.max() * 16
    laplace = torch.zeros(y.shape[1], dtype=torch.bool)
    for _ in range(60):  # bisect the base step on the log scale; the model choice follows the step
        mid = (lo * hi).sqrt()
        k = (y / mid).round()
        g = symbol_bits(k, mid, sigma, torch.zeros_like(laplace)).mean(0)
        lap = symbol_bits(k, mid, sigma, torch.ones_like(laplace)).mean(0)
        laplace = lap < g
        if torch.minimum(g, lap).sum() > target:
            lo = mid
        else:
            hi = mid
    return {"mu": mu.float(), "T": t.float(), "Ti": ti.float(), "sigma": sigma, "laplace": laplace,
            "base": hi, "nbytes": nbytes, "bs": bs}


def fit_transforms_ec_shared(xs: list[torch.Tensor], metrics: list[torch.Tensor], nbytes: int, bs: int = 16,
                             min_bytes: float = 0.75, weights: list[float] | None = None,
                             held: int = 0) -> list[dict]:
    """:func:`fit_transform_ec` for many heads at once (every layer's KV heads of one side) under one budget of
    ``nbytes`` a row on average: every head's base step is the same whitened step, the one at which the heads'
    calibration rows take the whole budget, and each head's bytes a row (``nbytes`` in its dict, a float; a block
    gets its rows' share rounded down) are what its own rows take at that step, at least ``min_bytes`` more than
    a block's header and flush. Equal step in the whitened basis is equal error per coefficient in what the error
    costs, the least total cost at the total rate; a head whose rows vary little (a first layer's) then codes in
    fewer bytes and a busy one in more, where equal bytes a head give every head a different step. ``weights``
    (one a head: what a unit of its whitened error costs downstream, e.g. a measured KL per unit) make the
    weighted error least instead: head ``h``'s step is the shared one over ``sqrt(weights[h])``. ``held``: the
    blocks' first rows kept at bf16 in their own bytes (a sequence's first block): each head pays them, and its
    other rows share what is left at the shared step, so the bytes a row are a first block's share."""
    d = xs[0].shape[1] if xs else 0
    over = (STEP_BYTES + FLUSH_BYTES + held * d * HELD_ELEMENT_BYTES) / bs  # a block's header, flush and held rows
    coded = (bs - held) / bs  # the rows a block codes, a row's share
    w = torch.tensor(weights if weights is not None else [1.0] * len(xs), dtype=torch.float64)
    if len(w) != len(xs) or not bool((w > 0).all()):
        raise ValueError("one positive weight a head")
    rel = (w.log().mean() - w.log()).mul(0.5).exp()  # each head's step over the shared one (geometric mean 1)
    heads = []
    for x, metric in zip(xs, metrics, strict=True):
        mu, t, ti, y = whitened_klt(x, metric)
        heads.append((mu, t, ti, y, y.std(0).clamp_min(1e-9)))

    def rates(step):  # modelled bits a row of each head, and each coefficient's better model
        out = []
        for (*_, y, sigma), r in zip(heads, rel.tolist(), strict=True):
            st = step * r
            k = (y / st).round()
            g = symbol_bits(k, st, sigma, torch.zeros(y.shape[1], dtype=torch.bool)).mean(0)
            lap = symbol_bits(k, st, sigma, torch.ones(y.shape[1], dtype=torch.bool)).mean(0)
            out.append((torch.minimum(g, lap).sum().item(), lap < g))
        return out

    def row_bytes(r):
        return max(r * coded / 8 + over, over + min_bytes)

    lo = torch.tensor(1e-6, dtype=torch.float64)
    hi = max(h[4].max() for h in heads) * 16
    for _ in range(50):  # bisect the shared step on the log scale
        mid = (lo * hi).sqrt()
        if sum(row_bytes(r) for r, _ in rates(mid)) > nbytes * len(heads):
            lo = mid
        else:
            hi = mid
    return [{"mu": mu.float(), "T": t.float(), "Ti": ti.float(), "sigma": sigma, "laplace": laplace,
             "base": hi * rh, "nbytes": row_bytes(r), "bs": bs}
            for (mu, t, ti, _, sigma), (r, laplace), rh in zip(heads, rates(hi), rel, strict=True)]
