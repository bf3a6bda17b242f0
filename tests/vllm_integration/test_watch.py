"""`kvledger watch` against vLLM 0.32.0 itself: vLLM's own scheduler and KV cache manager (no model; the
harness feeds fake tokens) publishing through vLLM's own ``ZmqEventPublisher`` (PUB + replay ROUTER, on
local sockets) into the watch's subscriber and mirror. What a user of the mirror would notice: its "would
hit" equals the ``cached_tokens`` vLLM then reports for the request, its blocks are exactly the ones in
vLLM's prefix cache, and it stays so across a dropped stream and a restarted vLLM. Runs in `make test-vllm`.

(`benchmarks/vllm_watch_replay.py` does the same through `vllm serve` with the real model.)"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from kvledger.integrations.vllm.harness import build_scheduler
from kvledger.integrations.vllm_events import VllmBlockHasher, VllmCacheMirror
from kvledger.integrations.vllm_watch import EventSubscriber

BS = 16
HASHER = VllmBlockHasher()  # vLLM's defaults: sha256, its fixed NONE_HASH seed, int hashes in the events


def prompts(n: int, seed: int) -> list[list[int]]:
    """Half open with one 64-token header; some are whole blocks long (vLLM then recomputes the last block
    and caches a second copy of its hash)."""
    rng = random.Random(seed)
    head = [rng.randrange(32000) for _ in range(64)]
    out = []
    for i in range(n):
        own = rng.choice((BS, 2 * BS, rng.randrange(5, 150)))
        out.append((head if i % 2 == 0 else []) + [rng.randrange(32000) for _ in range(own)])
    return out


class Vllm:
    """One vLLM engine's scheduler, its events on ``ipc://`` sockets under ``where`` (a restart binds the
    same ones again, as a restarted `vllm serve` with the same --kv-events-config does)."""

    def __init__(self, where: Path, num_blocks: int, buffer_steps: int = 10_000) -> None:
        from vllm.distributed.kv_events import ZmqEventPublisher

        self.h = build_scheduler("vllm", num_blocks=num_blocks, block_size=BS, kv_events=True,
                                 max_num_batched_tokens=1024)
        self.events, self.replay = f"ipc://{where}/kv-events", f"ipc://{where}/kv-replay"
        self.pub = ZmqEventPublisher(0, endpoint=self.events, replay_endpoint=self.replay,
                                     buffer_steps=buffer_steps, topic="kv")
        self.published = 0
        publish = self.pub.publish

        def counted(batch) -> None:
            self.published += 1
            publish(batch)

        self.pub.publish = counted
        self.h.scheduler.kv_event_publisher = self.pub

    def serve(self, batch: list[list[int]], max_tokens: int = 20) -> list:
        """Run requests to completion (all at once); returns vLLM's requests (their prefill stats)."""
        reqs = [self.h.add(f"r{self.published}-{i}-{time.monotonic_ns()}", p, max_tokens) for i, p in enumerate(batch)]
        stats = [r.prefill_stats for r in reqs]  # vLLM fills these at scheduling and hands them out once
        self.h.run(20_000)
        return stats

    def cached(self) -> set:
        """vLLM's prefix cache itself, keyed as the events key it."""
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id, maybe_convert_block_hash

        pool = self.h.scheduler.kv_cache_manager.block_pool
        return {(pool.medium or "GPU", get_group_id(k), maybe_convert_block_hash(get_block_hash(k)))
                for k in pool.cached_block_hash_to_block._cache}

    def sent(self) -> None:
        """Until vLLM's publisher thread has sent everything queued (to whoever is connected then)."""
        deadline = time.monotonic() + 20
        while self.pub._event_queue.qsize() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)

    def close(self) -> None:
        self.pub.shutdown()


def caught_up(sub: EventSubscriber, vllm: Vllm, timeout_s: float = 20.0) -> None:
    """Until the mirror has applied this engine's last batch (after a restart: the new engine's)."""
    deadline = time.monotonic() + timeout_s
    while sub.mirror.sync.next_seq != vllm.published:
        assert time.monotonic() < deadline, f"mirror at batch {sub.mirror.sync.next_seq} of {vllm.published}"
        sub.poll(0.02)
    sub.poll(0.05)


def subscribe(vllm: Vllm, mirror: VllmCacheMirror | None = None) -> EventSubscriber:
    sub = EventSubscriber(vllm.events, mirror or VllmCacheMirror(), replay_endpoint=vllm.replay, topic="kv")
    time.sleep(0.2)  # ZMQ's slow joiner: batches before the connection are only in vLLM's replay buffer
    return sub


@pytest.fixture
def vllm(tmp_path: Path):
    engine = Vllm(tmp_path, num_blocks=100)
    yield engine
    engine.close()


def test_would_hit_is_vllms_cached_tokens_and_the_mirror_is_vllms_prefix_cache(vllm: Vllm) -> None:
    """The shared peer workload's shape in small: a first pass all at once, then each prompt again one at a
    time, in a pool small enough that the second pass evicts. A prompt a whole number of blocks long hits
    all but its last block (vLLM recomputes the last token) and caches a second copy of that block's hash;
    evicting one copy leaves the other. Before each request the mirror is asked; vLLM then answers."""
    sub = subscribe(vllm)
    try:
        work = prompts(24, seed=5)
        vllm.serve(work)
        rows = []
        for p in work:
            caught_up(sub, vllm)
            assert set(sub.mirror.blocks) == vllm.cached()
            hit = sub.mirror.would_hit(p, hasher=HASHER)
            [stats] = vllm.serve([p])
            rows.append((hit.cached_tokens, stats.num_cached_tokens, hit.by_hash == hit.by_chain))
        caught_up(sub, vllm)
        assert set(sub.mirror.blocks) == vllm.cached()
        sub.mirror.check()
        assert [r[0] for r in rows] == [r[1] for r in rows]
        assert all(r[2] for r in rows)
        counts = sub.mirror.counts
        # what made this hard is there: hits, second copies of a hash, evictions of one copy and of the last
        assert sum(r[1] for r in rows) > 0 and counts.restored > 0 and counts.removed_copy > 0 and counts.removed > 0
        assert sub.mirror.snapshot()["sync"]["state"] == "live"
    finally:
        sub.close()


def test_a_dropped_stream_is_replayed_and_a_restarted_vllm_is_followed(tmp_path: Path) -> None:
    first = Vllm(tmp_path, num_blocks=70)
    work = prompts(12, seed=9)
    mirror = VllmCacheMirror()
    sub = subscribe(first, mirror)
    try:
        first.serve(work[:4])
        caught_up(sub, first)
        assert set(mirror.blocks) == first.cached()
        sub.close()  # the watch loses its connection; vLLM goes on
        first.serve(work[4:8])
        first.sent()
        sub = subscribe(first, mirror)
        first.serve(work[8:9])  # the next live batch shows the gap: the rest comes from vLLM's replay socket
        caught_up(sub, first)
        assert sub.stats.replays >= 1 and mirror.snapshot()["sync"]["state"] == "live"
        assert set(mirror.blocks) == first.cached()
        first.close()  # vLLM stops; a new process binds the same endpoints, its batches counted from 0 again
        second = Vllm(tmp_path, num_blocks=70)
        try:
            [stats] = second.serve([work[0]])
            assert stats.num_cached_tokens == 0  # the new process started empty...
            deadline = time.monotonic() + 20
            while mirror.sync.restarts == 0:  # ...and its stream reaches the watch once ZMQ has reconnected
                assert time.monotonic() < deadline, "the restarted vLLM's stream never reached the watch"
                sub.poll(0.3)
                if mirror.sync.restarts == 0:
                    second.serve([work[1]])  # batches sent before the reconnect come back through the replay
            caught_up(sub, second)
            assert mirror.snapshot()["sync"]["state"] == "live"
            assert set(mirror.blocks) == second.cached()  # ...and so did the mirror: none of the old blocks
            hit = mirror.would_hit(work[0], hasher=HASHER)
            [stats] = second.serve([work[0]])
            assert hit.cached_tokens == stats.num_cached_tokens > 0
        finally:
            second.close()
    finally:
        sub.close()


def test_a_gap_past_vllms_replay_buffer_is_stale_until_its_cache_is_reset(tmp_path: Path) -> None:
    engine = Vllm(tmp_path, num_blocks=70, buffer_steps=2)
    work = prompts(8, seed=11)
    mirror = VllmCacheMirror()
    sub = subscribe(engine, mirror)
    try:
        engine.serve(work[:2])
        caught_up(sub, engine)
        sub.close()
        engine.serve(work[2:6])  # many steps: the replay buffer keeps the last 2 batches only
        engine.sent()
        sub = subscribe(engine, mirror)
        engine.serve(work[6:7])
        caught_up(sub, engine)
        sync = mirror.snapshot()["sync"]
        assert sync["state"] == "stale" and sub.stats.replay_failures >= 1
        assert engine.h.scheduler.reset_prefix_cache()  # vLLM's cache empties: AllBlocksCleared
        engine.serve(work[:1])  # the next step publishes it
        caught_up(sub, engine)
        assert mirror.snapshot()["sync"]["state"] == "live" and set(mirror.blocks) == engine.cached()
    finally:
        sub.close()
        engine.close()
