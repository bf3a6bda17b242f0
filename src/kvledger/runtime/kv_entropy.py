"""Entropy-coded KV blocks: the static models and the calls into the native rANS coder (``csrc/kv_rans.h``).

A block is ``rows`` rows of ``D`` coefficients (one head's transformed K or V rows), each snapped to the block's
step ``base * 2 ** ((code - 128) / 8)`` (``code`` one byte) as an integer symbol, and the symbols are coded by
rANS into 16-bit words under one model per coefficient: a discretised zero-mean Gaussian or Laplacian whose
deviation, in steps, is the coefficient's calibrated deviation over the step. Deviations are rounded to an
eighth of an octave, so every model is one of a fixed set of tables (:func:`tables`: two families, ``CLASSES``
deviations from 2^-8 to 2^10 steps) and a code one lower is exactly one class higher. A table codes ``|k|`` in
buckets of ``2 ** shift`` (the bucket through the table, the rest raw; a bucket is at most an eighth of the
deviation, where the density is nearly flat), an escape for the far tail, and the sign raw.

:func:`fit_blocks` gives each block the smallest step whose words fit its budget (so a page of fixed bytes always
holds it); :func:`decode_blocks` returns the symbols. Both need the native kernels (``make install``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError

PROB_BITS = 14  # table frequencies sum to 2 ** PROB_BITS (the kernel's kProbBits)
CLASSES_PER_OCTAVE = 8  # one step code is one class
LOG2_MIN = -8  # class 0: a deviation of 2 ** -8 steps
CLASSES = (10 - LOG2_MIN) * CLASSES_PER_OCTAVE + 1  # up to 2 ** 10 steps
FINE = 3  # a bucket is at most 2 ** -FINE of the deviation
TAIL = 2.0 ** -20  # the escape stands for at most this much of a table's mass
MAX_SYMBOLS = 256  # a table's symbols, its escape included
STEP_CODES = 256
CENTRE_CODE = STEP_CODES // 2
SYMBOL_MAX = 2 ** 15  # symbols are clamped to [-SYMBOL_MAX, SYMBOL_MAX - 1]
LUT_BITS = 8  # a decoder's first guess per table: one entry per 2 ** (PROB_BITS - LUT_BITS) slots
# What the kernels must agree on (csrc/kv_rans.h exports its own as EC_CONSTANTS; :func:`_native` compares them).
FORMAT = {"prob_bits": PROB_BITS, "step_codes": STEP_CODES, "codes_per_octave": CLASSES_PER_OCTAVE,
          "symbol_max": SYMBOL_MAX, "lut_bits": LUT_BITS}


@dataclass(frozen=True, slots=True)
class Tables:
    """``cdf [2 * CLASSES, MAX_SYMBOLS + 1]`` int32 (Gaussian tables first), ``lut [2 * CLASSES, 2 ** LUT_BITS]``
    (the symbol whose interval holds slot ``j << (PROB_BITS - LUT_BITS)``: a decoder's first guess), ``nsym`` and
    ``shift``."""

    cdf: torch.Tensor
    lut: torch.Tensor
    nsym: torch.Tensor
    shift: torch.Tensor


def _abs_cdf(t: torch.Tensor, r: float, laplace: bool) -> torch.Tensor:
    """``P(|X| < t)`` for a zero-mean Gaussian (deviation ``r``) or Laplacian (deviation ``r``), float64."""
    if laplace:
        return -torch.expm1(-t * math.sqrt(2) / r)
    return torch.special.erf(t / (r * math.sqrt(2)))


def table(cls: int, laplace: bool) -> tuple[list[int], int]:
    """One table: its cumulative frequencies (``nsym + 1`` of them, 0 .. 2 ** PROB_BITS) and its shift."""
    log2r = cls / CLASSES_PER_OCTAVE + LOG2_MIN
    r = 2.0 ** log2r
    shift = max(0, math.floor(log2r) - FINE)
    width = 2 ** shift
    h = torch.arange(MAX_SYMBOLS - 1, dtype=torch.float64)
    upper = _abs_cdf((h + 1) * width - 0.5, r, laplace)
    lower = _abs_cdf((h * width - 0.5).clamp_min(0), r, laplace)
    tail = 1 - upper
    buckets = int(min(MAX_SYMBOLS - 1, int((tail >= TAIL).sum()) + 1))  # the first bucket past which < TAIL lies
    p = torch.cat(((upper - lower)[:buckets], (1 - upper[buckets - 1]).reshape(1))).clamp_min(0)
    n = buckets + 1
    total = 2 ** PROB_BITS
    freq = 1 + torch.floor(p / p.sum() * (total - n)).long()
    freq[int(p.argmax())] += total - int(freq.sum())
    cdf = [0] + torch.cumsum(freq, 0).tolist()
    return cdf, shift


@functools.cache
def tables() -> Tables:
    """Every table, built once (deterministic: float64 arithmetic only)."""
    cdf = torch.full((2 * CLASSES, MAX_SYMBOLS + 1), 2 ** PROB_BITS, dtype=torch.int32)
    nsym = torch.empty(2 * CLASSES, dtype=torch.int32)
    shift = torch.empty(2 * CLASSES, dtype=torch.int32)
    for fam, laplace in enumerate((False, True)):
        for c in range(CLASSES):
            row, sh = table(c, laplace)
            t = fam * CLASSES + c
            cdf[t, :len(row)] = torch.tensor(row, dtype=torch.int32)
            nsym[t], shift[t] = len(row) - 1, sh
    slots = (torch.arange(2 ** LUT_BITS, dtype=torch.int32) << (PROB_BITS - LUT_BITS)).expand(2 * CLASSES, -1)
    slots = slots.contiguous()
    lut = (torch.searchsorted(cdf, slots, right=True) - 1).to(torch.int32)
    return Tables(cdf, lut, nsym, shift)


def class_of(deviation: torch.Tensor) -> torch.Tensor:
    """The class at code 128 of coefficients whose deviation, in base steps, is ``deviation``: int32, not clamped
    (the kernel clamps the class it uses at each code)."""
    return (torch.log2(deviation.double().clamp_min(1e-300)) * CLASSES_PER_OCTAVE
            - LOG2_MIN * CLASSES_PER_OCTAVE).round().to(torch.int32)


def _coefficients(y: torch.Tensor) -> torch.Tensor:
    """``y`` as the coder reads it (float64, contiguous); a non-finite value has no symbol."""
    y = y.double().contiguous()
    if not bool(torch.isfinite(y).all()):
        raise ConfigError("entropy coding needs finite coefficients")
    return y


def _native():
    from . import native

    module = native.require()
    theirs = dict(getattr(module, "EC_CONSTANTS", {}))
    if theirs != FORMAT:
        raise ConfigError(f"the native entropy coder's constants {theirs} differ from kv_entropy's {FORMAT}: rebuild "
                          "the kernels (make install)")
    return module


def fit_blocks(y: torch.Tensor, rows: torch.Tensor, class0: torch.Tensor, laplace: torch.Tensor,
               budget_words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks ``y [N, R, D]`` (coefficients in base steps; rows past ``rows[b]`` ignored), each coefficient's class
    at code 128 ``class0 [N, D]`` and family ``laplace [D]``: per block the smallest step code whose words fit
    ``budget_words[b]`` (16-bit words, the 2 state words included) and at which no symbol clamps to the alphabet
    (a block with a value past the alphabet at every code fits at no code). Returns ``codes [N]``,
    ``nwords [N]`` (over the budget only where no code fits: then code 255) and ``words [N, max budget]`` (int32
    holding uint16)."""
    y = _coefficients(y)
    n = y.shape[0]
    tb = tables()
    budget = budget_words.to(torch.int32).contiguous()
    cap = int(budget.max()) if n else 2
    codes = torch.empty(n, dtype=torch.int32)
    nwords = torch.empty(n, dtype=torch.int32)
    words = torch.zeros(n, cap, dtype=torch.int32)
    _native().ec_fit_blocks(y, rows.to(torch.int32).contiguous(), class0.to(torch.int32).contiguous(),
                            laplace.to(torch.int32).contiguous(), tb.cdf, tb.lut, tb.nsym, tb.shift, budget, codes,
                            nwords, words)
    return codes, nwords, words


def encode_blocks(y: torch.Tensor, rows: torch.Tensor, class0: torch.Tensor, laplace: torch.Tensor,
                  codes: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks' words at the given step ``codes`` (as :func:`fit_blocks` codes them): ``nwords [N]`` and
    ``words [N, cap]`` (a block over ``cap`` words has only its count)."""
    y = _coefficients(y)
    tb = tables()
    nwords = torch.empty(y.shape[0], dtype=torch.int32)
    words = torch.zeros(y.shape[0], cap, dtype=torch.int32)
    _native().ec_encode_blocks(y, rows.to(torch.int32).contiguous(), class0.to(torch.int32).contiguous(),
                               laplace.to(torch.int32).contiguous(), tb.cdf, tb.lut, tb.nsym, tb.shift,
                               codes.to(torch.int32).contiguous(), nwords, words)
    return nwords, words


def decode_blocks(words: torch.Tensor, nwords: torch.Tensor, codes: torch.Tensor, rows: torch.Tensor,
                  class0: torch.Tensor, laplace: torch.Tensor, max_rows: int) -> torch.Tensor:
    """:func:`fit_blocks`'s inverse: the symbols ``[N, max_rows, D]`` (int32; rows past ``rows[b]`` are 0). A block
    whose words do not decode to exactly their count is an error (:class:`RuntimeError`). A count of 0 reads a
    block kept in a fixed slot of ``words.shape[1]`` words without its count: the words it does not read must be
    zero (the slot's padding), or it is an error too."""
    tb = tables()
    k = torch.empty(words.shape[0], max_rows, class0.shape[1], dtype=torch.int32)
    _native().ec_decode_blocks(words.to(torch.int32).contiguous(), nwords.to(torch.int32).contiguous(),
                               codes.to(torch.int32).contiguous(), rows.to(torch.int32).contiguous(),
                               class0.to(torch.int32).contiguous(), laplace.to(torch.int32).contiguous(), tb.cdf,
                               tb.lut, tb.nsym, tb.shift, k)
    return k


def step_rel(codes: torch.Tensor) -> torch.Tensor:
    """A code's step in base steps: ``2 ** ((code - 128) / 8)``, float64."""
    return 2.0 ** ((codes.double() - CENTRE_CODE) / CLASSES_PER_OCTAVE)


def symbols(y: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """What :func:`fit_blocks` codes: ``y [N, R, D]`` on each block's grid, clamped to the alphabet (int32)."""
    s = step_rel(codes)[:, None, None]
    return torch.round(y.double() / s).clamp(-SYMBOL_MAX, SYMBOL_MAX - 1).to(torch.int32)
