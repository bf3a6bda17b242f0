"""The allocator and device ledgers: glibc mallinfo2, the process and its cgroup, and the CUDA paths
(caching-allocator statistics, snapshot summary, NVML, mem_get_info) through fake sources."""

from __future__ import annotations

import types

import pytest

from kvledger.errors import ConfigError
from kvledger.runtime.measure.diagnostics.providers import (
    CudaAllocator,
    CudaMemGetInfo,
    FakeCuda,
    GlibcMalloc,
    NvmlDevice,
    ProcessMemory,
    Providers,
    cgroup_memory,
    summarise_cuda_snapshot,
)

MiB = 1 << 20


def test_glibc_reading_from_a_fake_mallinfo2():
    info = {"arena": 100, "ordblks": 3, "smblks": 0, "hblks": 2, "hblkhd": 50, "usmblks": 0, "fsmblks": 0,
            "uordblks": 70, "fordblks": 30, "keepcost": 10}
    s = GlibcMalloc(lambda: info).read()
    # in use = arena bytes in use + mmapped chunks; reserved = arena + mmapped; cached = free in arenas
    assert (s.backend, s.allocated, s.reserved, s.cached) == ("glibc", 120, 150, 30)
    assert s.details["top_pad"] == 10 and s.details["free_in_arenas"] == 30
    assert s.as_dict()["cached"] == 30


def test_glibc_sees_a_real_malloc_of_32_mib():
    g = GlibcMalloc()
    assert g.available
    before = g.read().allocated
    block = bytearray(32 * MiB)  # through malloc
    after = g.read().allocated
    assert after - before >= 32 * MiB
    del block


def test_no_mallinfo2_reads_as_none():
    g = GlibcMalloc()
    g.source = None
    assert g.read().backend == "none"


def test_cuda_allocator_from_fake_memory_stats():
    stats = {"allocated_bytes.all.current": 3 * MiB, "reserved_bytes.all.current": 8 * MiB,
             "allocated_bytes.all.peak": 6 * MiB, "active_bytes.all.current": 3 * MiB,
             "inactive_split_bytes.all.current": MiB, "reserved_bytes.all.peak": 8 * MiB, "num_ooms": 0}
    snapshot = [{"total_size": 8 * MiB, "blocks": [{"size": 3 * MiB, "state": "active_allocated"},
                                                   {"size": 2 * MiB, "state": "inactive"},
                                                   {"size": 3 * MiB, "state": "inactive"}]}]
    s = CudaAllocator(stats=lambda: stats, snapshot=lambda: snapshot).read()
    assert (s.backend, s.allocated, s.reserved, s.cached, s.peak_allocated) == ("cuda", 3 * MiB, 8 * MiB, 5 * MiB,
                                                                                6 * MiB)
    assert s.details["inactive_split"] == MiB
    assert s.details["largest_free_hole"] == 3 * MiB and s.details["segment_free_bytes"] == 5 * MiB


def test_snapshot_summary_accepts_the_dict_form():
    assert summarise_cuda_snapshot({"segments": []}) == {"segments": 0, "segment_bytes": 0, "segment_free_bytes": 0,
                                                         "largest_free_hole": 0}


def test_fake_cuda_keeps_freed_bytes_reserved_like_the_caching_allocator():
    fake = FakeCuda(total=80 * 1024 * MiB, context=500 * MiB)
    alloc, dev = fake.providers()
    fake.allocate(100 * MiB)
    fake.free(40 * MiB)
    a = alloc.read()
    assert (a.allocated, a.reserved, a.cached) == (60 * MiB, 100 * MiB, 40 * MiB)
    assert dev.read().used == 600 * MiB  # context + reserved: freed bytes stay on the device
    fake.external(64 * MiB)
    assert dev.read().used == 664 * MiB


class _Nvml(types.SimpleNamespace):
    pass


def _fake_nvml(pid_bytes: int | None, raise_on_procs: bool = False):
    def procs(handle):
        if raise_on_procs:
            raise RuntimeError("not permitted")
        import os

        return [types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=pid_bytes),
                types.SimpleNamespace(pid=1, usedGpuMemory=999)]

    return _Nvml(nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: ("gpu", i),
                 nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=80 * 1024 * MiB,
                                                                         free=70 * 1024 * MiB),
                 nvmlDeviceGetComputeRunningProcesses=procs)


def test_nvml_reads_this_process_or_falls_back_to_the_device():
    s = NvmlDevice(0, nvml=_fake_nvml(3 * 1024 * MiB)).read()
    assert (s.backend, s.used, s.total, s.free) == ("nvml", 3 * 1024 * MiB, 80 * 1024 * MiB, 70 * 1024 * MiB)
    s = NvmlDevice(0, nvml=_fake_nvml(None, raise_on_procs=True)).read()
    assert s.used == 10 * 1024 * MiB  # total - free when the process list is not readable


def test_nvml_init_failure_is_a_config_error():
    def boom():
        raise RuntimeError("NVML Shared Library Not Found")

    with pytest.raises(ConfigError, match="NVML is not usable"):
        NvmlDevice(0, nvml=_Nvml(nvmlInit=boom))


def test_mem_get_info_from_a_fake():
    s = CudaMemGetInfo(mem_get_info=lambda: (30, 100)).read()
    assert (s.used, s.total, s.free) == (70, 100, 30)


def test_process_memory_and_cgroup(tmp_path):
    s = ProcessMemory().read()
    assert s.backend == "process" and s.used > 10 * MiB
    fake = ProcessMemory(rss=lambda: 123, cgroup=lambda: {"cgroup_usage": 900, "cgroup_limit": 1000})
    s = fake.read()
    assert (s.used, s.total, s.free) == (123, 1000, 100)


def test_cgroup_v2_and_v1_layouts(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.current").write_text("4096\n")
    (v2 / "memory.max").write_text("max\n")
    assert cgroup_memory(v2) == {"cgroup_usage": 4096}
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.usage_in_bytes").write_text("2048")
    (v1 / "memory" / "memory.limit_in_bytes").write_text("8192")
    assert cgroup_memory(v1) == {"cgroup_usage": 2048, "cgroup_limit": 8192}
    assert cgroup_memory(tmp_path / "missing") == {}


def test_providers_for_cpu_and_unsupported_devices():
    p = Providers.for_device("cpu")
    assert p.device_type == "cpu" and isinstance(p.allocator, GlibcMalloc)
    with pytest.raises(ConfigError, match="cpu and cuda"):
        Providers.for_device("meta")


def test_no_layer_below_the_runtime_imports_the_diagnostics():
    import ast
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "src" / "kvledger"
    offenders = []
    for layer in ("core", "scheduler", "sim"):
        for path in sorted((src / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                    [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if any("runtime" in n for n in names):
                    offenders.append(str(path.relative_to(src)))
    assert offenders == []
