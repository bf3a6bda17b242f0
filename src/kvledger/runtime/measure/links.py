"""Measuring the links to the tiers: the real transfer path, timed by transfer size.

:func:`measure_links` moves ``n`` whole blocks of a real KV store to each tier and back -- through the very
:class:`~kvledger.runtime.transfer.TransferEngine` the engine uses, so gathers, staging rounds, file calls
and compression are all in the figure -- for each ``n`` of ``sizes``, and returns the median seconds per
(tier, direction, n). ``kvledger calibrate`` fits ``time = fixed + bytes / bandwidth`` to them
(:func:`kvledger.sim.calibrate.fit_link`). What a figure means is what the tier does on this machine: a
disk tier's reads right after its writes are usually served by the OS page cache.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from ...errors import ConfigError
from ...scheduler import StepPlan
from ..host_store import TierStores
from ..kv_store import KVStore
from ..transfer import TransferEngine

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32)


def measure_links(store: KVStore, *, tiers: Sequence[str] = ("host", "disk"), sizes: Sequence[int] = DEFAULT_SIZES,
                  repeats: int = 3, disk_dir: str | os.PathLike[str] | None = None, compression: str = "none",
                  log: Any = None) -> dict[str, Any]:
    """Median seconds to move ``n`` blocks device -> tier (``out``) and tier -> device (``in``) for every
    ``n`` of ``sizes`` (each at most the staging buffer, so one round each). The store's first
    ``max(sizes)`` blocks are used as they are (their contents do not matter; they are restored)."""
    sizes = sorted({int(n) for n in sizes})
    if not sizes or sizes[0] < 1 or sizes[-1] > store.num_blocks:
        raise ConfigError(f"link sizes must be in 1..{store.num_blocks} blocks, got {list(sizes)}")
    if repeats < 1:
        raise ConfigError("measuring a link needs at least one repeat")
    top = sizes[-1]
    out: dict[str, Any] = {"block_bytes": 0, "sizes": sizes, "tiers": {}}
    saved = store.take_blocks(list(range(top)))  # every byte, residual pages included
    try:
        for tier in tiers:
            stores = TierStores(store, [tier], [top], disk_dir=disk_dir, compression=compression)
            engine = TransferEngine(stores, staging_blocks=top, overlap=False)
            out["block_bytes"] = stores.blocks.nbytes
            points: dict[str, list[tuple[int, float]]] = {"out": [], "in": []}
            engine.run_now(StepPlan(0, swap_out=[(b, b) for b in range(top)]))  # warm-up: pages, file extent
            for n in sizes:
                for direction in ("out", "in"):
                    times = []
                    for _ in range(repeats):
                        plan = StepPlan(0, swap_out=[(b, b) for b in range(n)]) if direction == "out" else \
                            StepPlan(0, swap_in=[(b, b) for b in range(n)])
                        t0 = time.perf_counter()
                        engine.run_now(plan)
                        times.append(time.perf_counter() - t0)
                    points[direction].append((n, statistics.median(times)))
            if log is not None:
                log(f"{tier} link: " + ", ".join(f"{n} blocks out {t * 1e3:.2f} ms" for n, t in points["out"]))
            entry: dict[str, Any] = {"points": points}
            for t in stores.tiers:
                ratio = getattr(t, "ratio", None)
                if ratio is not None:
                    entry["compression"] = compression
                    entry["compression_ratio"] = ratio
            out["tiers"][tier] = entry
            engine.close()
    finally:
        store.put_blocks(list(range(top)), saved)
    return out


__all__ = ["DEFAULT_SIZES", "measure_links"]
