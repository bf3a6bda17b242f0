"""The elementwise layer kernels and packed projections: native and torch compute the same thing.

The native cases need the kernels ``make install`` builds; with ``KVLEDGER_NATIVE=0`` they are skipped
and the fallback is checked instead.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvledger.runtime import native
from kvledger.runtime.kernels import NativeKernels, TorchKernels, default_kernels
from kvledger.runtime.model import Linear


@pytest.fixture(scope="module")
def nk() -> NativeKernels:
    if os.environ.get(native.NATIVE_ENV) == "0":
        pytest.skip("KVLEDGER_NATIVE=0: only the pure-torch paths")
    return NativeKernels()  # ConfigError (a failure) when make install did not build the kernels


TK = TorchKernels()
GEN = torch.Generator().manual_seed(0)


def _r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (3 * torch.randn(*shape, generator=GEN)).to(dtype)


@pytest.mark.parametrize("rows", [1, 7, 32, 300])  # inline (a decode step) and threaded (a prefill)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_the_residual_add(nk: NativeKernels, rows: int, dtype: torch.dtype) -> None:
    x, add, w = _r(rows, 576, dtype=dtype), _r(rows, 576, dtype=dtype), _r(576, dtype=dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    torch.testing.assert_close(nk.rms_norm(x.clone(), w, 1e-5), TK.rms_norm(x.clone(), w, 1e-5), **tol)
    xn, xt = x.clone(), x.clone()
    out_n, out_t = nk.rms_norm(xn, w, 1e-5, add), TK.rms_norm(xt, w, 1e-5, add)
    assert torch.equal(xn, xt)  # the residual stream: x + add, rounded once, in place
    torch.testing.assert_close(out_n, out_t, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_on_strided_views(nk: NativeKernels, dtype: torch.dtype) -> None:
    """q and k are views into one fused projection output (row stride wider than heads * dim)."""
    t, d = 50, 64
    fused = _r(t, 9 * d + 2 * 3 * d, dtype=dtype)
    angles = torch.arange(t).float()[:, None] * torch.rand(d // 2, generator=GEN)[None]
    angles = torch.cat((angles, angles), -1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    for lo, heads in ((0, 9), (9 * d, 3)):
        view = fused[:, lo:lo + heads * d].view(t, heads, d)
        ref = TK.rope_(view.clone(), cos, sin)
        got = nk.rope_(view, cos, sin)
        assert got.data_ptr() == view.data_ptr()  # rotated where it lies, no copy
        tol = {"atol": 1e-5, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
        torch.testing.assert_close(got, ref, **tol)


@pytest.mark.parametrize("inter", [1536, 100])  # vector path, and a tail shorter than a vector
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(nk: NativeKernels, inter: int, dtype: torch.dtype) -> None:
    gate_up = _r(40, 2 * inter, dtype=dtype)
    gate_up[0, :8] = torch.tensor([-100.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.0, 200.0]).to(dtype)  # extremes
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    torch.testing.assert_close(nk.silu_mul(gate_up, inter), TK.silu_mul(gate_up, inter), **tol)


@pytest.mark.parametrize("rows", [1, 2, 32, 600])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_equals_f_linear(rows: int, dtype: torch.dtype) -> None:
    lin = Linear(576, 960, bias=True).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(_r(960, 576, dtype=dtype) / 24)
        lin.bias.copy_(_r(960, dtype=dtype))
    x = _r(rows, 576, dtype=dtype)
    ref = F.linear(x, lin.weight, lin.bias)
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        # oneDNN's bf16 path needs AVX-512 (or AVX-NE-CONVERT): on an AVX2-only CPU pack() declines and
        # the layer keeps F.linear, with the same results.
        assert not lin.pack()
    else:
        assert lin.pack()
    with torch.inference_mode():
        got = lin(x)
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    torch.testing.assert_close(got, ref, **tol)


def test_a_single_row_goes_through_the_packed_weight() -> None:
    """A lone sequence's decode multiplies one row by every narrow weight: on the default GEMV path
    that step took 39 ms against 25 ms through oneDNN (SmolLM2, one thread), slower than a step of
    four sequences. The packed copy is what a one-row product reads: zeroing the weight afterwards
    (the packed copy goes stale, as documented) leaves the product unchanged."""
    lin = Linear(576, 960, bias=False)
    with torch.no_grad():
        lin.weight.copy_(_r(960, 576) / 24)
    x = _r(1, 576)
    ref = F.linear(x, lin.weight)
    assert lin.pack()
    with torch.no_grad():
        lin.weight.zero_()
    with torch.inference_mode():
        got = lin(x)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)


def test_without_the_build_everything_falls_back_to_torch(tmp_path) -> None:
    """KVLEDGER_NATIVE=0 (or no build for this machine): status says why, the defaults are the torch
    paths, and asking for the native backend by name is one clear error."""
    code = (
        "import torch\n"
        "from kvledger.runtime import native\n"
        "from kvledger.runtime.kernels import default_kernels\n"
        "from kvledger.runtime.attention import make_attention_backend\n"
        "from kvledger.runtime.kv_store import KVStore\n"
        "from kvledger.core import KVSpec\n"
        "from kvledger.errors import ConfigError\n"
        "s = KVStore(KVSpec(1, 1, 64, kv_dtype='fp32', block_size=16), 2)\n"
        "print(native.status())\n"
        "print(default_kernels('cpu').name, type(make_attention_backend('auto', s)).__name__)\n"
        "try:\n"
        "    make_attention_backend('native', s)\n"
        "except ConfigError as e:\n"
        "    print('error:', e)\n"
    )
    for env, why in (({native.NATIVE_ENV: "0"}, "disabled by KVLEDGER_NATIVE=0"),
                     ({native.DIR_ENV: str(tmp_path)}, "not built for this machine")):
        base = {k: v for k, v in os.environ.items() if k != native.NATIVE_ENV}
        out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True,
                             text=True, timeout=120, check=True).stdout.splitlines()
        assert why in out[0]
        assert out[1] == "torch TorchPagedAttention"
        assert out[2].startswith("error: the native CPU kernels are unavailable: " + why)


def test_default_kernels_are_native_where_built() -> None:
    if os.environ.get(native.NATIVE_ENV) == "0":
        assert default_kernels("cpu").name == "torch"
    else:
        assert default_kernels("cpu").name == "native", native.status()
    assert default_kernels("meta").name == "torch"


def test_bf16_residual_stream_rounds_as_torch_does(nk: NativeKernels) -> None:
    """The vectorised bf16 add rounds ties to even and keeps inf and NaN, as torch's bf16 add does:
    1 + 2^-8 is a tie that stays at 1; 1 + 3 * 2^-8 and 1.0078125 + 2^-8 are ties that round up to even."""
    x = torch.ones(3, 576, dtype=torch.bfloat16)
    add = torch.full((3, 576), 2.0 ** -8, dtype=torch.bfloat16)
    add[1] = 3 * 2.0 ** -8
    x[2] = 1.0078125
    x[0, :4] = torch.tensor([float("inf"), float("nan"), -3.0e38, 3.0e38])
    add[0, :4] = torch.tensor([1.0, 1.0, -3.0e38, 3.0e38])
    xn, xt = x.clone(), x.clone()
    nk.rms_norm(xn, torch.ones(576, dtype=torch.bfloat16), 1e-5, add)
    TK.rms_norm(xt, torch.ones(576, dtype=torch.bfloat16), 1e-5, add)
    assert torch.equal(xn[:, 4:], xt[:, 4:]) and torch.equal(xn[0, :4].isnan(), xt[0, :4].isnan())
    assert xn[0, 0] == float("inf") and xn[0, 2] == float("-inf") and xn[0, 3] == float("inf")
    assert xn[0, 5] == 1.0 and xn[1, 5] == 1.015625 and xn[2, 5] == 1.015625
