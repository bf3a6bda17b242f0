"""Decode-sized bf16 products on a CPU with bf16 matrix instructions run on the calling thread and one helper
thread that claim pieces of the weight (csrc/kvledger_helper_pool.h): the same output as the one-thread product,
whoever runs which piece. The output projection (a vocabulary-wide weight) is cut finer."""

from __future__ import annotations

import time

import pytest
import torch

from kvledger.runtime import native
from kvledger.runtime.cpu_features import PATH_ENV
from kvledger.runtime.model import (
    AMX_ONE_THREAD_ROWS,
    SPLIT_ENV,
    SPLIT_MAX_ROWS,
    SPLIT_PIECES,
    WIDE_OUT,
    WIDE_SPLIT_PIECES,
    Linear,
)

pytestmark = pytest.mark.skipif(not native.available() or not hasattr(native.load(), "SplitLinear"),
                                reason="native kernels not built")


def _layer(out: int, bias: bool, split: bool, monkeypatch: pytest.MonkeyPatch, path: str = "amx") -> Linear:
    monkeypatch.setenv(PATH_ENV, path)  # the routing decision only: oneDNN picks its own kernels
    monkeypatch.setenv(SPLIT_ENV, "1" if split else "0")
    lin = Linear(576, out, bias=bias).to(torch.bfloat16)
    g = torch.Generator().manual_seed(out)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out, 576, generator=g).bfloat16() / 24)
        if bias:
            lin.bias.copy_(torch.randn(out, generator=g).bfloat16())
    if not lin.pack():
        pytest.skip("oneDNN declines bf16 on this CPU")
    return lin


@pytest.mark.parametrize("out", [960, 576, 3072, 200])
@pytest.mark.parametrize("rows", [1, 32, SPLIT_MAX_ROWS, AMX_ONE_THREAD_ROWS])
def test_split_product_equals_the_one_thread_product(monkeypatch: pytest.MonkeyPatch, out: int, rows: int) -> None:
    split, one = _layer(out, out == 200, True, monkeypatch), _layer(out, out == 200, False, monkeypatch)
    assert split._split is not None and split._split.pieces == min(SPLIT_PIECES, out // 64)
    assert one._split is None
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            got, want = split(x), one(x)
            native.load().helper_enabled(0)  # every piece on the calling thread
            alone = split(x)
        assert torch.get_num_threads() == 2
    finally:
        native.load().helper_enabled(1)
        torch.set_num_threads(threads)
    assert got.shape == (rows, out) and torch.equal(got, want) and torch.equal(alone, want)


def test_the_helper_thread_takes_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """The point of the split: the second core multiplies some of the pieces (it claims them as they come,
    so on a busy machine this waits until the helper gets a time slice)."""
    lin = _layer(3072, False, True, monkeypatch)
    x = torch.randn(32, 576).bfloat16()
    mod = native.load()
    before = mod.helper_pieces()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        deadline = time.monotonic() + 30
        with torch.inference_mode():
            while mod.helper_pieces() == before and time.monotonic() < deadline:
                lin(x)
    finally:
        torch.set_num_threads(threads)
    assert mod.helper_pieces() > before


def test_one_thread_asked_keeps_the_product_on_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    lin = _layer(960, False, True, monkeypatch)
    mod = native.load()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        before = mod.helper_pieces()
        with torch.inference_mode():
            for _ in range(50):
                lin(torch.randn(32, 576).bfloat16())
        assert mod.helper_pieces() == before
    finally:
        torch.set_num_threads(threads)


def test_a_piece_that_fails_raises_on_the_caller() -> None:
    mod = native.load()
    w = torch.randn(128, 576).bfloat16()
    packed = [torch.ops.mkldnn._reorder_linear_weight(w[:64].contiguous(), 32),
              torch.ops.mkldnn._reorder_linear_weight(w[64:].contiguous(), 32)]
    lin = mod.SplitLinear(packed, [None, None], [0, 64, 128])
    with torch.inference_mode(), pytest.raises(RuntimeError):
        lin.forward(torch.randn(4, 100).bfloat16())  # wrong reduction width
    with torch.inference_mode():
        assert lin.forward(torch.randn(4, 576).bfloat16()).shape == (4, 128)  # and the helper still serves


def _one_thread(lin: Linear, x: torch.Tensor) -> torch.Tensor:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            return torch.ops.mkldnn._linear_pointwise(x, lin._packed, lin.bias, "none", [], "")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("path", ["amx", "avx512_bf16"])
@pytest.mark.parametrize("rows", [1, 32, SPLIT_MAX_ROWS])
def test_the_output_projection_splits_finer_and_changes_no_bit(monkeypatch: pytest.MonkeyPatch, path: str,
                                                               rows: int) -> None:
    out = WIDE_OUT + 1024  # vocabulary-wide: the output projection's routing (SmolLM2's is 49,152)
    lin = _layer(out, False, True, monkeypatch, path)
    assert lin._split is not None and lin._split.pieces == WIDE_SPLIT_PIECES
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            got = lin(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, _one_thread(lin, x))


def test_misordered_pieces_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The equality checks above can fail: the same pieces joined in the wrong order differ from the product."""
    lin = _layer(WIDE_OUT + 1024, False, True, monkeypatch)
    w = lin.weight.detach()
    width = lin.out_features // WIDE_SPLIT_PIECES // 64 * 64
    edges = [0, width, 2 * width, lin.out_features]
    pieces = [w[lo:hi].contiguous() for lo, hi in zip(edges, edges[1:], strict=False)]
    pieces[0], pieces[1] = pieces[1], pieces[0]  # two equal widths swapped: shapes fit, columns do not
    packed = [torch.ops.mkldnn._reorder_linear_weight(p, 32) for p in pieces]
    swapped = native.load().SplitLinear(packed, [None] * 3, edges)
    x = torch.randn(32, 576, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.inference_mode():
        assert not torch.equal(swapped.forward(x), _one_thread(lin, x))


@pytest.mark.parametrize("path", ["avx512_bf16", "avx2"])
def test_narrow_products_split_only_with_amx(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Without AMX a layer's products stay on OpenMP (measured slower split on AVX-512 BF16 under load); the
    output projection splits on every path with bf16 dot products, never on AVX2 or in fp32."""
    assert _layer(3072, False, True, monkeypatch, path)._split is None
    wide = _layer(WIDE_OUT + 1024, False, True, monkeypatch, path)
    assert (wide._split is not None) == (path == "avx512_bf16")
    monkeypatch.setenv(PATH_ENV, "amx")
    fp32 = Linear(576, WIDE_OUT + 1024, bias=False)
    if fp32.pack():
        assert fp32._split is None
