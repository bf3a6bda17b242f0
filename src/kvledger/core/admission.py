"""Admission: one atomic decision per request, every request admitted as a family of branches.

A decision is taken in three steps, cheapest first:

1. **never** -- O(1) arithmetic on the request's declared lengths against the pool's size (no hashing,
   no per-branch work, no lock): a request that cannot fit even an empty pool is told so at once,
   however many branches it asks for;
2. **prepare** -- token ids are checked and, with prefix caching, the prompt's block digests computed
   (outside the lock; remembered per request id while the request waits, so a retry every step does
   not hash the prompt again);
3. **decide and commit** under the ledger's lock: prefix hits, new blocks and promises are counted,
   and either everything is committed or nothing changes.

A trust group may have a quota (``KVLedger.set_quota``; :class:`~kvledger.core.quota.QuotaBook`): the same
decision, under the same lock, refuses an admission that would take the group's charge -- active +
promised blocks + the growth its sequences may still take -- past its cap (``not_now``, or ``never`` when
the request alone exceeds it), with ``Decision.over_quota`` set.

A refused admission changes no block, index entry, promise, event or prefix-cache counter; only the
``not_now`` / ``never`` outcome counters move. ``Decision.reason`` is what a tenant may see: it speaks of
the request's own blocks only. The pool-wide free / evictable / promised figures behind the outcome are
in ``Decision.detail``, for the operator.

There is one decision and one commit, over a *family*: a new request with ``branches=k`` is a family of
``k`` identical branches (its blocks a single chain, shared by all; :meth:`FamilyLayout.chain`), and
:meth:`AdmissionControl.admit_family` re-admits the branches of one preempted request all-or-nothing, whose
tokens may have diverged (their blocks a trie, :meth:`FamilyLayout.of`). Either way the branches
physically share the full blocks of their common token prefixes exactly as a fork would have shared them
-- with or without prefix caching -- and a partial tail that several branches hold with identical tokens
is shared copy-on-write, so a family that fitted before preemption fits again. What differs is only
what the layout costs to build (a chain needs no hashing of trie keys) and how the decision is named
and counted (a request's decision speaks of one branch's blocks and counts its forks; a family's of
the family's distinct blocks).

:class:`AdmissionControl` is a collaborator of :class:`~kvledger.core.ledger.KVLedger`: it owns the digests
remembered for waiting requests and takes the ledger's lock, passed in, for every decision.

The module is a little past 600 lines because the decision and the commit for a chain and for a trie
share their rules (what a branch is charged, when a tail is copied, what a refusal says) and must change
together; split, the two halves would restate them.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

from ..errors import ConfigError, LedgerError
from . import checks
from .identity import check_tokens, mm_prompt_digests, prompt_digests
from .observe import Counters
from .pool import BlockPool
from .promises import PromiseBook, declared_blocks
from .quota import QuotaBook
from .table import BlockTable
from .types import Decision, Outcome, Request, Retention, SequenceState

_MEMO_LIMIT = 1024  # waiting requests whose digests are remembered between attempts


@dataclass(slots=True)
class FamilyLayout:
    """How the branches of a family share blocks, from their tokens alone (no pool state).

    Full blocks form a trie: ``paths[i][b]`` is the node holding full block ``b`` of branch ``i``; two
    branches hold the same node exactly when their tokens agree up to the end of that block. A partial
    tail is shared only by branches whose whole token lists are equal (``tails[i]``, -1 for none).
    ``chain``: every branch holds the same nodes ``0 .. nodes - 1`` in order (the branches of one new
    request); a chain's ``parents`` and ``digests`` are not listed (each node's parent is the one before
    it, its digest the prompt's), so one chain layout serves every prompt of its length."""

    paths: Sequence[Sequence[int]]
    parents: list[int]  # per node: the node of the previous block, -1 for the first block
    digests: Sequence[bytes | None]  # per node: its digest (None without prefix caching)
    tails: list[int]
    tail_holders: list[int]  # per tail group: how many branches hold it
    nodes: int
    chain: bool = False

    @staticmethod
    @functools.lru_cache(maxsize=1024)  # else built for every admission attempt; read only, like every layout
    def chain_of(prompt_len: int, block_size: int, branches: int) -> FamilyLayout:
        """``branches`` identical branches of one prompt: one chain of its full blocks, every branch
        holding all of them, and its partial tail (if any) held by every branch. Shared: read only."""
        full, partial = prompt_len // block_size, prompt_len % block_size != 0
        return FamilyLayout([range(full)] * branches, [], (), [0 if partial else -1] * branches,
                            [branches] if partial else [], full, chain=True)

    @classmethod
    def of(cls, requests: Sequence[Request], digests: Sequence[Sequence[bytes]], block_size: int,
           caching: bool) -> FamilyLayout:
        """The trie of branches whose tokens may differ. With prefix caching the block digests are its
        keys; without, the blocks' token tuples chained to their parent."""
        bs = block_size
        node_of: dict[object, int] = {}
        parents: list[int] = []
        node_digests: list[bytes | None] = []
        paths: list[list[int]] = []
        tail_of: dict[tuple, int] = {}
        tails: list[int] = []
        holders: list[int] = []
        for r, ds in zip(requests, digests, strict=True):
            prompt = r.prompt
            full = len(prompt) // bs
            parent = -1
            path: list[int] = []
            for b in range(full):
                key: object = ds[b] if caching else (parent, prompt[b * bs : (b + 1) * bs])
                node = node_of.get(key)
                if node is None:
                    node = node_of[key] = len(parents)
                    parents.append(parent)
                    node_digests.append(ds[b] if caching else None)
                path.append(node)
                parent = node
            paths.append(path)
            if len(prompt) % bs:
                tkey = (parent, prompt[full * bs :])
                group = tail_of.get(tkey)
                if group is None:
                    group = tail_of[tkey] = len(holders)
                    holders.append(0)
                holders[group] += 1
                tails.append(group)
            else:
                tails.append(-1)
        return cls(paths, parents, node_digests, tails, holders, len(parents))


# A family's prefix hits, as one tuple (it is built on every admission attempt): the device block per node
# (None: no hit; not listed for a chain, whose hits are its leading nodes), the hit blocks, how many were
# retained (they stop being evictable once taken) and pending (still being filled), and -- for a chain --
# how many leading hits are written (-1: count them at commit).
_Hits = tuple[list[int | None], list[int], int, int, int]


class AdmissionControl:
    """Decides and commits admissions for one ledger. Every argument is one of the ledger's parts (it
    owns none of them but the digest memo); decisions run under ``lock``, hashing outside it."""

    __slots__ = ("_block_size", "_caching", "_clock", "_counters", "_lock", "_memo", "_native", "_pool",
                 "_promises", "_quotas", "_seqs", "hit_cap", "on_commit")

    def __init__(self, *, lock: threading.RLock, pool: BlockPool, promises: PromiseBook, quotas: QuotaBook,
                 seqs: dict[str, SequenceState], counters: Counters, block_size: int, prefix_caching: bool,
                 native: ModuleType | None, clock: Callable[[], float]) -> None:
        self._lock = lock
        self._pool = pool
        self._promises = promises
        self._quotas = quotas
        self._seqs = seqs
        self._counters = counters
        self._block_size = block_size
        self._caching = prefix_caching
        self._native = native
        self._clock = clock
        self._memo: OrderedDict[str, tuple] = OrderedDict()  # requests told "not now": their digests
        # A hybrid pool's hooks, set by the ledger around one admission (None on a uniform pool): how many of a
        # prompt's leading hits every KV cache group serves, and what to take once the hits are held (before any
        # allocation could evict a retained block the other groups hit).
        self.hit_cap: Callable[[Sequence[bytes], list[int]], int] | None = None
        self.on_commit: Callable[[], None] | None = None

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    # ---- preparation (no lock) ----------------------------------------------------------------
    @staticmethod
    def checked(request: object) -> Request:
        if not isinstance(request, Request):
            raise ConfigError(f"admission takes a Request, got {type(request).__name__}")
        if not request.prompt:
            raise ConfigError(f"request {request.request_id!r} has an empty prompt")
        return request

    def never(self, request: Request) -> Decision | None:
        """The "never" rule, O(1): the declared maximum -- every branch's whole output allowance and
        speculative slots, the prompt's full blocks shared once -- exceeds the whole pool."""
        prompt_len, pool_blocks = len(request.prompt), self._pool.num_blocks
        k = request.branches
        need = declared_blocks(prompt_len, request.max_new_tokens, self._block_size, k, request.lookahead)
        caps = self._quotas.caps
        cap = caps.get(request.context.trust_group) if caps else None
        if need <= pool_blocks and k <= pool_blocks and (cap is None or need <= cap):
            return None
        branches = f" for {k} branches" if k > 1 else ""
        if need <= pool_blocks and k <= pool_blocks:
            reason = (f"needs {need} blocks ({prompt_len} + {request.max_new_tokens} tokens{branches}) but its "
                      f"trust group's quota is {cap} blocks")
            return Decision(request.request_id, Outcome.NEVER, reason, need, 0, 0, 0, 0, detail=reason,
                            over_quota=True)
        if need > pool_blocks:
            reason = (f"needs {need} blocks ({prompt_len} + {request.max_new_tokens} tokens{branches}) but the "
                      f"whole pool has {pool_blocks}")
        else:
            reason = f"asks for {k} branches but the whole pool has {pool_blocks} blocks"
        return Decision(request.request_id, Outcome.NEVER, reason, need, 0, 0, 0, 0, detail=reason)

    def prepare(self, request: Request, remember: bool = False) -> Sequence[bytes]:
        """Check the prompt's token ids and return its full-block digests ([] without prefix caching).
        A request told "not now" is usually asked again every step, so its digests are remembered under
        its id (:meth:`_remember`), checked against the same (immutable) prompt object and the same
        context root."""
        caching = self._caching
        root = request.context.root_digest() if caching else b""
        memo = self._memo
        if memo:  # usually empty: most requests are admitted at their first attempt
            with self._lock:
                hit = memo.get(request.request_id)
            if hit is not None and hit[0] is request.prompt and hit[1] == self._memo_key(request, root):
                return hit[2]  # a tuple: never changed; the commit takes a list of it
        if caching and request.mm_items:  # the blocks an image covers are keyed by it (checks the ids too)
            digests = mm_prompt_digests(root, request.prompt, self._block_size, request.mm_items, self._native)
        elif caching:
            digests = prompt_digests(root, request.prompt, self._block_size, self._native)  # checks the ids too
        else:
            check_tokens(request.prompt, self._native)  # token ids in [0, 2**32), with or without caching
            digests = []
        if remember:
            self._remember(request, digests)
        return digests

    def _remember(self, request: Request, digests: Sequence[bytes]) -> None:
        """Keep a waiting request's digests for its next attempt (bounded; oldest forgotten first)."""
        root = self._memo_key(request, request.context.root_digest() if self._caching else b"")
        with self._lock:
            memo = self._memo
            held = memo.get(request.request_id)
            if held is not None and held[0] is request.prompt and held[1] == root and held[2] is digests:
                return  # asked again with what it remembers already
            memo[request.request_id] = (request.prompt, root, tuple(digests))
            if len(memo) > _MEMO_LIMIT:
                memo.popitem(last=False)

    @staticmethod
    def _memo_key(request: Request, root: bytes) -> object:
        """What remembered digests were computed from besides the prompt: the root, and the images if any."""
        return (root, request.mm_items) if request.mm_items else root

    def remembered(self) -> list[str]:
        """The waiting requests whose digests are remembered, oldest first."""
        return list(self._memo)

    def forget(self) -> None:
        """Forget every remembered digest (a prefix cache reset)."""
        self._memo.clear()

    def apply_retention(self, ranges: tuple[Retention, ...], blocks: list[int], start: int, end: int) -> None:
        """Tell the eviction policy the priority of blocks ``[start, end)`` from the request's ranges
        (validated when the :class:`Retention` was built, so this cannot fail half-way)."""
        bs, now, policy = self._block_size, self._clock(), self._pool.retained
        for i in range(start, end):
            lo, hi = i * bs, (i + 1) * bs
            best: Retention | None = None
            for r in ranges:
                if r.start < hi and r.end > lo and (best is None or r.priority > best.priority):
                    best = r
            if best is not None:
                expires = None if best.duration_s is None else now + best.duration_s
                policy.set_priority(blocks[i], best.priority, expires)

    # ---- a request: a family of its branches ---------------------------------------------------
    def can_admit(self, request: Request, keep_free: int = 0) -> Decision:
        """The decision :meth:`admit` would take now, without changing anything."""
        keep_free = checks.count(keep_free, "keep_free")
        request = self.checked(request)
        never = self.never(request)
        if never is not None:
            return never
        digests = self.prepare(request, remember=True)  # the admit that usually follows reuses them
        layout = FamilyLayout.chain_of(len(request.prompt), self._block_size, request.branches)
        with self._lock:
            return self._decide([request] * request.branches, layout, digests, keep_free, request.request_id,
                                True)[0]

    def admit(self, request: Request, keep_free: int = 0) -> Decision:
        """Admit ``request`` and its branches atomically (see ``KVLedger.admit``)."""
        if keep_free.__class__ is not int or keep_free < 0:  # the check, skipped for the common plain int
            keep_free = checks.count(keep_free, "keep_free")
        request = self.checked(request)
        rid = request.request_id
        never = self.never(request)  # before any per-branch or per-token work
        if never is not None:
            with self._lock:
                self._memo.pop(rid, None)  # it will not be asked again: keep no copy of it
                self._count_never(request, never.over_quota)
            return never
        digests = self.prepare(request)  # hashing is pure: keep it outside the lock
        k = request.branches
        layout = FamilyLayout.chain_of(len(request.prompt), self._block_size, k)
        members = [request] * k
        with self._lock:
            seqs = self._seqs
            # Bounded: the never rule admits at most num_blocks branches.
            if rid in seqs or (k > 1 and any(f"{rid}/{i}" in seqs for i in range(1, k))):
                raise LedgerError(f"request id {rid!r} is already running")
            decision, hits = self._decide(members, layout, digests, keep_free, rid, True)
            if not decision.admitted:
                self._count_not_now(request, decision.over_quota)
                if digests.__class__ is not tuple:  # a tuple came from the memo: remembered already
                    self._remember(request, digests)  # it will be asked again: hash it once
                return decision
            if self._memo:
                self._memo.pop(rid, None)
            ids = [rid, *(f"{rid}/{i}" for i in range(1, k))] if k > 1 else [rid]
            self._commit(ids, members, layout, [digests] * k, hits, request.family or rid)
            self._count_admission(request.readmission)
            self._count_query(request, len(digests), len(hits[1]))
            if k > 1:
                self._counters.forks += k - 1  # its branches are forks of it
            return decision

    # ---- a re-admitted family -------------------------------------------------------------------
    def admit_family(self, requests: Sequence[Request], keep_free: int = 0) -> Decision:
        """Re-admit the branches of one preempted request together (see ``KVLedger.admit_family``)."""
        keep_free = checks.count(keep_free, "keep_free")
        reqs = self._family_members(requests)
        head = reqs[0]
        family = head.family or head.request_id
        pool_blocks = self._pool.num_blocks
        if len(reqs) > pool_blocks:  # before any per-token work
            reason = f"asks for {len(reqs)} branches but the whole pool has {pool_blocks} blocks"
            return self._family_never(reqs, family, reason, len(reqs))
        digests = [self.prepare(r) for r in reqs]  # checks every token id; pure, outside the lock
        layout = FamilyLayout.of(reqs, digests, self._block_size, self._caching)
        bs = self._block_size
        need_empty = layout.nodes + sum(
            self._blocks_for(len(r.prompt) + r.max_new_tokens + r.lookahead) - len(r.prompt) // bs for r in reqs)
        if need_empty > pool_blocks:
            reason = (f"needs {need_empty} blocks for {len(reqs)} branches at their longest ({layout.nodes} "
                      f"shared full blocks) but the whole pool has {pool_blocks}")
            return self._family_never(reqs, family, reason, need_empty)
        cap = self._quotas.cap(head.context.trust_group)
        if cap is not None and need_empty > cap:
            reason = (f"needs {need_empty} blocks for {len(reqs)} branches at their longest but its trust "
                      f"group's quota is {cap} blocks")
            return self._family_never(reqs, family, reason, need_empty, over_quota=True)
        with self._lock:
            for r in reqs:
                if r.request_id in self._seqs:
                    raise LedgerError(f"request id {r.request_id!r} is already running")
            decision, hits = self._decide(reqs, layout, (), keep_free, family, False)
            if not decision.admitted:
                self._count_not_now(head, decision.over_quota)
                for r, d in zip(reqs, digests, strict=True):
                    self._remember(r, d)  # the family will be asked again: hash it once
                return decision
            for r in reqs:
                self._memo.pop(r.request_id, None)
            self._commit([r.request_id for r in reqs], reqs, layout, digests, hits, family)
            self._count_admission(head.readmission)
            for r, path, d in zip(reqs, layout.paths, digests, strict=True):
                self._count_query(r, len(d), self._leading_hits(path, hits[0]))
            return decision

    @staticmethod
    def _family_members(requests: Sequence[Request]) -> list[Request]:
        if isinstance(requests, (str, bytes, Request)) or not hasattr(requests, "__iter__"):
            raise ConfigError("admit_family takes a sequence of Request, one per branch")
        reqs = [AdmissionControl.checked(r) for r in requests]
        if not reqs:
            raise ConfigError("admit_family needs at least one request")
        head = reqs[0]
        family = head.family or head.request_id
        for r in reqs:
            if r.branches != 1:
                raise ConfigError(f"request {r.request_id!r}: a family member is one branch (branches=1)")
            if (r.family or r.request_id) != family:
                raise ConfigError(f"request {r.request_id!r} is not of family {family!r}")
            if r.context != head.context:
                raise ConfigError(f"request {r.request_id!r}: every branch of a family has one cache context")
            if r.readmission != head.readmission or r.read_prefix_cache != head.read_prefix_cache:
                raise ConfigError(f"request {r.request_id!r}: readmission and read_prefix_cache are per family")
            if r.drop_last_hit_block != head.drop_last_hit_block:
                raise ConfigError(f"request {r.request_id!r}: drop_last_hit_block is per family")
        if len({r.request_id for r in reqs}) != len(reqs):
            raise ConfigError(f"family {family!r} names a branch twice")
        return reqs

    def _family_never(self, reqs: list[Request], family: str, reason: str, need: int,
                      over_quota: bool = False) -> Decision:
        with self._lock:
            for r in reqs:
                self._memo.pop(r.request_id, None)
            self._count_never(reqs[0], over_quota)
        return Decision(family, Outcome.NEVER, reason, need, 0, 0, 0, 0, detail=reason, over_quota=over_quota)

    # ---- the one decision and the one commit (under the lock) -----------------------------------
    def _hits(self, layout: FamilyLayout, digests: Sequence[bytes], read: bool, share_pending: bool = True,
              drop_last: Sequence[int] | None = None) -> _Hits:
        """The family's prefix hits; ``digests``: a chain's (its prompt's), unused for a trie.
        ``share_pending=False``: a chain's hits stop at its first block not yet written. ``drop_last``: each
        path's prompt length, when every path's hit gives up its last block (``Request.drop_last_hit_block``:
        vLLM's rule, the hit stopping before the prompt's last token first)."""
        nodes = layout.nodes
        if not (self._caching and read):
            return [] if layout.chain else [None] * nodes, [], 0, 0, -1
        pool = self._pool
        index, ref, leased, written = pool.index, pool.ref, pool.leased, pool.written
        if layout.chain:  # one chain: its hits are the leading digests found in the index
            fast = self._native
            found = fast.prefix_hits(index, digests, ref, leased, written) if fast is not None else None
            if found is not None:
                hits, retained, pending, ready = found
            else:
                hits = []
                retained = pending = ready = 0
                for d in digests:
                    block = index.get(d)
                    if block is None:
                        break
                    hits.append(block)
                    if ref[block] == 0 and not leased[block]:
                        retained += 1
                    if not written[block]:
                        pending += 1
                    elif ready == len(hits) - 1:
                        ready += 1  # leading hits already written: readable at once
            if pending and not share_pending:
                hits = hits[:ready]
                retained = sum(1 for b in hits if ref[b] == 0 and not leased[b])
                pending = 0
            cap = self.hit_cap
            n = cap(digests, hits) if cap is not None and hits else len(hits)
            if drop_last is not None:
                n = max(0, min(n, (drop_last[0] - 1) // self._block_size) - 1)
            if n < len(hits):
                hits = hits[:n]
                retained = sum(1 for b in hits if ref[b] == 0 and not leased[b])
                pending = sum(1 for b in hits if not written[b])
                ready = next((i for i, b in enumerate(hits) if not written[b]), n)
            return [], hits, retained, pending, ready
        of_node: list[int | None] = [None] * nodes
        parents = layout.parents
        for node, d in enumerate(layout.digests):  # a parent always precedes its children
            if parents[node] < 0 or of_node[parents[node]] is not None:
                of_node[node] = index.get(d)  # type: ignore[arg-type]
        cap = self.hit_cap
        if cap is not None and len(layout.paths) == 1:  # a hybrid pool's one branch: its path is its blocks
            path = layout.paths[0]
            lead = self._leading_hits(list(path), of_node)
            n = cap(layout.digests, [of_node[node] for node in path[:lead]])  # type: ignore[arg-type,misc]
            for node in path[n:]:
                of_node[node] = None
        if drop_last is not None:
            bs = self._block_size
            keep = [max(0, min(self._leading_hits(list(path), of_node), (n - 1) // bs) - 1)
                    for path, n in zip(layout.paths, drop_last, strict=True)]
            for path, k in zip(layout.paths, keep, strict=True):
                for node in path[k:]:
                    of_node[node] = None
            for node in range(nodes):  # a parent precedes its children: a hit's parent stays a hit
                if parents[node] >= 0 and of_node[parents[node]] is None:
                    of_node[node] = None
        blocks = [b for b in of_node if b is not None]
        return (of_node, blocks, sum(1 for b in blocks if ref[b] == 0 and not leased[b]),
                sum(1 for b in blocks if not written[b]), -1)

    def _decide(self, members: list[Request], layout: FamilyLayout, digests: Sequence[bytes], keep_free: int,
                name: str, one_request: bool) -> tuple[Decision, _Hits]:
        """The decision for a family the never rule let through. ``one_request``: the members are the
        branches of one new request, whose decision speaks of one branch's blocks (``blocks_total``) and
        of the branches apart (``blocks_branches``); otherwise of the family's distinct blocks."""
        head = members[0]
        hits = self._hits(layout, digests, head.read_prefix_cache, head.share_pending,
                          [len(r.prompt) for r in members] if head.drop_last_hit_block else None)
        _, hit_blocks, retained, pending, _ = hits
        hit_count = len(hit_blocks)
        bs = self._block_size
        if one_request:  # every branch the same: one sum
            prompt_len = len(head.prompt)
            first = -(-(prompt_len + head.reserved_new_tokens + head.lookahead) // bs) - -(-prompt_len // bs)
            own = first * len(members)
        else:
            allowances = [-(-(len(r.prompt) + r.reserved_new_tokens + r.lookahead) // bs) - -(-len(r.prompt) // bs)
                          for r in members]
            first, own = allowances[0], sum(allowances)
        copies = sum(layout.tail_holders) - len(layout.tail_holders)
        new_now = layout.nodes - hit_count + len(layout.tail_holders)
        promise = own + copies
        need = new_now + promise
        total = hit_count + need
        branches = promise - first  # what the branches after the first add
        shown_total = total - branches if one_request else total
        caps = self._quotas.caps
        cap = caps.get(head.context.trust_group) if caps else None
        if cap is not None:
            # The group's charge grows by every block it will newly hold -- new blocks, hits nobody
            # holds now (retained or deferred), each branch up to its declared maximum, tail copies.
            ref = self._pool.ref
            unheld_hits = sum(1 for b in hit_blocks if ref[b] == 0)
            growth = 0
            for r, path, tail in zip(members, layout.paths, layout.tails, strict=True):
                most = max(self._blocks_for(len(r.prompt) + r.reserved_new_tokens + r.lookahead),
                           self._blocks_for(len(r.prompt) + r.max_new_tokens))
                growth += max(0, most - len(path) - (1 if tail >= 0 else 0))
            refused = self._quotas.over(name, head.context.trust_group, cap, new_now + unheld_hits + copies + growth,
                                        shown_total, hit_count, pending, new_now, promise, branches)
            if refused is not None:
                return refused, hits
        available, detail = self._promises.room(retained, keep_free)
        family = "" if one_request else f"family of {len(members)} branches"
        if need > available:
            reason = (f"{family + ' ' if family else ''}needs {need} new blocks ({hit_count} of {shown_total} "
                      f"shared); the pool cannot promise them now")
            return Decision(name, Outcome.NOT_NOW, reason, shown_total, hit_count, pending, new_now, promise,
                            branches, f"needs {need} new blocks but only {detail}"), hits
        reason = (f"{family + ': ' if family else ''}{hit_count} shared + {new_now} new + {promise} promised = "
                  f"{total} blocks")
        return Decision(name, Outcome.ADMITTED, reason, shown_total, hit_count, pending, new_now, promise,
                        branches, f"{reason}; {detail}"), hits

    @staticmethod
    def _leading_hits(path: list[int], of_node: list[int | None]) -> int:
        n = 0
        while n < len(path) and of_node[path[n]] is not None:
            n += 1
        return n

    def _commit(self, ids: list[str], members: list[Request], layout: FamilyLayout,
                digests: Sequence[Sequence[bytes]], hits: _Hits, family: str) -> None:
        """Take every block the decision counted and open one sequence per branch: hits first (so that
        allocating cannot evict them), then the new blocks of the distinct nodes and tails, each branch
        holding one reference on each of its blocks, and the promises -- each branch its own allowance,
        each shared partial tail one copy per holder beyond the first."""
        pool, bs = self._pool, self._block_size
        head = members[0]
        group = head.context.trust_group
        of_node, hit_blocks, _, _, _ = hits
        tail_count = len(layout.tail_holders)
        if layout.chain:
            chain_digests = digests[0]  # every branch's: they are one prompt
            if type(chain_digests) is not list:  # remembered as a tuple; a sequence's own list grows with it
                chain_digests = list(chain_digests)
            if hit_blocks:
                pool.share_many(hit_blocks)
            if self.on_commit is not None:
                self.on_commit()
            chain = hit_blocks + pool.allocate_many(layout.nodes - len(hit_blocks) + tail_count)
            if self._caching:  # the new full prompt blocks: pending until written
                pool.register_many(chain, chain_digests, len(hit_blocks), group)
            for _ in range(1, len(members)):
                pool.share_many(chain)  # each further branch: a fork of the first
            if head.retention:
                self.apply_retention(head.retention, chain, 0, len(chain_digests))
            self._open_chain(ids, head, chain, chain_digests, hits, family)
            return
        # A trie: the branches' tokens differ.
        for path in layout.paths:  # one reference per branch on every hit (a prefix of its path)
            lead = self._leading_hits(path, of_node)
            if lead:
                pool.share_many([of_node[n] for n in path[:lead]])  # type: ignore[misc]
        if self.on_commit is not None:
            self.on_commit()
        fresh_nodes = [n for n in range(layout.nodes) if of_node[n] is None]
        fresh = pool.allocate_many(len(fresh_nodes) + tail_count)
        phys: list[int] = [b if b is not None else -1 for b in of_node]
        for node, block in zip(fresh_nodes, fresh, strict=False):
            phys[node] = block
        tail_blocks = fresh[len(fresh_nodes):]
        if self._caching and pool._policy_link is not None:  # a tree policy: each node under its parent
            fresh_set = set(fresh_nodes)
            for path in layout.paths:
                for depth, node in enumerate(path):
                    if node in fresh_set:
                        fresh_set.discard(node)
                        pool.register(phys[node], layout.digests[node], group,  # type: ignore[arg-type]
                                      parent=layout.digests[path[depth - 1]] if depth else None, depth=depth)
        elif self._caching:  # pending until written; an identity already indexed stays canonical
            pool.register_many([phys[n] for n in fresh_nodes],
                               [layout.digests[n] for n in fresh_nodes], 0, group)  # type: ignore[misc]
        taken: set[int] = set(fresh)  # fresh blocks carry their first reference from allocate_many
        tables = []
        for r, path, tail, ds in zip(members, layout.paths, layout.tails, digests, strict=True):
            blocks = [phys[node] for node in path]
            if tail >= 0:
                blocks.append(tail_blocks[tail])
            for node_block in blocks[self._leading_hits(path, of_node):]:
                if node_block in taken:
                    taken.discard(node_block)  # the first holder keeps the allocation's reference
                else:
                    pool.share(node_block)
            if r.retention:
                self.apply_retention(r.retention, blocks, 0, len(ds))
            tables.append(blocks)
        root = head.context.root_digest() if self._caching else b""
        written, seqs, promises = pool.written, self._seqs, self._promises
        tail_holders = layout.tail_holders
        for rid, r, path, tail, blocks, ds in zip(ids, members, layout.paths, layout.tails, tables, digests,
                                                  strict=True):
            if type(ds) is not list:  # remembered as a tuple; a sequence's own list grows as it does
                ds = list(ds)
            hit_count = self._leading_hits(path, of_node)
            ready = 0
            while ready < hit_count and written[blocks[ready]]:
                ready += 1
            prompt = list(r.prompt)
            n = len(prompt)
            reserved = -(-(n + r.reserved_new_tokens + r.lookahead) // bs)
            seq = seqs[rid] = SequenceState(
                request_id=rid, context=head.context, root=root, tokens=prompt, num_prompt=n,
                max_new_tokens=r.max_new_tokens, table=BlockTable(bs, blocks), promised=0,
                digests=ds, computed_mark=min(ready * bs, n), written_blocks=ready,
                hit_blocks=hit_count, cow_tail=tail >= 0 and tail_holders[tail] > 1, family=family,
                retention=r.retention, reserved_blocks=reserved, readmitted=r.readmission, mm_items=r.mm_items,
            )
            promises.promise(seq, reserved + (-n // bs))
        for group_id, holders in enumerate(layout.tail_holders):
            if holders > 1:
                promises.promise_copies(tail_blocks[group_id], holders - 1)

    def _open_chain(self, ids: list[str], request: Request, chain: list[int], digests: list[bytes], hits: _Hits,
                    family: str) -> None:
        """Open the sequences of one new request's branches on ``chain`` (its blocks, hits first): each
        branch its own copy of the table, tokens and digests, its own allowance promised, and -- when
        there are several and the prompt ends in a partial block -- that shared tail's copies promised.
        (The branches are identical, so this is the per-branch loop of :meth:`_commit` with nothing
        to tell apart: the path of every admission that is not a re-admitted family.)"""
        bs, pool = self._block_size, self._pool
        _, hit_blocks, _, _, ready = hits
        hit_count = len(hit_blocks)
        if ready < 0:  # not counted with the hits: count the leading written ones now
            ready, written = 0, pool.written
            while ready < hit_count and written[chain[ready]]:
                ready += 1
        n = len(request.prompt)
        reserved = -(-(n + request.reserved_new_tokens + request.lookahead) // bs)
        promise = reserved + (-n // bs)
        shared_tail = n % bs != 0 and len(ids) > 1  # every branch holds the partial tail: copied on write
        root = request.context.root_digest() if self._caching else b""
        seqs, promises = self._seqs, self._promises
        for i, rid in enumerate(ids):
            seq = seqs[rid] = SequenceState(
                request_id=rid, context=request.context, root=root, tokens=list(request.prompt), num_prompt=n,
                max_new_tokens=request.max_new_tokens, table=BlockTable(bs, chain[:] if i else chain), promised=0,
                digests=digests[:] if i else digests, computed_mark=min(ready * bs, n), written_blocks=ready,
                hit_blocks=hit_count, cow_tail=shared_tail, family=family, retention=request.retention,
                reserved_blocks=reserved, readmitted=request.readmission, mm_items=request.mm_items,
            )
            promises.promise(seq, promise)
        if shared_tail:
            promises.promise_copies(chain[n // bs], len(ids) - 1)

    # ---- counters --------------------------------------------------------------------------------
    def _count_never(self, request: Request, over_quota: bool) -> None:
        self._counters.rejected_never += 1
        if over_quota:
            self._counters.record_quota_refusal(request.context.trust_group)

    def _count_not_now(self, request: Request, over_quota: bool) -> None:
        self._counters.rejected_not_now += 1
        if over_quota:
            self._counters.record_quota_refusal(request.context.trust_group)

    def _count_admission(self, readmission: bool) -> None:
        if readmission:
            self._counters.readmitted += 1
        else:
            self._counters.admitted += 1

    def _count_query(self, request: Request, blocks: int, hits: int) -> None:
        if not self._caching:
            return
        if request.read_prefix_cache:
            self._counters.record_query(request.context.trust_group, blocks, hits, len(request.prompt),
                                        hits * self._block_size, readmission=request.readmission)
        else:
            self._counters.read_skipped += 1


__all__ = ["AdmissionControl", "FamilyLayout"]
