"""A snapshot of the four ledgers at one moment, and the difference between two snapshots.

``take_snapshot(engine)`` reads, in this order: the pool (the KV ledger's blocks by state, tier and trust
group), the tensors (by owner, plus a storage-deduplicated scan of everything nobody registered), the
allocator and the device. ``diff(a, b)`` subtracts two snapshots ledger by ledger and says, in words,
what the change means -- including the case the seed warns about: blocks returned to the free list move
pool bytes from *active* to *free* while the allocator and the device do not move at all, because the
KV pool is one tensor allocated up front; ownership changed, allocation did not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ....units import format_bytes
from .pool import PoolSample, pool_sample
from .providers import AllocatorStats, DeviceStats, Providers
from .tensors import CreationSites, StorageKey, TensorRegistry, TensorSample, scan


def engine_registry(engine: Any) -> TensorRegistry:
    """The owners of an :class:`~kvledger.runtime.engine.Engine`'s tensors: its weights (and the other
    decoders the process keeps loaded) and their packed oneDNN copies on CPU, the device KV store, the host
    tier, the transfers' staging buffer, the attention backend's per-step workspace (index tensors and masks it
    keeps between steps)."""
    from ... import loading

    reg = TensorRegistry()
    reg.register("weights/packed", lambda: _packed(engine.runner.model), call=True)
    reg.register("weights", engine.runner.model)
    reg.register("weights", lambda: list(loading._DECODERS.values()), call=True)
    reg.register("kv/device", engine.runner.store)
    if engine.host_store is not None:
        reg.register("kv/host", engine.host_store)
    transfers = getattr(engine, "transfers", None)
    if transfers is not None:
        reg.register("staging", lambda: [transfers.staging], call=True)  # the bounded transfer buffer
    reg.register("workspace", engine.runner.backend)
    return reg


def _packed(model: Any) -> list[Any]:
    """The oneDNN weight copies a CPU runner packs next to its weights (``model.Linear._packed``)."""
    out: list[Any] = []
    for m in model.modules():
        packed = getattr(m, "_packed", None)
        if packed is None:
            continue
        # One packed tensor per projection (older runners kept a (weight, bias) pair).
        out.extend(packed if isinstance(packed, tuple | list) else (packed,))
    return out


@dataclass(slots=True)
class MemorySnapshot:
    """The four ledgers at one moment (``step``: the engine step it follows, if any)."""

    step: int | None
    time_s: float
    device: str  # the device type the allocator and device ledgers describe: "cpu" or "cuda"
    tensors: TensorSample
    allocator: AllocatorStats
    device_stats: DeviceStats
    pool: PoolSample | None = None
    running: tuple[str, ...] = ()  # requests running at the sample

    # ---- the headline attribution -------------------------------------------------------------------
    def attribution(self) -> dict[str, int]:
        """Where the device's (or process's) bytes are, in one partition that sums to ``device_used``:
        weights (packed copies included), the KV pool split by block state (live, orphaned -- held for no
        live owner --, retained, free and promised, free), other tensors, the allocator's cache, the
        allocator's non-tensor bytes, and the rest (runtime, libraries, CUDA context, external allocations)."""
        dev = self.device
        t = self.tensors
        weights = sum(t.owner_bytes(o, dev) for o in t.owners if o == "weights" or o.startswith("weights/"))
        kv = t.owner_bytes("kv/device", dev)
        out: dict[str, int] = {"weights": weights}
        if self.pool is not None and kv:
            p = self.pool
            promised_free = min(p.promised, p.free)
            orphaned = p.orphan_blocks
            parts = {"kv_live": p.active - orphaned, "kv_orphaned": orphaned, "kv_retained": p.retained,
                     "kv_promised": promised_free, "kv_free": p.free - promised_free}
            scale = kv / max(1, p.total)
            for name, blocks in parts.items():
                out[name] = int(blocks * scale)
            out["kv_live"] += kv - sum(out[n] for n in parts)  # rounding goes to live
        else:
            out.update({"kv_live": kv, "kv_orphaned": 0, "kv_retained": 0, "kv_promised": 0, "kv_free": 0})
        tensors_here = t.total(dev)
        out["other_tensors"] = tensors_here - weights - kv
        out["allocator_cache"] = self.allocator.cached
        out["allocator_other"] = max(0, self.allocator.allocated - tensors_here)
        accounted = tensors_here + out["allocator_cache"] + out["allocator_other"]
        out["outside_allocator"] = self.device_stats.used - accounted
        out["device_used"] = self.device_stats.used
        return out

    def ledgers(self) -> dict[str, Any]:
        return {
            "tensors": self.tensors.as_dict(),
            "allocator": self.allocator.as_dict(),
            "pool": self.pool.as_dict() if self.pool is not None else None,
            "device": self.device_stats.as_dict(),
        }

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "time_s": round(self.time_s, 6), "device": self.device,
                "running": list(self.running), "attribution": self.attribution(), "ledgers": self.ledgers()}


def take_snapshot(engine: Any = None, *, registry: TensorRegistry | None = None, providers: Providers | None = None,
                  sites: CreationSites | None = None, step: int | None = None) -> MemorySnapshot:
    """Read the four ledgers now. With ``engine``, its pool, owners and device are used (call it from the
    thread that steps the engine, between steps); without, only tensors, allocator and device (on CPU
    unless ``providers`` says otherwise)."""
    pool = None
    running: tuple[str, ...] = ()
    device = "cpu"
    if engine is not None:
        device = engine.runner.store.device.type
        if registry is None:
            registry = engine_registry(engine)
        sched = engine.scheduler
        host = sched.host
        pool = pool_sample(engine.ledger, engine.spec.block_bytes, scheduler=sched, host_pool=host,
                           host_block_bytes=engine.spec.block_bytes)
        running = tuple(sorted(sched.running))
        if step is None:
            step = engine.driver.steps
    if providers is None:
        providers = Providers.for_device(device)
    else:
        device = providers.device_type
    tensors = scan(registry, sites)
    allocator = providers.allocator.read()
    dev = providers.device.read()
    return MemorySnapshot(step, time.perf_counter(), device, tensors, allocator, dev, pool, running)


# ---- differences -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class SnapshotDiff:
    """``after - before``, ledger by ledger, with the storages that appeared and disappeared."""

    before: MemorySnapshot
    after: MemorySnapshot
    attribution: dict[str, int]
    owners: dict[str, int]
    pool: dict[str, int]
    allocator: dict[str, int]
    device: int
    new_storages: list[tuple[StorageKey, int]] = field(default_factory=list)
    gone_storages: list[tuple[StorageKey, int]] = field(default_factory=list)

    def notes(self) -> list[str]:
        """What the difference means, in sentences (the largest movements only)."""
        out: list[str] = []
        p, a, d = self.pool, self.allocator, self.device
        threshold = max(1 << 20, self.before.pool.block_bytes if self.before.pool else 0)
        freed = -p.get("active_bytes", 0)
        if freed >= threshold:
            moved = p.get("free_bytes", 0) + p.get("retained_bytes", 0)
            out.append(
                f"the pool returned {format_bytes(freed)} of blocks ({format_bytes(max(0, moved))} to the free list "
                f"or the prefix cache) while the allocator moved {format_bytes(a.get('reserved', 0))} reserved / "
                f"{format_bytes(a.get('allocated', 0))} allocated and the device {format_bytes(d)}: returning a "
                f"block changes who owns it, not what is allocated -- the KV pool is one tensor allocated up "
                f"front, so its bytes stay reserved and in use at the device however many blocks are free")
        grown = p.get("active_bytes", 0)
        if grown >= threshold:
            out.append(f"the pool handed out {format_bytes(grown)} of blocks; the allocator moved "
                       f"{format_bytes(a.get('allocated', 0))}: the blocks were already allocated")
        new = sum(n for _, n in self.new_storages)
        if new >= 1 << 20:
            out.append(f"{len(self.new_storages)} tensor storages nobody registered appeared "
                       f"({format_bytes(new)})")
        if a.get("cached", 0) >= 1 << 20:
            out.append(f"the allocator's cache grew by {format_bytes(a['cached'])} (held from the device/OS, "
                       f"not handed out)")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"from_step": self.before.step, "to_step": self.after.step, "attribution": self.attribution,
                "owners": self.owners, "pool": self.pool, "allocator": self.allocator, "device_used": self.device,
                "new_unregistered_bytes": sum(n for _, n in self.new_storages),
                "gone_unregistered_bytes": sum(n for _, n in self.gone_storages), "notes": self.notes()}


def _sub(a: dict[str, Any], b: dict[str, Any]) -> dict[str, int]:
    return {k: int(b[k]) - int(a.get(k, 0)) for k in b if isinstance(b[k], (int, float)) and not isinstance(b[k], bool)}


def diff(before: MemorySnapshot, after: MemorySnapshot) -> SnapshotDiff:
    """``after - before`` for every ledger."""
    owners = {o: after.tensors.owner_bytes(o) - before.tensors.owner_bytes(o)
              for o in sorted(set(before.tensors.owners) | set(after.tensors.owners))}
    owners["unregistered"] = after.tensors.unregistered_bytes() - before.tensors.unregistered_bytes()
    pool = _sub(before.pool.as_dict(), after.pool.as_dict()) if before.pool and after.pool else {}
    a_before, a_after = before.allocator.as_dict(), after.allocator.as_dict()
    new = [(k, s.nbytes) for k, s in after.tensors.unregistered.items() if k not in before.tensors.unregistered]
    gone = [(k, s.nbytes) for k, s in before.tensors.unregistered.items() if k not in after.tensors.unregistered]
    return SnapshotDiff(before, after, _sub(before.attribution(), after.attribution()), owners, pool,
                        _sub(a_before, a_after), after.device_stats.used - before.device_stats.used, new, gone)


__all__ = ["MemorySnapshot", "SnapshotDiff", "diff", "engine_registry", "take_snapshot"]
