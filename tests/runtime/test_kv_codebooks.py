"""The codebook quantisers the 4-bit KV screen learns (benchmarks/kv_codebooks.py) pinned on hand-made data:
sub-vector channel order (RoPE pairs), nearest-centroid codes and their range, the deterministic k-means
start and fixed points worked out by hand, exact round trips where the codebook holds every row, the
per-row scale, the error bound of a uniform level set, and the byte counts; and the runtime's fits of the
transform-coded tables (kvledger.runtime.kv_transform_fit: the whitened basis, the coefficients' models, one step
shared by many heads) on the same hand-made rows."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from kvledger.runtime import kv_entropy as ke
from kvledger.runtime import kv_transform_fit as ktf
from kvledger.runtime import native

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "kv_codebooks.py"
_spec = importlib.util.spec_from_file_location("kv_codebooks", _PATH)
cbq = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cbq)
needs_coder = pytest.mark.skipif(not native.available() or not hasattr(native.load(), "ec_fit_blocks"),
                                 reason="the native CPU kernels (the entropy coder) are not built")


def test_pair_order_groups_rope_pairs():
    assert cbq.pair_order(8, 1).tolist() == list(range(8))
    assert cbq.pair_order(8, 2).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert cbq.pair_order(8, 4).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    for bad in (3, 16):
        with pytest.raises(ValueError):
            cbq.pair_order(8, bad)


def test_subvectors_round_trip():
    x = torch.arange(16.0).view(2, 8)
    s = cbq.to_subvectors(x, 2)
    assert s.shape == (2, 4, 2)
    assert s[0].tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert cbq.to_subvectors(x, 4)[1].tolist() == [[8, 12, 9, 13], [10, 14, 11, 15]]
    for d in (1, 2, 4):
        assert torch.equal(cbq.from_subvectors(cbq.to_subvectors(x, d)), x)


def test_nearest_codes():
    cb = torch.tensor([[[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]]])
    x = torch.tensor([[[1.0, 1.0], [9.0, 1.0], [1.0, 6.0], [-5.0, -5.0], [20.0, 19.0]]])
    assert cbq.nearest(x, cb).tolist() == [[0, 1, 2, 0, 1]]
    # chunking changes nothing
    assert cbq.nearest(x, cb, chunk_elems=1).tolist() == [[0, 1, 2, 0, 1]]


def test_grid_init_quantile_midpoints():
    x = torch.arange(16.0).view(1, 16, 1)  # quantile q of 0..15 is 15 q (linear interpolation)
    assert cbq.grid_init(x, 4).flatten().tolist() == [1.875, 5.625, 9.375, 13.125]
    two = torch.stack((torch.arange(16.0), 100 + torch.arange(16.0)), -1)[None]  # 8 = 4 x 2 grid
    got = cbq.grid_init(two, 8)[0].tolist()
    assert got == [[a, b] for a in (1.875, 5.625, 9.375, 13.125) for b in (103.75, 111.25)]
    with pytest.raises(ValueError):
        cbq.grid_init(x, 6)


def test_kmeans_fixed_points_by_hand():
    # two clusters: the quantile start (1.25, 10.75) splits them; one round moves to their means
    x = torch.tensor([0.0, 1, 2, 10, 11, 12]).view(1, 6, 1)
    assert cbq.kmeans(x, 2).flatten().tolist() == [1.0, 11.0]
    # four repeated points on a square: the grid start is already them
    pts = torch.tensor([[0.0, 0], [0, 10], [10, 0], [10, 10]]).repeat(3, 1)[None]
    assert sorted(map(tuple, cbq.kmeans(pts, 4)[0].tolist())) == [(0, 0), (0, 10), (10, 0), (10, 10)]
    # centroids that win no point keep their place
    x = torch.tensor([0.0, 0, 0, 10]).view(1, 4, 1)
    assert cbq.kmeans(x, 4).flatten().tolist() == [0.0, 0.0, 0.0, 10.0]


def test_fit_recovers_few_distinct_values_and_rounds_to_fp16():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 2, (64, 2, 8), generator=g).float() * 0.1  # every channel in {0, 0.1}
    cb = cbq.fit(x, 1, 1, scaled=False)
    assert cb.shape == (2, 8, 2, 1)
    assert torch.equal(cb, cb.half().float())
    assert cb[..., 0].tolist() == [[[0.0, torch.tensor(0.1).half().item()]] * 8] * 2
    codes, s = cbq.encode(x, cb, scaled=False)
    assert s is None and codes.shape == (64, 2, 8)
    assert codes.min() >= 0 and codes.max() <= 1
    assert torch.equal(codes, (x > 0).long())
    assert torch.equal(cbq.decode(codes, cb, None), x.half().float())


def test_round_trip_exact_when_the_codebook_holds_the_rows():
    # D = 4, pairs (0, 2) and (1, 3); rows with RMS 2 and 0.5 (exact in fp16)
    x = torch.tensor([[[2.0, -2.0, 2.0, -2.0]], [[0.5, 0.5, -0.5, 0.5]]])  # [N=2, H=1, D=4]
    unit = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [1.0, -1.0], [-1.0, 1.0]])
    cb = unit.expand(1, 2, 4, 2).clone()  # [H, G, k, d]
    codes, s = cbq.encode(x, cb, scaled=True)
    assert s.flatten().tolist() == [2.0, 0.5]
    assert codes.tolist() == [[[0, 1]], [[2, 0]]]
    assert torch.equal(cbq.decode(codes, cb, s), x)
    raw = unit.mul(2).expand(1, 2, 4, 2).clone()  # unscaled: the codebook holds the first row's pairs
    c2, s2 = cbq.encode(x[:1], raw, scaled=False)
    assert s2 is None and torch.equal(cbq.decode(c2, raw, None), x[:1])


def test_uniform_levels_bound_the_error_by_half_a_step():
    levels = torch.arange(16.0).view(1, 1, 16, 1).expand(1, 4, 16, 1).clone()  # per channel, step 1
    x = torch.linspace(-0.4, 15.4, 400).view(100, 1, 4)
    codes, _ = cbq.encode(x, levels, scaled=False)
    assert codes.min() == 0 and codes.max() == 15
    err = (cbq.decode(codes, levels, None) - x).abs().max().item()
    assert err <= 0.5 + 1e-6


def test_bytes():
    assert cbq.code_bytes(64, 2, 8, False) == 32
    assert cbq.code_bytes(64, 2, 9, False) == 36
    assert cbq.code_bytes(64, 1, 4, True) == 34
    assert cbq.codebook_bytes(30, 3, 64, 2, 8) == 30 * 3 * 32 * 256 * 2 * 2 == 2_949_120
    assert cbq.codebook_bytes(30, 3, 64, 1, 4) == 30 * 3 * 64 * 16 * 2 == 184_320


def test_allocate_greedy_by_hand():
    # gains 0.75 * err * 4^-b: 12 | .75 .75 .75 -> ch0; 3 -> ch0; tie .75 (ch0 at b=2 and ch1..3) -> ch0; then ch1
    assert cbq.allocate(torch.tensor([16.0, 1, 1, 1]), 4).tolist() == [3, 1, 0, 0]
    assert cbq.allocate(torch.tensor([16.0, 1, 1, 1]), 8).tolist() == [4, 2, 1, 1]
    assert cbq.allocate(torch.tensor([1.0, 1]), 4, max_bits=2).tolist() == [2, 2]  # the cap moves bits on
    assert cbq.allocate(torch.tensor([5.0, 0.0]), 3).tolist() == [3, 0]
    with pytest.raises(ValueError):
        cbq.allocate(torch.tensor([1.0, 1]), 5, max_bits=2)


def test_fit_allocated_codes_stay_in_each_channels_range():
    # channel 0 constant (variance 0: no bits, its mean), channel 1 in {0, 1}, channel 2 in {0, 2, 4, 6}
    g = torch.Generator().manual_seed(1)
    n = 400
    x = torch.stack((torch.full((n,), 3.0), torch.randint(0, 2, (n,), generator=g).float(),
                     2 * torch.randint(0, 4, (n,), generator=g).float()), -1)[:, None, :]  # [N, H=1, D=3]
    weight = torch.tensor([[1.0, 4.0, 1.0]])
    bits, cb = cbq.fit_allocated(x, weight, total_bits=3, max_bits=4)
    # err = weight * variance: 0, 4 * 0.25 = 1, ~5: ch2 gets the 1st bit (3.75 > .75), then 0.94 vs .75: ch2,
    # then ch1 .75 vs ch2 .23
    assert bits.tolist() == [[0, 1, 2]]
    assert cb.shape == (1, 3, 16, 1)
    assert cb[0, 0, :, 0].tolist() == [3.0] * 16
    assert cb[0, 1, :2, 0].tolist() == [0.0, 1.0] and cb[0, 1, 2:, 0].tolist() == [0.0] * 14
    assert cb[0, 2, :4, 0].tolist() == [0.0, 2.0, 4.0, 6.0] and cb[0, 2, 4:, 0].tolist() == [0.0] * 12
    codes, _ = cbq.encode(x, cb, scaled=False)
    assert codes[..., 0].max() == 0 and codes[..., 1].max() == 1 and codes[..., 2].max() == 3
    assert torch.equal(cbq.decode(codes, cb, None), x)


def test_allocate_table_pays_the_first_bit_its_metadata():
    err = torch.tensor([[10.0, 1.0, 0.1], [1.0, 0.5, 0.2]])
    # ch0's first bit: 9 / 3 = 3 a bit (3 spent); its second 0.9 (4 spent); ch1's first 0.5 / 3 needs 3 more
    assert cbq.allocate_table(err, 4, 3).tolist() == [2, 0]
    assert cbq.allocate_table(err, 6, 3).tolist() == [2, 0]
    assert cbq.allocate_table(err, 7, 3).tolist() == [2, 1]
    assert cbq.allocate_table(err, 100, 3).tolist() == [2, 2]  # the table's top
    assert cbq.allocate_table(err, 2, 3).tolist() == [0, 0]


def test_block_errors_by_hand():
    x = torch.tensor([0.0, 2.0, 1.0, 1.0]).view(4, 1, 1)  # blocks of 2: ranges 2 and 0; variance 2 / 3
    err = cbq.block_errors(x, torch.tensor([[3.0]]), bs=2, max_bits=2)
    assert err.shape == (1, 1, 3)
    assert torch.allclose(err[0, 0], torch.tensor([2.0, 3 * 2 / 12, 3 * 2 / (12 * 9)]))


def test_block_allocated_grid_and_mean():
    x = torch.tensor([[0.0, 7], [3, 8], [1, 9], [2, 1], [0.25, 4]]).view(5, 1, 2)
    bits = torch.tensor([[2, 0]])
    mean = torch.tensor([[5.0, 5.0]])
    y = cbq.block_allocated(x, bits, mean, bs=4)
    # block 0, channel 0: min 0, step 3 / 3 = 1, exact; block 1 is row 4 padded with itself: range 0
    assert y[:, 0, 0].tolist() == [0.0, 3.0, 1.0, 2.0, 0.25]
    assert y[:, 0, 1].tolist() == [5.0] * 5  # no bits: the calibration mean
    one = cbq.block_allocated(torch.tensor([0.0, 0.4, 0.6, 1.0]).view(4, 1, 1), torch.tensor([[1]]),
                              torch.zeros(1, 1), bs=4)
    assert one.flatten().tolist() == [0.0, 0.0, 1.0, 1.0]  # 1 bit: the block's two ends


def test_allocate_table_jumps_past_a_first_bit_that_gains_nothing():
    # ch0 at 1 bit is worse than at 0 but at 2 bits far better: the move 0 -> 2 gains 0.99 / 2 a bit
    err = torch.tensor([[1.0, 2.0, 0.01], [1.0, 0.9, 0.8]])
    assert cbq.allocate_table(err, 2, 1).tolist() == [2, 0]
    assert cbq.allocate_table(err, 3, 1).tolist() == [2, 1]  # then ch1 one bit at a time (0.1 a bit either way)
    assert cbq.allocate_table(err, 4, 1).tolist() == [2, 2]
    assert cbq.allocate_table(err, 1, 1).tolist() == [0, 1]  # the jump does not fit


def _correlated_rows(n=512, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g, dtype=torch.float64)
    scale = torch.tensor([8.0, 4, 2, 1, 0.5, 0.25, 0.1, 0.01], dtype=torch.float64)[:d]
    return (torch.randn(n, d, generator=g, dtype=torch.float64) * scale) @ mix + 3.0


def _metric(d=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(d, d, generator=g, dtype=torch.float64)
    return a @ a.T + 0.1 * torch.eye(d, dtype=torch.float64)


def test_metric_root_squares_and_inverts():
    m = _metric()
    w, wi = ktf.metric_root(m)
    assert torch.allclose(w @ w, m, atol=1e-9)
    assert torch.allclose(w @ wi, torch.eye(8, dtype=torch.float64), atol=1e-9)
    assert torch.allclose(w, w.T)
    # a singular metric: the floor keeps the inverse finite
    _, wi0 = ktf.metric_root(torch.diag(torch.tensor([1.0, 0.0], dtype=torch.float64)))
    assert torch.isfinite(wi0).all() and wi0[1, 1] == 1e3


def test_transform_whitens_the_metric_and_decorrelates_the_rows():
    x, m = _correlated_rows(), _metric()
    f = cbq.fit_transform(x.float(), m, total_bits=32, max_bits=8)
    t, ti = f["T"].double(), f["Ti"].double()
    assert torch.allclose(t @ ti, torch.eye(8, dtype=torch.float64), atol=1e-4)
    # an error e in the coefficients costs |e|^2 under the metric: Ti M Ti^T = I
    assert torch.allclose(ti @ m @ ti.T, torch.eye(8, dtype=torch.float64), atol=1e-4)
    # the coefficients of the calibration rows are uncorrelated (the KLT)
    y = (x - x.mean(0)) @ t
    cov = y.T @ y / len(y)
    assert torch.allclose(cov - torch.diag(cov.diagonal()), torch.zeros(8, 8, dtype=torch.float64),
                          atol=1e-3 * cov.diagonal().max().item())
    assert torch.allclose(f["mu"].double(), x.mean(0), atol=1e-4)


def test_transform_bits_follow_the_variances_and_codes_stay_in_range():
    x, m = _correlated_rows(), _metric()
    f = cbq.fit_transform(x.float(), m, total_bits=24, max_bits=8)
    bits = f["bits"]
    assert int(bits.sum()) == 24 and bits.max() <= 8
    y = ((x.float() - f["mu"]) @ f["T"])
    var = y.var(0)
    order = var.argsort(descending=True)
    assert (bits[order][:-1] >= bits[order][1:]).all()  # more variance, never fewer bits
    assert torch.equal(f["levels"], f["levels"].half().float())
    codes = cbq.transform_codes(x.float(), f)
    assert (codes < (2 ** bits)[None]).all() and codes.min() >= 0
    # a coefficient of 0 bits decodes to 0: its level row is all zeros
    for c in (bits == 0).nonzero(as_tuple=True)[0].tolist():
        assert f["levels"][c].abs().max() == 0


def test_transform_round_trip_is_exact_on_what_its_levels_hold_and_error_falls_with_bits():
    x, m = _correlated_rows(), _metric()
    f = cbq.fit_transform(x.float(), m, total_bits=24, max_bits=8)
    # rows whose coefficients are exactly levels decode to themselves (up to fp32)
    codes = torch.stack([torch.randint(0, 2 ** int(b), (16,), generator=torch.Generator().manual_seed(c))
                         for c, b in enumerate(f["bits"].tolist())], 1)
    rows = cbq.transform_decode(codes, f)
    assert torch.equal(cbq.transform_codes(rows, f), codes)

    def err(bits):
        g = cbq.fit_transform(x.float(), m, total_bits=bits, max_bits=8)
        e = (cbq.transform_decode(cbq.transform_codes(x.float(), g), g).double() - x)
        return float(torch.einsum("nd,de,ne->", e, m, e) / len(x))
    e8, e24, e48 = err(8), err(24), err(48)
    assert e48 < e24 < e8


def test_transform_bytes():
    assert cbq.transform_bytes(1, 1, 64) == (2 * 64 * 64 + 64 + 64 * 256) * 2
    assert cbq.transform_bytes(30, 3, 64) == 4_435_200


# ---- entropy-coded transform coding ----

def test_symbol_bits_by_hand():
    one, s2 = torch.tensor(1.0, dtype=torch.float64), torch.tensor(2.0 ** 0.5, dtype=torch.float64)
    gauss, lap = torch.tensor(False), torch.tensor(True)
    # Gaussian, step = sigma: P(0) = erf(1 / (2 sqrt 2)) = 0.382925
    assert ktf.symbol_bits(torch.tensor(0), one, one, gauss).item() == pytest.approx(-math.log2(0.3829249225), 1e-9)
    # P(1) = Phi(1.5) - Phi(0.5) = 0.241730
    assert ktf.symbol_bits(torch.tensor(1), one, one, gauss).item() == pytest.approx(-math.log2(0.2417303375), 1e-8)
    # Laplacian of sigma sqrt 2 (scale 1), step 1: P(0) = 1 - e^-1/2, P(+-2) = e^-3/2 (1 - e^-1) / 2
    assert ktf.symbol_bits(torch.tensor(0), one, s2, lap).item() == pytest.approx(-math.log2(1 - math.exp(-0.5)))
    p2 = math.exp(-1.5) * (1 - math.exp(-1)) / 2
    assert ktf.symbol_bits(torch.tensor([2, -2]), one, s2, lap).tolist() == pytest.approx([-math.log2(p2)] * 2)
    # far tails cost the floor's 24 bits, not infinity
    assert ktf.symbol_bits(torch.tensor(10 ** 4), one, one, gauss).item() == pytest.approx(24.0)
    # each model's probabilities sum to 1 over the symbols (to within the floor's mass on the far tail's few)
    k = torch.arange(-60, 61)
    for fam in (gauss, lap):
        p = 2.0 ** -ktf.symbol_bits(k, torch.tensor(0.3, dtype=torch.float64), one, fam)
        assert p.sum().item() == pytest.approx(1.0, abs=1e-5)


def test_step_codes_are_eighth_octaves_around_the_base():
    base = torch.tensor(0.5, dtype=torch.float64)
    steps = cbq.step_of(base, torch.tensor([0, 120, 128, 129, 136, 144, 255]))
    assert steps.tolist() == pytest.approx([0.5 / 2 ** 16, 0.25, 0.5, 0.5 * 2 ** 0.125, 1.0, 2.0, 0.5 * 2 ** (127 / 8)])


def _ec_fit(nbytes=4, n=2048, seed=0):
    x, m = _correlated_rows(n=n, seed=seed), _metric()
    return x, m, ktf.fit_transform_ec(x[: n // 2], m, nbytes)


def _mixed_fit(nbytes=2, n=8192, seed=5):
    """Two independent channels, a Gaussian of deviation 1 and a Laplacian of deviation 3: one of each model."""
    g = torch.Generator().manual_seed(seed)
    gauss = torch.randn(n, generator=g, dtype=torch.float64)
    torch.manual_seed(seed)
    lap = torch.distributions.Laplace(0.0, 3.0 / 2 ** 0.5).sample((n,)).double()
    x = torch.stack((gauss, lap), 1)
    return x, ktf.fit_transform_ec(x, torch.eye(2, dtype=torch.float64), nbytes)


@needs_coder
@pytest.mark.parametrize("adapt", [False, True])
def test_ec_quantise_fits_every_block_with_the_smallest_step_and_bounds_each_coefficient(adapt):
    x, m, f = _ec_fit(nbytes=4)
    held = x[1024:1024 + 16 * 12 + 7]  # 12 whole blocks and a short one
    xq, code, scale_code, used = cbq.ec_quantise(held, f, adapt)
    header = 2 if adapt else 1
    rows = torch.tensor([16] * 12 + [7])
    assert (used <= rows * 4).all()
    if not adapt:
        assert (cbq.MODEL_SCALES[scale_code] == 1).all()
    y, yq = ((held - f["mu"].double()) @ f["T"].double(), (xq - f["mu"].double()) @ f["T"].double())
    base = float(f["base"])
    for b in range(13):
        step = float(cbq.step_of(f["base"], code[b:b + 1])[0])
        sl = slice(16 * b, 16 * b + int(rows[b]))
        # each coefficient within half a step of its row's, on the block's step grid
        assert ((y[sl] - yq[sl]).abs() <= step / 2 + 1e-4 * step).all()  # T and Ti are fp32
        assert torch.allclose(yq[sl] / step, (yq[sl] / step).round(), atol=1e-4)
        # the block's words at its code decode to those symbols; one code finer does not fit
        yb = (y[sl] / base)[None]
        c0 = ke.class_of(f["sigma"].double() * float(cbq.MODEL_SCALES[scale_code[b]]) / base)[None]
        r = rows[b:b + 1]
        nw, words = ke.encode_blocks(yb, r, c0, f["laplace"], code[b:b + 1], cap=64)
        assert used[b] == header + 2 * int(nw[0])
        k = ke.decode_blocks(words, nw, code[b:b + 1], r, c0, f["laplace"], int(rows[b]))
        assert torch.equal(k[0].long(), (y[sl] / step).round().long())
        finer, _ = ke.encode_blocks(yb, r, c0, f["laplace"], code[b:b + 1] - 1, cap=64)
        assert code[b] == 0 or header + 2 * int(finer[0]) > int(rows[b]) * 4

    def err(nbytes):
        g = ktf.fit_transform_ec(x[:1024], m, nbytes)
        e = cbq.ec_quantise(held, g, adapt)[0] - held
        return float(torch.einsum("nd,de,ne->", e, m, e) / len(held))
    assert err(6) < err(4) < err(2)


@needs_coder
def test_ec_adaptive_blocks_name_the_deviation_their_rows_have():
    x, _, f = _ec_fit(nbytes=4)
    mu = f["mu"].double()
    held = x[1024:1024 + 64]
    for spread, side in ((8.0, 1), (1 / 8, -1)):  # rows spread 8x wider, or 8x narrower, than the calibration's
        rows = mu + (held - mu) * spread
        _, code, scale_code, used = cbq.ec_quantise(rows, f, adapt=True)
        assert ((cbq.MODEL_SCALES[scale_code] - 1) * side > 0).all()
        _, code1, _, _ = cbq.ec_quantise(rows, f, adapt=False)
        assert (code <= code1).all() and (code < code1).any()  # a model that fits codes at finer steps


def test_ec_fit_picks_each_coefficients_model_and_a_base_step_that_fills_the_budget():
    x, f = _mixed_fit(nbytes=2)
    # the principal axes are the channels (ascending variance): the Gaussian first, then the Laplacian
    assert f["laplace"].tolist() == [False, True]
    assert f["sigma"].tolist() == pytest.approx([1.0, 3.0], rel=0.05)
    y = (x - f["mu"].double()) @ f["T"].double()
    bits = ktf.symbol_bits((y / f["base"]).round(), f["base"], f["sigma"], f["laplace"]).sum(1).mean()
    assert bits.item() == pytest.approx((2 - 5 / 16) * 8, rel=1e-3)


def test_block_rows_symbols_and_model_bytes():
    assert cbq.block_rows(32, 16).tolist() == [16, 16]
    assert cbq.block_rows(39, 16).tolist() == [16, 16, 7]
    assert cbq.block_rows(5, 16).tolist() == [5]
    y = torch.tensor([0.49, 0.51, -1.6, 1e9, -1e9], dtype=torch.float64)
    assert cbq.to_symbols(y, 1.0).tolist() == [0, 1, -2, cbq.SYMBOL_RANGE - 1, -cbq.SYMBOL_RANGE]
    assert cbq.to_symbols(y[:3], 0.5).tolist() == [1, 1, -3]
    # SmolLM2: 90 layer-heads of T, Ti, mean and deviations (fp16), a model byte a coefficient, a 4-byte base
    assert cbq.transform_ec_bytes(30, 3, 64) == 90 * ((2 * 64 * 64 + 128) * 2 + 64 + 4) == 1_503_720


@needs_coder
def test_ec_slack_leaves_words_unused_and_coarsens_no_block_less():
    x, _, f = _ec_fit(nbytes=4)
    held = x[1024:1024 + 16 * 8]
    _, code0, _, used0 = cbq.ec_quantise(held, f)
    _, code3, _, used3 = cbq.ec_quantise(held, f, slack_words=3)
    words = (16 * 4 - 1) // 2  # a block's words: 64 bytes less the step's byte, 2 bytes a word
    assert (used3 <= 1 + 2 * (words - 3)).all() and (used0 > 1 + 2 * (words - 3)).any()
    assert (code3 >= code0).all() and (code3 > code0).any()


def _heads(spreads, n=1024, seed=3):
    """Heads of correlated rows, head ``h`` spread ``spreads[h]`` times the first's, under one metric."""
    x, m = _correlated_rows(n=n, seed=seed), _metric()
    mu = x.mean(0)
    return [mu + (x - mu) * s for s in spreads], [m] * len(spreads)


def _modelled_bytes(x, m, f):
    """A head's modelled bytes a row at its base step (each coefficient under its fitted model), plus a block's
    header and flush a row."""
    y = (x - f["mu"].double()) @ f["T"].double()
    bits = ktf.symbol_bits((y / f["base"]).round(), f["base"], f["sigma"], f["laplace"]).sum(1).mean()
    return bits.item() / 8 + (cbq.STEP_BYTES + ktf.FLUSH_BYTES) / 16


def test_shared_step_spends_the_budget_where_the_rows_vary_and_equal_steps_everywhere():
    xs, ms = _heads([1.0, 4.0, 16.0])
    fl = ktf.fit_transforms_ec_shared(xs, ms, 4)
    # one step for every head, and each head's bytes what its rows take at it: the budget in all
    assert [float(f["base"]) for f in fl] == pytest.approx([float(fl[0]["base"])] * 3, rel=1e-12)
    assert sum(f["nbytes"] for f in fl) == pytest.approx(3 * 4, rel=1e-3)
    for x, m, f in zip(xs, ms, fl, strict=True):
        assert f["nbytes"] == pytest.approx(_modelled_bytes(x, m, f), rel=1e-4)  # T, mu kept at fp32
    # a head spread 4x wider takes 2 bits more a coefficient (8 coefficients: 2 bytes a row), give or take
    # the coefficients near the step
    assert fl[0]["nbytes"] < fl[1]["nbytes"] < fl[2]["nbytes"]
    assert fl[2]["nbytes"] - fl[1]["nbytes"] == pytest.approx(2.0, abs=0.35)


def test_weights_set_each_heads_step_and_a_quiet_head_keeps_its_floor():
    xs, ms = _heads([1.0, 1.0, 1e-6])
    fl = ktf.fit_transforms_ec_shared(xs, ms, 4, weights=[1.0, 16.0, 1.0], min_bytes=0.5)
    # the weighted step is shared: a head whose error costs 16x gets a step 4x finer, and 2 bits more a coefficient
    steps = [float(f["base"]) * w ** 0.5 for f, w in zip(fl, (1.0, 16.0, 1.0), strict=True)]
    assert steps == pytest.approx([steps[0]] * 3, rel=1e-12)
    assert fl[1]["nbytes"] - fl[0]["nbytes"] == pytest.approx(2.0, abs=0.35)
    # rows that barely vary code in a block's header, flush and the floor
    assert fl[2]["nbytes"] == pytest.approx((cbq.STEP_BYTES + ktf.FLUSH_BYTES) / 16 + 0.5)
    assert sum(f["nbytes"] for f in fl) == pytest.approx(12, rel=1e-3)
    with pytest.raises(ValueError, match="positive weight"):
        ktf.fit_transforms_ec_shared(xs, ms, 4, weights=[1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="positive weight"):
        ktf.fit_transforms_ec_shared(xs, ms, 4, weights=[1.0, 1.0])


def test_a_first_blocks_held_rows_are_paid_by_every_head_at_one_coarser_step():
    xs, ms = _heads([1.0, 4.0, 16.0])
    plain = ktf.fit_transforms_ec_shared(xs, ms, 4)
    first = ktf.fit_transforms_ec_shared(xs, ms, 4, held=1)
    d = xs[0].shape[1]
    assert sum(f["nbytes"] for f in first) == pytest.approx(3 * 4, rel=1e-3)  # the same budget
    assert [float(f["base"]) for f in first] == pytest.approx([float(first[0]["base"])] * 3, rel=1e-12)
    assert float(first[0]["base"]) > float(plain[0]["base"])  # the held rows' 2 d bytes a head come out of it
    for x, m, f in zip(xs, ms, first, strict=True):
        # 15 coded rows at the step, then a block's header, flush and its held row at bf16: a row's share of each
        coded = _modelled_bytes(x, m, f) - (cbq.STEP_BYTES + ktf.FLUSH_BYTES) / 16
        assert f["nbytes"] == pytest.approx(coded * 15 / 16 + (cbq.STEP_BYTES + ktf.FLUSH_BYTES + 2 * d) / 16,
                                            rel=1e-4)


def test_block_budget_rounds_a_heads_share_down():
    assert cbq.block_budget(torch.tensor([16, 16, 7]), 4).tolist() == [64, 64, 28]
    assert cbq.block_budget(torch.tensor([16, 7]), 2.53).tolist() == [40, 17]  # 40.48 and 17.71, down
    assert cbq.block_budget(torch.tensor([16]), 36.6875).tolist() == [587]  # exact products stay exact


@needs_coder
def test_ec_quantise_keeps_a_fractional_share_within_its_bytes():
    xs, ms = _heads([1.0, 3.0], n=2048)
    fl = ktf.fit_transforms_ec_shared([x[:1024] for x in xs], ms, 4)
    for x, f in zip(xs, fl, strict=True):
        assert f["nbytes"] != int(f["nbytes"])
        held = x[1024:1024 + 16 * 6 + 5]
        _, _, _, used = cbq.ec_quantise(held, f)
        budget = cbq.block_budget(cbq.block_rows(len(held), 16), f["nbytes"])
        assert (used <= budget).all() and (used >= budget - 2).all()  # a word short at most: the words are 2 bytes


@needs_coder
@pytest.mark.parametrize("adapt", [False, True])
def test_ec_held_rows_take_their_bytes_from_block_zero_and_come_back_as_given(adapt):
    x, _, f = _ec_fit(nbytes=6)
    held_rows = x[1024:1024 + 16 * 3 + 5]
    xq0, code0, _, used0 = cbq.ec_quantise(held_rows, f, adapt)
    xq, code, _, used = cbq.ec_quantise(held_rows, f, adapt, held=2)
    d = held_rows.shape[1]
    # block 0 holds 2 rows at bf16 and codes 14 in the rest of its 96 bytes: a coarser step than with all 16 coded
    assert used[0] <= 16 * 6 and used0[0] <= 16 * 6 and code[0] > code0[0]
    assert torch.equal(code[1:], code0[1:]) and torch.equal(used[1:], used0[1:])  # the others unchanged
    assert torch.equal(xq[:2], held_rows[:2].bfloat16().to(xq.dtype))  # the held rows, at bf16
    assert d == 8
    assert torch.allclose(xq[16:], xq0[16:])
    y = (held_rows - f["mu"].double()) @ f["T"].double()
    yq = (xq - f["mu"].double()) @ f["T"].double()
    step = float(cbq.step_of(f["base"], code[:1])[0])
    assert ((y[2:16] - yq[2:16]).abs() <= step / 2 + 1e-4 * step).all()  # block 0's coded rows on its step's grid
    with pytest.raises(ValueError, match="held rows"):
        cbq.ec_quantise(held_rows, f, adapt, held=16)
