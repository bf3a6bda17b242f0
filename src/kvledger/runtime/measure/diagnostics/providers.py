"""The allocator and device ledgers: what the memory allocator holds and what the device (or process) uses.

Two questions, two providers, one per backend:

* **allocator** -- bytes the framework's allocator hands out (``allocated``), bytes it holds from the
  device or the OS (``reserved``), and the difference, memory it keeps cached for reuse (``cached``).
  CUDA: ``torch.cuda.memory_stats`` (allocated, reserved, active, inactive split, peaks) and a summary of
  ``torch.cuda.memory_snapshot`` (segments and their largest free hole). CPU: torch allocates through
  the C library, so the process allocator is glibc's ``malloc``, read with ``mallinfo2`` through ctypes:
  in-use (``uordblks`` plus mmapped chunks), free inside the arenas (``fordblks``) and the releasable
  top pad (``keepcost``).
* **device** -- what the device or the operating system says the process uses. CUDA: NVML
  (``nvidia-ml-py``, imported lazily) or ``torch.cuda.mem_get_info``. CPU: the resident set (psutil) and
  the cgroup's memory (``/sys/fs/cgroup``).

Every provider takes its raw source as a callable, so the CUDA paths are tested on any machine with a
fake source (:class:`FakeCuda`), and nothing here initialises CUDA unless asked to.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ....errors import ConfigError


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    """One reading of an allocator. ``cached = reserved - allocated``: held, not handed out.

    ``details`` keeps the backend's own figures (CUDA: active, inactive split, peaks, segments, the
    largest free hole of any segment; glibc: arena, mmapped, in use, free in arenas, top pad)."""

    backend: str  # "cuda", "glibc", "none"
    allocated: int
    reserved: int
    peak_allocated: int = 0
    details: dict[str, int] = field(default_factory=dict)

    @property
    def cached(self) -> int:
        return max(0, self.reserved - self.allocated)

    def as_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "allocated": self.allocated, "reserved": self.reserved,
                "cached": self.cached, "peak_allocated": self.peak_allocated, **self.details}


@dataclass(frozen=True, slots=True)
class DeviceStats:
    """One reading of the device (or of the process and its cgroup on CPU).

    ``used`` is what this process holds there: NVML's per-process figure (or total - free when NVML
    cannot say) on CUDA, the resident set on CPU. ``total``/``free`` describe the device or the cgroup
    limit when there is one."""

    backend: str  # "nvml", "cuda-mem-get-info", "process", "none"
    used: int
    total: int = 0
    free: int = 0
    details: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "used": self.used, "total": self.total, "free": self.free,
                **self.details}


class AllocatorProvider(Protocol):
    def read(self) -> AllocatorStats: ...


class DeviceProvider(Protocol):
    def read(self) -> DeviceStats: ...


# ---- glibc malloc ---------------------------------------------------------------------------------


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc() -> Any | None:
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        lib = ctypes.CDLL(name)
        fn = lib.mallinfo2
    except (OSError, AttributeError):  # not glibc, or glibc older than 2.33
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return lib


class GlibcMalloc:
    """glibc's ``mallinfo2``: the process allocator torch's CPU tensors come from.

    allocated = in use in the arenas + mmapped chunks; reserved = arena bytes + mmapped chunks (what
    malloc took from the OS); cached = free bytes inside the arenas, of which ``top_pad`` (keepcost) is
    at the top and could be trimmed. ``read`` returns a ``none`` reading where mallinfo2 is missing."""

    def __init__(self, source: Callable[[], Mapping[str, int]] | None = None) -> None:
        if source is None:
            lib = _libc()
            if lib is not None:
                def source() -> Mapping[str, int]:
                    info = lib.mallinfo2()
                    return {name: int(getattr(info, name)) for name, _ in _MallInfo2._fields_}
        self.source = source

    @property
    def available(self) -> bool:
        return self.source is not None

    def read(self) -> AllocatorStats:
        if self.source is None:
            return AllocatorStats("none", 0, 0)
        m = self.source()
        in_use = int(m["uordblks"]) + int(m["hblkhd"])
        reserved = int(m["arena"]) + int(m["hblkhd"])
        return AllocatorStats("glibc", in_use, reserved, 0, {
            "arena": int(m["arena"]), "mmapped": int(m["hblkhd"]), "mmapped_chunks": int(m["hblks"]),
            "in_use_arena": int(m["uordblks"]), "free_in_arenas": int(m["fordblks"]),
            "top_pad": int(m["keepcost"]),
        })


# ---- CUDA caching allocator -------------------------------------------------------------------------


def summarise_cuda_snapshot(snapshot: Any) -> dict[str, int]:
    """Segments, their bytes and the largest free hole in any segment, from ``torch.cuda.memory_snapshot()``
    (a list of segments, each with ``total_size`` and ``blocks`` of ``size``/``state``). The largest free
    hole is what a contiguous allocation can get without asking the device for more."""
    segments = snapshot.get("segments", []) if isinstance(snapshot, Mapping) else snapshot
    total = free = largest = count = 0
    for seg in segments or ():
        count += 1
        total += int(seg.get("total_size", 0))
        for block in seg.get("blocks", ()):
            if block.get("state") == "inactive":
                size = int(block.get("size", 0))
                free += size
                largest = max(largest, size)
    return {"segments": count, "segment_bytes": total, "segment_free_bytes": free, "largest_free_hole": largest}


class CudaAllocator:
    """``torch.cuda.memory_stats`` (and optionally a snapshot summary) of one device. ``stats`` and
    ``snapshot`` are injectable so the path is testable without a GPU."""

    def __init__(self, device: Any = None, *, stats: Callable[[], Mapping[str, Any]] | None = None,
                 snapshot: Callable[[], Any] | None = None, with_snapshot: bool = False) -> None:
        if stats is None:
            import torch

            def stats() -> Mapping[str, Any]:
                return torch.cuda.memory_stats(device)

            if with_snapshot and snapshot is None:
                snapshot = torch.cuda.memory_snapshot
        self.stats = stats
        self.snapshot = snapshot if with_snapshot or snapshot is not None else None

    def read(self) -> AllocatorStats:
        s = self.stats()

        def g(key: str) -> int:
            return int(s.get(key, 0))

        details = {
            "active": g("active_bytes.all.current"),
            "inactive_split": g("inactive_split_bytes.all.current"),
            "peak_reserved": g("reserved_bytes.all.peak"),
            "alloc_retries": g("num_alloc_retries"),
            "ooms": g("num_ooms"),
        }
        if self.snapshot is not None:
            details.update(summarise_cuda_snapshot(self.snapshot()))
        return AllocatorStats("cuda", g("allocated_bytes.all.current"), g("reserved_bytes.all.current"),
                              g("allocated_bytes.all.peak"), details)


# ---- devices ------------------------------------------------------------------------------------------


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def cgroup_memory(root: Path = Path("/sys/fs/cgroup")) -> dict[str, int]:
    """The process's cgroup memory: usage and limit (v2 ``memory.current``/``memory.max``, or v1
    ``memory.usage_in_bytes``/``memory.limit_in_bytes``); empty where neither is readable."""
    rel = ""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3 and parts[0] == "0":
                rel = parts[2].lstrip("/")
    except OSError:
        pass
    out: dict[str, int] = {}
    for base in ([root / rel] if rel else []) + [root]:
        usage = _read_int(base / "memory.current")
        if usage is not None:
            out["cgroup_usage"] = usage
            limit = _read_int(base / "memory.max")
            if limit is not None:
                out["cgroup_limit"] = limit
            return out
    usage = _read_int(root / "memory" / "memory.usage_in_bytes")
    if usage is not None:
        out["cgroup_usage"] = usage
        limit = _read_int(root / "memory" / "memory.limit_in_bytes")
        if limit is not None and limit < 2**60:
            out["cgroup_limit"] = limit
    return out


class ProcessMemory:
    """The process's resident set (psutil) and its cgroup's memory: the CPU "device"."""

    def __init__(self, rss: Callable[[], int] | None = None,
                 cgroup: Callable[[], Mapping[str, int]] | None = cgroup_memory) -> None:
        if rss is None:
            import psutil

            proc = psutil.Process(os.getpid())

            def rss() -> int:
                return int(proc.memory_info().rss)
        self.rss = rss
        self.cgroup = cgroup

    def read(self) -> DeviceStats:
        used = int(self.rss())
        details = dict(self.cgroup()) if self.cgroup is not None else {}
        limit = details.get("cgroup_limit", 0)
        usage = details.get("cgroup_usage", 0)
        return DeviceStats("process", used, limit, max(0, limit - usage) if limit else 0, details)


class NvmlDevice:
    """NVML's view of one GPU: this process's bytes on it (or total - free where NVML cannot list
    processes), total and free. ``nvml`` is the ``pynvml`` module (imported lazily from nvidia-ml-py)."""

    def __init__(self, index: int = 0, nvml: Any = None) -> None:
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError:
                raise ConfigError("NVML readings need the nvidia-ml-py package") from None
        self.nvml = nvml
        try:
            nvml.nvmlInit()
            self.handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:  # noqa: BLE001 -- pynvml raises its own NVMLError family
            raise ConfigError(f"NVML is not usable here: {exc}") from None
        self.pid = os.getpid()

    def read(self) -> DeviceStats:
        nvml = self.nvml
        info = nvml.nvmlDeviceGetMemoryInfo(self.handle)
        total, free = int(info.total), int(info.free)
        used = total - free
        mine: int | None = None
        try:
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
                if int(proc.pid) == self.pid and proc.usedGpuMemory is not None:
                    mine = int(proc.usedGpuMemory)
        except Exception:  # noqa: BLE001 -- not permitted in some containers: fall back to the device total
            mine = None
        details = {"device_used": used}
        return DeviceStats("nvml", used if mine is None else mine, total, free, details)


class CudaMemGetInfo:
    """``torch.cuda.mem_get_info``: free and total of the device (``used`` = total - free, every process)."""

    def __init__(self, device: Any = None, mem_get_info: Callable[[], tuple[int, int]] | None = None) -> None:
        if mem_get_info is None:
            import torch

            def mem_get_info() -> tuple[int, int]:
                return torch.cuda.mem_get_info(device)
        self.mem_get_info = mem_get_info

    def read(self) -> DeviceStats:
        free, total = self.mem_get_info()
        return DeviceStats("cuda-mem-get-info", int(total) - int(free), int(total), int(free),
                           {"device_used": int(total) - int(free)})


class FakeCuda:
    """A scripted CUDA allocator and device for tests and dry runs: ``allocate``/``free``/``cache``/
    ``external`` change the figures the way the caching allocator and the driver would."""

    def __init__(self, total: int = 80 * 2**30, context: int = 500 * 2**20) -> None:
        self.total = total
        self.context = context  # CUDA context, cuBLAS handles: on the device, outside the allocator
        self.allocated = 0
        self.reserved = 0
        self.peak = 0
        self.external_bytes = 0

    def allocate(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated)

    def free(self, n: int) -> None:
        """Freed blocks stay reserved: the caching allocator keeps them for reuse."""
        self.allocated -= n

    def cache(self, n: int) -> None:
        """Reserve ``n`` more bytes that nothing uses (a burst that was freed, a fragmented split)."""
        self.reserved += n

    def external(self, n: int) -> None:
        self.external_bytes += n

    def memory_stats(self) -> dict[str, int]:
        return {"allocated_bytes.all.current": self.allocated, "reserved_bytes.all.current": self.reserved,
                "allocated_bytes.all.peak": self.peak, "active_bytes.all.current": self.allocated,
                "inactive_split_bytes.all.current": 0, "reserved_bytes.all.peak": self.reserved}

    def mem_get_info(self) -> tuple[int, int]:
        used = self.context + self.reserved + self.external_bytes
        return self.total - used, self.total

    def providers(self) -> tuple[CudaAllocator, CudaMemGetInfo]:
        return CudaAllocator(stats=self.memory_stats), CudaMemGetInfo(mem_get_info=self.mem_get_info)


# ---- choosing providers -------------------------------------------------------------------------------


@dataclass(slots=True)
class Providers:
    """The allocator and device providers for one device."""

    device_type: str  # "cpu" or "cuda"
    allocator: AllocatorProvider
    device: DeviceProvider

    @classmethod
    def for_device(cls, device: Any = "cpu") -> Providers:
        """glibc + the process on CPU; the caching allocator + NVML (or mem_get_info) on CUDA."""
        import torch

        dev = torch.device(device)
        if dev.type == "cuda":
            dev_provider: DeviceProvider
            try:
                dev_provider = NvmlDevice(dev.index or 0)
            except ConfigError:
                dev_provider = CudaMemGetInfo(dev)
            return cls("cuda", CudaAllocator(dev, with_snapshot=True), dev_provider)
        if dev.type != "cpu":
            raise ConfigError(f"memory diagnostics support cpu and cuda devices, not {dev.type!r}")
        return cls("cpu", GlibcMalloc(), ProcessMemory())


__all__ = ["AllocatorProvider", "AllocatorStats", "CudaAllocator", "CudaMemGetInfo", "DeviceProvider", "DeviceStats",
           "FakeCuda", "GlibcMalloc", "NvmlDevice", "ProcessMemory", "Providers", "cgroup_memory",
           "summarise_cuda_snapshot"]
