"""The engine's own process (``kvledger serve --engine-process``, the default): the child side of
:class:`~kvledger.server.engine_proc.ProcessBackend`.

Why a process: the HTTP loop (parsing, tokenizing, detokenizing, SSE) and the engine loop in one
interpreter share one lock, so every millisecond the server spends on HTTP is a millisecond no step runs,
and under CPU contention both lose. vLLM runs its engine core apart for the same reason, fed the same way.

The wire (ZeroMQ over ``ipc://``, msgpack by msgspec): the parent binds an input socket (requests,
cancels, calls) and an output socket; this process connects to both. After every engine step it sends
*one* message with every request's new tokens (``("step", running, events)``), never one per token;
calls (``check_request``, ``state``, ``audit``, ...) get one reply each. Anything that is not a plain value
(a request's ``SamplingParams``, its ``RequestResult``, logprobs, a snapshot, an exception) travels as
pickle bytes inside the message, all of its fields as they are: whatever a later version adds to those
dataclasses crosses with them.

This process never outlives its parent: the parent holds its stdin open and a thread here exits the
process when it reads EOF (the parent is gone, however it died), ``PR_SET_PDEATHSIG`` backs that up on
Linux, and SIGINT/SIGTERM are ignored here (a Ctrl-C in a terminal reaches the whole process group; the
parent drains first, then stops this process).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass, fields
from typing import Any

EVENT_FIELDS = ("request_id", "branch", "token", "position", "time_s", "finished", "finish_reason")


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the server reads from the engine once, at start (the child's ``ready`` message)."""

    model_name: str
    block_size: int
    pool_blocks: int
    max_context: int | None
    vocab_size: int
    max_num_seqs: int
    checkpoint_path: str
    kv_dtype: str
    store_nbytes: int
    pid: int


def sampling_to_wire(params: Any) -> bytes | None:
    """A ``SamplingParams`` as pickle bytes: every field as it is, except a JSON constraint (a compiled
    grammar that does not pickle), which crosses as its schema and end tokens and is compiled again here."""
    if params is None:
        return None
    values = {f.name: getattr(params, f.name) for f in fields(params)}
    constraint = values.get("constraint")
    if constraint is not None:
        values["constraint"] = ("json_schema", constraint.schema, tuple(constraint.end_ids))
    return pickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL)


class _Core:
    """The engine and the two sockets, in the child."""

    def __init__(self, config: Any, threads: int | None, in_addr: str, out_addr: str) -> None:
        import msgspec
        import zmq

        self.zctx = zmq.Context()
        self.inp = self.zctx.socket(zmq.PULL)
        self.inp.connect(in_addr)
        self.out = self.zctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.SNDHWM, 0)
        self.out.setsockopt(zmq.LINGER, 2000)
        self.out.connect(out_addr)
        self.enc = msgspec.msgpack.Encoder()
        self.dec = msgspec.msgpack.Decoder()
        self._send_lock = threading.Lock()
        self.config = config
        self.threads = threads
        self.engine: Any = None
        self.handles: dict[str, Any] = {}  # request id -> the engine's handle, until it finishes
        self.submitting: set[str] = set()  # ids whose submit has not returned yet
        self.pending: list[tuple[Any, ...]] = []  # this step's events (engine thread only)
        self._grammars: dict[tuple[int, ...], Any] = {}
        self._codec: Any = None
        self._error_sent = False

    def send(self, msg: tuple[Any, ...]) -> None:
        data = self.enc.encode(msg)
        with self._send_lock:
            self.out.send(data, copy=False)

    # ---- engine thread ----------------------------------------------------------------------------
    def on_token(self, event: Any) -> None:
        extra = None
        if event.logprobs is not None or event.prompt_logprobs is not None:
            extra = pickle.dumps((event.logprobs, event.prompt_logprobs), protocol=pickle.HIGHEST_PROTOCOL)
        result = None
        if event.finished:
            handle = self.handles.pop(event.request_id, None)
            if handle is None:
                handle = self._late_handle(event.request_id)
            if handle is not None and handle.done():
                result = pickle.dumps(handle.result(timeout=0), protocol=pickle.HIGHEST_PROTOCOL)
        self.pending.append((event.request_id, event.branch, event.token, event.position, event.time_s,
                             event.finished, event.finish_reason, extra, result))

    def _late_handle(self, rid: str) -> Any:
        """A request that finished in the very step that took it, before ``submit`` returned its handle to
        the main thread: that thread is about to store it (no lock held across a step, so submissions never
        wait for one)."""
        deadline = time.monotonic() + 2.0
        while rid in self.submitting and time.monotonic() < deadline:
            time.sleep(0.0002)
        return self.handles.pop(rid, None)

    def after_step(self, _result: Any) -> None:
        if self.pending:
            events, self.pending = self.pending, []
            self.send(("step", self.engine.num_running(), events))

    # ---- main thread --------------------------------------------------------------------------------
    def build(self) -> None:
        from ..runtime.engine import Engine

        engine = Engine.from_config(self.config)
        engine.step_observers.append(self.after_step)
        self.engine = engine
        snap = engine.snapshot()
        info = EngineInfo(engine.model_name, snap.block_size, snap.pool_blocks, engine.max_context,
                          engine.vocab_size, snap.max_running, str(engine.checkpoint.path)
                          if engine.checkpoint is not None else "", str(engine.spec.kv_dtype),
                          int(engine.runner.store.nbytes), os.getpid())
        engine.start()
        self.send(("ready", pickle.dumps(info)))

    def sampling(self, data: bytes | None) -> Any:
        if data is None:
            return None
        from ..runtime.sampling import SamplingParams

        values = pickle.loads(data)
        spec = values.get("constraint")
        if spec is not None:
            values["constraint"] = self.constraint(spec[1], tuple(spec[2]))
        return SamplingParams(**values)

    def constraint(self, schema: Any, end_ids: tuple[int, ...]) -> Any:
        from . import structured
        from .text import TextCodec

        grammar = self._grammars.get(end_ids)
        if grammar is None:
            if self._codec is None:
                self._codec = TextCodec.from_pretrained(str(self.engine.checkpoint.path))
            grammar = self._grammars[end_ids] = structured.GrammarTokenizer(
                self._codec.tok, self.engine.vocab_size, frozenset(end_ids))
        return structured.JsonConstraint(grammar, schema)

    def submit(self, msg: list[Any]) -> None:
        _, rid, prompt, max_new, sampling, stop_ids, group, priority, salt = msg
        self.submitting.add(rid)
        try:
            params = self.sampling(sampling)
            self.handles[rid] = self.engine.submit(prompt, max_new, params, stop_token_ids=stop_ids,
                                                   trust_group=group, priority=priority, request_id=rid,
                                                   on_token=self.on_token, cache_salt=salt)
        except Exception as exc:  # noqa: BLE001 -- the request's own refusal, told to its caller
            self.handles.pop(rid, None)
            self.send(("rejected", rid, _pickle_error(exc)))
        finally:
            self.submitting.discard(rid)

    def call(self, msg: list[Any]) -> None:
        _, call_id, method, args = msg
        try:
            value = getattr(self, "call_" + method)(*pickle.loads(args))
            self.send(("reply", call_id, True, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)))
        except Exception as exc:  # noqa: BLE001 -- raised again in the caller
            self.send(("reply", call_id, False, _pickle_error(exc)))

    def call_check_request(self, prompt: Any, max_new: int, sampling: Any, kw: dict[str, Any]) -> Any:
        return self.engine.check_request(prompt, max_new, self.sampling(sampling), **kw)

    def call_largest_allowance(self, prompt: Any, sampling: Any, kw: dict[str, Any]) -> int:
        return self.engine.largest_allowance(prompt, self.sampling(sampling), **kw)

    def call_set_quota(self, group: str, max_blocks: int | None) -> None:
        self.engine.set_quota(group, max_blocks)

    def call_state(self) -> Any:
        return _Wrapped(self.engine).state()

    def call_audit(self) -> Any:
        from .backend import EngineBackend

        return EngineBackend.audit(_Wrapped(self.engine))  # type: ignore[arg-type]

    def call_reset_prefix_cache(self, reset_running: bool) -> Any:
        return self.engine.reset_prefix_cache(requeue_running=reset_running)

    def call_drain(self, timeout: float) -> bool:
        from .backend import EngineBackend

        return EngineBackend.drain(_Wrapped(self.engine), timeout)  # type: ignore[arg-type]

    def call_ping(self) -> int:
        return os.getpid()

    def serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self.inp, zmq.POLLIN)
        while True:
            if self.engine.error is not None and not self._error_sent:
                self._error_sent = True
                self.send(("error", f"{type(self.engine.error).__name__}: {self.engine.error}"))
            if not poller.poll(200):
                continue
            msg = self.dec.decode(self.inp.recv())
            kind = msg[0]
            if kind == "submit":
                self.submit(msg)
            elif kind == "cancel":
                self.engine.cancel(msg[1])
            elif kind == "call":
                self.call(msg)
            elif kind == "stop":
                self.engine.stop(timeout=10)
                self.send(("stopped",))
                return


class _Wrapped:
    """Lets this process reuse :class:`EngineBackend`'s snapshot, audit and drain over its engine."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def state(self) -> Any:
        from .backend import EngineBackend

        return EngineBackend.state(self)  # type: ignore[arg-type]


def _pickle_error(exc: BaseException) -> bytes:
    try:
        data = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(data)
        return data
    except Exception:  # noqa: BLE001 -- an exception that does not travel: its type and text do
        return pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))


def _die_with_parent() -> None:
    """Exit when the parent is gone: EOF on stdin (the parent held it open), and PR_SET_PDEATHSIG."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        try:
            while sys.stdin.buffer.read(65536):
                pass
        finally:
            os._exit(0)

    threading.Thread(target=watch, name="kvledger-parent-watch", daemon=True).start()


def main() -> None:
    """The child's entry (``python -c "...main()" IN OUT``); the config (pickled, its size on the first line)
    comes on stdin."""
    in_addr, out_addr = sys.argv[1], sys.argv[2]
    size = int(sys.stdin.buffer.readline())
    config, threads = pickle.loads(sys.stdin.buffer.read(size))
    _die_with_parent()
    from ..torch_setup import prepare_torch

    prepare_torch(threads)
    core = _Core(config, threads, in_addr, out_addr)
    try:
        core.build()
    except Exception as exc:  # noqa: BLE001 -- the parent raises it as the CLI's one line
        core.send(("failed", _pickle_error(exc)))
        core.out.close(linger=5000)
        sys.exit(3)
    core.serve()
    core.inp.close(linger=0)
    core.out.close(linger=5000)  # the "stopped" message goes out before this returns
    os._exit(0)

