"""Offline references for prefix-cache eviction (issue 38): what the best possible policy would have kept.

**The model** (what the references and :func:`replay_policy` share). Requests come one at a time, in
arrival order. Request ``r``'s prompt is a chain of full-block identities (keys, chained as the ledger's
digests are) plus, while it runs, its other blocks (a partial last block): ``footprint[r]`` blocks in all,
each resident while it runs. Its hit is the longest prefix of its chain that is cached; the rest is
recomputed. After it, its chain blocks are cached. A cache of ``C`` blocks holds, during request ``r``,
its ``footprint[r]`` blocks and at most ``C - footprint[r]`` others. A cached block is useful only with
its ancestors (the prefix-tree constraint): a hit stops at the first missing block. There is no
concurrency: this is the cache's problem alone, so the references bound every eviction policy at that
cache size (the simulator's pool also holds running requests' blocks).

**Belady (hit count).** :func:`belady` evicts the cached block whose next use is furthest (never used
again first), deeper first among equals. A block's next use is never before its parent's (a request
using it uses the parent in the same request), so the victim is always a leaf of the cached tree: the
cache stays prefix-closed, every cached block is a hit when next used, and MIN's optimality for paging
carries over. Tests check it against brute force on small traces.

**Cost-aware bound (saved prefill time).** A hit on the block at depth ``d`` saves ``cost[d]``, the time
recomputing it would take (the cost model's marginal prefill time of that block of the prompt). Keeping
block ``b`` from one use to its next is an interval over the requests between them; choosing intervals
of greatest total saving under the per-request capacity is a min-cost flow (an interval matrix is
totally unimodular). :func:`cost_bound` solves it exactly by successive shortest paths (primal-dual:
one Dijkstra per distinct path length, blocking flows on the zero-reduced-cost graph), for every cache
size of a sweep in one run. The flow does not see the prefix-tree constraint, so its optimum
(``upper``) bounds the honest optimum from above; dropping from its solution every hit whose ancestors
were not kept gives a feasible honest schedule (``lower``). The honest optimum lies between the two; the
tests hold both to brute force.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core import checks
from ..errors import ConfigError


@dataclass(frozen=True, slots=True)
class Accesses:
    """A trace as the cache sees it: per request its chain of full-block keys, its footprint in blocks and
    its prompt length; ``block_size`` tokens per block."""

    chains: tuple[tuple[Hashable, ...], ...]
    footprints: tuple[int, ...]
    prompt_tokens: tuple[int, ...]
    block_size: int

    def __post_init__(self) -> None:
        checks.positive(self.block_size, "block_size")
        if not len(self.chains) == len(self.footprints) == len(self.prompt_tokens):
            raise ConfigError("chains, footprints and prompt_tokens must have one entry per request")
        for chain, foot in zip(self.chains, self.footprints, strict=True):
            if foot < len(chain):
                raise ConfigError("a request's footprint must hold its chain")

    @property
    def total_tokens(self) -> int:
        return sum(self.prompt_tokens)

    @property
    def largest_footprint(self) -> int:
        return max(self.footprints, default=0)

    @classmethod
    def of_chains(cls, chains: Sequence[Sequence[Hashable]], block_size: int = 1,
                  footprints: Sequence[int] | None = None) -> Accesses:
        """Small hand-made traces: each chain a list of keys (a key is its whole prefix, so give chains
        that agree on their shared heads), footprints default to the chains' lengths."""
        chains_t = tuple(tuple(c) for c in chains)
        feet = tuple(footprints) if footprints is not None else tuple(len(c) for c in chains_t)
        return cls(chains_t, feet, tuple(len(c) * block_size for c in chains_t), block_size)


def accesses_from_requests(requests: Sequence[Any], block_size: int, *, isolate: bool = False) -> Accesses:
    """The chains of :class:`~kvledger.workloads.SimRequest` prompts, keyed as the ledger's digests are (a
    full block's key is its trust group, its tokens and its parent's key; cf. ``prefix_hit_bound``)."""
    checks.positive(block_size, "block_size")
    chains, feet, tokens = [], [], []
    for i, r in enumerate(requests):
        parent: Hashable = ("request", i) if isolate else ("group", r.trust_group)
        full = r.prompt_len // block_size
        chain = []
        for b in range(full):
            parent = hash((parent, r.prompt_tokens[b * block_size:(b + 1) * block_size].runs))
            chain.append(parent)
        chains.append(tuple(chain))
        feet.append(-(-r.prompt_len // block_size))
        tokens.append(r.prompt_len)
    return Accesses(tuple(chains), tuple(feet), tuple(tokens), block_size)


def _next_uses(acc: Accesses) -> list[list[int]]:
    """Per request, per chain position: the index of the next request using that key (inf: never)."""
    nxt: list[list[int]] = [[0] * len(c) for c in acc.chains]
    later: dict[Hashable, int] = {}
    never = len(acc.chains)
    for r in range(len(acc.chains) - 1, -1, -1):
        row = nxt[r]
        for pos, key in enumerate(acc.chains[r]):
            row[pos] = later.get(key, never)
        for key in acc.chains[r]:
            later[key] = r
    return nxt


def _check_capacity(acc: Accesses, capacity: int) -> None:
    checks.positive(capacity, "capacity")
    if acc.largest_footprint > capacity:
        raise ConfigError(f"a request needs {acc.largest_footprint} blocks at once, more than the cache's "
                          f"{capacity}; drop or trim such requests first")


@dataclass(slots=True)
class CacheResult:
    """Hit blocks per request (a prefix of each chain) and the totals."""

    capacity: int
    hits: list[int] = field(default_factory=list)

    def hit_tokens(self, acc: Accesses) -> int:
        return sum(h * acc.block_size for h in self.hits)

    def hit_rate(self, acc: Accesses) -> float:
        total = acc.total_tokens
        return self.hit_tokens(acc) / total if total else 0.0

    def saved(self, costs: Sequence[float]) -> float:
        return sum(costs[h] for h in self.hits)


def prefix_costs(cost_of_prefix: Callable[[int], float], max_blocks: int, block_size: int) -> list[float]:
    """``out[k]`` = time saved by a hit of the first ``k`` blocks: the prefill of the whole prefix
    (``cost_of_prefix(tokens)``) at ``k`` blocks, so ``out[k] - out[k - 1]`` is block ``k - 1``'s cost."""
    return [cost_of_prefix(k * block_size) if k else 0.0 for k in range(max_blocks + 1)]


def belady(acc: Accesses, capacity: int) -> CacheResult:
    """Belady's MIN under the model above: the most hit blocks any policy can get with ``capacity``."""
    _check_capacity(acc, capacity)
    nxt = _next_uses(acc)
    cached: dict[Hashable, tuple[int, int]] = {}  # key -> (next use, depth): its live heap entry
    heap: list[tuple[int, int, int, Hashable]] = []  # (-next use, -depth, tiebreak, key), lazily deleted
    tick = 0
    out = CacheResult(capacity)
    for r, chain in enumerate(acc.chains):
        h = 0
        while h < len(chain) and chain[h] in cached:
            h += 1
        out.hits.append(h)
        for key in chain[:h]:  # in use now: never a victim while it runs
            cached[key] = (r, -1)
        room = capacity - acc.footprints[r]
        while len(cached) - h > room:
            neg_next, neg_depth, _, key = heapq.heappop(heap)
            if cached.get(key) != (-neg_next, -neg_depth):
                continue  # stale: used again since
            del cached[key]
        # (keys of the chain past the hit prefix are never cached here: the cache is prefix-closed)
        for depth, key in enumerate(chain):
            entry = (nxt[r][depth], depth)
            cached[key] = entry
            tick += 1
            heapq.heappush(heap, (-entry[0], -depth, tick, key))
        if len(heap) > 4 * len(cached) + 64:
            heap = [(-n, -d, i, k) for i, (k, (n, d)) in enumerate(cached.items())]
            heapq.heapify(heap)
    return out


# ---- the cost-aware bound: min-cost flow over keep-intervals ----------------------------------------

@dataclass(slots=True)
class CostBound:
    """Saved prefill time at one cache size: ``upper`` (the flow's optimum, no tree constraint) and
    ``lower`` (its schedule with every hit lacking an ancestor dropped: achievable), and the hit tokens
    of that honest schedule."""

    capacity: int
    upper: float
    lower: float
    lower_hit_tokens: int


class _Flow:
    """Min-cost flow on a DAG-shaped graph by primal-dual successive shortest paths (integer costs)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.head: list[list[int]] = [[] for _ in range(n)]
        self.to: list[int] = []
        self.cap: list[int] = []
        self.cost: list[int] = []

    def arc(self, u: int, v: int, cap: int, cost: int) -> int:
        i = len(self.to)
        self.to += [v, u]
        self.cap += [cap, 0]
        self.cost += [cost, -cost]
        self.head[u].append(i)
        self.head[v].append(i + 1)
        return i

    def run(self, targets: Sequence[int], on_target: Callable[[int], None]) -> None:
        """Push flow from node 0 to node n-1, calling ``on_target(value)`` when the flow reaches each
        target (ascending); the flow is a min-cost flow of its value at every call."""
        n, to, cap, cost, head = self.n, self.to, self.cap, self.cost, self.head
        inf = float("inf")
        pot = [inf] * n  # DAG (every arc goes to a higher node): shortest distances in index order
        pot[0] = 0
        for u in range(n):
            if pot[u] == inf:
                continue
            for i in head[u]:
                if cap[i] > 0 and pot[u] + cost[i] < pot[to[i]]:
                    pot[to[i]] = pot[u] + cost[i]
        pot = [0 if p == inf else p for p in pot]
        flow = 0
        for target in targets:
            while flow < target:
                dist = [inf] * n
                dist[0] = 0
                heap = [(0, 0)]
                while heap:
                    d, u = heapq.heappop(heap)
                    if d > dist[u]:
                        continue
                    pu = pot[u]
                    for i in head[u]:
                        if cap[i] > 0:
                            v = to[i]
                            nd = d + cost[i] + pu - pot[v]
                            if nd < dist[v]:
                                dist[v] = nd
                                heapq.heappush(heap, (nd, v))
                if dist[n - 1] == inf:
                    raise ConfigError("the cache cannot hold the flow asked for")  # never: the spine is wide
                big = dist[n - 1]
                for v in range(n):
                    pot[v] += dist[v] if dist[v] < big else big
                flow += self._blocking(target - flow, pot)
            on_target(flow)

    def _blocking(self, limit: int, pot: list[int]) -> int:
        """Augment along zero-reduced-cost paths (levels by BFS, Dinic style) up to ``limit`` units."""
        n, to, cap, cost, head = self.n, self.to, self.cap, self.cost, self.head
        level = [-1] * n
        level[0] = 0
        queue = [0]
        for u in queue:
            for i in head[u]:
                v = to[i]
                if cap[i] > 0 and level[v] < 0 and cost[i] + pot[u] - pot[v] == 0:
                    level[v] = level[u] + 1
                    queue.append(v)
        if level[n - 1] < 0:
            return 0
        it = [0] * n
        pushed = 0
        while pushed < limit:
            # one path by iterative DFS over admissible level arcs
            path: list[int] = []
            u = 0
            while u != n - 1:
                arcs = head[u]
                advanced = False
                while it[u] < len(arcs):
                    i = arcs[it[u]]
                    v = to[i]
                    if cap[i] > 0 and level[v] == level[u] + 1 and cost[i] + pot[u] - pot[v] == 0:
                        path.append(i)
                        u = v
                        advanced = True
                        break
                    it[u] += 1
                if not advanced:
                    if not path:
                        return pushed
                    level[u] = -1  # dead end
                    i = path.pop()
                    u = to[i ^ 1]
                    it[u] += 1
            push = min(limit - pushed, min(cap[i] for i in path))
            for i in path:
                cap[i] -= push
                cap[i ^ 1] += push
            pushed += push
        return pushed


COST_WEIGHT = 1e6  # the flow's costs are integers: the costliest block weighs a million
COST_STEP = 1.005  # block costs are rounded up to a power of this (<= 0.5% more), so equal ones merge


def cost_bound(acc: Accesses, capacities: Sequence[int], block_costs: Sequence[float]) -> list[CostBound]:
    """The cost-aware bound at each capacity (see the module's docstring). ``block_costs[d]`` is the time
    a hit on the block at depth ``d`` saves (at least as long as the longest chain).

    Keep-intervals with the same ends and (rounded) cost are one arc of that many units, so a long prompt
    reused whole is a handful of arcs. The costs are rounded *up* (by at most 0.5%), so ``upper`` stays
    an upper bound; ``lower`` is valued at the true costs, keeping the shallowest blocks of a merged arc."""
    caps = sorted(set(capacities))
    if not caps:
        return []
    for c in caps:
        _check_capacity(acc, c)
    longest = max((len(c) for c in acc.chains), default=0)
    if len(block_costs) < longest:
        raise ConfigError(f"block_costs covers {len(block_costs)} depths; the longest chain has {longest}")
    rounded = [COST_STEP ** math.ceil(math.log(c, COST_STEP)) if c > 0 else 0.0 for c in block_costs[:longest]]
    scale = COST_WEIGHT / max(max(rounded, default=1.0), 1e-30)
    w = [max(1, round(c * scale)) for c in rounded]
    t = len(acc.chains)
    last: dict[Hashable, int] = {}
    groups: dict[tuple[int, int, int], list[int]] = {}  # (start, end, weight) -> depths at the end request
    free_gain: list[tuple[int, int]] = []  # (end request, depth) of reuses by the very next request
    for r, chain in enumerate(acc.chains):
        for depth, key in enumerate(chain):
            prev = last.get(key)
            if prev is not None:
                if prev + 1 == r:
                    free_gain.append((r, depth))
                else:
                    groups.setdefault((prev, r, w[depth]), []).append(depth)
            last[key] = r
    big = sum(k[2] * len(v) for k, v in groups.items()) + 1
    flow = _Flow(t + 1)
    for m in range(t):
        flow.arc(m, m + 1, acc.footprints[m], -big)  # the request's own blocks: always resident
        flow.arc(m, m + 1, caps[-1], 0)  # an empty slot
    keys = list(groups)
    arc_of = [flow.arc(a + 1, b, len(groups[(a, b, wt)]), -wt) for a, b, wt in keys]
    out: list[CostBound] = []
    free_up = sum(rounded[d] for _, d in free_gain)

    def record(value: int) -> None:
        upper = free_up
        present: set[tuple[int, int]] = set(free_gain)
        for key, i in zip(keys, arc_of, strict=True):
            kept = flow.cap[i ^ 1]  # units on the arc
            if kept:
                depths = sorted(groups[key])[:kept]  # the shallowest: a prefix is what can hit
                upper += kept * rounded[depths[0]]
                present.update((key[1], d) for d in depths)
        lower = 0.0
        hit_tokens = 0
        for r, chain in enumerate(acc.chains):
            d = 0
            while d < len(chain) and (r, d) in present:
                lower += block_costs[d]
                d += 1
            hit_tokens += d * acc.block_size
        out.append(CostBound(value, upper, lower, hit_tokens))

    flow.run(caps, record)
    return out


def brute_force(acc: Accesses, capacity: int, block_costs: Sequence[float] | None = None) -> float:
    """The honest optimum by exhaustive search (tiny traces only): hit blocks, or saved cost with
    ``block_costs``. Before each request any cached blocks outside its chain may be evicted, as long as
    the rest and the request fit; a hit is the longest cached prefix."""
    _check_capacity(acc, capacity)
    from itertools import combinations

    value = (lambda d: 1.0) if block_costs is None else (lambda d: block_costs[d])

    @functools.cache
    def best(r: int, cache: frozenset) -> float:
        if r == len(acc.chains):
            return 0.0
        chain = acc.chains[r]
        h = 0
        while h < len(chain) and chain[h] in cache:
            h += 1
        gain = sum(value(d) for d in range(h))
        others = sorted(cache - set(chain), key=repr)
        room = capacity - acc.footprints[r]
        top = -math.inf
        for k in range(min(room, len(others)), -1, -1):
            for keep in combinations(others, k):
                top = max(top, best(r + 1, frozenset(keep) | frozenset(chain)))
        return gain + top

    return best(0, frozenset())


# ---- online policies on the same model: the real ledger, one request at a time ----------------------

def prompts_of_chains(acc: Accesses) -> list[tuple[list[int], str]]:
    """Token prompts whose ledger digests follow ``acc``'s chains (each key one block of one repeated
    token id) plus ``footprint - len(chain)`` blocks' worth of private tokens (the last one partial)."""
    ids: dict[Hashable, int] = {}
    bs = acc.block_size
    out = []
    for r, (chain, foot) in enumerate(zip(acc.chains, acc.footprints, strict=True)):
        tokens = [ids.setdefault(k, len(ids) + 1) for k in chain for _ in range(bs)]
        extra = foot - len(chain)
        if extra:
            tokens += [-(r + 1) % 2**30 + 10**6] * ((extra - 1) * bs + max(1, bs - 1))
        out.append((tokens, "g"))
    return out


def replay_policy(prompts: Sequence[tuple[Sequence[int], str]], block_size: int, capacity: int, policy: Any,
                  block_cost: Callable[[int], float] | None = None) -> CacheResult:
    """Hit blocks per request when the real :class:`~kvledger.core.ledger.KVLedger` of ``capacity`` blocks,
    evicting with ``policy`` (a registered name), serves the prompts one at a time: admit (one output
    token allowed), compute the prompt, release. ``block_cost`` (seconds by depth) is given to policies
    that weigh blocks by it (gdsf)."""
    from ..core.identity import CacheContext, request_context
    from ..core.ledger import KVLedger, Request

    ledger = KVLedger(capacity, block_size, prefix_caching=True, policy=policy)
    setter = getattr(ledger.pool.retained, "set_block_cost", None)
    if setter is not None and block_cost is not None:
        setter(block_cost)
    contexts: dict[str, CacheContext] = {}
    out = CacheResult(capacity)
    for i, (tokens, group) in enumerate(prompts):
        ctx = contexts.get(group)
        if ctx is None:
            ctx = contexts[group] = request_context(group, model="replay")
        rid = f"r{i}"
        decision = ledger.admit(Request(rid, list(tokens), 1, ctx))
        if not decision.admitted:
            raise ConfigError(f"request {i} ({len(tokens)} tokens) does not fit a cache of {capacity} blocks")
        ledger.mark_computed(rid, len(tokens))
        out.hits.append(decision.blocks_hit)
        ledger.release(rid)
    return out


__all__ = ["Accesses", "CacheResult", "CostBound", "accesses_from_requests", "belady", "brute_force",
           "cost_bound", "prefix_costs", "prompts_of_chains", "replay_policy"]
