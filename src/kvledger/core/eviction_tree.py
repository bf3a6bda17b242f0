"""Eviction policies that see the prefix tree: LFU with dynamic aging, GreedyDual-Size-Frequency, ARC,
S3-FIFO and SGLang-style priority.

Why a tree: a cached block is useful only together with its ancestors (a prefix hit stops at the first
missing block), so evicting a block whose child is still cached strands the child. Every policy here
evicts **leaves only** -- retained blocks none of whose children are retained -- as SGLang's radix cache
does; the policy's own score only orders the leaves. The pool tells a policy each block's parent and
depth when it registers the block's identity (:meth:`TreePolicy.link`), and the identity's end
(:meth:`TreePolicy.forget`).

Cost: each policy keeps one binary heap per queue of its leaves, deleted lazily, so ``add``/``remove`` are
O(log n) and a victim is O(log n) amortised (stale entries are popped once each; the heaps are rebuilt
when stale entries outnumber live ones). S3-FIFO and ARC move a block between queues at most a bounded
number of times per use, so they stay O(log n) amortised per evicted block.

When the ledger core's C part is loaded (:mod:`kvledger.core.native`) the same bookkeeping lives in its
``PolicyCore`` (flat arrays per block id, one indexed heap per queue holding exactly the evictable leaves),
and the pool calls it directly on its hot paths; the Python code here is the reference and the fallback
(``KVLEDGER_NATIVE=0``, no compiler), and the tests run both on the same random sequences and require the
same victims. The C part takes block ids only (ints in 0..2**26), as the pool gives.

What a "use" is here: the policy sees a block when it becomes retained (``add``: a holder released it)
and when a request takes it back (``remove``). A block shared by running requests is never retained
between those uses, so the policies count *releases*: a block released twice was used twice.

The module is just past 600 lines and kept whole: the five tree policies are small subclasses of one
``TreePolicy`` that owns the leaf rule (only a block with no cached child is evictable), the lazy heaps and
the hand-off to the C part, and they plug in through private hooks (``_place``, ``_evict_from``,
``_on_evict``, ``_take``, ``_requeue``) whose contract is read against that base. Split per policy, each file
would reach into another module's private hooks or restate them.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError, LedgerError
from . import native
from .eviction import DEFAULT_PRIORITY, EVICTION_POLICIES, MAX_PRIORITY

# Tokens of context at which a block's attention costs what its weights do (Llama-3.1-8B: 2 x 8e9 FLOPs per
# token against 4 x 32 layers x 4096 per context token x 2): the default block cost's proxy until the
# engine or the simulator sets the cost model's own (``set_block_cost``).
ATTENTION_KNEE_TOKENS = 32768


def default_block_cost(depth: int, block_size: int) -> float:
    """Relative time to recompute block ``depth`` (0 = first): its tokens' weight FLOPs plus attention over
    the context before it, in token units."""
    return block_size * (1.0 + (depth + 0.5) * block_size / ATTENTION_KNEE_TOKENS)


def _cost_at_depth(costs: list[float], fn: Callable[[int], float] | None, block_size: int, depth: int) -> float:
    """The block cost at ``depth``, memoised in ``costs`` in depth order (a cost callable is asked once per
    depth, in order)."""
    if depth >= len(costs):
        for d in range(len(costs), depth + 1):
            costs.append(fn(d) if fn is not None else default_block_cost(d, block_size))
    return costs[depth]


class TreePolicy:
    """Leaf-only eviction over per-queue heaps; subclasses choose the queue and the key."""

    name = ""
    queues = 1
    # The native core's kind for this exact class (a subclass that overrides the hooks runs in Python).
    _native_kind: int | None = None
    __slots__ = ("_clock", "_node", "_kids", "_entry", "_heaps", "_size", "_seq", "_gens", "_capacity",
                 "_block_size", "_cost", "_costs", "_core")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # linked block -> (its generation, parent block or -1, the parent's generation, depth, digest);
        # generations are never reused, so a parent that lost its identity is recognised as gone
        self._node: dict[int, tuple[int, int, int, int, bytes]] = {}
        self._kids: dict[int, int] = {}  # block -> how many of its children are retained
        self._entry: dict[int, list[Any]] = {}  # retained block -> [key, seq, block, queue, in_heap]
        self._heaps: list[list[list[Any]]] = [[] for _ in range(self.queues)]
        self._size = [0] * self.queues
        self._seq = itertools.count()
        self._gens = itertools.count(1)
        self._capacity = 0  # the pool's size when the ledger says it (ghost bounds, S3-FIFO's small queue)
        self._block_size = 16
        self._cost: Callable[[int], float] | None = None
        self._costs: list[float] = []  # block cost by depth, memoised
        kind = type(self).__dict__.get("_native_kind")
        fast = native.MODULE
        # The C part's state when it is loaded: every method below then hands over to it.
        self._core: Any = None if fast is None or kind is None else fast.PolicyCore(kind, LedgerError, clock,
                                                                                      self._cost_table(),
                                                                                      GHOST_KEY_BYTES)

    @property
    def native_core(self) -> Any:
        """The native ``PolicyCore`` holding this policy's state (the pool calls it directly), or None."""
        return self._core

    # ---- what the ledger and the pool tell it --------------------------------------------------
    def configure(self, num_blocks: int, block_size: int) -> None:
        """The pool's size and block size (the ledger calls this once, before any block)."""
        self._capacity = num_blocks
        self._block_size = block_size
        self._costs = []
        if self._core is not None:
            self._core.configure(num_blocks)
            self._core.reset_costs(self._cost_table())

    def set_block_cost(self, cost: Callable[[int], float] | None) -> None:
        """Seconds (or any unit) to recompute the block at a depth; None = the FLOP proxy."""
        if cost is not None and not callable(cost):
            raise ConfigError("block cost must be a callable of the block's depth")
        self._cost = cost
        self._costs = []
        if self._core is not None:
            self._core.reset_costs(self._cost_table())

    def block_cost(self, block: int) -> float:
        return self._cost_at(self.depth(block))

    def _cost_at(self, depth: int) -> float:
        return _cost_at_depth(self._costs, self._cost, self._block_size, depth)

    def _cost_table(self) -> Callable[[int], float]:
        """What the native core asks for a depth's cost: the same memo, without a reference back to the
        policy (the core holds it; a cycle through a C object would never be collected)."""
        return functools.partial(_cost_at_depth, self._costs, self._cost, self._block_size)

    def depth(self, block: int) -> int:
        if self._core is not None:
            return self._core.depth(block)
        node = self._node.get(block)
        return 0 if node is None else node[3]

    def digest(self, block: int) -> bytes | None:
        if self._core is not None:
            return self._core.digest(block)
        node = self._node.get(block)
        return None if node is None else node[4]

    def link(self, block: int, digest: bytes, parent: int | None, depth: int) -> None:
        """``block`` now holds the identity ``digest`` at ``depth`` under ``parent`` (None: a root, or
        unknown)."""
        if self._core is not None:
            self._core.link(block, digest, parent, depth)
            return
        up = None if parent is None or parent == block else self._node.get(parent)
        self._node[block] = (next(self._gens), -1 if up is None else parent, 0 if up is None else up[0],
                             depth, digest)  # type: ignore[assignment]
        self._on_link(block, digest)

    def forget(self, block: int) -> None:
        """The block lost its identity (freed or evicted)."""
        if self._core is not None:
            self._core.forget(block)
            return
        if self._node.pop(block, None) is None:
            return
        self._kids.pop(block, None)
        self._on_forget(block)

    def set_priority(self, block: int, priority: int, expires_at: float | None) -> None:
        return None

    # ---- the retained set ----------------------------------------------------------------------
    def _parent_of(self, block: int) -> int | None:
        if self._core is not None:
            return self._core.parent(block)
        node = self._node.get(block)
        if node is None or node[1] < 0:
            return None
        up = self._node.get(node[1])
        return node[1] if up is not None and up[0] == node[2] else None

    def add(self, block: int) -> None:
        if self._core is not None:
            self._core.add(block)
            return
        entry_of = self._entry
        if block in entry_of:
            raise LedgerError(f"block {block} is retained already")
        queue, key = self._place(block)
        entry = [key, next(self._seq), block, queue, False]
        entry_of[block] = entry
        self._size[queue] += 1
        node = self._node.get(block)
        kids = self._kids
        if node is not None and node[1] >= 0:
            up = self._node.get(node[1])
            if up is not None and up[0] == node[2]:
                kids[node[1]] = kids.get(node[1], 0) + 1
        if block not in kids:
            entry[4] = True
            heapq.heappush(self._heaps[queue], entry)

    def add_many(self, blocks: list[int]) -> None:
        if self._core is not None:
            self._core.add_many(blocks)
            return
        add = self.add
        for block in blocks:
            add(block)

    def _take(self, block: int) -> list[Any]:
        entry = self._entry.pop(block)
        self._size[entry[3]] -= 1
        node = self._node.get(block)
        if node is not None and node[1] >= 0:
            parent = node[1]
            up = self._node.get(parent)
            if up is not None and up[0] == node[2]:
                kids = self._kids
                left = kids.get(parent, 0) - 1
                if left > 0:
                    kids[parent] = left
                else:
                    kids.pop(parent, None)
                    pentry = self._entry.get(parent)
                    if pentry is not None and not pentry[4]:  # the parent is now a leaf: it may be chosen
                        pentry[4] = True
                        heapq.heappush(self._heaps[pentry[3]], pentry)
        return entry

    def remove(self, block: int) -> None:
        """A request took the block back (a prefix hit)."""
        if self._core is not None:
            self._core.remove(block)
            return
        self._take(block)
        self._on_hit(block)

    def _leaf(self, queue: int) -> list[Any] | None:
        """The queue's lowest-key leaf, left in place (stale and non-leaf entries dropped on the way)."""
        heap, entry_of, kids = self._heaps[queue], self._entry, self._kids
        while heap:
            top = heap[0]
            block = top[2]
            if entry_of.get(block) is not top:
                heapq.heappop(heap)
                continue
            if kids.get(block):
                heapq.heappop(heap)
                top[4] = False  # pushed again when its last retained child goes
                continue
            return top
        return None

    def _requeue(self, block: int, queue: int, key: Any) -> None:
        """Move a retained leaf to ``queue`` with ``key`` (S3-FIFO's and ARC's moves)."""
        old = self._entry[block]
        self._size[old[3]] -= 1
        entry = [key, next(self._seq), block, queue, True]
        self._entry[block] = entry
        self._size[queue] += 1
        heapq.heappush(self._heaps[queue], entry)

    def _evict_from(self, queue: int) -> int | None:
        top = self._leaf(queue)
        if top is None:
            return None
        block = top[2]
        self._take(block)
        return block

    def pop_victims(self, n: int) -> list[int]:
        if self._core is not None:
            return self._core.pop_victims(n)
        if n > len(self._entry):
            raise LedgerError("fewer retained blocks than requested victims")
        out: list[int] = []
        order, evict_from, on_evict = self._queue_order, self._evict_from, self._on_evict
        while len(out) < n:
            for queue in order():
                block = evict_from(queue)
                if block is not None:
                    break
            else:
                raise LedgerError("no evictable leaf among the retained blocks")  # a forest always has one
            on_evict(block)
            out.append(block)
        self._compact()
        return out

    def _compact(self) -> None:
        live = len(self._entry)
        if (len(self._heaps[0]) if self.queues == 1 else sum(len(h) for h in self._heaps)) > 2 * live + 64:
            for q, heap in enumerate(self._heaps):
                fresh = [e for e in heap if self._entry.get(e[2]) is e and e[4] and not self._kids.get(e[2])]
                for e in heap:
                    if self._entry.get(e[2]) is e:
                        e[4] = False
                for e in fresh:
                    e[4] = True
                heapq.heapify(fresh)
                self._heaps[q] = fresh

    # ---- subclasses ----------------------------------------------------------------------------
    def _place(self, block: int) -> tuple[int, Any]:
        """(queue, key) of a block becoming retained."""
        return 0, next(self._seq)

    def _queue_order(self) -> tuple[int, ...]:
        return tuple(range(self.queues))

    def _on_link(self, block: int, digest: bytes) -> None:
        return None

    def _on_forget(self, block: int) -> None:
        return None

    def _on_hit(self, block: int) -> None:
        return None

    def _on_evict(self, block: int) -> None:
        return None

    # ---- reports -------------------------------------------------------------------------------
    def blocks(self) -> list[int]:
        """Every retained block, in the order the policy would evict them if none moved (O(n log n))."""
        if self._core is not None:
            return self._core.blocks()
        order = self._queue_order()
        rank = {q: i for i, q in enumerate(order)}
        entries = sorted(self._entry.values(), key=lambda e: (rank.get(e[3], len(order)), e[0], e[1]))
        return [e[2] for e in entries]

    def peek(self, n: int) -> list[int]:
        """The next ``n`` likely victims (leaves first), for write-back planning."""
        if self._core is not None:
            return self._core.peek(n)
        leaves = [e for e in self._entry.values() if not self._kids.get(e[2])]
        order = self._queue_order()
        rank = {q: i for i, q in enumerate(order)}
        return [e[2] for e in heapq.nsmallest(max(n, 0), leaves, key=lambda e: (rank.get(e[3], 9), e[0], e[1]))]

    def __len__(self) -> int:
        return len(self._entry) if self._core is None else len(self._core)

    def __contains__(self, block: int) -> bool:
        return block in self._entry if self._core is None else block in self._core

    def clear(self) -> None:
        if self._core is not None:
            self._core.clear()
        self._entry.clear()
        self._heaps = [[] for _ in range(self.queues)]
        self._size = [0] * self.queues
        self._kids.clear()
        self._node.clear()


class LFUPolicy(TreePolicy):
    """Least frequently used with dynamic aging (LFU-DA): key = L + uses, where L is the key of the last
    block evicted, so old counts stop protecting blocks nobody uses any more; LRU among equal keys."""

    name = "lfu"
    _native_kind = 1
    __slots__ = ("_uses", "_age", "_entry_key")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock)
        self._uses: dict[int, int] = {}
        self._age = 0.0
        self._entry_key = 0.0  # the key of the leaf being evicted (L becomes it)

    def _weight(self, block: int) -> float:
        return 1.0

    def _place(self, block: int) -> tuple[int, Any]:
        uses = self._uses[block] = self._uses.get(block, 0) + 1
        return 0, self._age + uses * self._weight(block)

    def _on_evict(self, block: int) -> None:
        self._age = max(self._age, self._entry_key)

    def _evict_from(self, queue: int) -> int | None:
        top = self._leaf(queue)
        if top is None:
            return None
        self._entry_key = top[0]
        self._take(top[2])
        return top[2]

    def _on_forget(self, block: int) -> None:
        self._uses.pop(block, None)

    def clear(self) -> None:
        super().clear()
        self._uses.clear()
        self._age = 0.0


class GDSFPolicy(LFUPolicy):
    """GreedyDual-Size-Frequency: key = L + uses x cost / size, with cost the time recomputing the block
    would take (its tokens at its depth: :meth:`TreePolicy.block_cost`) and size one block. Deep blocks of
    long prompts cost more to recompute, so they stay longer at equal use."""

    name = "gdsf"
    _native_kind = 2
    __slots__ = ()

    def _weight(self, block: int) -> float:
        return self.block_cost(block)


T1, T2 = 0, 1

# A ghost (ARC's B1/B2, S3-FIFO's ghost list) is keyed by its digest's first GHOST_KEY_BYTES bytes, not
# the whole 64: a ghost is only a hint that an identity was evicted recently, and 128 bits of BLAKE2b
# output tell two identities apart with a chance of ~2^-128 of a false match (the cache's identity itself
# already relies on the hash resisting collisions), at a quarter of the memory per ghost. The C part
# (PolicyCore) is handed this width at construction and refuses any other, so both answer alike.
GHOST_KEY_BYTES = 16


class ARCPolicy(TreePolicy):
    """Adaptive Replacement Cache (Megiddo and Modha): T1 holds blocks used once, T2 blocks used again,
    each LRU; ghosts B1/B2 remember the digests (their first GHOST_KEY_BYTES) evicted from each, and a
    miss that finds its digest in a ghost moves the target size ``p`` of T1 toward the list that would have
    kept it."""

    name = "arc"
    queues = 2
    _native_kind = 3
    __slots__ = ("_uses", "_often", "_b1", "_b2", "_p")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock)
        self._uses: dict[int, int] = {}
        self._often: set[int] = set()  # blocks whose identity came back from a ghost list
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._p = 0.0

    @property
    def target_size(self) -> float:
        """ARC's target size ``p`` of T1 (moved by ghost hits)."""
        return self._p if self._core is None else self._core.state()["p"]

    def _ghost_limit(self) -> int:
        return max(self._capacity, len(self._entry), 1)

    def _on_link(self, block: int, digest: bytes) -> None:
        key = digest[:GHOST_KEY_BYTES]
        if key in self._b1:
            self._p = min(float(self._ghost_limit()), self._p + max(1.0, len(self._b2) / len(self._b1)))
            del self._b1[key]
            self._often.add(block)
        elif key in self._b2:
            self._p = max(0.0, self._p - max(1.0, len(self._b1) / len(self._b2)))
            del self._b2[key]
            self._often.add(block)

    def _place(self, block: int) -> tuple[int, Any]:
        uses = self._uses[block] = self._uses.get(block, 0) + 1
        return (T2 if uses > 1 or block in self._often else T1), next(self._seq)

    def _queue_order(self) -> tuple[int, ...]:
        t1 = self._size[T1]
        return (T1, T2) if t1 and (t1 > self._p or not self._size[T2]) else (T2, T1)

    def _on_evict(self, block: int) -> None:
        ghosts = self._b2 if (self._uses.get(block, 0) > 1 or block in self._often) else self._b1
        digest = self.digest(block)
        if digest is not None:
            ghosts[digest[:GHOST_KEY_BYTES]] = None
            if len(ghosts) > self._ghost_limit():
                ghosts.popitem(last=False)

    def _on_forget(self, block: int) -> None:
        self._uses.pop(block, None)
        self._often.discard(block)

    def clear(self) -> None:
        super().clear()
        self._uses.clear()
        self._often.clear()
        self._b1.clear()
        self._b2.clear()
        self._p = 0.0


SMALL, MAIN = 0, 1
S3_SMALL_SHARE = 0.1
S3_MAX_FREQ = 3


class S3FIFOPolicy(TreePolicy):
    """S3-FIFO (Yang et al., SOSP '23): a small FIFO (10% of the retained blocks) takes new identities, a
    main FIFO those used again; a block leaving the small queue unused goes to a ghost list of digests,
    and an identity found there enters the main queue directly. The main queue gives a used block
    another round (its count minus one) instead of evicting it. FIFO position is the block's insertion,
    kept while a request holds it."""

    name = "s3fifo"
    queues = 2
    _native_kind = 4
    __slots__ = ("_freq", "_queue", "_stamp", "_ghost")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock)
        self._freq: dict[int, int] = {}
        self._queue: dict[int, int] = {}
        self._stamp: dict[int, int] = {}
        self._ghost: OrderedDict[bytes, None] = OrderedDict()

    def _on_link(self, block: int, digest: bytes) -> None:
        key = digest[:GHOST_KEY_BYTES]
        if key in self._ghost:
            del self._ghost[key]
            self._queue[block] = MAIN
        else:
            self._queue[block] = SMALL
        self._freq[block] = -1  # the first release is its insertion, not a reuse
        self._stamp[block] = next(self._seq)

    def _place(self, block: int) -> tuple[int, Any]:
        self._freq[block] = min(self._freq.get(block, -1) + 1, S3_MAX_FREQ)
        if block not in self._stamp:  # an identity registered before the policy saw it
            self._stamp[block] = next(self._seq)
        return self._queue.get(block, SMALL), self._stamp[block]

    def _queue_order(self) -> tuple[int, ...]:
        small = self._size[SMALL]
        return (SMALL, MAIN) if small and (small >= S3_SMALL_SHARE * len(self._entry) or not self._size[MAIN]) \
            else (MAIN, SMALL)

    def _evict_from(self, queue: int) -> int | None:
        while True:
            top = self._leaf(queue)
            if top is None:
                return None
            block = top[2]
            freq = self._freq.get(block, 0)
            if queue == SMALL and freq > 0:  # used again while small: promoted to main's tail
                self._freq[block] = 0
                self._queue[block] = MAIN
                self._stamp[block] = next(self._seq)
                self._requeue(block, MAIN, self._stamp[block])
                if not self._size[SMALL]:
                    return None
                continue
            if queue == MAIN and freq > 0:  # another round at main's tail
                self._freq[block] = freq - 1
                self._stamp[block] = next(self._seq)
                self._requeue(block, MAIN, self._stamp[block])
                continue
            self._take(block)
            return block

    def _on_evict(self, block: int) -> None:
        if self._queue.get(block) == SMALL:
            digest = self.digest(block)
            if digest is not None:
                self._ghost[digest[:GHOST_KEY_BYTES]] = None
                if len(self._ghost) > max(self._capacity, len(self._entry), 1):
                    self._ghost.popitem(last=False)

    def _on_forget(self, block: int) -> None:
        self._freq.pop(block, None)
        self._queue.pop(block, None)
        self._stamp.pop(block, None)

    def clear(self) -> None:
        super().clear()
        self._freq.clear()
        self._queue.clear()
        self._stamp.clear()
        self._ghost.clear()


class RadixPriorityPolicy(TreePolicy):
    """SGLang's radix-cache priority eviction: a block keeps the highest priority any request gave its
    tokens (``Retention`` ranges; :data:`DEFAULT_PRIORITY` otherwise), and the lowest-priority leaf goes
    first, least recently released among equals. Unlike ``priority`` (TensorRT-LLM's), nothing expires
    and only leaves are evicted."""

    name = "sglang-priority"
    _native_kind = 5
    __slots__ = ("_prio",)

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock)
        self._prio: dict[int, int] = {}

    def set_priority(self, block: int, priority: int, expires_at: float | None) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= MAX_PRIORITY:
            raise ConfigError(f"priority must be an integer in 0..{MAX_PRIORITY}, got {priority!r}")
        if self._core is not None:
            self._core.set_want(block, priority, None)
            return
        self._prio[block] = max(priority, self._prio.get(block, priority))

    def _place(self, block: int) -> tuple[int, Any]:
        return 0, (self._prio.get(block, DEFAULT_PRIORITY), next(self._seq))

    def _on_forget(self, block: int) -> None:
        self._prio.pop(block, None)

    def clear(self) -> None:
        super().clear()
        self._prio.clear()


TREE_POLICIES = (LFUPolicy, GDSFPolicy, ARCPolicy, S3FIFOPolicy, RadixPriorityPolicy)
_HELP = {
    "lfu": "least frequently used, with dynamic aging (LFU-DA); leaves of the prefix tree only",
    "gdsf": "GreedyDual-Size-Frequency: uses x recompute time saved, aged; leaves only",
    "arc": "Adaptive Replacement Cache (recency and frequency lists, ghost digests); leaves only",
    "s3fifo": "S3-FIFO: small and main FIFO queues with a ghost list; leaves only",
    "sglang-priority": "SGLang's radix priority: lowest request priority leaf first, LRU among equals",
}
for _cls in TREE_POLICIES:
    EVICTION_POLICIES.register(_cls.name, _cls, _HELP[_cls.name])

__all__ = ["ATTENTION_KNEE_TOKENS", "ARCPolicy", "GDSFPolicy", "GHOST_KEY_BYTES", "LFUPolicy", "RadixPriorityPolicy",
           "S3FIFOPolicy", "TREE_POLICIES", "TreePolicy", "default_block_cost"]
