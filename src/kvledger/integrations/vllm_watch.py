"""A live mirror of a running vLLM: its KV events over ZMQ, its Prometheus metrics over HTTP, and the
seed's explanation of its memory; plus the adapter that lets the fleet router read such a mirror as a
replica.

The wire (vLLM 0.32.0's ``ZmqEventPublisher``): a PUB socket sends multipart messages ``(topic, seq,
payload)``, ``seq`` an 8-byte big-endian counter from 0 per process; an optional ROUTER socket
(``replay_endpoint``) answers a request carrying an 8-byte start sequence with every buffered batch from
there as ``(topic, seq, payload)``, then ``(b"", -1, b"")`` (releases before 0.32 left the topic out; both
are read). The subscriber here is read-only and single-threaded: ``poll()`` takes what arrived, asks for a
replay on a gap, and feeds the mirror in sequence order. vLLM binds its PUB only on a wildcard
(``tcp://*:P``) or ``ipc://`` endpoint; given ``tcp://HOST:P`` it connects there instead.

Metrics (vLLM's ``/metrics``): ``vllm:cache_config_info`` (an info gauge whose labels are the cache config:
``num_gpu_blocks``, ``block_size``, ``gpu_memory_utilization``, ``prefix_caching_hash_algo``...),
``vllm:kv_cache_usage_perc`` (blocks in use / (num_gpu_blocks - 1), the null block excluded),
``vllm:prefix_cache_queries``/``hits`` (token counters), ``vllm:num_requests_running``/``waiting``.
Scraped with the standard library.
"""

from __future__ import annotations

import math
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .vllm_events import (
    MEDIUM_GPU,
    EventFormatError,
    VllmBlockHasher,
    VllmCacheMirror,
    decode_batch,
    digest_of,
    need,
)

END_SEQ = -1
REPLAY_TIMEOUT_S = 2.0
MAX_METRICS_BYTES = 8 << 20


def check_endpoint(url: str, what: str = "--events") -> str:
    """A ZMQ endpoint to connect to: tcp://HOST:PORT or ipc://PATH (vLLM binds ``tcp://*:5557``)."""
    if re.fullmatch(r"tcp://[^\s:/*]+:\d{1,5}", url) or re.fullmatch(r"tcp://\[[0-9a-fA-F:.]+\]:\d{1,5}", url):
        if 0 < int(url.rsplit(":", 1)[1]) < 65536:
            return url
    if url.startswith("ipc://") and len(url) > 6:
        return url
    raise ConfigError(f"{what} must be tcp://HOST:PORT or ipc://PATH (where vLLM's events are), got {url[:80]!r}")


# ---- events -------------------------------------------------------------------------------------------
@dataclass(slots=True)
class SubscriberStats:
    messages: int = 0
    replays: int = 0
    replayed_batches: int = 0
    replay_failures: int = 0
    last_message_s: float | None = None  # local monotonic time of the last message


class EventSubscriber:
    """SUB to vLLM's publisher (and DEALER to its replay socket, when given), feeding ``mirror``."""

    def __init__(self, endpoint: str, mirror: VllmCacheMirror, *, replay_endpoint: str | None = None,
                 topic: str = "", replay_timeout_s: float = REPLAY_TIMEOUT_S, context: Any = None) -> None:
        self.zmq = need("zmq")
        need("msgspec")
        self.endpoint = check_endpoint(endpoint)
        self.replay_endpoint = None if replay_endpoint is None else check_endpoint(replay_endpoint, "--replay")
        self.mirror = mirror
        self.topic = topic.encode("utf-8")
        self.replay_timeout_s = replay_timeout_s
        self.stats = SubscriberStats()
        self._ctx = context or self.zmq.Context.instance()
        self._sub = self._ctx.socket(self.zmq.SUB)
        self._sub.setsockopt(self.zmq.LINGER, 0)
        self._sub.setsockopt(self.zmq.SUBSCRIBE, self.topic)
        self._sub.connect(self.endpoint)  # ZMQ reconnects by itself when vLLM restarts
        self._first = True

    def close(self) -> None:
        self._sub.close(linger=0)

    def poll(self, timeout_s: float) -> int:
        """Take every message that arrives within ``timeout_s`` (at least the ones already queued);
        returns how many batches were applied."""
        zmq = self.zmq
        deadline = time.monotonic() + timeout_s
        applied = 0
        while True:
            left = max(0.0, deadline - time.monotonic())
            if not self._sub.poll(int(left * 1000)):
                return applied
            while True:
                try:
                    frames = self._sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                applied += self._message(frames)
            if time.monotonic() >= deadline:
                return applied

    def _message(self, frames: list[bytes]) -> int:
        self.stats.messages += 1
        self.stats.last_message_s = time.monotonic()
        if len(frames) != 3 or len(frames[1]) != 8:
            self.mirror.bad_payload(f"{len(frames)} frames, not (topic, seq, payload)")
            return 0
        seq = int.from_bytes(frames[1], "big", signed=True)
        try:
            batch = decode_batch(frames[2])
        except EventFormatError as exc:
            self.mirror.bad_payload(str(exc))
            return 0
        m = self.mirror
        expected = m.sync.next_seq
        if self.replay_endpoint is not None and seq > 0 and (
                (expected is None and self._first) or (expected is not None and seq != expected)):
            # joined late, or vLLM restarted and its first batches were missed: replay from 0; a gap: from it
            wanted = 0 if expected is None or seq < expected else expected
            self._first = False
            if self._replay(wanted, upto=seq):
                m.ingest(seq, batch)
                return 1
        self._first = False
        m.ingest(seq, batch)
        return 1

    def _replay(self, wanted: int, upto: int) -> bool:
        """Ask vLLM's replay socket for batches ``wanted``..: True if it covered the gap up to ``upto``.

        A gap may hide a restart whose new stream already counts past the old one: the replay then starts
        one batch early, at the last one applied, and a different time stamp under that number is another
        process's batch -- the mirror empties and replays the new process from 0."""
        zmq = self.zmq
        self.stats.replays += 1
        last_ts = self.mirror.sync.last_ts
        start = wanted - 1 if wanted > 0 and last_ts is not None else wanted
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        first: int | None = None
        restarted = False
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                if not sock.poll(int(self.replay_timeout_s * 1000)):
                    break
                frames = sock.recv_multipart()
                frames = frames[1:] if frames and frames[0] == b"" else frames
                if len(frames) == 3:
                    frames = frames[1:]  # vLLM 0.32 sends the topic first: (topic, seq, payload)
                if len(frames) != 2:
                    break
                seq = int.from_bytes(frames[0], "big", signed=True)
                if seq == END_SEQ:
                    break
                if first is None:
                    first = seq  # above ``wanted``: the buffer no longer holds the gap's start (stale)
                if seq >= upto:
                    continue  # the live message itself is applied by the caller
                try:
                    batch = decode_batch(frames[1])
                except EventFormatError as exc:
                    self.mirror.bad_payload(str(exc))
                    continue
                if seq < wanted:  # the batch applied last, sent again: the same process if the same batch
                    if batch.ts != last_ts:
                        restarted = True
                        break
                    continue
                self.mirror.ingest(seq, batch)
                self.stats.replayed_batches += 1
        finally:
            sock.close(linger=0)
        if restarted:
            self.mirror.engine_restarted("vLLM restarted (a replayed batch differs from the one applied under its "
                                         "number): replaying its new stream")
            return self._replay(0, upto)
        if first is not None and first <= wanted:
            return True  # the replayed batches were applied in order: the gap never reached the mirror
        self.stats.replay_failures += 1
        return False


# ---- metrics ------------------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition: name -> [(labels, value)]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.setdefault(m.group(1), []).append((labels, value))
    return out


@dataclass(slots=True)
class VllmMetrics:
    """The figures of vLLM's /metrics the watch explains (one engine: the first, or ``engine``)."""

    num_gpu_blocks: int | None = None
    block_size: int | None = None
    gpu_memory_utilization: float | None = None
    cache_dtype: str | None = None
    hash_algo: str | None = None
    prefix_caching: bool | None = None
    usage: float | None = None  # vllm:kv_cache_usage_perc (0..1)
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    running: int | None = None
    waiting: int | None = None
    model_name: str | None = None
    error: str | None = None  # why the last scrape failed (None: it worked)
    scraped_at: float | None = None

    @property
    def usable_blocks(self) -> int | None:
        """vLLM's pool less its null block (block 0 is never handed out)."""
        return None if self.num_gpu_blocks is None else max(0, self.num_gpu_blocks - 1)

    @property
    def active_blocks(self) -> int | None:
        """Blocks held by running requests: usage x usable blocks, as vLLM computes the usage."""
        if self.usage is None or self.usable_blocks is None:
            return None
        return round(self.usage * self.usable_blocks)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


Samples = list[tuple[dict[str, str], float]]


def _first(samples: Samples | None, engine: str | None) -> tuple[dict[str, str], float] | None:
    if not samples:
        return None
    for labels, value in samples:
        if engine is None or labels.get("engine") == engine:
            return labels, value
    return None


def metrics_from_text(text: str, engine: str | None = None) -> VllmMetrics:
    p = parse_prometheus(text)
    m = VllmMetrics()
    info = _first(p.get("vllm:cache_config_info"), engine)
    if info is not None:
        labels = info[0]

        def num(name: str, kind: type) -> Any:
            try:
                return kind(labels[name])
            except (KeyError, ValueError):
                return None

        m.num_gpu_blocks, m.block_size = num("num_gpu_blocks", int), num("block_size", int)
        m.gpu_memory_utilization = num("gpu_memory_utilization", float)
        m.cache_dtype, m.hash_algo = labels.get("cache_dtype"), labels.get("prefix_caching_hash_algo")
        if "enable_prefix_caching" in labels:
            m.prefix_caching = labels["enable_prefix_caching"] == "True"
    for attr, names, kind in (("usage", ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), float),
                              ("prefix_queries", ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries"),
                               float),
                              ("prefix_hits", ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits"), float),
                              ("running", ("vllm:num_requests_running",), int),
                              ("waiting", ("vllm:num_requests_waiting",), int)):
        for name in names:
            got = _first(p.get(name), engine)
            if got is not None and math.isfinite(got[1]):
                setattr(m, attr, kind(got[1]))
                if m.model_name is None:
                    m.model_name = got[0].get("model_name")
                break
    return m


def check_metrics_url(url: str) -> str:
    if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", url):
        raise ConfigError(f"--metrics must be an http(s) URL such as http://127.0.0.1:8000/metrics, got {url[:80]!r}")
    return url


def scrape_metrics(url: str, timeout_s: float = 2.0, engine: str | None = None) -> VllmMetrics:
    """Read vLLM's /metrics once; a server that is down is a figure-less result with ``error``, not a failure."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 -- the user's own URL
            text = resp.read(MAX_METRICS_BYTES).decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return VllmMetrics(error=f"metrics unreachable: {str(reason)[:160]}", scraped_at=time.time())
    m = metrics_from_text(text, engine)
    m.scraped_at = time.time()
    return m


@dataclass(slots=True)
class RestartWatch:
    """Reads successive scrapes for a vLLM restart the event stream has not shown yet: a counter that went
    back (``vllm:prefix_cache_queries``) while the mirror saw no sequence reset means the mirror still holds
    the old process's blocks, so it is emptied (the new process's cache starts empty) and waits for the new
    stream."""

    previous: VllmMetrics | None = None
    restarts_seen: int = 0

    def observe(self, mirror: VllmCacheMirror, current: VllmMetrics) -> bool:
        """Returns whether this scrape shows a restart."""
        prev, self.previous = self.previous, current if current.error is None else self.previous
        seen, self.restarts_seen = self.restarts_seen, mirror.sync.restarts
        if prev is None or prev.prefix_queries is None or current.prefix_queries is None \
                or current.prefix_queries >= prev.prefix_queries:
            return False
        if mirror.sync.restarts == seen:  # the events have not shown it: the mirror is the old process's
            mirror.engine_restarted("vLLM restarted (its counters reset): waiting for its new event stream")
            self.restarts_seen = mirror.sync.restarts
        return True


# ---- the explanation ----------------------------------------------------------------------------------
@dataclass(slots=True)
class PlannerTerms:
    """Our planner's figures for the model vLLM serves (``--model``): what one token and one block cost."""

    model: str
    bytes_per_token: int
    block_bytes: int
    gpu: str | None = None  # with a catalogue GPU: the pool `kvledger plan --engine vllm` predicts there
    pool_blocks: int | None = None


def explain(mirror: VllmCacheMirror, metrics: VllmMetrics | None, planner: PlannerTerms | None = None,
            *, top: int = 5) -> dict[str, Any]:
    """The seed's explanation of a running vLLM's KV memory, from what its events and metrics tell.

    Blocks by state: *active* (held by running requests: the usage metric), *cached* (hashed blocks the
    events say are in the prefix cache, active or not), *retained* (cached and held by nobody: evictable,
    reused on a hit) and *free* (neither). Events do not say which cached blocks are in use, so retained
    and free are bounds unless one of them is pinned by the other figures."""
    snap = mirror.snapshot()
    gpu_cached = snap["blocks"].get(MEDIUM_GPU, 0)
    out: dict[str, Any] = {"mirror": snap, "shared_prefixes": mirror.shared_prefixes(top)}
    m = metrics
    block_size = (m.block_size if m is not None else None) or mirror.block_size
    pool: dict[str, Any] = {"block_size": block_size}
    states: dict[str, Any] = {"cached": gpu_cached}
    if m is not None:
        out["metrics"] = m.to_dict()
        if m.num_gpu_blocks is not None:
            pool.update(num_gpu_blocks=m.num_gpu_blocks, usable_blocks=m.usable_blocks, null_blocks=1,
                        gpu_memory_utilization=m.gpu_memory_utilization, cache_dtype=m.cache_dtype)
            if block_size:
                pool["kv_tokens"] = m.num_gpu_blocks * block_size  # vLLM logs "GPU KV cache size: N tokens"
        active, usable = m.active_blocks, m.usable_blocks
        if active is not None and usable is not None:
            lo, hi = max(0, gpu_cached - active), min(gpu_cached, usable - active)
            states.update(active=active, retained_min=lo, retained_max=max(lo, hi),
                          free_min=max(0, usable - active - max(lo, hi)), free_max=max(0, usable - active - lo))
        if m.prefix_queries:
            out["prefix_cache_hit_rate"] = (m.prefix_hits or 0.0) / m.prefix_queries
    if planner is not None:
        pool["planner"] = {"model": planner.model, "kv_bytes_per_token": planner.bytes_per_token,
                           "block_bytes": planner.block_bytes}
        if m is not None and m.num_gpu_blocks is not None:
            pool["planner"]["pool_bytes"] = m.num_gpu_blocks * planner.block_bytes
            pool["planner"]["cached_bytes"] = gpu_cached * planner.block_bytes
        if planner.pool_blocks is not None:
            pool["planner"].update(gpu=planner.gpu, predicted_num_gpu_blocks=planner.pool_blocks)
            if m is not None and m.num_gpu_blocks:
                pool["planner"]["predicted_vs_vllm"] = planner.pool_blocks / m.num_gpu_blocks - 1.0
    out["pool"], out["states"] = pool, states
    return out


# ---- the router's view of a mirrored vLLM -------------------------------------------------------------
@dataclass(slots=True)
class MirrorReplica:
    """Feeds one mirrored vLLM into a :class:`kvledger.placement.view.RouterView` as replica ``name``:
    its cached GPU blocks become the view's prefix index (digests: the events' hashes, see
    :func:`request_digests`), its metrics the replica's load. Admission stays with vLLM."""

    name: str
    mirror: VllmCacheMirror
    _epoch: int | None = None
    _load_seq: int = 0
    _synced: bool = field(default=False)

    def sync(self, view: Any, metrics: VllmMetrics | None, now: float) -> None:
        from ..placement.view import REMOVED, STORED

        over, changes = self.mirror.drain()
        if over or not self._synced or self._epoch != self.mirror.sync.epoch:
            view.resync(self.name)
            view.apply_events(self.name, [(STORED, digest_of(k[2])) for k in self.mirror.keys_on(MEDIUM_GPU)])
            self._epoch, self._synced = self.mirror.sync.epoch, True
        else:
            view.apply_events(self.name, [(STORED if kind == "stored" else REMOVED, digest_of(key[2]))
                                          for kind, key in changes if key[0] == MEDIUM_GPU])
        load = mirror_load(self.mirror, metrics, self._load_seq, now)
        if load is not None:
            self._load_seq += 1
            view.update_load(self.name, load, now)


def mirror_load(mirror: VllmCacheMirror, metrics: VllmMetrics | None, seq: int, now: float) -> Any:
    """A :class:`~kvledger.placement.score.ReplicaLoad` from a mirror and metrics (None without a pool
    size): vLLM promises nothing ahead (it allocates as tokens come), and the evictable figure is the
    lower bound of retained blocks, so ``available`` never overstates what vLLM could take."""
    from ..placement.score import ReplicaLoad

    if metrics is None or metrics.usable_blocks is None or metrics.active_blocks is None:
        return None
    usable, active = metrics.usable_blocks, metrics.active_blocks
    retained = max(0, mirror.held(MEDIUM_GPU) - active)
    free = max(0, usable - active - retained)
    return ReplicaLoad(pool=usable, free=free, evictable=retained, promised=0, running=metrics.running or 0,
                       waiting=metrics.waiting or 0, seq=seq, stamp=now)


def request_digests(token_ids: list[int], block_size: int, hasher: VllmBlockHasher,
                    cache_salt: str | None = None) -> tuple[bytes, ...]:
    """A prompt's full-block digests as a view of mirrored vLLMs keys them (vLLM's hashes, as events carry them)."""
    return tuple(digest_of(hasher.external(h)) for h in hasher.block_hashes(token_ids, block_size, cache_salt))


__all__ = ["EventSubscriber", "MirrorReplica", "PlannerTerms", "VllmMetrics", "check_endpoint", "check_metrics_url",
           "explain", "metrics_from_text", "mirror_load", "RestartWatch", "parse_prometheus", "request_digests",
           "scrape_metrics"]
