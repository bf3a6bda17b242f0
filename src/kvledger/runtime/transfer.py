"""Real, timed transfers between the device pool and the tiers below it, overlapping compute on a worker.

A step's transfers come in three phases, in this order (:mod:`kvledger.scheduler.transfers`)::

    A  demote                  evicted device blocks out, before anything writes them
    B  promote, swap_in        blocks coming up from a tier
    C  tier_moves, writeback,  entries one tier down, then retained blocks copied down ahead of eviction;
       swap_out                requests preempted by swap (their device blocks stay leased until confirm)

:meth:`TransferEngine.start` runs in the executor's thread what the step depends on -- A always, B when a
work of the step reads an incoming block -- and queues the rest on one background worker thread, which
runs it while the executor's thread computes; the executor waits for the worker before the step ends. The
time run inline and the time waited at the end are the step's **exposed** transfer time; the rest of the
worker's busy time ran beside the compute and was **hidden** (:class:`StepTransfers`). Work the step must
wait for is never handed to the worker: a thread hand-off only adds latency to a wait.

Memory and staging. Host-tier slots are written and read in place (pinned host memory on CUDA); disk-tier
blocks go through a bounded staging buffer of ``staging_blocks`` rows (``staging_blocks x block_bytes``
bytes, allocated once, counted by the diagnostics as ``staging``): a batch larger than the buffer takes
several rounds. On CUDA every device copy runs on a dedicated copy stream, which first waits for the
compute stream's work so far (the blocks a demotion reads were written by earlier steps), and the stream is
synchronised before a phase is reported done, so a forward pass never reads a half-copied block.

Failures. The prefix cache's transfers (demotions, write-backs, moves, promotions) belong to no request and
copy blocks nobody needs to be there: one that raises (a full disk's ``OSError``, say) loses only its own
block. It is recorded in the step's :attr:`StepTransfers.lost` (the executor hands it to the scheduler,
which drops the tier entry or sends the promoted prefix's request back to recompute) and counted
(``failures`` in :meth:`TransferEngine.stats`), and every other transfer of the step goes on. A swap is a
request's only copy of its KV: a swap that raises stops the step's transfers (``StepTransfers.error``) and
fails its request.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from ..errors import ConfigError
from ..scheduler import StepPlan
from .host_store import FileTier, MemoryTier, TierStores

MAX_STAGING_BLOCKS = 4096
# The prefix cache's transfers, by the StepPlan field that lists them: a failure loses only that block.
CACHE_KINDS = ("demote", "tier_moves", "writeback", "promote")
DEMOTION_KINDS = ("demote", "tier_moves", "writeback")  # writes of a cached entry into a tier slot

Pair = tuple[int, int]


@dataclass(slots=True)
class LinkCounters:
    """Blocks, bytes and worker seconds per (tier, direction)."""

    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    batches: int = 0


@dataclass(slots=True)
class StepTransfers:
    """One step's transfers: the part run in the executor's thread because the step depends on it
    (``inline_s``, exposed), and the rest queued on the worker (``worker_s``), of which the executor waited
    ``waited_s`` at the end of the step (exposed) while the remainder ran beside its compute (hidden)."""

    plan: StepPlan
    done: threading.Event = field(default_factory=threading.Event)
    inline_s: float = 0.0
    worker_s: float = 0.0
    waited_s: float = 0.0
    error: BaseException | None = None  # a swap failed: the step fails its request
    # The prefix cache's transfers that raised, by plan field (CACHE_KINDS), and the first such error.
    lost: dict[str, list[Pair]] = field(init=False, default_factory=lambda: {k: [] for k in CACHE_KINDS})
    lost_error: BaseException | None = field(init=False, default=None)
    _reported: dict[str, int] = field(init=False, repr=False, default_factory=lambda: dict.fromkeys(CACHE_KINDS, 0))
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)

    def lose(self, kind: str, pair: Pair, error: BaseException) -> None:
        """A transfer of the prefix cache raised (called by the thread that ran it)."""
        with self._lock:
            self.lost[kind].append(pair)
            if self.lost_error is None:
                self.lost_error = error

    def take_lost(self) -> StepPlan | None:
        """The transfers lost since the last call, as a plan of the same step holding only them (the shape
        ``Scheduler.transfers_failed`` takes); None when nothing new was lost."""
        with self._lock:
            new = {k: self.lost[k][self._reported[k]:] for k in CACHE_KINDS}
            if not any(new.values()):
                return None
            for k in CACHE_KINDS:
                self._reported[k] = len(self.lost[k])
        return StepPlan(self.plan.step, **new)

    def lost_count(self, kind: str) -> int:
        with self._lock:
            return len(self.lost[kind])

    def wait(self) -> float:
        """Wait for the worker's part; returns the seconds waited (also added to ``waited_s``)."""
        if self.done.is_set():
            return 0.0
        t0 = time.perf_counter()
        self.done.wait()
        waited = time.perf_counter() - t0
        self.waited_s += waited
        return waited

    @property
    def busy_s(self) -> float:
        return self.inline_s + self.worker_s

    @property
    def exposed_s(self) -> float:
        return self.inline_s + self.waited_s

    @property
    def hidden_s(self) -> float:
        return max(0.0, self.worker_s - self.waited_s)


PHASES = ("A", "B", "C")


class TransferEngine:
    """Moves blocks between the device KV store and ``stores`` (the tiers' bytes). ``overlap=False`` runs
    every transfer in the executor's thread before the compute (a baseline: all of it exposed)."""

    def __init__(self, stores: TierStores, *, staging_blocks: int = 32, overlap: bool = True) -> None:
        if isinstance(staging_blocks, bool) or not isinstance(staging_blocks, int) \
                or not 1 <= staging_blocks <= MAX_STAGING_BLOCKS:
            raise ConfigError(f"staging_blocks must be an integer in 1..{MAX_STAGING_BLOCKS}, got {staging_blocks!r}")
        self.stores = stores
        self.blocks = stores.blocks
        self.overlap = overlap
        self.staging_blocks = staging_blocks
        device = self.blocks.device
        self.cuda = device.type == "cuda"
        needs_staging = any(isinstance(t, FileTier) for t in stores.tiers)
        rows = staging_blocks if needs_staging else 0
        # Bounded and allocated once: the only host memory transfers use besides the tiers themselves.
        self.staging = torch.empty((rows, self.blocks.nbytes), dtype=torch.uint8, pin_memory=self.cuda and rows > 0)
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.counters: dict[tuple[str, str], LinkCounters] = {}
        self.failures = dict.fromkeys(CACHE_KINDS, 0)  # blocks whose transfer raised, by kind
        self._queue: queue.Queue[tuple[StepTransfers, tuple[str, ...]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ---- lifecycle --------------------------------------------------------------------------------
    def _ensure_worker(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="kvledger-transfers", daemon=True)
                self._thread.start()

    def close(self) -> None:
        """Stop the worker (after what is queued) and close the tiers' files."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._queue.put(None)
            thread.join(timeout=30)
        self._thread = None
        self.stores.close()

    @property
    def staging_bytes(self) -> int:
        return self.staging.numel()

    # ---- a step's transfers -----------------------------------------------------------------------
    @staticmethod
    def has_work(plan: StepPlan) -> bool:
        return bool(plan.swap_out or plan.swap_in or plan.tier_transfers)

    def start(self, plan: StepPlan, inbound_needed: bool = True) -> StepTransfers:
        """Run what the step depends on now -- urgent demotions (A), and the incoming blocks (B) when
        ``inbound_needed`` -- and queue the rest on the worker. Errors are kept in the handle's ``error``."""
        batch = StepTransfers(plan)
        if self.overlap:
            inline = ("A", "B") if inbound_needed else ("A",)
        else:
            inline = PHASES
        rest = tuple(p for p in PHASES if p not in inline and self._phase_has_work(plan, p))
        if self.stream is not None:
            # The copies must see every write the compute stream has queued so far.
            self.stream.wait_stream(torch.cuda.current_stream(self.blocks.device))
        t0 = time.perf_counter()
        self._phases(batch, inline)
        batch.inline_s = time.perf_counter() - t0
        if rest and batch.error is None:
            self._ensure_worker()
            self._queue.put((batch, rest))
        else:
            batch.done.set()
        return batch

    def run_now(self, plan: StepPlan) -> StepTransfers:
        """Every transfer of ``plan`` in the calling thread (measurements, baselines); raises on any
        error, a lost cache transfer's included (after the rest ran)."""
        batch = StepTransfers(plan)
        t0 = time.perf_counter()
        self._phases(batch, PHASES)
        batch.inline_s = time.perf_counter() - t0
        batch.done.set()
        if batch.error is not None:
            raise batch.error
        if batch.lost_error is not None:
            raise batch.lost_error
        return batch

    @staticmethod
    def _phase_has_work(plan: StepPlan, phase: str) -> bool:
        if phase == "A":
            return bool(plan.demote)
        if phase == "B":
            return bool(plan.promote or plan.swap_in)
        return bool(plan.tier_moves or plan.writeback or plan.swap_out)

    # ---- the worker -------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch, phases = item
            t0 = time.perf_counter()
            try:
                self._phases(batch, phases)
            finally:
                batch.worker_s = time.perf_counter() - t0
                batch.done.set()

    def _phases(self, batch: StepTransfers, phases: tuple[str, ...]) -> None:
        plan = batch.plan
        try:
            ctx = torch.cuda.stream(self.stream) if self.stream is not None else _nullcontext()
            with ctx:
                if "A" in phases:
                    self._out(plan.demote, batch, "demote")
                    self._sync()
                if "B" in phases:
                    self._in(plan.promote, batch, "promote")
                    self._in(plan.swap_in, None, "swap_in")
                    self._sync()
                if "C" in phases:
                    self._moves(plan.tier_moves, batch)  # before the write-backs: one may reuse a moved entry's slot
                    self._out(plan.writeback, batch, "writeback")
                    self._out(plan.swap_out, None, "swap_out")
                    self._sync()
        except Exception as exc:  # noqa: BLE001 -- handed to the executor, which raises it in its thread
            batch.error = exc

    def _sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def _count(self, tier: str, direction: str, blocks: int, nbytes: int, seconds: float) -> None:
        c = self.counters.setdefault((tier, direction), LinkCounters())
        c.blocks += blocks
        c.bytes += nbytes
        c.seconds += seconds
        c.batches += 1

    def _by_tier(self, pairs: list[tuple[int, int]], slot_index: int) -> dict[int, list[tuple[int, int]]]:
        groups: dict[int, list[tuple[int, int]]] = {}
        for pair in pairs:
            tier, _ = self.stores.locate(pair[slot_index])
            groups.setdefault(id(tier), []).append(pair)
        return groups

    def _attempt(self, batch: StepTransfers | None, kind: str, pair: Pair, move: Callable[[], None]) -> bool:
        """Run one block's transfer. A swap's error propagates (``batch`` None: it fails the step); a cache
        transfer's is recorded in ``batch`` and counted, and the step's other transfers go on."""
        if batch is None:
            move()
            return True
        try:
            move()
        except Exception as exc:  # noqa: BLE001 -- only this cache entry is lost; the scheduler drops it
            batch.lose(kind, pair, exc)
            with self._lock:
                self.failures[kind] += 1
            return False
        return True

    def _out(self, pairs: list[Pair], batch: StepTransfers | None, kind: str) -> None:
        """Device block -> tier slot, for each ``(device block, slot)``."""
        if not pairs:
            return
        blocks, nb, stores = self.blocks, self.blocks.nbytes, self.stores
        for group in self._by_tier(pairs, 1).values():
            t0 = time.perf_counter()
            tier, _ = stores.locate(group[0][1])
            moved = 0
            if isinstance(tier, MemoryTier):
                for pair in group:
                    b, slot = pair
                    row = tier.row(stores.locate(slot)[1])
                    moved += self._attempt(batch, kind, pair, partial(blocks.read, b, row, non_blocking=self.cuda))
                self._sync()
            else:
                for start in range(0, len(group), self.staging_blocks):  # one staging round
                    chunk = group[start:start + self.staging_blocks]
                    for i, (b, _) in enumerate(chunk):
                        blocks.read(b, self.staging[i], non_blocking=self.cuda)
                    self._sync()
                    for i, pair in enumerate(chunk):
                        local, row = stores.locate(pair[1])[1], self.staging[i]
                        moved += self._attempt(batch, kind, pair, partial(tier.write, local, row))
            self._count(tier.kind, "out", moved, moved * nb, time.perf_counter() - t0)

    def _in(self, pairs: list[Pair], batch: StepTransfers | None, kind: str) -> None:
        """Tier slot -> device block, for each ``(slot, device block)``."""
        if not pairs:
            return
        blocks, nb, stores = self.blocks, self.blocks.nbytes, self.stores
        for group in self._by_tier(pairs, 0).values():
            t0 = time.perf_counter()
            tier, _ = stores.locate(group[0][0])
            moved = 0
            if isinstance(tier, MemoryTier):
                for pair in group:
                    slot, d = pair
                    row = tier.row(stores.locate(slot)[1])
                    moved += self._attempt(batch, kind, pair, partial(blocks.write, d, row, non_blocking=self.cuda))
                self._sync()
            else:
                for start in range(0, len(group), self.staging_blocks):
                    chunk = group[start:start + self.staging_blocks]
                    self._sync()  # the previous round's copies out of staging are done
                    for i, pair in enumerate(chunk):
                        local, row = stores.locate(pair[0])[1], self.staging[i]
                        # A block whose read failed is not copied up: its device block keeps no bytes of it.
                        if self._attempt(batch, kind, pair, partial(tier.read, local, row)):
                            blocks.write(pair[1], row, non_blocking=self.cuda)
                            moved += 1
                self._sync()
            self._count(tier.kind, "in", moved, moved * nb, time.perf_counter() - t0)

    def _moves(self, pairs: list[Pair], batch: StepTransfers | None) -> None:
        """Tier slot -> slot of a slower tier (run before the write-backs: one may reuse a source slot)."""
        if not pairs:
            return
        t0 = time.perf_counter()
        moved = sum(self._attempt(batch, "tier_moves", pair, partial(self._move, *pair)) for pair in pairs)
        dst_kind = self.stores.locate(pairs[0][1])[0].kind
        self._count(dst_kind, "move", moved, moved * self.blocks.nbytes, time.perf_counter() - t0)

    def _move(self, src: int, dst: int) -> None:
        s_tier, s_local = self.stores.locate(src)
        d_tier, d_local = self.stores.locate(dst)
        if isinstance(s_tier, MemoryTier):
            d_tier.write(d_local, s_tier.row(s_local))
        elif isinstance(d_tier, MemoryTier):
            s_tier.read(s_local, d_tier.row(d_local))
        else:  # file to file: through one staging row (there is staging whenever a file tier exists)
            s_tier.read(s_local, self.staging[0])
            d_tier.write(d_local, self.staging[0])

    # ---- reporting --------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        links = {f"{tier}/{direction}": {"blocks": c.blocks, "bytes": c.bytes, "seconds": c.seconds,
                                         "batches": c.batches,
                                         "bandwidth_Bps": c.bytes / c.seconds if c.seconds else None}
                 for (tier, direction), c in sorted(self.counters.items())}
        with self._lock:
            failures = dict(self.failures)
        return {"staging_blocks": self.staging.shape[0], "staging_bytes": self.staging_bytes, "overlap": self.overlap,
                "links": links, "tiers": self.stores.stats(), "failures": failures,
                "demotion_failures": sum(failures[k] for k in DEMOTION_KINDS),
                "promotion_failures": failures["promote"]}


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


TransferErrorHook = Callable[[StepPlan], None]

__all__ = ["CACHE_KINDS", "DEMOTION_KINDS", "LinkCounters", "StepTransfers", "TransferEngine", "TransferErrorHook"]
