"""Admission: one atomic decision per request, or per re-admitted family of branches.

A decision is taken in three steps, cheapest first:

1. **never** -- O(1) arithmetic on the request's declared lengths against the pool's size (no hashing,
   no per-branch work, no lock): a request that cannot fit even an empty pool is told so at once,
   however many branches it asks for;
2. **prepare** -- token ids are checked and, with prefix caching, the prompt's block digests computed
   (outside the lock; remembered per request id while the request waits, so a retry every step does
   not hash the prompt again);
3. **decide and commit** under the ledger's lock: prefix hits, new blocks and promises are counted,
   and either everything is committed or nothing changes.

A trust group may have a quota (:meth:`AdmissionOps.set_quota`; the group ledgers of
:mod:`.quota`): the same decision, under the same lock, refuses an admission that would take the group's
charge -- active + promised blocks + the growth its sequences may still take -- past its cap (``not_now``,
or ``never`` when the request alone exceeds it), with ``Decision.over_quota`` set.

A refused admission changes no block, index entry, promise, event or prefix-cache counter; only the
``not_now`` / ``never`` outcome counters move. ``Decision.reason`` is what a tenant may see: it speaks of
the request's own blocks only. The pool-wide free / evictable / promised figures behind the outcome are
in ``Decision.detail``, for the operator.

:meth:`AdmissionOps.admit_family` re-admits the branches of one preempted request all-or-nothing. The
branches physically share the full blocks of their common token prefixes exactly as :meth:`fork` would
have shared them -- with or without prefix caching -- and a partial tail that several branches hold
with identical tokens is shared copy-on-write, so a family that fitted before preemption fits again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError, LedgerError
from .identity import check_tokens, prompt_digests
from .promises import declared_blocks
from .quota import QuotaOps
from .table import BlockTable
from .types import Decision, Outcome, Request, Retention, SequenceState, as_count

if TYPE_CHECKING:
    from .ledger import KVLedger

_MEMO_LIMIT = 1024  # waiting requests whose digests are remembered between attempts


@dataclass(slots=True)
class FamilyLayout:
    """How the branches of a family share blocks, from their tokens alone (no pool state).

    Full blocks form a trie: ``paths[i][b]`` is the node holding full block ``b`` of branch ``i``; two
    branches hold the same node exactly when their tokens agree up to the end of that block. A partial
    tail is shared only by branches whose whole token lists are equal (``tails[i]``, -1 for none)."""

    paths: list[list[int]]
    parents: list[int]  # per node: the node of the previous block, -1 for the first block
    digests: list[bytes | None]  # per node: its digest (None without prefix caching)
    tails: list[int]
    tail_holders: list[int]  # per tail group: how many branches hold it

    @property
    def nodes(self) -> int:
        return len(self.parents)


class AdmissionOps(QuotaOps):
    """Mixed into :class:`~kvledger.core.ledger.KVLedger`; decisions run under its lock."""

    # ---- preparation (no lock) ----------------------------------------------------------------
    def _request(self: KVLedger, request: object) -> Request:
        if not isinstance(request, Request):
            raise ConfigError(f"admission takes a Request, got {type(request).__name__}")
        if not request.prompt:
            raise ConfigError(f"request {request.request_id!r} has an empty prompt")
        return request

    def _never(self: KVLedger, request: Request) -> Decision | None:
        """The "never" rule, O(1): the declared maximum -- every branch's whole output allowance and
        speculative slots, the prompt's full blocks shared once -- exceeds the whole pool."""
        prompt_len, pool_blocks = len(request.prompt), self.pool.num_blocks
        k = request.branches
        need = declared_blocks(prompt_len, request.max_new_tokens, self.block_size, k, request.lookahead)
        cap = self._quotas.get(request.context.trust_group) if self._quotas else None
        branches = f" for {k} branches" if k > 1 else ""
        if need <= pool_blocks and k <= pool_blocks:
            if cap is None or need <= cap:
                return None
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

    def _prepare(self: KVLedger, request: Request, remember: bool = False) -> Sequence[bytes]:
        """Check the prompt's token ids and return its full-block digests ([] without prefix caching).
        A request told "not now" is usually asked again every step, so its digests are remembered under
        its id (:meth:`_remember`), checked against the same (immutable) prompt object and the same
        context root."""
        caching = self.prefix_caching
        root = request.context.root_digest() if caching else b""
        memo = self._digest_cache
        if memo:  # usually empty: most requests are admitted at their first attempt
            with self._lock:
                hit = memo.get(request.request_id)
            if hit is not None and hit[0] is request.prompt and hit[1] == root:
                return hit[2]  # a tuple: never changed; _commit takes a list of it
        if caching:
            digests = prompt_digests(root, request.prompt, self.block_size, self._native)  # checks the ids too
        else:
            check_tokens(request.prompt, self._native)  # token ids in [0, 2**32), with or without caching
            digests = []
        if remember:
            self._remember(request, digests)
        return digests

    def _remember(self: KVLedger, request: Request, digests: Sequence[bytes]) -> None:
        """Keep a waiting request's digests for its next attempt (bounded; oldest forgotten first)."""
        root = request.context.root_digest() if self.prefix_caching else b""
        with self._lock:
            memo = self._digest_cache
            held = memo.get(request.request_id)
            if held is not None and held[0] is request.prompt and held[1] == root and held[2] is digests:
                return  # asked again with what it remembers already
            memo[request.request_id] = (request.prompt, root, tuple(digests))
            if len(memo) > _MEMO_LIMIT:
                memo.popitem(last=False)

    # ---- one request ----------------------------------------------------------------------------
    def can_admit(self: KVLedger, request: Request, keep_free: int = 0) -> Decision:
        """The decision :meth:`admit` would take now, without changing anything."""
        keep_free = as_count(keep_free, "keep_free")
        request = self._request(request)
        never = self._never(request)
        if never is not None:
            return never
        digests = self._prepare(request, remember=True)  # the admit that usually follows reuses them
        with self._lock:
            return self._decide(request, digests, keep_free)[0]

    def admit(self: KVLedger, request: Request, keep_free: int = 0) -> Decision:
        """Admit ``request`` atomically: share indexed prefix blocks, allocate the rest of the prompt,
        and promise the reserved output allowance -- or change nothing and say why not.

        ``keep_free`` blocks must stay available after the admission: the watermark or emergency
        headroom of policies that do not reserve the whole output allowance."""
        keep_free = as_count(keep_free, "keep_free")
        request = self._request(request)
        rid = request.request_id
        never = self._never(request)  # before any per-branch or per-token work
        if never is not None:
            with self._lock:
                self._digest_cache.pop(rid, None)  # it will not be asked again: keep no copy of it
                self.counters.rejected_never += 1
                if never.over_quota:
                    self.counters.record_quota_refusal(request.context.trust_group)
            return never
        digests = self._prepare(request)  # hashing is pure: keep it outside the lock
        with self._lock:
            # Bounded: the never rule admits at most num_blocks branches.
            if rid in self._seqs or any(f"{rid}/{i}" in self._seqs for i in range(1, request.branches)):
                raise LedgerError(f"request id {rid!r} is already running")
            decision, hits, ready = self._decide(request, digests, keep_free)
            if decision.admitted:
                if self._digest_cache:
                    self._digest_cache.pop(rid, None)
                self._commit(request, digests, hits, ready, decision)
                self._count_admission(request.readmission)
                self._count_query(request, len(digests), len(hits))
            else:
                self.counters.rejected_not_now += 1
                if decision.over_quota:
                    self.counters.record_quota_refusal(request.context.trust_group)
                self._remember(request, digests)  # it will be asked again: hash it once
            return decision

    def _decide(self: KVLedger, request: Request, digests: Sequence[bytes],
                keep_free: int) -> tuple[Decision, list[int], int]:
        """Under the lock, for a request the never rule let through. Returns the decision, the prefix hits
        and how many leading hits are written (readable at once)."""
        pool, bs = self.pool, self.block_size
        prompt_len = len(request.prompt)
        total = self._blocks_for(prompt_len + request.reserved_new_tokens + request.lookahead)
        prompt_blocks = self._blocks_for(prompt_len)
        rid = request.request_id
        # Each extra branch: its own output allowance, plus a copy of the partial prompt tail.
        per_branch = (total - prompt_blocks) + (1 if prompt_len % bs else 0)
        hits: list[int] = []
        retained_hits = pending_hits = ready = 0
        if request.read_prefix_cache:
            index, ref, leased, written = pool.index, pool.ref, pool.leased, pool.written
            fast = self._native
            found = fast.prefix_hits(index, digests, ref, leased, written) if fast is not None else None
            if found is not None:
                hits, retained_hits, pending_hits, ready = found
            else:
                for d in digests:
                    block = index.get(d)
                    if block is None:
                        break
                    hits.append(block)
                    # Retained hits stop being evictable once taken, so they cannot also back a new block.
                    if ref[block] == 0 and not leased[block]:
                        retained_hits += 1
                    if not written[block]:
                        pending_hits += 1
                    elif ready == len(hits) - 1:
                        ready += 1  # leading hits already written: readable at once
        new_now = prompt_blocks - len(hits)
        branch_blocks = (request.branches - 1) * per_branch
        promise = total - prompt_blocks + branch_blocks
        need = new_now + promise
        if self._quotas:
            group = request.context.trust_group
            cap = self._quotas.get(group)
            if cap is not None:
                # The group's charge grows by every block it will newly hold -- new blocks, hits nobody
                # holds now (retained or deferred), each branch up to its declared maximum, tail copies.
                ref = pool.ref
                unheld_hits = sum(1 for b in hits if ref[b] == 0)
                most = max(total, self._blocks_for(prompt_len + request.max_new_tokens))
                adds = (new_now + unheld_hits + request.branches * (most - prompt_blocks)
                        + (request.branches - 1) * (1 if prompt_len % bs else 0))
                refused = self._over_quota(rid, group, cap, adds, total, len(hits), pending_hits, new_now, promise,
                                           branch_blocks)
                if refused is not None:
                    return refused, hits, ready
        available, detail = self.promises.room(retained_hits, keep_free)
        if need > available:
            reason = f"needs {need} new blocks ({len(hits)} of {total} shared); the pool cannot promise them now"
            return Decision(rid, Outcome.NOT_NOW, reason, total, len(hits), pending_hits, new_now, promise,
                            branch_blocks, f"needs {need} new blocks but only {detail}"), hits, ready
        reason = f"{len(hits)} shared + {new_now} new + {promise} promised = {total + branch_blocks} blocks"
        return Decision(rid, Outcome.ADMITTED, reason, total, len(hits), pending_hits, new_now, promise,
                        branch_blocks, f"{reason}; {detail}"), hits, ready

    def _commit(self: KVLedger, request: Request, digests: Sequence[bytes], hits: list[int], ready: int,
                decision: Decision) -> None:
        pool = self.pool
        if type(digests) is not list:
            digests = list(digests)  # remembered as a tuple; the sequence's own list grows as it does
        # Take the hits first, so allocating the new blocks can never evict the request's own hits.
        if hits:
            pool.share_many(hits)
        blocks = hits + pool.allocate_many(decision.blocks_new)
        group = request.context.trust_group
        pool.register_many(blocks, digests, len(hits), group)  # the new full prompt blocks: pending until written
        if request.retention:
            self._apply_retention(request.retention, blocks, 0, len(digests))
        own_promise = decision.blocks_promised - decision.blocks_branches
        prompt = list(request.prompt)
        rid = request.request_id
        seq = SequenceState(
            request_id=rid, context=request.context,
            root=request.context.root_digest() if self.prefix_caching else b"",
            tokens=prompt, num_prompt=len(prompt), max_new_tokens=request.max_new_tokens,
            table=BlockTable(self.block_size, blocks), promised=0, digests=digests,
            computed_mark=min(ready * self.block_size, len(prompt)), written_blocks=ready,
            hit_blocks=len(hits), retention=request.retention, family=request.family or rid,
            reserved_blocks=decision.blocks_total, readmitted=request.readmission,
        )
        self.promises.promise(seq, own_promise)
        self._seqs[rid] = seq
        # Each fork charges its parent's promise plus a tail copy: exactly what _decide counted per branch.
        for i in range(1, request.branches):
            self._fork_unchecked(seq, f"{rid}/{i}")

    def _apply_retention(self: KVLedger, ranges: tuple[Retention, ...], blocks: list[int], start: int,
                         end: int) -> None:
        """Tell the eviction policy the priority of blocks ``[start, end)`` from the request's ranges
        (validated when the :class:`Retention` was built, so this cannot fail half-way)."""
        bs, now, policy = self.block_size, self.clock(), self.pool.retained
        for i in range(start, end):
            lo, hi = i * bs, (i + 1) * bs
            best: Retention | None = None
            for r in ranges:
                if r.start < hi and r.end > lo and (best is None or r.priority > best.priority):
                    best = r
            if best is not None:
                expires = None if best.duration_s is None else now + best.duration_s
                policy.set_priority(blocks[i], best.priority, expires)

    def _count_admission(self: KVLedger, readmission: bool) -> None:
        if readmission:
            self.counters.readmitted += 1
        else:
            self.counters.admitted += 1

    def _count_query(self: KVLedger, request: Request, blocks: int, hits: int) -> None:
        if not self.prefix_caching:
            return
        if request.read_prefix_cache:
            self.counters.record_query(request.context.trust_group, blocks, hits, len(request.prompt),
                                       hits * self.block_size, readmission=request.readmission)
        else:
            self.counters.read_skipped += 1

    # ---- a family of branches -------------------------------------------------------------------
    def admit_family(self: KVLedger, requests: Sequence[Request], keep_free: int = 0) -> Decision:
        """Re-admit the branches of one preempted request together, all-or-nothing.

        ``requests`` are single-branch requests (``branches == 1``) of one family: the same ``family``
        (or, for the first, its own id), distinct ids, one context, and the same ``readmission`` and
        ``read_prefix_cache`` switches; their tokens may have diverged. One decision is taken under
        the lock. On refusal nothing changes -- no eviction, no prefix-cache query or hit counted, no
        event, no index entry -- except the ``not_now`` / ``never`` outcome counter. On success the
        branches share the full blocks of their common token prefixes as :meth:`fork` would have
        shared them, with or without prefix caching; a partial tail held by branches with identical
        tokens is shared copy-on-write (one promised copy per extra holder); prefix-index hits are
        used when caching is on and the family reads the cache. A block shared by several branches
        appears in each of their tables: whoever restores contents (a swap-in) writes it once.

        The outcome is NEVER when the family could not fit even the empty pool, counting that
        sharing and every branch's whole ``max_new_tokens`` and lookahead.

        The returned decision names the family; its block figures are the family's: ``blocks_hit`` and
        ``blocks_new`` count distinct blocks, ``blocks_promised`` every branch's reserved allowance
        plus the tail copies, ``blocks_branches`` what the branches after the first add to it, and
        ``blocks_total`` the family's distinct blocks at its reserved lengths."""
        keep_free = as_count(keep_free, "keep_free")
        reqs = self._family_members(requests)
        head = reqs[0]
        family = head.family or head.request_id
        pool_blocks = self.pool.num_blocks
        if len(reqs) > pool_blocks:  # before any per-token work
            reason = f"asks for {len(reqs)} branches but the whole pool has {pool_blocks} blocks"
            return self._family_never(reqs, family, reason, len(reqs))
        digests = [self._prepare(r) for r in reqs]  # checks every token id; pure, outside the lock
        layout = self.family_layout(reqs, digests)
        bs = self.block_size
        need_empty = layout.nodes + sum(
            self._blocks_for(len(r.prompt) + r.max_new_tokens + r.lookahead) - len(r.prompt) // bs for r in reqs)
        if need_empty > pool_blocks:
            reason = (f"needs {need_empty} blocks for {len(reqs)} branches at their longest ({layout.nodes} "
                      f"shared full blocks) but the whole pool has {pool_blocks}")
            return self._family_never(reqs, family, reason, need_empty)
        cap = self._quotas.get(head.context.trust_group) if self._quotas else None
        if cap is not None and need_empty > cap:
            reason = (f"needs {need_empty} blocks for {len(reqs)} branches at their longest but its trust "
                      f"group's quota is {cap} blocks")
            return self._family_never(reqs, family, reason, need_empty, over_quota=True)
        with self._lock:
            for r in reqs:
                if r.request_id in self._seqs:
                    raise LedgerError(f"request id {r.request_id!r} is already running")
            decision, hit_of = self._decide_family(reqs, family, layout, keep_free)
            if not decision.admitted:
                self.counters.rejected_not_now += 1
                if decision.over_quota:
                    self.counters.record_quota_refusal(head.context.trust_group)
                for r, d in zip(reqs, digests, strict=True):
                    self._remember(r, d)  # the family will be asked again: hash it once
                return decision
            for r in reqs:
                self._digest_cache.pop(r.request_id, None)
            self._commit_family(reqs, family, layout, digests, hit_of)
            self._count_admission(head.readmission)
            for r, path, d in zip(reqs, layout.paths, digests, strict=True):
                hits = 0
                while hits < len(path) and hit_of[path[hits]] is not None:
                    hits += 1
                self._count_query(r, len(d), hits)
            return decision

    def _family_members(self: KVLedger, requests: Sequence[Request]) -> list[Request]:
        if isinstance(requests, (str, bytes, Request)) or not hasattr(requests, "__iter__"):
            raise ConfigError("admit_family takes a sequence of Request, one per branch")
        reqs = [self._request(r) for r in requests]
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
        if len({r.request_id for r in reqs}) != len(reqs):
            raise ConfigError(f"family {family!r} names a branch twice")
        return reqs

    def _family_never(self: KVLedger, reqs: list[Request], family: str, reason: str, need: int,
                      over_quota: bool = False) -> Decision:
        with self._lock:
            for r in reqs:
                self._digest_cache.pop(r.request_id, None)
            self.counters.rejected_never += 1
            if over_quota:
                self.counters.record_quota_refusal(reqs[0].context.trust_group)
        return Decision(family, Outcome.NEVER, reason, need, 0, 0, 0, 0, detail=reason, over_quota=over_quota)

    def family_layout(self: KVLedger, requests: Sequence[Request], digests: list[list[bytes]]) -> FamilyLayout:
        """The block-sharing trie of a family (pure; see :class:`FamilyLayout`). With prefix caching the
        block digests are the trie's keys; without, the blocks' token tuples chained to their parent."""
        bs, caching = self.block_size, self.prefix_caching
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
        return FamilyLayout(paths, parents, node_digests, tails, holders)

    def _decide_family(self: KVLedger, reqs: list[Request], family: str, layout: FamilyLayout,
                       keep_free: int) -> tuple[Decision, list[int | None]]:
        pool = self.pool
        hit_of: list[int | None] = [None] * layout.nodes
        if self.prefix_caching and reqs[0].read_prefix_cache:
            index, parents = pool.index, layout.parents
            for node, d in enumerate(layout.digests):  # a parent always precedes its children
                if parents[node] < 0 or hit_of[parents[node]] is not None:
                    hit_of[node] = index.get(d)  # type: ignore[arg-type]
        hits = [b for b in hit_of if b is not None]
        ref, leased, written = pool.ref, pool.leased, pool.written
        retained_hits = sum(1 for b in hits if ref[b] == 0 and not leased[b])
        pending_hits = sum(1 for b in hits if not written[b])
        new_now = layout.nodes - len(hits) + len(layout.tail_holders)
        own = [self._blocks_for(len(r.prompt) + r.reserved_new_tokens + r.lookahead) - self._blocks_for(len(r.prompt))
               for r in reqs]
        copies = sum(h - 1 for h in layout.tail_holders)
        promise = sum(own) + copies
        need = new_now + promise
        total = len(hits) + need
        branches = promise - own[0]
        if self._quotas:
            group = reqs[0].context.trust_group
            cap = self._quotas.get(group)
            if cap is not None:
                unheld_hits = sum(1 for b in hits if ref[b] == 0)
                tables = [len(path) + (1 if tail >= 0 else 0) for path, tail in zip(layout.paths, layout.tails,
                                                                                     strict=True)]
                most = [max(self._blocks_for(len(r.prompt) + r.reserved_new_tokens + r.lookahead),
                            self._blocks_for(len(r.prompt) + r.max_new_tokens)) for r in reqs]
                adds = new_now + unheld_hits + copies + sum(max(0, m - t) for m, t in zip(most, tables, strict=True))
                refused = self._over_quota(family, group, cap, adds, total, len(hits), pending_hits, new_now, promise,
                                           branches)
                if refused is not None:
                    return refused, hit_of
        available, detail = self.promises.room(retained_hits, keep_free)
        if need > available:
            reason = (f"family of {len(reqs)} branches needs {need} new blocks ({len(hits)} of {total} shared); "
                      f"the pool cannot promise them now")
            return Decision(family, Outcome.NOT_NOW, reason, total, len(hits), pending_hits, new_now, promise,
                            branches, f"needs {need} new blocks but only {detail}"), hit_of
        reason = (f"family of {len(reqs)} branches: {len(hits)} shared + {new_now} new + {promise} promised = "
                  f"{total} blocks")
        return Decision(family, Outcome.ADMITTED, reason, total, len(hits), pending_hits, new_now, promise,
                        branches, f"{reason}; {detail}"), hit_of

    def _commit_family(self: KVLedger, reqs: list[Request], family: str, layout: FamilyLayout,
                       digests: list[list[bytes]], hit_of: list[int | None]) -> None:
        pool, bs = self.pool, self.block_size
        share = pool.share
        # One reference per branch on every hit, first, so that allocating cannot evict a hit.
        for path in layout.paths:
            for node in path:
                block = hit_of[node]
                if block is not None:
                    share(block)
        fresh_nodes = [node for node in range(layout.nodes) if hit_of[node] is None]
        fresh = pool.allocate_many(len(fresh_nodes) + len(layout.tail_holders))
        phys: list[int] = [b if b is not None else -1 for b in hit_of]
        for node, block in zip(fresh_nodes, fresh, strict=False):
            phys[node] = block
        tail_blocks = fresh[len(fresh_nodes):]
        head = reqs[0]
        group = head.context.trust_group
        if self.prefix_caching:
            for node in fresh_nodes:  # pending until written; an identity already indexed stays canonical
                pool.register(phys[node], layout.digests[node], group)  # type: ignore[arg-type]
        taken: set[int] = set(fresh)  # fresh blocks carry their first reference from allocate_many
        root = head.context.root_digest() if self.prefix_caching else b""
        written = pool.written
        for r, path, tail, ds in zip(reqs, layout.paths, layout.tails, digests, strict=True):
            blocks = [phys[node] for node in path]
            for node, block in zip(path, blocks, strict=True):
                if hit_of[node] is not None:
                    continue  # referenced above
                if block in taken:
                    taken.discard(block)  # the first holder keeps the allocation's reference
                else:
                    share(block)
            if tail >= 0:
                block = tail_blocks[tail]
                if block in taken:
                    taken.discard(block)
                else:
                    share(block)
                blocks.append(block)
            if r.retention:
                self._apply_retention(r.retention, blocks, 0, len(ds))
            hits = 0
            while hits < len(path) and hit_of[path[hits]] is not None:
                hits += 1
            ready = 0
            while ready < hits and written[blocks[ready]]:
                ready += 1
            reserved = self._blocks_for(len(r.prompt) + r.reserved_new_tokens + r.lookahead)
            own = reserved - self._blocks_for(len(r.prompt))
            prompt = list(r.prompt)
            seq = self._seqs[r.request_id] = SequenceState(
                request_id=r.request_id, context=head.context, root=root, tokens=prompt, num_prompt=len(prompt),
                max_new_tokens=r.max_new_tokens, table=BlockTable(bs, blocks), promised=0, digests=list(ds),
                computed_mark=min(ready * bs, len(prompt)), written_blocks=ready, hit_blocks=hits,
                cow_tail=tail >= 0 and layout.tail_holders[tail] > 1, family=family, retention=r.retention,
                reserved_blocks=reserved, readmitted=r.readmission,
            )
            self.promises.promise(seq, own)
        for group_id, holders in enumerate(layout.tail_holders):
            if holders > 1:
                self.promises.promise_copies(tail_blocks[group_id], holders - 1)
