"""Running the app: bind, serve with uvicorn, and shut down cleanly.

Shutdown (SIGTERM or Ctrl-C): the server stops accepting at once (new generation requests on open
connections get 503), lets running requests finish for up to ``drain_timeout`` seconds, cancels what is
left (their blocks come back at the engine's next safe point), waits for the engine to go idle, audits
the ledger (every conservation law, nothing active, promised or leased) and reports it in one line.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import signal
import socket
import sys
from typing import Any

import uvicorn
from fastapi import FastAPI

from ..errors import ConfigError
from .app import ServerContext


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (``port`` 0: any free port; read it back from the socket)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {port!r}")
    try:
        family = socket.AF_INET6 if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address) else socket.AF_INET
    except ValueError:
        family = socket.AF_INET  # a host name such as localhost
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    """uvicorn, plus: from the first signal on the app refuses new generation requests, and after
    ``drain_timeout`` seconds it cancels what still runs -- in the engine, so every response then ends
    normally (finish_reason abort) and uvicorn never has to kill a task."""

    def __init__(self, config: uvicorn.Config, ctx: ServerContext, drain_timeout: float) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.ctx.draining and self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.call_later, self.drain_timeout, self.ctx.cancel_all)
        self.ctx.draining = True
        super().handle_exit(sig, frame)


def serve(app: FastAPI, sock: socket.socket, *, drain_timeout: float = 30.0, log_level: str = "warning",
          echo: Any = None) -> dict[str, Any]:
    """Serve until a signal; then drain, audit and return the shutdown report."""
    ctx: ServerContext = app.state.kvledger
    say = echo or (lambda line: print(line, file=sys.stderr, flush=True))
    # uvicorn's own limit is only a backstop: the server cancels in the engine at drain_timeout first.
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=drain_timeout + 30,
                            access_log=log_level in ("info", "debug", "trace"), lifespan="off")
    server = _Server(config, ctx, drain_timeout)
    # uvicorn re-raises the signal it caught once it is done; these handlers receive it (and any further
    # SIGTERM during the drain, which is bounded anyway), so the drain and the audit always run.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            asyncio.run(server.serve(sockets=[sock]))
        finally:
            sock.close()
            ctx.close()
        say("kvledger serve: stopped accepting; cancelling what did not finish and draining the engine")
        for run in list(ctx.runs):
            run.cancel()
        backend = ctx.backend
        drained = backend.drain(timeout=max(5.0, drain_timeout))
        report: dict[str, Any] = {"drained": drained}
        try:
            report.update(backend.audit())
        except Exception as exc:  # noqa: BLE001 -- reported, and the exit code says it
            report.update(clean=False, error=str(exc))
        backend.stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    state = "clean" if report.get("clean") else "NOT clean"
    say(f"kvledger serve: ledger {state} at exit: " + json.dumps(report, sort_keys=True))
    return report


__all__ = ["bind", "serve"]
