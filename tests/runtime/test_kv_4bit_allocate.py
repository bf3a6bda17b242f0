"""The per-layer mix of the 4-bit KV screen (benchmarks/kv_4bit_screen.py ``allocate``) on hand-made KL
tables: the least summed KL within the bytes, worked out by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def screen():
    sys.path.insert(0, str(_BENCH))  # the screen imports kv_codebooks beside it
    try:
        spec = importlib.util.spec_from_file_location("kv_4bit_screen", _BENCH / "kv_4bit_screen.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(_BENCH))
    return mod


# keys: kivi4 48 B, tok4h 36 B; values: tok4h 36 B, tok3h 28 B (per token and layer-head)
SCAN = {
    "k:kivi4": [1.0, 1.0, 1.0],
    "k:tok4h": [9.0, 2.0, 9.0],  # layer 1's keys lose little at 36 B
    "v:tok4h": [1.0, 1.0, 1.0],
    "v:tok3h": [1.5, 5.0, 4.0],  # layer 0's values lose little at 28 B
}
COSTS = {"k:kivi4": 48, "k:tok4h": 36, "v:tok4h": 36, "v:tok3h": 28}


def test_room_for_everything_takes_the_best_of_each_layer(screen):
    kl, used, picks = screen.allocate(SCAN, COSTS, 3, 84)
    assert picks == [("kivi4", "tok4h")] * 3
    assert kl == pytest.approx(6.0)
    assert used == pytest.approx(84)


def test_each_saving_goes_where_it_costs_least(screen):
    # 8 B short over three layers: one value downgrade (8 B), the cheapest one: layer 0's (+0.5)
    kl, used, picks = screen.allocate(SCAN, COSTS, 3, (3 * 84 - 8) / 3)
    assert picks == [("kivi4", "tok3h"), ("kivi4", "tok4h"), ("kivi4", "tok4h")]
    assert kl == pytest.approx(6.5)
    # 12 B short: a key downgrade (12 B) at layer 1 (+1.0) beats two value downgrades (16 B, +0.5 +3.0)
    kl, used, picks = screen.allocate(SCAN, COSTS, 3, (3 * 84 - 12) / 3)
    assert picks == [("kivi4", "tok4h"), ("tok4h", "tok4h"), ("kivi4", "tok4h")]
    assert kl == pytest.approx(7.0)
    # 20 B short: both of the above (+1.5), not layer 1's two downgrades (+5.0)
    kl, used, picks = screen.allocate(SCAN, COSTS, 3, (3 * 84 - 20) / 3)
    assert picks == [("kivi4", "tok3h"), ("tok4h", "tok4h"), ("kivi4", "tok4h")]
    assert kl == pytest.approx(7.5)
    assert used * 3 == pytest.approx(3 * 84 - 20)


def test_nothing_fits(screen):
    assert screen.allocate(SCAN, COSTS, 3, 63) is None  # the cheapest pair is 64 B


def test_transform_quantisers_name_their_rope_side_and_bytes(screen):
    smollm2 = screen.Shape(30, 3, 64)
    k, pk = screen.quantiser("klt37", "k"), screen.quantiser("pklt37", "k", smollm2)
    pv = screen.quantiser("pklt37", "v")
    assert (k.pre_rope, k.bytes) == (False, 37)
    assert (pk.pre_rope, pk.bytes) == (True, 37)  # keys before RoPE: RoPE applied to the decoded key
    assert (pv.pre_rope, pv.bytes) == (False, 37)  # values have no RoPE side
    assert pk.model_bytes == 4_435_200  # per model, from its shape
    assert k.model_bytes is None  # no shape given, no per-model figure


def test_a_query_turned_back_to_the_key_position_scores_a_pre_rope_key_error(screen):
    """What the pre-RoPE key metric rests on: a pre-RoPE key error e at position n moves query m's score by
    (R_n^T q_m) . e, R_n^T being RoPE at n with the sine negated."""
    import torch

    g = torch.Generator().manual_seed(0)
    d, t = 8, 12
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    ang = torch.arange(t).float()[:, None] * inv[None]
    ang = torch.cat((ang, ang), -1)
    cos, sin = ang.cos(), ang.sin()
    q, k, e = (torch.randn(t, 1, d, generator=g, dtype=torch.float64) for _ in range(3))
    cos, sin = cos.double(), sin.double()
    m, n = 9, 4
    moved = (screen.rope(q, cos, sin)[m] * (screen.rope(k + e, cos, sin)[n] - screen.rope(k, cos, sin)[n])).sum()
    turned = screen.rope(screen.rope(q, cos, sin)[m:m + 1], cos[n:n + 1], -sin[n:n + 1])[0]
    assert torch.allclose(moved, (turned * e[n]).sum(), atol=1e-12)
    assert torch.allclose(screen.rope(screen.rope(k, cos, sin), cos, -sin), k, atol=1e-12)  # R^T R = I


def test_the_screens_byte_figures_are_the_format_registrys(screen):
    """The screen's bytes per token come from the model's shape and the KV-format registry, which owns every
    byte figure: bf16's is the registry's, and its quantisers that mirror a shipped format's grids (KIVI keys per
    channel over the block, 4-bit values per token: ``int4``; bf16 both sides) cost what that format does."""
    shape = screen.Shape(30, 3, 64)  # SmolLM2-135M
    assert shape.token_bytes("bf16") == 30 * 3 * 64 * 2 * 2 == 23040
    assert shape.scheme_bytes("kivi4", "tok4") == shape.token_bytes("int4") == 7560
    assert shape.scheme_bytes("bf16", "bf16") == shape.token_bytes("bf16")
    assert shape.scheme_bytes("pklt37", "tok4h") == (37 + 36) * 90  # a transform code's bytes are its name's
    assert shape.scheme_bytes("kva40", "tok4h") == (40 + 36) * 90
    assert shape.scheme_bytes("none", "tok4h") is None  # a side left exact has no byte figure
    assert screen.quantiser("kivi4", "k", shape).bytes == 48


def test_the_screen_reads_its_shape_from_the_model(screen):
    class Attn:
        kv_heads, head_dim = 5, 64

    class Layer:
        self_attn = Attn()

    class Model:
        layers = [Layer()] * 7

    shape = screen.Shape.of(Model())
    assert (shape.layers, shape.kv_heads, shape.layer_heads) == (7, 5, 35)
    assert shape.token_bytes("bf16") == 7 * 5 * 64 * 2 * 2
    Attn.head_dim = 128
    with pytest.raises(SystemExit, match="head dim 64"):
        screen.Shape.of(Model())


def test_kind_balanced_kl_weighs_each_kind_the_same(screen):
    import torch

    names = ["prose:a", "prose:b", "code:a", "chat:a"]
    kls = [torch.tensor([1.0, 1.0]), torch.tensor([4.0]), torch.tensor([2.0, 2.0, 2.0, 2.0]), torch.tensor([0.0])]
    # prose: (1 + 1 + 4) / 3 = 2 over its three positions; code 2; chat 0 -> (2 + 2 + 0) / 3
    assert screen.kind_balanced_kl(names, kls) == pytest.approx(4 / 3)


class _Tok:
    """Token ids of a text: one per 4 characters (the calibration's structure, not real ids)."""

    def __call__(self, text, add_special_tokens=False):
        return type("Enc", (), {"input_ids": list(range(len(text) // 4))})()


def test_calibrations_nest_and_add_one_prose_and_one_code_text_per_step(screen):
    if not (screen.PEERS / "workload.json").exists():
        pytest.skip("the peer workload (../shared/peers) is not here")
    narrow, kinds, wide = (screen.calibration_texts(_Tok(), c) for c in ("narrow", "kinds", "wide"))
    assert len(narrow) == 8 and len(kinds) == 10 and len(wide) == 16
    assert kinds[2:] == narrow and wide[8:] == narrow  # the narrow texts last, in their order (cache keys)
    assert kinds[:2] == [wide[0], wide[4]]  # the first licence and the first module


def test_shared_step_quantisers_parse_and_refuse_the_fixed_rate_transform(screen):
    for tail in ("r", "w", "j"):
        k, v = screen.quantiser(f"pklte33{tail}", "k"), screen.quantiser(f"klte40{tail}", "v")
        assert (k.pre_rope, k.bytes, v.pre_rope, v.bytes) == (True, 33, False, 40)  # the average a row
    with pytest.raises(ValueError, match="entropy-coded"):
        screen.quantiser("klt37w", "k")


def test_whitened_noise_has_a_uniform_quantisers_power_in_what_an_error_costs(screen):
    import torch

    g = torch.Generator().manual_seed(0)
    d, n = 8, 20000
    fits = []
    for h in range(2):
        t = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0] * (1 + h)  # whitening * turn
        fits.append({"T": t, "Ti": torch.linalg.inv(t), "base": torch.tensor(0.3 * (1 + h), dtype=torch.float64)})
    x = torch.randn(n, 2, d, generator=g)
    out = screen.whitened_noise(x, fits, torch.Generator().manual_seed(1))
    for h, f in enumerate(fits):
        y = (out[:, h] - x[:, h]).double() @ f["T"]  # the noise in the head's whitened coefficients
        assert y.std(0).tolist() == pytest.approx([float(f["base"]) / 12 ** 0.5] * d, rel=0.03)
        assert y.mean(0).abs().max().item() < 0.01
