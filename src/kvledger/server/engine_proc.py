""":class:`ProcessBackend`: the server's :class:`~kvledger.server.backend.Backend` over an engine in a
process of its own (:mod:`kvledger.server.engine_core`), so the HTTP loop and the engine loop never wait
for one interpreter lock.

Requests and cancels go out fire-and-forget on a ZeroMQ socket; a request the engine refuses at
submission comes back as a finished request whose result raises the engine's own error (the server
answers it as the in-process engine's refusal). Each engine step comes back as one message with every
request's new tokens; a receiver thread hands each event to its request's ``on_token`` callback (the
server's bridge to the event loop), so the callbacks see exactly the engine's events: a request's result
is complete before its ``finished`` event arrives. ``check_request``, ``largest_allowance``, ``set_quota``,
``state``, ``audit``, ``reset_prefix_cache`` and ``drain`` are request/reply calls with a timeout.

A child that dies (killed, out of memory, a crash) is noticed within a fraction of a second: every request
in flight ends with :class:`~kvledger.server.serving.EngineFailed` (a 500 or an SSE error event), every
later call raises it, and ``error`` is set (``/health`` answers 503). A child never outlives this process
(see :mod:`~kvledger.server.engine_core`), and :meth:`stop` (or this object's finalizer) ends it.
"""

from __future__ import annotations

import itertools
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .backend import BackendState
from .engine_core import EngineInfo, sampling_to_wire
from .serving import EngineFailed

# Not ``-m``: the child's classes must be pickled under their module's name, not ``__main__``'s.
_CHILD = "from kvledger.server.engine_core import main; main()"
_POLL_MS = 100  # how often the receiver checks that the child is alive while it hears nothing


@dataclass(slots=True)
class ProcessHandle:
    """A request in the child: its callback, and its result once the child says it finished."""

    request_id: str
    on_token: Callable[[Any], None] | None
    _result: Any = None
    _error: BaseException | None = None

    def done(self) -> bool:
        return self._result is not None or self._error is not None

    def result(self, timeout: float | None = None) -> Any:
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise RuntimeError(f"request {self.request_id!r} has not finished")
        return self._result


@dataclass(slots=True)
class _Waiter:
    event: threading.Event = field(default_factory=threading.Event)
    reply: tuple[bool, bytes] | None = None


def _end_child(proc: subprocess.Popen[bytes], tmp: str) -> None:
    """The finalizer: the child goes however this object goes (closing its stdin tells it, then a kill)."""
    try:
        if proc.stdin is not None:
            proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    shutil.rmtree(tmp, ignore_errors=True)


class ProcessBackend:
    """:class:`Backend` over :class:`~kvledger.runtime.engine.Engine` built from ``config`` in a child
    process with ``threads`` torch threads. Blocks until the engine is built (its errors raise here)."""

    supports_constraints = True  # response_format grammars cross as their schema and compile in the child
    remote = True  # check_request and largest_allowance are round trips: the app calls them off its loop

    def __init__(self, config: Any, threads: int | None = None, *, start_timeout: float = 900.0,
                 call_timeout: float = 60.0) -> None:
        import msgspec
        import zmq

        self.call_timeout = call_timeout
        self._tmp = tempfile.mkdtemp(prefix="kvledger-engine-")
        in_addr, out_addr = f"ipc://{self._tmp}/in", f"ipc://{self._tmp}/out"
        self._zctx = zmq.Context()
        self._inp = self._zctx.socket(zmq.PUSH)
        self._inp.setsockopt(zmq.SNDHWM, 0)
        self._inp.setsockopt(zmq.LINGER, 0)
        self._inp.bind(in_addr)
        self._out = self._zctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(out_addr)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder()
        self._send_lock = threading.Lock()
        self._handles: dict[str, ProcessHandle] = {}
        self._calls: dict[int, _Waiter] = {}
        self._ids = itertools.count()
        self._running = 0
        self._error: BaseException | None = None
        self._closing = False
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, in_addr, out_addr],
                                     stdin=subprocess.PIPE)
        self._finalizer = weakref.finalize(self, _end_child, self.proc, self._tmp)
        try:
            assert self.proc.stdin is not None
            payload = pickle.dumps((config, threads), protocol=pickle.HIGHEST_PROTOCOL)
            self.proc.stdin.write(f"{len(payload)}\n".encode() + payload)
            self.proc.stdin.flush()  # stdin stays open: its EOF is how the child learns this process is gone
            info = self._wait_ready(start_timeout)
        except BaseException:
            self._finalizer()
            self._close_sockets()
            raise
        self.info = info
        self.model_name = info.model_name
        self.block_size = info.block_size
        self.pool_blocks = info.pool_blocks
        self.max_context = info.max_context
        self.vocab_size = info.vocab_size
        self.max_num_seqs = info.max_num_seqs
        self._receiver = threading.Thread(target=self._receive, name="kvledger-engine-output", daemon=True)
        self._receiver.start()

    def _wait_ready(self, timeout: float) -> EngineInfo:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._out.poll(_POLL_MS):
                msg = self._dec.decode(self._out.recv())
                if msg[0] == "ready":
                    return pickle.loads(msg[1])
                if msg[0] == "failed":
                    raise pickle.loads(msg[1])
            elif self.proc.poll() is not None:
                raise ConfigError(f"the engine process exited with code {self.proc.returncode} before it was ready")
        raise ConfigError(f"the engine process was not ready after {timeout:g} s")

    # ---- the channel -------------------------------------------------------------------------------
    def _send(self, msg: tuple[Any, ...]) -> None:
        if self._error is not None:
            raise EngineFailed(f"the engine stopped: {self._error}")
        data = self._enc.encode(msg)
        with self._send_lock:
            self._inp.send(data, copy=False)

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        waiter = _Waiter()
        call_id = next(self._ids)
        self._calls[call_id] = waiter
        try:
            self._send(("call", call_id, method, pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)))
            limit = self.call_timeout if timeout is None else timeout
            if not waiter.event.wait(limit):
                raise TimeoutError(f"the engine process did not answer {method} within {limit:g} s")
        finally:
            self._calls.pop(call_id, None)
        if waiter.reply is None:  # woken by the child's death
            raise EngineFailed(f"the engine stopped: {self._error}")
        ok, payload = waiter.reply
        value = pickle.loads(payload)
        if ok:
            return value
        raise value

    def _receive(self) -> None:
        """The receiver thread: every message from the child, until it stops or dies."""
        out, dec = self._out, self._dec
        try:
            while not self._closing:
                if not out.poll(_POLL_MS):
                    if self.proc.poll() is not None:
                        break
                    continue
                msg = dec.decode(out.recv())
                kind = msg[0]
                if kind == "step":
                    self._running = msg[1]
                    for event in msg[2]:
                        self._deliver(*event)
                elif kind == "reply":
                    waiter = self._calls.get(msg[1])
                    if waiter is not None:
                        waiter.reply = (msg[2], msg[3])
                        waiter.event.set()
                elif kind == "rejected":
                    self._reject(msg[1], pickle.loads(msg[2]))
                elif kind == "error":
                    self._error = RuntimeError(msg[1])
                elif kind == "stopped":
                    return
        except Exception as exc:  # noqa: BLE001 -- a broken channel is a dead engine to the server
            self._error = RuntimeError(f"the channel to the engine process failed: {exc}")
        if not self._closing:
            code = self.proc.poll()
            self._died(f"the engine process exited with code {code}" if code is not None else
                       str(self._error or "the engine process stopped answering"))

    def _deliver(self, rid: str, branch: int, token: int | None, position: int, time_s: float, finished: bool,
                 reason: str | None, extra: bytes | None, result: bytes | None) -> None:
        from ..runtime.handles import TokenEvent

        handle = self._handles.get(rid)
        if handle is None:
            return
        logprobs = prompt_logprobs = None
        if extra is not None:
            logprobs, prompt_logprobs = pickle.loads(extra)
        if finished:
            self._handles.pop(rid, None)
            if result is not None:
                handle._result = pickle.loads(result)
            else:
                handle._error = EngineFailed(f"request {rid} ended without a result")
        self._notify(handle, TokenEvent(rid, branch, token, position, time_s, finished, reason, logprobs,
                                        prompt_logprobs))

    def _notify(self, handle: ProcessHandle, event: Any) -> None:
        if handle.on_token is None:
            return
        try:
            handle.on_token(event)
        except Exception:  # noqa: BLE001 -- as the engine does: a callback that raises ends its request only
            if not event.finished:
                self.cancel(handle.request_id)

    def _reject(self, rid: str, error: BaseException) -> None:
        """The child's engine refused a submission: the request ends at once, its result raising why."""
        from ..runtime.handles import TokenEvent

        handle = self._handles.pop(rid, None)
        if handle is not None:
            handle._error = error
            self._notify(handle, TokenEvent(rid, 0, None, 0, time.perf_counter(), True, "rejected"))

    def _died(self, why: str) -> None:
        from ..runtime.handles import TokenEvent

        self._error = self._error if isinstance(self._error, EngineFailed) else EngineFailed(why)
        for waiter in list(self._calls.values()):
            waiter.event.set()
        for rid in list(self._handles):
            handle = self._handles.pop(rid)
            handle._error = EngineFailed(f"the engine stopped: {why}")
            self._notify(handle, TokenEvent(rid, 0, None, 0, time.perf_counter(), True, "abort"))

    # ---- Backend ----------------------------------------------------------------------------------
    @property
    def error(self) -> BaseException | None:
        return self._error

    def check_request(self, prompt: Sequence[int], max_new_tokens: int, sampling: Any = None, *,
                      trust_group: str = "default", request_id: str = "check",
                      cache_salt: str | None = None) -> tuple[list[int], int, Any]:
        kw = {"trust_group": trust_group, "request_id": request_id, "cache_salt": cache_salt}
        return self._call("check_request", list(prompt), max_new_tokens, sampling_to_wire(sampling), kw)

    def largest_allowance(self, prompt: Sequence[int], sampling: Any = None, *, trust_group: str = "default",
                          cache_salt: str | None = None) -> int:
        kw = {"trust_group": trust_group, "cache_salt": cache_salt}
        return self._call("largest_allowance", list(prompt), sampling_to_wire(sampling), kw)

    def submit(self, prompt: Sequence[int], max_new_tokens: int, sampling: Any = None, *,
               stop_token_ids: Sequence[int] = (), trust_group: str = "default", priority: int = 0,
               request_id: str | None = None, on_token: Callable[[Any], None] | None = None,
               cache_salt: str | None = None) -> ProcessHandle:
        rid = request_id if request_id is not None else f"proc-{next(self._ids)}"
        if rid in self._handles:
            raise ConfigError(f"request id {rid!r} was already submitted")
        handle = ProcessHandle(rid, on_token)
        self._handles[rid] = handle
        try:
            self._send(("submit", rid, [int(t) for t in prompt], int(max_new_tokens), sampling_to_wire(sampling),
                        [int(t) for t in stop_token_ids], trust_group, int(priority), cache_salt))
        except BaseException:
            self._handles.pop(rid, None)
            raise
        return handle

    def cancel(self, request_id: str) -> bool:
        if request_id not in self._handles or self._error is not None:
            return False
        self._send(("cancel", request_id))
        return True

    def set_quota(self, trust_group: str, max_blocks: int | None) -> None:
        self._call("set_quota", trust_group, max_blocks)

    def num_running(self) -> int:
        return self._running  # as of the child's last step: one read, no round trip

    def state(self) -> BackendState:
        return self._call("state")

    def audit(self) -> dict[str, Any]:
        return self._call("audit")

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> Any:
        return self._call("reset_prefix_cache", reset_running_requests)

    def start(self) -> None:
        """The child's engine runs from the moment it is ready."""

    def drain(self, timeout: float) -> bool:
        if self._error is not None:
            return False
        try:
            return bool(self._call("drain", timeout, timeout=timeout + self.call_timeout))
        except (EngineFailed, TimeoutError):
            return False

    def stop(self) -> None:
        """Stop the child's engine and wait for the child to exit (killed past 15 s); idempotent."""
        if self.proc.poll() is None and self._error is None:
            try:
                self._send(("stop",))
            except EngineFailed:
                pass
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        self._closing = True
        self._finalizer()
        self._receiver.join(5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._inp, self._out):
            sock.close(linger=0)
        self._zctx.term()


__all__ = ["ProcessBackend", "ProcessHandle"]
