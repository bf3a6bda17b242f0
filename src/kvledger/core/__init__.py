"""The ledger core: pure Python, no third-party imports.

KV geometry and inventory, the block pool, block tables, cache identity and prefix index,
reservations and admission. Everything above (scheduler, runtime, simulator, faces) builds on this.
"""

from __future__ import annotations

from .eviction import EvictionPolicy, LRUPolicy
from .identity import CacheContext
from .ledger import Decision, KVLedger, Outcome, Request, SequenceState, Usage
from .pool import BlockPool
from .sizing.geometry import KVSpec
from .table import BlockTable

__all__ = [
    "BlockPool", "BlockTable", "CacheContext", "Decision", "EvictionPolicy", "KVLedger", "KVSpec",
    "LRUPolicy", "Outcome", "Request", "SequenceState", "Usage",
]
