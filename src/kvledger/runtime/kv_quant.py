"""Quantise and dequantise K/V rows for the quantised KV formats (``core.sizing.kv_formats``), in torch.

These are the reference definitions: the store writes through them (both attention paths read what they
wrote) and the torch read path dequantises with them; the native kernels' row loaders compute the same
dequantisation in C++. Scales and minimums are rounded to fp16 *before* the codes are computed, so a
stored code always means ``code * scale (+ minimum)`` with the stored scale.
"""

from __future__ import annotations

import functools
import math

import torch

FP8_MAX = 448.0  # largest finite e4m3fn value
_TINY = 1e-30  # guards a zero scale (an all-zero row: every code is 0)


def quant_token(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x [n, H, D]`` -> (codes ``[n, H, D]``, fp16 scale ``[n, H]``), one scale per token and head.

    ``fmt`` is the code element (``int8``; anything else is e4m3). int8: symmetric, ``s = amax / 127``,
    ``code = round(x / s)`` in [-127, 127].
    fp8-scaled: ``s = amax / 448``, ``code = e4m3(x / s)`` (round to nearest even by the cast)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    top = 127.0 if fmt == "int8" else FP8_MAX
    scale = (amax / top).to(torch.float16)
    s = scale.float().clamp_min(_TINY)[..., None]
    y = (xf / s).clamp(-top, top)
    codes = y.round().to(torch.int8) if fmt == "int8" else y.to(torch.float8_e4m3fn)
    return codes, scale


def dequant_token(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``codes [..., H, D]`` times their fp16 ``scale [..., H]``, in fp32."""
    return codes.float() * scale.float()[..., None]


def quant_channel(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys of whole blocks ``[n, B, H, D]`` -> (uint8 codes ``[n, B, H, D]``, fp16 scale and minimum
    ``[n, H, D]``): asymmetric per channel over the block's ``B`` tokens (KIVI/KVQuant's key grouping: an
    outlier channel gets a grid of its own instead of stretching every channel's), 256 codes from the
    minimum (rounded down to fp16) in steps of ``(max - min) / 255`` (rounded up), so every element is within
    half a step of its code and a channel with a large steady offset spends its codes on its spread."""
    codes, scale, low = _asym_codes(blocks, 1, 255.0)
    return codes.to(torch.uint8), scale.squeeze(1), low.squeeze(1)


def dequant_channel(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """``codes [..., H, D]`` with the block's per-channel ``scale``/``low [..., H, D]``, in fp32."""
    return codes.float() * scale.float() + low.float()


@functools.cache
def _hadamard_fp64(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(d)


def hadamard(d: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalised Walsh-Hadamard matrix of order ``d`` (a power of two): symmetric and orthogonal,
    ``H @ H == I``, so it is its own inverse and ``(q H) . (k H) == q . k``. Entries are ``+-1/sqrt(d)``."""
    if d <= 0 or d & (d - 1):
        raise ValueError(f"a Walsh-Hadamard matrix needs a power-of-two order, got {d}")
    return _hadamard_fp64(d).to(dtype=dtype, device=device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D] @ H`` in ``x``'s dtype (fp32 math for half types): turning, and turning back (``H`` is
    its own inverse)."""
    work = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    return (x.to(work) @ hadamard(x.shape[-1], work, x.device)).to(x.dtype)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``[..., D]`` (0..15) -> bytes ``[..., D / 2]``: channel ``2i`` in the low nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., D / 2]`` -> 4-bit codes ``[..., D]`` as fp32."""
    lo = (packed & 15).float()
    hi = (packed >> 4).float()
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def _fp16_down(x: torch.Tensor) -> torch.Tensor:
    """The largest fp16 value <= ``x`` (fp32)."""
    h = x.to(torch.float16)
    return torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, -math.inf)), h)


def _fp16_up(x: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 value >= ``x`` (fp32)."""
    h = x.to(torch.float16)
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, math.inf)), h)


def _asym(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit over ``dim``: ``code = round((x - low) / s)``, ``s = (max - low) / 15``.

    ``low`` is the group's minimum rounded *down* to fp16 and ``s`` is rounded *up*, so the whole group
    lies on the 16-code grid ``low + s * [0, 15]`` and every element is within ``s / 2`` of its code.
    (Rounded to nearest, a minimum whose rounding exceeds ``s / 2`` -- a channel whose spread is small
    against its magnitude, common for keys -- pushed the group's top off the grid: errors of several
    steps after the clamp.)"""
    codes, scale, low = _asym_codes(x, dim, 15.0)
    return _pack(codes), scale.squeeze(dim), low.squeeze(dim)


def _asym_codes(x: torch.Tensor, dim: int, top: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_asym``'s grid with ``top + 1`` codes: (codes as fp32, scale, low), scale and low keeping ``dim``."""
    mn = x.amin(dim=dim, keepdim=True).float()
    mx = x.amax(dim=dim, keepdim=True).float()
    low = _fp16_down(mn)
    scale = _fp16_up((mx - low.float()) / top)
    codes = ((x.float() - low.float()) / scale.float().clamp_min(_TINY)).round().clamp(0, top)
    return codes, scale, low


def quant_kivi_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys of whole blocks ``[n, B, H, D]`` -> (codes ``[n, B, H, D/2]``, scale ``[n, H, D]``,
    minimum ``[n, H, D]``): per channel, over the block's ``B`` tokens (KIVI's key grouping)."""
    return _asym(blocks, dim=1)


def quant_kivi_v(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values ``[..., H, D]`` -> (codes ``[..., H, D/2]``, scale ``[..., H]``, minimum ``[..., H]``): per
    token and head, over its ``D`` channels."""
    return _asym(rows, dim=-1)


def dequant_kivi_k(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """``codes [..., H, D/2]`` with the block's per-channel ``scale``/``low [..., H, D]``, in fp32."""
    return _unpack(codes) * scale.float() + low.float()


def dequant_kivi_v(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """``codes [..., H, D/2]`` with per-token ``scale``/``low [..., H]``, in fp32."""
    return _unpack(codes) * scale.float()[..., None] + low.float()[..., None]


__all__ = ["FP8_MAX", "dequant_channel", "dequant_kivi_k", "dequant_kivi_v", "dequant_token", "hadamard",
           "quant_channel", "quant_kivi_k", "quant_kivi_v", "quant_token", "rotate"]
