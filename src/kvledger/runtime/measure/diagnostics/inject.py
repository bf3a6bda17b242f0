"""Pathologies injected on purpose, so a diagnosis can be checked against a known answer.

Each injection acts once, at the first decode-only step at or after ``at_step`` that the sampler samples
(a decode step, so that nothing else in the step moves memory much), records the bytes it injected, and
says which finding kind should name it:

* ``retained-tensor`` -> ``retained_tensors``: a cache keeps a copy of the KV slice (all layers, K and V)
  of the running request with the most blocks; the request later finishes, the copy stays.
* ``pool-leak`` -> ``logical_pool_leak``: a request admitted straight into the ledger behind the
  scheduler's back and never released (``KVLedger.check()`` still passes: the ledger cannot know).
* ``external-alloc`` -> ``external_allocation``: a stray numpy array (CPU) or a raw ``cudaMalloc`` (CUDA),
  written so its pages are resident, kept to the end.
* ``peak`` -> ``transient_peak``: one step holds an extra buffer during its forward pass.
* ``cache-growth`` -> ``cached_reservation``: memory allocated and freed so the allocator keeps it --
  on glibc, 64 KiB chunks freed between small live fences (the arena cannot coalesce or trim them); on
  CUDA, a tensor freed into the caching allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections.abc import Callable
from typing import Any

import torch

from ....core import Request, checks
from ....errors import ConfigError

MiB = 1 << 20


class Injection:
    """Base: subclasses implement ``act(sampler, result)`` (at the step boundary) and may use
    ``during(sampler, plan)`` (inside the step, after the peak meter started)."""

    name = ""
    kind = ""

    def __init__(self, nbytes: int = 64 * MiB, at_step: int = 2) -> None:
        self.nbytes = checks.size(nbytes, "an injection's nbytes (at least 1 MiB)", MiB)
        self.at_step = at_step
        self.injected_bytes = 0
        self.step: int | None = None
        self.detail: dict[str, Any] = {}

    def install(self, sampler: Any) -> None:
        sampler.during_step.append(self._during)
        sampler.after_step.append(self._after)

    def _due(self, sampler: Any, plan: Any) -> bool:
        return (self.step is None and plan is not None and plan.step >= self.at_step and not plan.prefills
                and bool(plan.decodes) and sampler._sampled(plan.step))

    def _during(self, sampler: Any, plan: Any) -> None:
        if self._due(sampler, plan):
            self.during(sampler, plan)

    def _after(self, sampler: Any, result: Any) -> None:
        if self._due(sampler, result.plan):
            self.step = result.plan.step
            self.act(sampler, result)

    def during(self, sampler: Any, plan: Any) -> None:
        pass

    def act(self, sampler: Any, result: Any) -> None:
        raise NotImplementedError

    def release(self) -> None:
        """Give back what the injection holds (after the diagnosis)."""

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "expected_kind": self.kind, "step": self.step, "bytes": self.injected_bytes,
                **self.detail}


class RetainedTensor(Injection):
    name, kind = "retained-tensor", "retained_tensors"

    def __init__(self, nbytes: int = 64 * MiB, at_step: int = 2) -> None:
        super().__init__(nbytes, at_step)
        self.cache: dict[str, torch.Tensor] = {}  # what holds the slices: a "cache" keyed by request

    def act(self, sampler: Any, result: Any) -> None:
        engine = sampler.engine
        branches = [br for brs in engine.scheduler.running.values() for br in brs if br.blocks]
        if not branches:
            self.step = None
            return
        br = max(branches, key=lambda b: len(b.blocks))
        store = engine.runner.store
        idx = torch.tensor(list(br.blocks), dtype=torch.long, device=store.device)
        self.cache[br.seq_id] = store.kv[:, :, idx].clone()
        self.injected_bytes = self.cache[br.seq_id].nbytes
        self.detail = {"request": br.request.request_id, "blocks": len(br.blocks)}

    def release(self) -> None:
        self.cache.clear()


class PoolLeak(Injection):
    name, kind = "pool-leak", "logical_pool_leak"

    def act(self, sampler: Any, result: Any) -> None:
        engine = sampler.engine
        ledger, spec = engine.ledger, engine.spec
        blocks = max(1, min(self.nbytes // spec.block_bytes, ledger.usage().available - 2))
        if blocks < 1 or ledger.usage().available < 3:
            self.step = None
            return
        rid = f"leaked-{result.plan.step}"
        tokens = [16 + (result.plan.step * 7919 + i * 104729) % 40000 for i in range(blocks * spec.block_size)]
        ctx = spec.cache_context("tenant-leak", engine.model_name)
        decision = ledger.admit(Request(rid, tokens, 1, ctx))
        if not decision.admitted:
            self.step = None
            return
        ledger.mark_computed(rid, len(tokens))
        held = len(ledger.sequence(rid).table.blocks)
        self.injected_bytes = held * spec.block_bytes
        self.detail = {"sequence": rid, "blocks": held, "promised_blocks": ledger.sequence(rid).promised}


class ExternalAlloc(Injection):
    name, kind = "external-alloc", "external_allocation"

    def __init__(self, nbytes: int = 64 * MiB, at_step: int = 2) -> None:
        super().__init__(nbytes, at_step)
        self.held: Any = None
        self._free: Callable[[], None] | None = None

    def act(self, sampler: Any, result: Any) -> None:
        device = sampler.engine.runner.store.device
        if device.type == "cuda":
            self.held, self._free = _cuda_malloc(self.nbytes)
            how = "cudaMalloc"
        else:
            try:
                import numpy as np

                self.held = np.ones(self.nbytes, dtype=np.uint8)  # written: its pages are resident
                how = "numpy array"
            except ImportError:
                self.held = bytearray(b"\x01") * self.nbytes
                how = "bytearray"
        self.injected_bytes = self.nbytes
        self.detail = {"how": how}

    def release(self) -> None:
        if self._free is not None:
            self._free()
        self.held = self._free = None


class Peak(Injection):
    name, kind = "peak", "transient_peak"

    def __init__(self, nbytes: int = 64 * MiB, at_step: int = 2) -> None:
        super().__init__(nbytes, at_step)
        self.buffer: torch.Tensor | None = None

    def during(self, sampler: Any, plan: Any) -> None:
        device = sampler.engine.runner.store.device
        self.buffer = torch.ones(self.nbytes // 4, dtype=torch.float32, device=device)

    def act(self, sampler: Any, result: Any) -> None:
        if self.buffer is None:
            self.step = None
            return
        self.injected_bytes = self.buffer.nbytes
        self.buffer = None  # freed at the step boundary: a transient of this step only


class CacheGrowth(Injection):
    name, kind = "cache-growth", "cached_reservation"
    CHUNK = 64 * 1024  # below glibc's smallest mmap threshold: always from an arena

    def __init__(self, nbytes: int = 64 * MiB, at_step: int = 2) -> None:
        super().__init__(nbytes, at_step)
        self.fences: list[int] = []
        self._libc: Any = None

    def act(self, sampler: Any, result: Any) -> None:
        device = sampler.engine.runner.store.device
        if device.type == "cuda":
            x = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
            del x  # back to the caching allocator, which keeps it reserved
            self.injected_bytes = self.nbytes
            self.detail = {"how": "a tensor freed into the CUDA caching allocator"}
            return
        from .providers import GlibcMalloc

        reader = GlibcMalloc()
        before = reader.read().details.get("free_in_arenas", 0)
        worker = threading.Thread(target=self._fragment, name="kvledger-cache-growth")
        worker.start()  # a thread of its own gets a fresh malloc arena: no old holes to fill
        worker.join()
        self.injected_bytes = max(0, reader.read().details.get("free_in_arenas", 0) - before)
        self.detail = {"how": f"{self.nbytes // self.CHUNK} chunks of {self.CHUNK // 1024} KiB written, then freed "
                              f"around live 16-byte fences", "requested_bytes": self.nbytes}

    def _fragment(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.realloc.restype = ctypes.c_void_p
        libc.realloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        self._libc = libc
        chunks = []
        for _ in range(self.nbytes // self.CHUNK):
            p = libc.malloc(self.CHUNK)
            if not p:
                break
            ctypes.memset(p, 1, self.CHUNK)  # used, then freed: resident and cached by the arena
            chunks.append(p)
        tail = libc.malloc(16)  # a live neighbour at the top: the last hole cannot be trimmed
        for i, p in enumerate(chunks):
            if i % 2:
                # Shrunk in place to a 16-byte fence; the rest of the chunk is freed and merges with the
                # next (freed) chunk, but never across the fence.
                self.fences.append(libc.realloc(p, 16) or p)
            else:
                libc.free(p)
        if tail:
            self.fences.append(tail)

    def release(self) -> None:
        if self._libc is not None:
            for p in self.fences:
                self._libc.free(p)
        self.fences = []


def _cuda_malloc(nbytes: int) -> tuple[int, Callable[[], None]]:
    """A raw cudaMalloc outside torch's allocator (the CUDA runtime torch loaded)."""
    import glob
    import os

    names = [ctypes.util.find_library("cudart")] + sorted(glob.glob(os.path.join(
        os.path.dirname(torch.__file__), "..", "nvidia", "cuda_runtime", "lib", "libcudart.so*")))
    for name in filter(None, names):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise ConfigError("external-alloc on CUDA needs the CUDA runtime library (libcudart)")
    ptr = ctypes.c_void_p()
    if lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)) != 0:
        raise ConfigError(f"cudaMalloc of {nbytes} bytes failed")
    return ptr.value or 0, lambda: lib.cudaFree(ptr)


INJECTIONS: dict[str, type[Injection]] = {cls.name: cls for cls in (RetainedTensor, PoolLeak, ExternalAlloc, Peak,
                                                                     CacheGrowth)}


def make_injections(names: str | list[str], nbytes: int = 64 * MiB, at_step: int = 2) -> list[Injection]:
    """Injections by name (a comma-separated string or a list); unknown names are a ConfigError."""
    items = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    unknown = [n for n in items if n not in INJECTIONS]
    if unknown:
        raise ConfigError(f"unknown injection {', '.join(unknown)} (known: {', '.join(INJECTIONS)})")
    if len(set(items)) != len(items):
        raise ConfigError("each injection may be named once")
    # Spread them over successive steps so each lands in its own sampling interval.
    return [INJECTIONS[n](nbytes, at_step + 2 * i) for i, n in enumerate(items)]


__all__ = ["INJECTIONS", "CacheGrowth", "ExternalAlloc", "Injection", "Peak", "PoolLeak", "RetainedTensor",
           "make_injections"]
