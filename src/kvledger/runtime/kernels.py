"""The elementwise steps of a decoder layer, in two interchangeable implementations.

:class:`TorchKernels` is plain torch (any device). :class:`NativeKernels` calls the compiled CPU kernels
(:mod:`kvledger.runtime.native`): one pass per row instead of one torch op per arithmetic step. Both
compute Hugging Face's Llama arithmetic (RMSNorm in fp32 then cast back, RoPE with the rotate-half
layout, SwiGLU) and agree to float rounding; the model takes whichever :func:`default_kernels` picks.
"""

from __future__ import annotations

from types import ModuleType
from typing import Protocol

import torch
import torch.nn.functional as F

from . import native


class LayerKernels(Protocol):
    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 add: torch.Tensor | None = None) -> torch.Tensor:
        """``rmsnorm(x) * weight``; with ``add``, first ``x += add`` in place (the residual stream)."""
        ...

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, heads, D]`` by ``cos``/``sin`` ``[T, D]``; may work in place. Returns it."""
        ...

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up = [gate | up]`` ``[T, 2 * inter]``."""
        ...


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 whatever the compute dtype: the mean of squares overflows/underflows in fp16.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class TorchKernels:
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 add: torch.Tensor | None = None) -> torch.Tensor:
        if add is not None:
            x.add_(add)
        return _torch_rms_norm(x, weight, eps)

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None] + rotated * sin[:, None]

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        gate, up = gate_up.split(inter, dim=-1)
        return F.silu(gate) * up


class NativeKernels(TorchKernels):
    """The compiled CPU kernels: RMSNorm (fused with the residual add), RoPE in place, SwiGLU."""

    name = "native"

    def __init__(self, module: ModuleType | None = None) -> None:
        self.ops = module or native.require()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 add: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.stride(-1) != 1 or (add is not None and add.stride(-1) != 1):
            return super().rms_norm(x, weight, eps, add)
        out = torch.empty_like(x)
        self.ops.rms_norm(out, x, add, weight, eps)
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        self.ops.rope_(x, cos, sin)
        return x

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        if gate_up.dim() != 2 or gate_up.stride(-1) != 1:
            return super().silu_mul(gate_up, inter)
        out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
        self.ops.silu_mul(out, gate_up, inter)
        return out


def default_kernels(device: torch.device | str) -> LayerKernels:
    """The compiled kernels on CPU when they are built (and not disabled), else torch."""
    if torch.device(device).type == "cpu":
        module = native.load()
        if module is not None:
            return NativeKernels(module)
    return TorchKernels()


__all__ = ["LayerKernels", "NativeKernels", "TorchKernels", "default_kernels"]
