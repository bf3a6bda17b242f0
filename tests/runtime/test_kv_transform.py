"""Transform-coded KV blocks in fixed slots (runtime/kv_transform.py) on hand-made tables: the slot's layout byte
by byte, round trips within half a step in the whitened basis, the smallest step that fits, a short block's
share, held rows kept at bf16 from the block's own bytes, corrupt slots refused, and the tables' checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvledger.errors import ConfigError
from kvledger.runtime import kv_entropy as ke
from kvledger.runtime import kv_transform as kt
from kvledger.runtime import native

pytestmark = pytest.mark.skipif(not native.available() or not hasattr(native.load(), "ec_fit_blocks"),
                                reason="the native CPU kernels are not built")
D, B = 8, 16


def _code(row_bytes=((3.0, 5.5),), seed=0) -> kt.SideCode:
    """One layer (or more) of two heads of width 8: a random turn (so x and y differ), deviations 2^-3 .. 2^4, every
    third coefficient Laplacian."""
    g = torch.Generator().manual_seed(seed)
    rb = torch.tensor(row_bytes, dtype=torch.float64)
    layers, heads = rb.shape
    turn = torch.linalg.qr(torch.randn(layers, heads, D, D, generator=g, dtype=torch.float64))[0] * 0.5
    return kt.SideCode(
        mu=torch.randn(layers, heads, D, generator=g, dtype=torch.float64),
        turn=turn, back=torch.linalg.inv(turn),
        sigma=(2.0 ** torch.linspace(-3, 4, D, dtype=torch.float64)).expand(layers, heads, D).clone(),
        laplace=(torch.arange(D) % 3 == 0).expand(layers, heads, D).clone(),
        base=torch.full((layers, heads), 0.5, dtype=torch.float64), row_bytes=rb, block_size=B)


def _rows(code: kt.SideCode, n: int, layer=0, head=0, seed=1) -> torch.Tensor:
    """Rows whose coefficients follow the code's models: ``x = y back + mu``."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(n, B, D, generator=g, dtype=torch.float64) * code.sigma[layer, head]
    return (y @ code.back[layer, head] + code.mu[layer, head]).float()


def _coefficients(code, x, layer=0, head=0):
    return (x.double() - code.mu[layer, head]) @ code.turn[layer, head]


def test_slot_bytes_are_a_blocks_share_rounded_down():
    code = _code(((3.0, 5.5), (2.53, 36.6875)))
    assert code.slot_bytes.tolist() == [[48, 88], [40, 587]]  # 16 * 2.53 = 40.48, 16 * 36.6875 = 587 exactly
    assert kt.block_bytes(torch.tensor([16, 7]), 2.53).tolist() == [40, 17]


def test_round_trip_within_half_a_step_at_the_smallest_step_that_fits():
    code = _code()
    for head in (0, 1):
        x = _rows(code, 10, head=head, seed=head)
        slots, codes, used = code.encode(0, head, x)
        slot = int(code.slot_bytes[0, head])
        assert slots.shape == (10, slot) and slots.dtype == torch.uint8
        assert bool((used <= slot).all()) and bool((used > slot - 2).any())  # words fill the slot, a byte spare
        assert slots[:, 0].tolist() == codes.tolist()  # byte 0: the step code
        for b in range(10):  # after the used bytes: zeros
            assert int(slots[b, int(used[b]):].sum()) == 0
        xq = code.decode(0, head, slots)
        y, yq = _coefficients(code, x, head=head), _coefficients(code, xq, head=head)
        step = (0.5 * ke.step_rel(codes))[:, None, None]
        assert bool(((y - yq).abs() <= step / 2 * (1 + 1e-5) + 1e-6).all())
        # the words: little-endian 16-bit, the coder's at the block's code; one code finer does not fit the slot
        base = code.base[0, head]
        c0 = ke.class_of(code.sigma[0, head] / base)[None].expand(10, D)
        rows = torch.full((10,), B)
        nw, words = ke.encode_blocks(y / base, rows, c0, code.laplace[0, head], codes, cap=slot)
        assert bool((used == 1 + 2 * nw).all())
        w0 = words[0, :int(nw[0])]
        assert slots[0, 1:1 + 2 * len(w0)].tolist() == torch.stack((w0 & 0xFF, w0 >> 8), 1).flatten().tolist()
        finer, _ = ke.encode_blocks(y / base, rows, c0, code.laplace[0, head], codes - 1, cap=slot)
        assert bool((1 + 2 * finer > slot).all())


def test_a_short_block_gets_its_rows_share_and_reads_the_mean_past_them():
    code = _code()
    x = _rows(code, 2, head=1)
    rows = torch.tensor([16, 7])
    slots, codes, used = code.encode(0, 1, x, rows)
    assert int(used[1]) <= 7 * 5.5 and int(used[1]) > 7 * 5.5 - 3
    xq = code.decode(0, 1, slots, rows)
    assert torch.allclose(xq[1, 7:], code.mu[0, 1].float().expand(9, D))
    step = 0.5 * float(ke.step_rel(codes[1:2])[0])
    assert bool(((_coefficients(code, x[1, :7], head=1) - _coefficients(code, xq[1, :7], head=1)).abs()
                 <= step / 2 * (1 + 1e-5) + 1e-6).all())


def test_held_rows_stay_bf16_from_the_blocks_own_bytes():
    code = _code(((6.0625, 5.5),))  # a 97-byte slot: an odd stride between slots
    x = _rows(code, 3)
    plain, codes0, _ = code.encode(0, 0, x)
    slots, codes, used = code.encode(0, 0, x, held=1)
    # byte 0 the code, bytes 1..16 the held row at bf16, then the words; 97 - 1 - 16 bytes for 15 rows
    held = torch.stack([slots[b, 1:1 + 2 * D].clone().view(torch.bfloat16) for b in range(3)])
    assert held.tolist() == x[:, 0].bfloat16().tolist()
    assert bool((used <= 97).all()) and bool((codes >= codes0).all()) and bool((codes > codes0).any())
    xq = code.decode(0, 0, slots, held=1)
    assert torch.equal(xq[:, 0], x[:, 0].bfloat16().float())
    assert torch.equal(code.decode(0, 0, slots[:1], held=1), xq[:1])  # one slot alone (its bytes at an odd offset)
    step = (0.5 * ke.step_rel(codes))[:, None, None]
    assert bool(((_coefficients(code, x[:, 1:]) - _coefficients(code, xq[:, 1:])).abs()
                 <= step / 2 * (1 + 1e-5) + 1e-6).all())
    with pytest.raises(RuntimeError):  # the held row is not words: read as words, the slot does not decode
        code.decode(0, 0, slots)


def test_rows_kept_apart_leave_the_whole_slot_to_the_others():
    code = _code(((6.0625, 5.5),))  # a 97-byte slot
    x = _rows(code, 3)
    _, held_codes, _ = code.encode(0, 0, x, held=1)
    slots, codes, used = code.encode(0, 0, x, skip=1)
    assert slots.shape == (3, 97) and bool((used <= 97).all())
    assert bool((codes <= held_codes).all()) and bool((codes < held_codes).any())  # no bf16 row: a finer step
    xq = code.decode(0, 0, slots, skip=1)
    assert bool((xq[:, 0] == 0).all())  # the caller's row: not in the slot
    step = (0.5 * ke.step_rel(codes))[:, None, None]
    assert bool(((_coefficients(code, x[:, 1:]) - _coefficients(code, xq[:, 1:])).abs()
                 <= step / 2 * (1 + 1e-5) + 1e-6).all())  # rows 1.. in place, each within half a step
    with pytest.raises(ConfigError, match="not both"):
        code.encode(0, 0, x, held=1, skip=1)


def test_a_first_blocks_slot_is_sized_apart_where_the_tables_say():
    code = dataclasses.replace(_code(((6.0625, 5.5),)), first_row_bytes=torch.tensor([[9.0, 4.0]], dtype=torch.float64))
    assert code.slot_bytes.tolist() == [[97, 88]] and code.first_slot_bytes.tolist() == [[144, 64]]
    x = _rows(code, 3)
    slots, codes, used = code.encode(0, 0, x, held=1)  # a block holding rows: the first block's slot
    assert slots.shape == (3, 144) and bool((used <= 144).all()) and bool((used > 140).any())
    assert torch.equal(code.decode(0, 0, slots, held=1)[:, 0], x[:, 0].bfloat16().float())
    plain, _, _ = code.encode(0, 0, x)  # every other block: its own slot
    assert plain.shape == (3, 97)
    wider = dataclasses.replace(code, first_row_bytes=torch.tensor([[6.0625, 4.0]], dtype=torch.float64))
    assert bool((codes < wider.encode(0, 0, x, held=1)[1]).all())  # more bytes, a finer step
    assert torch.equal(kt.SideCode.from_dict(code.to_dict()).first_row_bytes, code.first_row_bytes)
    with pytest.raises(ConfigError, match="first_row_bytes"):
        dataclasses.replace(code, first_row_bytes=torch.ones(2, 2, dtype=torch.float64))


def test_corrupt_slots_are_refused():
    code = _code()
    x = _rows(code, 2)
    slots, _, used = code.encode(0, 0, x, spare_words=2)  # two words of padding at least
    assert bool((used <= 48 - 4).all())
    for at in (int(used[0]), 47):  # a padding word's byte; the odd byte past the last word (47 bytes after the code)
        pad = slots.clone()
        pad[0, at] = 7
        with pytest.raises(RuntimeError, match="corrupt"):
            code.decode(0, 0, pad)
    word = slots.clone()
    word[1, 2] ^= 0x40  # the state
    with pytest.raises(RuntimeError):
        code.decode(0, 0, word)


def test_bad_tables_and_blocks_are_refused():
    code = _code()
    with pytest.raises(ConfigError, match="turn"):
        kt.SideCode(**{**code.to_dict(), "turn": code.turn[..., :4]})
    with pytest.raises(ConfigError, match="at least 5 bytes"):
        kt.SideCode(**{**code.to_dict(), "row_bytes": torch.tensor([[0.25, 3.0]], dtype=torch.float64)})
    with pytest.raises(ConfigError, match="positive"):
        kt.SideCode(**{**code.to_dict(), "base": torch.tensor([[0.5, 0.0]], dtype=torch.float64)})
    x = _rows(code, 2)
    with pytest.raises(ConfigError, match="at most 16 rows"):
        code.encode(0, 0, torch.cat((x, x), 1))
    with pytest.raises(ConfigError, match="held"):
        code.encode(0, 0, x, torch.tensor([16, 1]), held=1)
    with pytest.raises(ConfigError, match="no step"):
        code.encode(0, 0, x * 1e9)  # far past any step the codes name
    with pytest.raises(ConfigError, match="finite"):
        code.encode(0, 0, x.masked_fill(torch.zeros_like(x, dtype=torch.bool).index_fill_(1, torch.tensor([3]), True),
                                        float("inf")))


def test_tables_from_per_head_fits_and_back():
    code = _code(((3.0, 5.5), (4.0, 2.5)))
    heads = [[{"mu": code.mu[li, h].float(), "T": code.turn[li, h].float(), "Ti": code.back[li, h].float(),
               "sigma": code.sigma[li, h], "laplace": code.laplace[li, h], "base": code.base[li, h],
               "nbytes": float(code.row_bytes[li, h])} for h in range(2)] for li in range(2)]
    again = kt.SideCode.from_heads(heads, B)
    assert again.slot_bytes.tolist() == code.slot_bytes.tolist()
    assert torch.allclose(again.turn, code.turn, atol=1e-6) and again.mu.dtype == torch.float64
    assert torch.equal(kt.SideCode.from_dict(code.to_dict()).row_bytes, code.row_bytes)
