"""Hybrid KV cache groups: a ledger for models whose layers keep different spans of tokens.

Gemma 3 interleaves five sliding-window layers (1,024 tokens) with each global one, gpt-oss alternates 128-token
windows with full attention, hybrid models add layers with a fixed-size state. Charging such a model as if every
layer were global (`KVLedger`) holds, at 32k tokens, 2.3x the bytes Gemma 3's layers need. `GroupLedger` is the
ledger of vLLM's hybrid allocator: layers are split into KV cache groups of one kind each
(`core.sizing.hybrid.hybrid_plan` makes them from a model's geometry), every group draws block ids from one shared
`BlockPool`, and a request holds one block table per group:

- a **full** group keeps every block of the request;
- a **sliding** group of window W keeps only the blocks the next query still attends to: before a step that
  starts at position n, blocks wholly before ``n - W + 1`` are released (the step that read them has been
  confirmed, so no kernel still reads them); a full, written block is retained as cache, as vLLM does, so it
  can still serve a prefix hit. Its reservation is bounded by its window: ``ceil((W - 1 + step) / block) + 1``
  blocks (``step``: the most tokens one step computes), never more than the request's own blocks; once the prompt
  is computed, steps compute at most ``decode_tokens`` and the bound shrinks to the decode step's;
- a **state** group (linear attention, Mamba) holds one block per request for its whole life.

Admission is one decision for all groups under the ledger's lock: the request's reservation in every group (full
blocks for its reserved length, the window bound for sliding groups, one block for a state group) less its prefix
hits must fit the pool's ``free + evictable - promised``; nothing is allocated or promised unless every group's
share fits. Blocks are allocated step by step (`schedule`), from the request's own promises, so a promise always
becomes a block without touching another request. A prefix hit is the longest length every group can serve: a
full group needs every block before it, a sliding group only the blocks covering the last W - 1 tokens before it
(vLLM's ``find_longest_cache_hit``), a state group none of them (its state is not kept per position, so a model
with a state group gets no hit). Digests are the cache identity's chain (`core.identity`) keyed by group. With a
``hash_block_size`` below the block size a hit may end inside a block: the request gets a new block there and the
cached block's leading slots are copied into it (`take_copies`). ``drop_last_hit_block`` gives up the last matched
block for a drafter; `MMItem` images key only the blocks they cover.

`check()` states each group's conservation law: for every request and group, carried + promised == reserved and
held <= reserved (a sliding group carries the capacity of the blocks it owns; a block shared by a prefix hit has
one owner among its holders, and passes to another holder when its owner drops it); across groups, the blocks the
tables hold carry exactly the pool's references, and the pool's ``free + active + retained == total``. Every
operation is O(blocks it touches); the lock makes the ledger thread-safe. The scheduler's own hybrid pool is
`KVLedger(kv_groups=...)` (`core/windows.py`); both take the group arithmetic (`KVCacheGroup`) and the hit rule
(`longest_hit`) from here, and uniform pools take none of these paths.

The module is past 600 lines because admission, the window's release, the shared-block ownership and the audit
that states their laws must be read side by side: each one's rule is the others' invariant.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import ConfigError, InvariantError, LedgerError
from . import checks
from .eviction import EvictionPolicy
from .identity import MMItem, block_key, mm_prompt_digests
from .pool import BlockPool
from .types import Outcome, as_token_id

GROUP_KINDS = ("full", "sliding", "state")
NULL_BLOCK = -1  # a table entry whose block left the window (vLLM's null block): no kernel reads it


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """One KV cache group: ``layers`` layers of one kind sharing a block table. ``layer_block_bytes`` is one layer's
    page (what ``KVFormat.parts`` lays out for one block of one layer), so the group's block holds
    ``bytes_per_block`` bytes; the pool's block is as large as its largest group's."""

    kind: str
    layers: int = 1
    window: int | None = None
    layer_block_bytes: int = 0

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ConfigError(f"KV cache group kind must be one of {', '.join(GROUP_KINDS)}, got {self.kind!r}")
        checks.positive(self.layers, "KVCacheGroup.layers")
        checks.non_negative(self.layer_block_bytes, "KVCacheGroup.layer_block_bytes")
        if self.kind == "sliding":
            checks.positive(self.window, "KVCacheGroup.window (a sliding group needs its window)")
        elif self.window is not None:
            raise ConfigError(f"a {self.kind} group has no window (got window={self.window})")

    @property
    def bytes_per_block(self) -> int:
        return self.layers * self.layer_block_bytes

    def reserved_blocks(self, tokens: int, block_size: int, step_tokens: int) -> int:
        """Blocks a request of ``tokens`` tokens may hold at once in this group."""
        if self.kind == "state":
            return 1
        n = _cdiv(tokens, block_size)
        if self.kind == "sliding":
            n = min(n, _cdiv(self.window - 1 + step_tokens, block_size) + 1)  # type: ignore[operator]
        return n

    def first_needed(self, computed: int, block_size: int) -> int:
        """The first block a query at position ``computed`` (or later) still reads."""
        if self.kind != "sliding":
            return 0
        return max(0, computed - self.window + 1) // block_size  # type: ignore[operator]


def longest_hit(groups: Sequence[KVCacheGroup], cached: Callable[[int, int], int | None], limit: int,
                block_size: int) -> tuple[int, list[list[int]]]:
    """vLLM's ``find_longest_cache_hit`` over KV cache groups: (the most blocks, at most ``limit``, every group
    serves, the cached blocks each group takes). ``cached(g, j)``: group g's readable block for prompt block j, or
    None. A full group needs every block before the hit; a sliding group only those its window still reads
    (``first_needed``), so a sliding group's miss caps the hit just below it. A state group serves a hit of n
    blocks only from a state cached at that boundary (``cached(g, n - 1)``: the state after block n - 1, vLLM's
    'align' mode; a pool that caches no state answers None, so the hit is 0 and the request recomputes), and
    takes that one block. A state or sliding group's cap may undo another's agreement: repeated until none
    lowers the hit."""
    hit = limit
    for g, group in enumerate(groups):  # full groups first: a prefix-closed bound
        if group.kind == "full":
            n = 0
            while n < hit and cached(g, n) is not None:
                n += 1
            hit = n
    agreed = None
    while agreed != hit:
        agreed = hit
        for g, group in enumerate(groups):
            if group.kind == "state":
                while hit > 0 and cached(g, hit - 1) is None:
                    hit -= 1
                continue
            if group.kind != "sliding":
                continue
            # The longest n <= hit whose window blocks [first_needed(n*bs), n) are all cached.
            n = hit
            while n > 0:
                first = group.first_needed(n * block_size, block_size)
                miss = next((j for j in range(n - 1, first - 1, -1) if cached(g, j) is None), None)
                if miss is None:
                    break
                n = miss  # no length past a missing block can use it
            hit = n
    out = []
    for g, group in enumerate(groups):
        if group.kind == "state":
            out.append([cached(g, hit - 1)] if hit else [])  # type: ignore[list-item]
            continue
        first = group.first_needed(hit * block_size, block_size)
        out.append([cached(g, j) for j in range(first, hit)])  # type: ignore[misc]
    return hit, out


@dataclass(slots=True)
class GroupRequest:
    """One request's state in a `GroupLedger`: its tokens, how many have computed KV, its reservation, and per group
    a block table (``NULL_BLOCK`` where a block left the window) and the blocks still promised to it."""

    request_id: str
    tokens: list[int]
    max_tokens: int  # prompt + reserved output: the reservation's length
    prompt_len: int
    root: bytes
    computed: int = 0
    scheduled: int = 0  # tokens given slots by the last `schedule`, not yet confirmed
    window_from: int = 0  # the computed position the sliding groups last dropped blocks for
    nulled: list[int] = field(default_factory=list)  # per group: leading table entries already NULL_BLOCK
    tables: list[list[int]] = field(default_factory=list)
    held: list[int] = field(default_factory=list)  # live (non-null) entries per group
    own: list[int] = field(default_factory=list)  # of those, the blocks whose capacity this request carries
    promised: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)  # chain digests of the full computed blocks
    registered: list[int] = field(default_factory=list)  # per group: leading blocks already indexed
    mm_items: tuple[MMItem, ...] = ()

    def block_tables(self) -> tuple[list[int], ...]:
        return tuple(list(t) for t in self.tables)


@dataclass(frozen=True, slots=True)
class GroupDecision:
    request_id: str
    outcome: Outcome
    reason: str
    hit_tokens: int = 0  # prompt tokens every group serves from the cache
    blocks_hit: tuple[int, ...] = ()  # per group: blocks taken from the cache
    blocks_reserved: tuple[int, ...] = ()  # per group: the reservation

    @property
    def admitted(self) -> bool:
        return self.outcome is Outcome.ADMITTED


class GroupLedger:
    """The ledger of a hybrid KV pool (see the module docstring). ``step_tokens`` is the most tokens one
    `schedule` gives a request (the scheduler's chunk): it bounds what a sliding group holds at once."""

    def __init__(self, num_blocks: int, block_size: int, groups: tuple[KVCacheGroup, ...] | list[KVCacheGroup], *,
                 step_tokens: int = 8192, decode_tokens: int = 1, enable_prefix_caching: bool = True,
                 hash_block_size: int | None = None, policy: EvictionPolicy | None = None) -> None:
        checks.positive(num_blocks, "num_blocks")
        self.block_size = checks.positive(block_size, "block_size")
        self.step_tokens = checks.positive(step_tokens, "step_tokens")
        self.decode_tokens = checks.count(decode_tokens, "decode_tokens", 1, self.step_tokens)
        # vLLM's hash block size: a prefix hit may end every `hash_block_size` tokens, inside a block (sub-block hits).
        self.hash_block_size = block_size if hash_block_size is None else checks.positive(hash_block_size,
                                                                                          "hash_block_size")
        if block_size % self.hash_block_size:
            raise ConfigError(f"hash_block_size ({self.hash_block_size}) must divide block_size ({block_size})")
        self.groups = tuple(groups)
        if not self.groups or len(self.groups) > 255:
            raise ConfigError("a GroupLedger needs between 1 and 255 KV cache groups")
        if not all(isinstance(g, KVCacheGroup) for g in self.groups):
            raise ConfigError("groups must be KVCacheGroup values")
        self.pool = BlockPool(num_blocks, policy)
        self.prefix_caching = bool(enable_prefix_caching) and all(g.kind != "state" for g in self.groups)
        self._group_keys = [bytes((i,)) for i in range(len(self.groups))]
        self.requests: dict[str, GroupRequest] = {}
        self.promised = 0
        # A sliding group's block may be shared (a prefix hit) and then dropped by one holder while others keep it:
        # its capacity is carried by exactly one holder, its owner, and passes to another holder when the owner
        # lets go, so a drop re-promises a block only when one really came back.
        self._owner: dict[int, str] = {}
        self._holders: dict[int, list[str]] = {}
        # Sub-block hits: the digest of each leading part of a cached block -> (block, the block's full key), valid
        # while the block still carries that key; per block the parts it registered (bounded by the pool).
        self._partial: dict[bytes, tuple[int, bytes]] = {}
        self._partial_of: dict[int, list[bytes]] = {}
        self._copies: dict[str, list[tuple[int, int, int]]] = {}  # rid -> (source, destination, slots) not yet taken
        self._lock = threading.RLock()

    # ---- sizes ------------------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """Bytes of one block id: the largest group's block (vLLM pads the others to it)."""
        return max(g.bytes_per_block for g in self.groups)

    def reserved_blocks(self, tokens: int) -> tuple[int, ...]:
        """Per group, the blocks a request of ``tokens`` tokens reserves."""
        return tuple(g.reserved_blocks(tokens, self.block_size, self.step_tokens) for g in self.groups)

    def available(self) -> int:
        """Blocks a new reservation may still claim: free + evictable - promised."""
        return self.pool.num_free + self.pool.num_evictable - self.promised

    # ---- admission --------------------------------------------------------------------------------
    def admit(self, request_id: str, prompt: list[int], max_new_tokens: int, *, root: bytes = b"",
              drop_last_hit_block: bool = False, mm_items: tuple[MMItem, ...] | list[MMItem] = ()) -> GroupDecision:
        """Reserve the request in every group at once, or in none (see the module docstring).

        ``drop_last_hit_block`` gives up the last block of a prefix hit, so its tokens are computed again: a drafter
        (EAGLE) needs the target model's hidden states of the tokens before its first proposal, which the cache
        does not keep (vLLM drops the last matched block for it). ``mm_items`` are the prompt's images (`MMItem`)."""
        if not isinstance(request_id, str) or not request_id:
            raise ConfigError("request_id must be a non-empty string")
        tokens = [as_token_id(t, request_id) for t in prompt]
        if not tokens:
            raise ConfigError(f"{request_id!r}: a prompt needs at least one token")
        max_new = checks.count(max_new_tokens, "max_new_tokens")
        length = len(tokens) + max_new
        need = self.reserved_blocks(length)
        if sum(need) > self.pool.num_blocks:
            return GroupDecision(request_id, Outcome.NEVER, f"needs {sum(need)} blocks ({' + '.join(map(str, need))} "
                                 f"by group) but the pool has {self.pool.num_blocks}", 0, (), need)
        checks.flag(drop_last_hit_block, "drop_last_hit_block")
        items = tuple(mm_items)
        if not all(isinstance(m, MMItem) and m.offset + m.length <= len(tokens) for m in items):
            raise ConfigError(f"{request_id!r}: mm_items must be MMItem values inside the prompt")
        digests = self._prompt_digests(root, tokens, items) if self.prefix_caching else []
        with self._lock:
            if request_id in self.requests:
                raise LedgerError(f"request {request_id!r} is already admitted")
            hit_blocks, per_group = self._longest_hit(digests, len(tokens))
            if drop_last_hit_block and hit_blocks:
                hit_blocks, per_group = self._longest_hit(digests, len(tokens), hit_blocks - 1)
            parts, sources = (0, []) if drop_last_hit_block or not self.prefix_caching else self._partial_hit(
                tokens, digests, hit_blocks, items, root)
            taken = [len(b) for b in per_group]
            ref = self.pool.ref
            # A full group's hits are charged to nobody new (they are never dropped before the request ends); a
            # sliding group carries only the cached blocks nobody holds (taking them costs capacity), not the ones
            # it borrows from running requests, which their owners carry.
            own = [len(blocks) if group.kind != "sliding" else sum(1 for b in blocks if ref[b] == 0)
                   for group, blocks in zip(self.groups, per_group, strict=True)]
            retained_hits = sum(1 for blocks in per_group for b in blocks if ref[b] == 0)
            retained_hits += sum(1 for b in sources if ref[b] == 0)
            charge = sum(n - o for n, o in zip(need, own, strict=True))
            if charge > self.available() - retained_hits:
                return GroupDecision(request_id, Outcome.NOT_NOW,
                                     f"needs {charge} more blocks; {self.available() - retained_hits} can be "
                                     "promised now", 0, tuple(taken), need)
            req = GroupRequest(request_id, tokens, length, len(tokens), root, mm_items=items)
            bs = self.block_size
            hit_tokens = hit_blocks * bs
            for g, blocks in enumerate(per_group):
                if self.groups[g].kind == "sliding":
                    for b in blocks:
                        if ref[b] == 0:
                            self._owner[b] = request_id
                        self._holders.setdefault(b, []).append(request_id)
                self.pool.share_many(blocks)
                first = hit_blocks - len(blocks)
                req.tables.append([NULL_BLOCK] * first + blocks)
                req.nulled.append(first)
                req.held.append(len(blocks))
                req.own.append(own[g])
                req.promised.append(need[g] - own[g])
                req.reserved.append(need[g])
                req.registered.append(hit_blocks)
            req.digests = digests[:hit_blocks]
            self.promised += charge
            if parts:
                # The hit ends inside block `hit_blocks`: each group gets a new block there (from the request's own
                # promise) into which the cached block's first `parts` slots are copied before the next step.
                slots = parts * self.hash_block_size
                self.pool.share_many(sources)
                fresh = self.pool.allocate_many(len(sources))
                for g, dst in enumerate(fresh):
                    req.tables[g].append(dst)
                    req.held[g] += 1
                    req.own[g] += 1
                    req.promised[g] -= 1
                    if self.groups[g].kind == "sliding":
                        self._owner[dst] = request_id
                        self._holders[dst] = [request_id]
                self.promised -= len(fresh)
                self._copies[request_id] = [(src, dst, slots) for src, dst in zip(sources, fresh, strict=True)]
                hit_tokens += slots
            req.computed = req.scheduled = hit_tokens
            req.window_from = hit_blocks * bs  # the window blocks were taken for the whole-block hit
            self.requests[request_id] = req
            return GroupDecision(request_id, Outcome.ADMITTED, "admitted", hit_tokens, tuple(taken), need)

    def _partial_hit(self, tokens: list[int], digests: list[bytes], hit: int, items: tuple[MMItem, ...],
                     root: bytes) -> tuple[int, list[int]]:
        """(hash blocks, per group the cached block) of the longest sub-block hit past ``hit`` whole blocks that
        every group has, still ending before the prompt's last token; (0, []) when none."""
        h, bs = self.hash_block_size, self.block_size
        if h == bs:
            return 0, []
        start = hit * bs
        parent = digests[hit - 1] if hit else root
        pool_digest, written, partial, keys = self.pool.digest, self.pool.written, self._partial, self._group_keys
        for m in range(bs // h - 1, 0, -1):
            if start + m * h > len(tokens) - 1:
                continue
            sub = block_key(parent, tokens[start:start + m * h], start, items)
            sources = []
            for key in keys:
                entry = partial.get(sub + key)
                if entry is None or pool_digest[entry[0]] != entry[1] or not written[entry[0]]:
                    break
                sources.append(entry[0])
            else:
                return m, sources
        return 0, []

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The copies sub-block hits need before the next step, as ``(source, destination, slots)``: copy the first
        ``slots`` token slots of block ``source`` into ``destination``. Taking them ends the hold on the sources."""
        with self._lock:
            out = [c for copies in self._copies.values() for c in copies]
            self._copies.clear()
            self.pool.release_many([src for src, _, _ in out])
            return out

    def _register_parts(self, block: int, parent: bytes, tokens: list[int], start: int, items: tuple[MMItem, ...],
                        key: bytes, full: bytes) -> None:
        """Index the leading parts of a just-cached block for sub-block hits (a block's old parts go first)."""
        h = self.hash_block_size
        partial = self._partial
        for old in self._partial_of.pop(block, ()):
            if partial.get(old, (None,))[0] == block:
                del partial[old]
        parts = [block_key(parent, tokens[:m * h], start, items) + key for m in range(1, len(tokens) // h)]
        for part in parts:
            partial[part] = (block, full)
        self._partial_of[block] = parts

    def _prompt_digests(self, root: bytes, tokens: list[int], items: tuple[MMItem, ...]) -> list[bytes]:
        return mm_prompt_digests(root, tokens, self.block_size, items)

    def _longest_hit(self, digests: list[bytes], prompt_len: int, cap: int | None = None
                     ) -> tuple[int, list[list[int]]]:
        """(blocks every group serves, the cached blocks each group takes), at most ``cap`` blocks. At least the
        prompt's last token is always computed, so its logits exist: the hit ends before it."""
        if not digests:
            return 0, [[] for _ in self.groups]
        index, keys = self.pool.index, self._group_keys
        written = self.pool.written
        limit = min(len(digests), (prompt_len - 1) // self.block_size, len(digests) if cap is None else cap)

        def cached(g: int, j: int) -> int | None:
            b = index.get(digests[j] + keys[g])
            return b if b is not None and written[b] else None

        return longest_hit(self.groups, cached, limit, self.block_size)

    # ---- steps ------------------------------------------------------------------------------------
    def schedule(self, request_id: str, num_tokens: int) -> tuple[list[int], ...]:
        """Give the next ``num_tokens`` of the request's tokens slots in every group and return its block tables
        (the ledger's own lists, not copies, so a step costs O(1) per group: read them, never change them;
        `block_tables` copies).

        First every sliding group releases the blocks no query from the computed position on reads (the last
        step was confirmed, so nothing reads them); then each group allocates from the request's promises."""
        with self._lock:
            req = self._get(request_id)
            decoding = req.computed >= req.prompt_len
            n = checks.count(num_tokens, "num_tokens", 1, self.decode_tokens if decoding else self.step_tokens)
            if req.scheduled != req.computed:
                raise LedgerError(f"request {request_id!r} has a step scheduled but not confirmed")
            end = req.computed + n
            if end > len(req.tokens) or end > req.max_tokens:
                raise LedgerError(f"request {request_id!r}: {n} tokens from {req.computed} pass its tokens "
                                  f"({len(req.tokens)}) or its reservation ({req.max_tokens})")
            bs, pool = self.block_size, self.pool
            req.window_from = req.computed
            for g, group in enumerate(self.groups):
                table = req.tables[g]
                if group.kind == "sliding":
                    first = min(group.first_needed(req.computed, bs), len(table))
                    start = req.nulled[g]
                    if first > start:  # only the entries that left the window since the last step: O(1) a step
                        drop = [b for b in table[start:first] if b != NULL_BLOCK]
                        table[start:first] = [NULL_BLOCK] * (first - start)
                        req.nulled[g] = first
                        if drop:
                            self._drop(req, g, drop)
                    if decoding:
                        # Past the prompt a step computes at most `decode_tokens`: the window's bound shrinks from
                        # the prefill chunk's to the decode step's, and the difference is promised to nobody.
                        bound = group.reserved_blocks(req.max_tokens, bs, self.decode_tokens)
                        spare = req.reserved[g] - bound
                        if spare > 0:
                            req.reserved[g] = bound
                            req.promised[g] -= spare
                            self.promised -= spare
                want = 1 if group.kind == "state" else _cdiv(end, bs)
                grow = want - len(table)
                if grow > 0:
                    if grow > req.promised[g]:
                        raise InvariantError(f"group {g} of {request_id!r} needs {grow} blocks beyond its "
                                             f"reservation ({req.promised[g]} promised)")
                    new = pool.allocate_many(grow)
                    table.extend(new)
                    if group.kind == "sliding":
                        for b in new:
                            self._owner[b] = request_id
                            self._holders[b] = [request_id]
                    req.held[g] += grow
                    req.own[g] += grow
                    req.promised[g] -= grow
                    self.promised -= grow
            req.scheduled = end
            return tuple(req.tables)

    def confirm(self, request_id: str, sampled: int | None = None) -> None:
        """The scheduled step ran: its tokens' KV is written. Full blocks enter the prefix index (keyed by group);
        ``sampled`` is the token the step produced, appended to the request."""
        with self._lock:
            req = self._get(request_id)
            if sampled is not None:
                req.tokens.append(as_token_id(sampled, request_id))
            req.computed = req.scheduled
            if not self.prefix_caching:
                return
            bs, pool = self.block_size, self.pool
            full = min(req.computed, len(req.tokens)) // bs
            while len(req.digests) < full:
                j = len(req.digests)
                parent = req.digests[-1] if req.digests else req.root
                req.digests.append(block_key(parent, req.tokens[j * bs:(j + 1) * bs], j * bs, req.mm_items))
            parts = self.hash_block_size < bs
            for g in range(len(self.groups)):
                table, key = req.tables[g], self._group_keys[g]
                for j in range(req.registered[g], full):
                    b = table[j]
                    if b != NULL_BLOCK and pool.register(b, req.digests[j] + key):
                        pool.written[b] = True
                        if parts:
                            self._register_parts(b, req.digests[j - 1] if j else req.root,
                                                 req.tokens[j * bs:(j + 1) * bs], j * bs, req.mm_items, key,
                                                 req.digests[j] + key)
                req.registered[g] = max(req.registered[g], full)

    def release(self, request_id: str) -> None:
        """The request ended: every group's blocks return (written, indexed ones retained), its promises end."""
        with self._lock:
            req = self._get(request_id)
            pending = self._copies.pop(request_id, ())
            self.pool.release_many([src for src, _, _ in pending])  # copies into blocks about to be released
            for g, table in enumerate(req.tables):
                live = [b for b in reversed(table) if b != NULL_BLOCK]  # tail first: evicted before the head
                if self.groups[g].kind == "sliding":
                    self._drop(req, g, live)
                else:
                    self.pool.release_many(live)
                self.promised -= req.promised[g]
            del self.requests[request_id]

    def block_tables(self, request_id: str) -> tuple[list[int], ...]:
        with self._lock:
            return self._get(request_id).block_tables()

    def slot_mapping(self, request_id: str, start: int, end: int) -> tuple[list[int], ...]:
        """Per group, the flat slots of positions ``[start, end)`` (a state group: its one block, once)."""
        with self._lock:
            req = self._get(request_id)
            bs, out = self.block_size, []
            for g, group in enumerate(self.groups):
                table = req.tables[g]
                if group.kind == "state":
                    out.append([table[0] * bs])
                    continue
                slots = []
                for p in range(start, end):
                    b = table[p // bs] if p // bs < len(table) else NULL_BLOCK
                    if b == NULL_BLOCK:
                        raise LedgerError(f"position {p} of {request_id!r} has no block in group {g}")
                    slots.append(b * bs + p % bs)
                out.append(slots)
            return tuple(out)

    def _drop(self, req: GroupRequest, g: int, blocks: list[int]) -> None:
        """``req`` lets go of sliding-group blocks. An owned block still held by others passes to one of them (its
        promise pays for it: a holder's promises always cover the blocks it borrows); one nobody holds returns to
        the pool, and the owner's reservation is promised again."""
        rid, owner, holders = req.request_id, self._owner, self._holders
        for b in blocks:
            others = holders[b]
            others.remove(rid)
            if owner.get(b) == rid:
                req.own[g] -= 1
                req.promised[g] += 1
                self.promised += 1
                if others:
                    heir = self.requests[others[0]]
                    owner[b] = heir.request_id
                    heir.own[g] += 1
                    heir.promised[g] -= 1
                    self.promised -= 1
                else:
                    del owner[b]
            if not others:
                del holders[b]
        self.pool.release_many(blocks)
        req.held[g] -= len(blocks)

    def _get(self, request_id: str) -> GroupRequest:
        req = self.requests.get(request_id)
        if req is None:
            raise LedgerError(f"unknown request {request_id!r}")
        return req

    # ---- audit ------------------------------------------------------------------------------------
    def usage(self) -> dict[str, object]:
        with self._lock:
            held = [sum(r.held[g] for r in self.requests.values()) for g in range(len(self.groups))]
            return {"free": self.pool.num_free, "active": self.pool.num_active, "retained": self.pool.num_retained,
                    "promised": self.promised, "available": self.available(), "held_by_group": held,
                    "bytes_held_by_group": [h * g.bytes_per_block for h, g in zip(held, self.groups, strict=True)]}

    def check(self) -> None:
        """Every group's conservation law, then the pool's (O(pool + tables))."""
        with self._lock:
            pool, bs = self.pool, self.block_size
            refs = [0] * pool.num_blocks
            owner: dict[int, int] = {}
            promised = 0
            for rid, req in self.requests.items():
                for g, group in enumerate(self.groups):
                    table = req.tables[g]
                    live = [b for b in table if b != NULL_BLOCK]
                    if len(live) != req.held[g]:
                        raise InvariantError(f"{rid!r} group {g}: {len(live)} live blocks, held says {req.held[g]}")
                    if req.own[g] + req.promised[g] != req.reserved[g] or req.promised[g] < 0:
                        raise InvariantError(f"{rid!r} group {g}: own {req.own[g]} + promised {req.promised[g]} "
                                             f"!= reserved {req.reserved[g]}")
                    if req.held[g] > req.reserved[g]:
                        raise InvariantError(f"{rid!r} group {g}: holds {req.held[g]} blocks, above its bound "
                                             f"{req.reserved[g]}")
                    if group.kind != "sliding" and req.own[g] != req.held[g]:
                        raise InvariantError(f"{rid!r} group {g}: a {group.kind} group carries {req.own[g]} of "
                                             f"its {req.held[g]} blocks")
                    if group.kind == "sliding":
                        owned = sum(1 for b in live if self._owner.get(b) == rid)
                        if owned != req.own[g] or any(self._holders[b].count(rid) != 1 for b in live):
                            raise InvariantError(f"{rid!r} group {g}: owns {owned} blocks, own says {req.own[g]}")
                        first = group.first_needed(req.window_from, bs)
                        if any(b != NULL_BLOCK for b in table[:first]):
                            raise InvariantError(f"{rid!r} group {g}: a block before the window is still held")
                    elif NULL_BLOCK in table:
                        raise InvariantError(f"{rid!r} group {g}: a {group.kind} group dropped a block")
                    if group.kind == "state" and (req.computed or req.scheduled) and req.held[g] != req.reserved[g]:
                        # A state is fixed-size: from its first step to its release a request holds all of it.
                        raise InvariantError(f"{rid!r} group {g}: a state group holds {req.held[g]} of its "
                                             f"{req.reserved[g]} blocks after its first step")
                    for b in live:
                        refs[b] += 1
                        if owner.setdefault(b, g) != g:
                            raise InvariantError(f"block {b} is held by groups {owner[b]} and {g}")
                    promised += req.promised[g]
            for rid, copies in self._copies.items():
                tables = self.requests[rid].tables
                for src, dst, slots in copies:
                    refs[src] += 1  # held until the copy is taken
                    if not any(dst in t for t in tables) or not 0 < slots < bs:
                        raise InvariantError(f"{rid!r}: a pending copy into block {dst} it does not hold")
            if promised != self.promised:
                raise InvariantError(f"promised {self.promised} != the requests' promises {promised}")
            if self.promised > pool.num_free + pool.num_evictable:
                raise InvariantError(f"promised {self.promised} > free {pool.num_free} + evictable "
                                     f"{pool.num_evictable}")
            for b, rid in self._owner.items():
                if rid not in self._holders.get(b, ()):
                    raise InvariantError(f"block {b}'s owner {rid!r} does not hold it")
            if set(self._holders) != set(self._owner):
                raise InvariantError("a held sliding block has no owner")
            for b in range(pool.num_blocks):
                if refs[b] != pool.ref[b]:
                    raise InvariantError(f"block {b}: {pool.ref[b]} references, tables hold {refs[b]}")
            pool.check()


__all__ = ["GROUP_KINDS", "NULL_BLOCK", "GroupDecision", "GroupLedger", "GroupRequest", "KVCacheGroup", "MMItem",
           "block_key", "longest_hit"]
