"""The bf16 path follows the CPU's flags: AMX runs small bf16 products on one thread, others keep today's path."""

from __future__ import annotations

import pytest
import torch

from kvledger.errors import ConfigError
from kvledger.runtime import cpu_features
from kvledger.runtime.cpu_features import PATH_ENV, bf16_path, cpu_flags, cpu_model, path_for_flags
from kvledger.runtime.model import AMX_ONE_THREAD_ROWS, Linear

SAPPHIRE_RAPIDS = "fpu avx2 avx512f avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8"
COOPER_LAKE = "fpu avx2 avx512f avx512_bf16"
EPYC_ZEN2 = "fpu avx2 fma"


@pytest.mark.parametrize(("flags", "path"), [(SAPPHIRE_RAPIDS, "amx"), (COOPER_LAKE, "avx512_bf16"),
                                             (EPYC_ZEN2, "avx2"), ("amx_tile avx2", "avx2"), ("", "avx2")])
def test_the_path_follows_the_flags(flags: str, path: str) -> None:
    cpuinfo = f"processor\t: 0\nmodel name\t: x\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n"
    assert path_for_flags(cpu_flags(cpuinfo)) == path


def test_the_model_name_is_the_first_processors() -> None:
    cpuinfo = "processor\t: 0\nmodel name\t: AMD EPYC 9R14 96-Core Processor\nflags\t: avx2\n\nprocessor\t: 1\n" \
              "model name\t: other\n"
    assert cpu_model(cpuinfo) == "AMD EPYC 9R14 96-Core Processor"
    assert cpu_model("Features\t: fp asimd\n") is None  # an ARM board names no model this way


def test_this_machine_is_detected_as_torch_sees_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PATH_ENV, raising=False)
    monkeypatch.setattr(cpu_features, "_detected", None)
    want = "amx" if torch.cpu._is_amx_tile_supported() else (
        "avx512_bf16" if torch.cpu._is_avx512_bf16_supported() else "avx2")
    assert bf16_path() == want


def test_the_override_and_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PATH_ENV, "avx2")
    assert bf16_path() == "avx2"
    monkeypatch.setenv(PATH_ENV, "amx512")
    with pytest.raises(ConfigError, match="KVLEDGER_BF16_PATH='amx512': expected auto, amx, avx512_bf16, avx2"):
        bf16_path()


def _packed(dtype: torch.dtype) -> Linear:
    lin = Linear(576, 1728, bias=False).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(1728, 576, generator=torch.Generator().manual_seed(0)).to(dtype) / 24)
    if not lin.pack():
        pytest.skip("oneDNN declines this dtype on this CPU")
    return lin


@pytest.mark.parametrize("path", ["amx", "avx512_bf16", "avx2"])
def test_only_amx_runs_small_bf16_products_on_one_thread(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    monkeypatch.setenv(PATH_ENV, path)
    assert _packed(torch.bfloat16)._one_thread_rows == (AMX_ONE_THREAD_ROWS if path == "amx" else 0)
    assert _packed(torch.float32)._one_thread_rows == 0  # fp32 is arithmetic-bound: both threads pay off


@pytest.mark.parametrize("rows", [1, 32, AMX_ONE_THREAD_ROWS, AMX_ONE_THREAD_ROWS + 1])
def test_one_thread_changes_no_result_and_restores_the_threads(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    """The routing only threads the product differently: bit for bit the two-thread result, and the
    thread count afterwards is the caller's."""
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
    monkeypatch.setenv(PATH_ENV, "avx2")
    two = _packed(torch.bfloat16)
    monkeypatch.setenv(PATH_ENV, "amx")
    one = _packed(torch.bfloat16)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            a, b = one(x), two(x)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(a, b)
