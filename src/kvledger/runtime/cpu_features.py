"""Which bf16 matrix path this CPU has: AMX tiles, AVX-512 BF16 dot products, or neither.

The engine's bf16 projections already go through oneDNN, which picks AMX (``brg_matmul:avx10_1_512_amx``
in ``ONEDNN_VERBOSE=1``) or AVX-512 BF16 kernels by itself. What the path changes is how a *small*
product is threaded: with AMX a decode step's ``32 x 576 x 1728`` bf16 product is ~64 MFLOP that one core
finishes in about as long as it takes to wake a second OpenMP thread under ``OMP_WAIT_POLICY=PASSIVE``
(50-150 us on a shared 2-core machine), so such products skip OpenMP: cut in two column pieces that the
calling thread and one helper thread of the native kernels claim as they come, or on the calling thread
alone without the native build (:class:`kvledger.runtime.model.Linear`). Without AMX the arithmetic
dominates and both threads pay off, so AVX-512 BF16 and AVX2-only CPUs keep a layer's products on OpenMP; on
``avx512_bf16`` only the vocabulary-wide output projection is cut into pieces for the helper. On both ``amx``
and ``avx512_bf16`` a bf16 decode's
attention scores are AVX-512 BF16 dot products on the cached rows as stored (``paged_decode_bf16``); on
``avx2`` the rows are widened to fp32 first.

``KVLEDGER_BF16_PATH`` (``auto``, ``amx``, ``avx512_bf16``, ``avx2``) overrides the detection, for
measuring one path against another on the same machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from ..errors import ConfigError

PATH_ENV = "KVLEDGER_BF16_PATH"
PATHS = ("amx", "avx512_bf16", "avx2")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The ``flags`` line of ``/proc/cpuinfo`` (empty where there is none: another OS or architecture)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_model(cpuinfo: str | None = None) -> str | None:
    """The ``model name`` line of ``/proc/cpuinfo`` (``Intel(R) Xeon(R) Processor``, ``AMD EPYC 9R14``), None where
    there is none: benchmarks name the machine their figures come from beside its flags and load."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None


def path_for_flags(flags: Iterable[str]) -> str:
    """``amx`` needs tiles with bf16 (and the kernel's permission, which a listed flag implies on Linux);
    ``avx512_bf16`` the AVX-512 bf16 dot products; anything else is ``avx2`` (today's path)."""
    f = set(flags)
    if {"amx_tile", "amx_bf16"} <= f:
        return "amx"
    if "avx512_bf16" in f:
        return "avx512_bf16"
    return "avx2"


def _detect() -> str:
    flags = cpu_flags()
    if flags:
        return path_for_flags(flags)
    try:  # no /proc/cpuinfo: ask torch, which probes CPUID itself
        import torch

        if torch.cpu._is_amx_tile_supported():
            return "amx"
        if torch.cpu._is_avx512_bf16_supported():
            return "avx512_bf16"
    except (AttributeError, RuntimeError):
        pass
    return "avx2"


_detected: str | None = None


def bf16_path() -> str:
    """This CPU's bf16 path (``KVLEDGER_BF16_PATH`` when set to one of :data:`PATHS`), detected once."""
    forced = os.environ.get(PATH_ENV, "auto")
    if forced in PATHS:
        return forced
    if forced != "auto":
        raise ConfigError(f"{PATH_ENV}={forced!r}: expected auto, {', '.join(PATHS)}")
    global _detected
    if _detected is None:
        _detected = _detect()
    return _detected


__all__ = ["PATHS", "PATH_ENV", "bf16_path", "cpu_flags", "path_for_flags"]
