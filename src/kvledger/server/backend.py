"""What the server needs from an engine, and the adapter for kvledger's own :class:`Engine`.

The HTTP face is written against :class:`Backend` only, so the same app can front one local engine
(``kvledger serve``) or, later, a fleet ingress that forwards to replicas: anything with these methods.

A snapshot (:class:`BackendState`) is what ``/metrics`` and ``/admin/ledger`` show. It is the operator's
view of the whole pool; nothing in it ever reaches a tenant's response.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class Handle(Protocol):
    request_id: str

    def done(self) -> bool: ...
    def result(self, timeout: float | None = None) -> Any: ...  # RequestResult-like


class Backend(Protocol):
    """An engine-like thing: the public API of :class:`kvledger.runtime.engine.Engine`."""

    model_name: str
    block_size: int
    pool_blocks: int
    max_context: int | None
    vocab_size: int
    max_num_seqs: int  # most sequences (branches) running at once: a larger n can never run
    error: BaseException | None

    def check_request(self, prompt: Sequence[int], max_new_tokens: int, sampling: Any = None, *,
                      trust_group: str = "default", request_id: str = "check",
                      cache_salt: str | None = None) -> tuple[list[int], int, Any]: ...

    def largest_allowance(self, prompt: Sequence[int], sampling: Any = None, *, trust_group: str = "default",
                          cache_salt: str | None = None) -> int: ...

    def submit(self, prompt: Sequence[int], max_new_tokens: int, sampling: Any = None, *,
               stop_token_ids: Sequence[int] = (), trust_group: str = "default", priority: int = 0,
               request_id: str | None = None, on_token: Callable[[Any], None] | None = None,
               cache_salt: str | None = None) -> Handle: ...

    def cancel(self, request_id: str) -> bool: ...
    def set_quota(self, trust_group: str, max_blocks: int | None) -> None: ...
    def num_running(self) -> int: ...
    def state(self) -> BackendState: ...
    def audit(self) -> dict[str, Any]: ...
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> Any: ...  # a CacheReset
    def start(self) -> None: ...
    def drain(self, timeout: float) -> bool: ...
    def stop(self) -> None: ...


@dataclass(frozen=True, slots=True)
class BackendState:
    """A point-in-time view of the pool and the engine's counters (operator only)."""

    running: int  # requests with a branch admitted
    blocks: dict[str, int]  # free, active, retained, evictable, promised, pinned, leased
    total_blocks: int
    leases: int
    sequences: int
    admissions: dict[str, int]  # ledger decisions: admitted / not_now / never
    evictions: int
    preemptions: int
    swapped_blocks: dict[str, int]  # out / in
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    cancelled: int = 0  # requests the engine cancelled (client gone, stop string met, shutdown)
    # trust group -> its ledger (active, promised, growth, charged, cap), prefix-cache figures (query_tokens,
    # hit_tokens) and quota_refusals: KVLedger.group_stats()
    groups: dict[str, dict[str, int | None]] = field(default_factory=dict)
    # blocks whose copy into a tier below the device pool ("demotion") or back ("promotion") raised: each
    # lost only a cache entry, or had its request recompute it (TransferEngine.stats())
    tier_failures: dict[str, int] = field(default_factory=dict)
    # tokens per engine step -> steps (EngineStats.iteration_tokens): vllm:iteration_tokens_total
    iteration_tokens: dict[int, int] = field(default_factory=dict)


class EngineBackend:
    """:class:`Backend` over one local :class:`~kvledger.runtime.engine.Engine` in its background thread,
    through the engine's public API only (its snapshot for everything a scrape or an audit reads)."""

    supports_constraints = True  # SamplingParams.constraint (response_format's grammar) runs in this engine

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        snap = engine.snapshot()
        self.model_name = engine.model_name
        self.block_size = snap.block_size
        self.pool_blocks = snap.pool_blocks
        self.max_context = engine.max_context
        self.vocab_size = engine.vocab_size
        self.max_num_seqs = snap.max_running

    @property
    def error(self) -> BaseException | None:
        return self.engine.error

    def check_request(self, prompt: Sequence[int], max_new_tokens: int, sampling: Any = None, *,
                      trust_group: str = "default", request_id: str = "check",
                      cache_salt: str | None = None) -> tuple[list[int], int, Any]:
        return self.engine.check_request(prompt, max_new_tokens, sampling, trust_group=trust_group,
                                         request_id=request_id, cache_salt=cache_salt)

    def largest_allowance(self, prompt: Sequence[int], sampling: Any = None, *, trust_group: str = "default",
                          cache_salt: str | None = None) -> int:
        return self.engine.largest_allowance(prompt, sampling, trust_group=trust_group, cache_salt=cache_salt)

    def submit(self, prompt: Sequence[int], max_new_tokens: int, sampling: Any = None, *,
               stop_token_ids: Sequence[int] = (), trust_group: str = "default", priority: int = 0,
               request_id: str | None = None, on_token: Callable[[Any], None] | None = None,
               cache_salt: str | None = None) -> Handle:
        return self.engine.submit(prompt, max_new_tokens, sampling, stop_token_ids=stop_token_ids,
                                  trust_group=trust_group, priority=priority, request_id=request_id,
                                  on_token=on_token, cache_salt=cache_salt)

    def cancel(self, request_id: str) -> bool:
        return self.engine.cancel(request_id)

    def set_quota(self, trust_group: str, max_blocks: int | None) -> None:
        self.engine.set_quota(trust_group, max_blocks)

    def num_running(self) -> int:
        return self.engine.num_running()

    def state(self) -> BackendState:
        snap = self.engine.snapshot()
        u, stats = snap.blocks, snap.stats
        transfers = self.engine.transfers.stats() if self.engine.transfers is not None else None
        return BackendState(
            running=snap.running,
            blocks={"free": u["free"], "active": u["active"], "retained": u["retained"],
                    "evictable": u["evictable"], "promised": u["promised"], "pinned": u["pinned"],
                    "leased": u["deferred"]},
            total_blocks=u["total"], leases=snap.leases, sequences=u["sequences"],
            admissions=dict(snap.admissions), evictions=snap.evictions, preemptions=snap.preemptions,
            swapped_blocks={"out": stats["swapped_out_blocks"], "in": stats["swapped_in_blocks"]},
            prefix_queries_tokens=snap.prefix_query_tokens, prefix_hits_tokens=snap.prefix_hit_tokens,
            cancelled=stats["cancelled"], groups=snap.groups,
            tier_failures={"demotion": transfers["demotion_failures"], "promotion": transfers["promotion_failures"]}
            if transfers is not None else {},
            iteration_tokens=stats.get("iteration_tokens", {}))

    def audit(self) -> dict[str, Any]:
        """Check every conservation law now (between steps) and report whether the ledger is clean:
        nothing active, promised or leased, no sequence left."""
        self.engine.check()
        s = self.state()
        clean = (s.sequences == 0 and s.blocks["active"] == 0 and s.blocks["promised"] == 0
                 and s.blocks["leased"] == 0 and s.leases == 0)
        return {"clean": clean, "running": s.running, "sequences": s.sequences, "leases": s.leases,
                "blocks": s.blocks, "total_blocks": s.total_blocks, "checked": True,
                "groups": {g: {k: v for k, v in entry.items() if k in ("active", "promised", "growth", "charged",
                                                                       "cap")}
                           for g, entry in s.groups.items()}}

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> Any:
        """The engine's reset between steps (device pool, every tier, the hit-rate window): a
        ``CacheReset``, refused while blocks are held unless running requests are requeued."""
        return self.engine.reset_prefix_cache(requeue_running=reset_running_requests)

    def start(self) -> None:
        self.engine.start()

    def drain(self, timeout: float) -> bool:
        """Wait (bounded) until the engine has nothing left to do; True if it got there."""
        deadline = time.monotonic() + timeout
        while self.engine.has_work():
            if self.engine.error is not None or time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def stop(self) -> None:
        self.engine.stop(timeout=10)


__all__ = ["Backend", "BackendState", "EngineBackend", "Handle"]
