"""The entropy-coded KV blocks' coder (runtime/kv_entropy.py, native csrc/kv_rans.h) pinned on hand-made data: the
tables (frequencies that sum to the coder's scale, each symbol codable, buckets, escapes, probabilities worked by
hand), exact round trips (both families, short blocks, the alphabet's ends, far-tail escapes), the words against a
plain-Python rANS written from the format's description, the rate control's smallest fitting step, the coded size
against the model's bits, and corrupt blocks refused."""

from __future__ import annotations

import math

import pytest
import torch

from kvledger.errors import ConfigError
from kvledger.runtime import kv_entropy as ke
from kvledger.runtime import native

pytestmark = pytest.mark.skipif(not native.available() or not hasattr(native.load(), "ec_fit_blocks"),
                                reason="the native CPU kernels are not built")
M = 2 ** ke.PROB_BITS


def _blocks(n=24, rows=16, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    sig = 2.0 ** torch.linspace(-5, 4, dim, dtype=torch.float64)
    lap = torch.arange(dim) % 3 == 0
    gauss = torch.randn(n, rows, dim, generator=g, dtype=torch.float64) * sig
    u = torch.rand(n, rows, dim, generator=g, dtype=torch.float64) - 0.5
    laplace = -sig / math.sqrt(2) * torch.sign(u) * torch.log1p(-2 * u.abs())
    return torch.where(lap, laplace, gauss), sig, lap


def _class0(sig, n):
    return ke.class_of(sig)[None].expand(n, -1).contiguous()


def test_tables_sum_to_the_scale_and_code_every_symbol():
    tb = ke.tables()
    assert tb.cdf.shape == (2 * ke.CLASSES, ke.MAX_SYMBOLS + 1)
    for t in range(2 * ke.CLASSES):
        n = int(tb.nsym[t])
        row = tb.cdf[t, :n + 1]
        assert row[0] == 0 and row[-1] == M and bool((row[1:] > row[:-1]).all())  # every symbol has frequency >= 1
        assert bool((tb.cdf[t, n:] == M).all())
        log2r = (t % ke.CLASSES) / 8 - 8
        assert int(tb.shift[t]) == max(0, math.floor(log2r) - 3)
        # the decoder's first guess for slot j * 64: the last symbol whose interval starts at or below it
        want = [max(i for i in range(n) if int(row[i]) <= j * 64) for j in range(256)]
        assert tb.lut[t].tolist() == want


def test_table_probabilities_by_hand():
    # deviation 1 step (class 64), Gaussian: P(k = 0) = erf(0.5 / sqrt 2) = 0.3829, P(|k| = 1) = erf(1.5 / sqrt 2) -
    # erf(0.5 / sqrt 2) = 0.4835; Laplacian: P(0) = 1 - exp(-0.5 sqrt 2) = 0.5069
    cdf, shift = ke.table(64, laplace=False)
    assert shift == 0
    assert abs(cdf[1] / M - 0.3829) < 2e-3 and abs((cdf[2] - cdf[1]) / M - 0.4835) < 2e-3
    cdf, _ = ke.table(64, laplace=True)
    assert abs(cdf[1] / M - 0.5069) < 2e-3
    # 2 ** 6 steps (class 112): buckets of 2 ** 3; the escape is the last symbol and stands for < 2 ** -20 (+ its floor)
    cdf, shift = ke.table(112, laplace=False)
    assert shift == 3
    assert 8 * (len(cdf) - 2) > 4.5 * 64  # buckets reach past 4.5 deviations (mass there is ~7e-6 > 2 ** -20)
    assert cdf[-1] - cdf[-2] == 1  # the escape: the floor only
    # a tiny deviation: almost everything is 0
    cdf, _ = ke.table(0, laplace=False)
    assert cdf[1] >= M - len(cdf)


def test_round_trip_is_exact_for_both_families_short_blocks_and_the_alphabets_ends():
    y, sig, lap = _blocks()
    n = y.shape[0]
    y[0, 0, 0] = 1e9  # the rate control steps up until it is in the alphabet (at the top end, an escape)
    y[0, 1, 0] = -1e9
    y[1, 3, 5] = 2000 * float(sig[5])  # far in the tail of a small coefficient
    rows = torch.full((n,), 16, dtype=torch.int32)
    rows[-1], rows[-2] = 1, 7
    budget = torch.full((n,), 263, dtype=torch.int32)
    codes, nw, words = ke.fit_blocks(y, rows, _class0(sig, n), lap, budget)
    assert bool((nw <= budget).all())
    k = ke.decode_blocks(words, nw, codes, rows, _class0(sig, n), lap, 16)
    want = ke.symbols(y, codes)
    for b in range(n):
        assert torch.equal(k[b, :rows[b]], want[b, :rows[b]])
        assert bool((k[b, rows[b]:] == 0).all())
    assert int(want[0, 0, 0]) >= ke.SYMBOL_MAX // 2 and int(want[0, 1, 0]) <= -ke.SYMBOL_MAX // 2
    # at a code the caller names, the far values clamp to the alphabet's two ends, and those round-trip too
    at = torch.full((n,), ke.CENTRE_CODE, dtype=torch.int32)
    nw, words = ke.encode_blocks(y, rows, _class0(sig, n), lap, at, cap=4096)
    k = ke.decode_blocks(words, nw, at, rows, _class0(sig, n), lap, 16)
    want = ke.symbols(y, at)
    assert int(want[0, 0, 0]) == ke.SYMBOL_MAX - 1 and int(want[0, 1, 0]) == -ke.SYMBOL_MAX
    for b in range(n):
        assert torch.equal(k[b, :rows[b]], want[b, :rows[b]])


def _reference_words(k, tids):
    """A plain rANS encoder written from kv_rans.h's description (32-bit state in [2^16, 2^32), 16-bit words, ops
    pushed in reverse: sign, low bits, escape bytes, the table's symbol)."""
    tb = ke.tables()
    x, out = 1 << 16, []

    def put(start, freq):
        nonlocal x
        if x >= (freq << 18):
            out.append(x & 0xFFFF)
            x >>= 16
        x = (x // freq << ke.PROB_BITS) + x % freq + start

    def raw(v, bits):
        put(v << (ke.PROB_BITS - bits), 1 << (ke.PROB_BITS - bits))

    flat, dim = k.reshape(-1).tolist(), k.shape[1]
    for i in reversed(range(len(flat))):
        t = tids[i % dim]
        v = flat[i]
        m, sh, esc = abs(v), int(tb.shift[t]), int(tb.nsym[t]) - 1
        cdf = tb.cdf[t].tolist()
        if m:
            raw(int(v < 0), 1)
        if sh:
            raw(m & ((1 << sh) - 1), sh)
        high = m >> sh
        if high >= esc:
            raw((high - esc) & 0xFF, 8)
            raw((high - esc) >> 8, 8)
            high = esc
        put(cdf[high], cdf[high + 1] - cdf[high])
    return [x >> 16, x & 0xFFFF] + out[::-1]


def test_words_equal_a_plain_python_rans_of_the_described_format():
    y, sig, lap = _blocks(n=3, rows=5, dim=16, seed=3)
    y[2, 0, 0] = 5000 * float(sig[0])  # an escape
    n = y.shape[0]
    rows = torch.tensor([5, 5, 2], dtype=torch.int32)
    codes = torch.tensor([128, 120, 140], dtype=torch.int32)
    c0 = _class0(sig, n)
    nw, words = ke.encode_blocks(y, rows, c0, lap, codes, cap=400)
    k = ke.symbols(y, codes)
    for b in range(n):
        tids = [int(lap[c]) * ke.CLASSES + min(max(int(c0[b, c]) - (int(codes[b]) - 128), 0), ke.CLASSES - 1)
                for c in range(16)]
        ref = _reference_words(k[b, :rows[b]], tids)
        assert words[b, :nw[b]].tolist() == ref
        assert int(nw[b]) == len(ref)


def test_fit_picks_the_smallest_code_that_fits_each_budget():
    y, sig, lap = _blocks(n=12, seed=1)
    n = y.shape[0]
    rows = torch.full((n,), 16, dtype=torch.int32)
    budget = torch.tensor([40, 80, 120, 200, 263, 300, 400, 60, 90, 150, 250, 350], dtype=torch.int32)
    c0 = _class0(sig, n)
    codes, nw, words = ke.fit_blocks(y, rows, c0, lap, budget)
    at, _ = ke.encode_blocks(y, rows, c0, lap, codes, cap=1)
    below, _ = ke.encode_blocks(y, rows, c0, lap, codes - 1, cap=1)
    assert torch.equal(at, nw)
    assert bool((nw <= budget).all()) and bool((below > budget).all())
    assert (codes[torch.argsort(budget)].diff() <= 0).all()  # more words, a finer step


def test_the_rate_control_never_picks_a_step_at_which_a_symbol_clamps():
    # A generous budget: at the finest codes every symbol clamps to the alphabet's end and the block still fits
    # (a clamped symbol costs an escape like any far one), so "the smallest code that fits" alone would code
    # values it cannot give back. Block 0 holds one coefficient far out, which needs a step near the base's.
    y, sig, lap = _blocks(n=4, seed=3)
    y[0, 5, 7] = 3.0e4
    n = y.shape[0]
    rows = torch.full((n,), 16, dtype=torch.int32)
    c0 = _class0(sig, n)
    codes, nw, words = ke.fit_blocks(y, rows, c0, lap, torch.full((n,), 4000, dtype=torch.int32))
    assert bool((nw <= 4000).all())
    k = ke.decode_blocks(words, nw, codes, rows, c0, lap, 16).double()
    step = ke.step_rel(codes)[:, None, None]
    assert bool(((y - k * step).abs() <= step / 2 * (1 + 1e-9)).all())  # every value within half a step
    # the finest code whose symbols stay in the alphabet: one finer would clamp (the budget does not bind here)
    peak = y.abs().amax((1, 2))
    assert bool((peak / ke.step_rel(codes) <= ke.SYMBOL_MAX - 1).all())
    assert bool((peak / ke.step_rel(codes - 1) > ke.SYMBOL_MAX - 1).all())
    assert int(codes[0]) > int(codes[1:].max())  # the far value asks block 0 for a coarser step
    # a value no code's step keeps in the alphabet fits at no step (refused by the caller), never clamped
    far = y[:1].clone()
    far[0, 0, 0] = 1.0e12
    _, nw_far, _ = ke.fit_blocks(far, rows[:1], c0[:1], lap, torch.full((1,), 4000, dtype=torch.int32))
    assert int(nw_far[0]) > 4000


def test_coded_size_is_the_models_bits_plus_the_state():
    y, sig, lap = _blocks(n=32, seed=2)
    n = y.shape[0]
    rows = torch.full((n,), 16, dtype=torch.int32)
    codes = torch.full((n,), 128, dtype=torch.int32)
    nw, _ = ke.encode_blocks(y, rows, _class0(sig, n), lap, codes, cap=4096)
    k = ke.symbols(y, codes).double().abs()
    # ideal bits under the continuous models at step 1: -log2 of each symbol's bin (one sign's half of |k|'s)
    g = torch.special.erf((k + 0.5) / (sig * math.sqrt(2))) - torch.special.erf((k - 0.5).clamp_min(0) /
                                                                                   (sig * math.sqrt(2)))
    g = torch.where(k == 0, g, g / 2)
    beta = sig / math.sqrt(2)
    lp = torch.where(k == 0, -torch.expm1(-0.5 / beta),
                     0.5 * (torch.exp(-(k - 0.5) / beta) - torch.exp(-(k + 0.5) / beta)))
    p = torch.where(lap, lp, g).clamp_min(1e-300)
    ideal = -torch.log2(p).sum((1, 2))
    coded = nw.double() * 16
    # the state's 32 bits, the eighth-octave classes and 14-bit frequencies cost a little;
    # measured: 17 bits over to 1.6% over
    assert bool((coded >= ideal).all()) and bool((coded <= ideal * 1.025 + 32).all())


def test_corrupt_and_non_finite_blocks_are_refused():
    y, sig, lap = _blocks(n=2, seed=4)
    rows = torch.full((2,), 16, dtype=torch.int32)
    c0 = _class0(sig, 2)
    codes, nw, words = ke.fit_blocks(y, rows, c0, lap, torch.full((2,), 263, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="corrupt|past"):
        ke.decode_blocks(words, nw - 1, codes, rows, c0, lap, 16)  # a word short
    with pytest.raises(RuntimeError, match="corrupt|range"):
        ke.decode_blocks(words, nw + 1, codes, rows, c0, lap, 16)  # a word left over
    bad = words.clone()
    bad[:, 0] ^= 0x4000  # the state's top bits
    with pytest.raises(RuntimeError):
        ke.decode_blocks(bad, nw, codes, rows, c0, lap, 16)
    y[0, 0, 0] = float("nan")
    with pytest.raises(ConfigError, match="finite"):
        ke.fit_blocks(y, rows, c0, lap, torch.full((2,), 263, dtype=torch.int32))
    with pytest.raises(ConfigError, match="finite"):
        ke.encode_blocks(y, rows, c0, lap, codes, cap=263)


def test_a_slot_decodes_without_its_count_and_its_padding_must_be_zero():
    y, sig, lap = _blocks(n=3, seed=6)
    rows = torch.tensor([16, 16, 9], dtype=torch.int32)
    c0 = _class0(sig, 3)
    codes, nw, words = ke.fit_blocks(y, rows, c0, lap, torch.full((3,), 263, dtype=torch.int32))
    assert bool((nw < 263).all())  # room for padding in every block
    slot = torch.zeros(3, 300, dtype=torch.int32)  # the words, then zeros: what a fixed slot holds
    for b in range(3):
        slot[b, :nw[b]] = words[b, :nw[b]]
    counted = ke.decode_blocks(words, nw, codes, rows, c0, lap, 16)
    padded = ke.decode_blocks(slot, torch.zeros(3, dtype=torch.int32), codes, rows, c0, lap, 16)
    assert torch.equal(padded, counted)
    for b in range(3):
        bad = slot.clone()
        bad[b, int(nw[b]) + 5] = 1  # a padding word that is not zero
        with pytest.raises(RuntimeError, match="corrupt"):
            ke.decode_blocks(bad, torch.zeros(3, dtype=torch.int32), codes, rows, c0, lap, 16)
    bad = slot.clone()
    bad[1, 3] ^= 0x0100  # a used word
    with pytest.raises(RuntimeError):
        ke.decode_blocks(bad, torch.zeros(3, dtype=torch.int32), codes, rows, c0, lap, 16)


def test_the_kernels_and_the_tables_agree_on_the_format_or_the_coder_refuses(monkeypatch):
    assert dict(native.load().EC_CONSTANTS) == ke.FORMAT
    monkeypatch.setitem(ke.FORMAT, "codes_per_octave", 4)  # as if the tables were built for another step spacing
    y, sig, lap = _blocks(n=1)
    with pytest.raises(ConfigError, match="rebuild"):
        ke.fit_blocks(y, torch.tensor([16]), _class0(sig, 1), lap, torch.tensor([263]))
