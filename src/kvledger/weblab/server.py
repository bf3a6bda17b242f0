"""Serve the web lab with uvicorn on a socket we bind ourselves, so that `--port 0` can report the port the
system chose and a busy port is one clear error instead of a traceback."""

from __future__ import annotations

import ipaddress
import socket
import sys
import threading
import time
import webbrowser

import uvicorn

from ..errors import ConfigError
from .app import create_app


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0 picks a free port)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot resolve host {host!r}: {exc.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url_for(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/"


def make_server(host: str, port: int, open_browser: bool = False) -> tuple[uvicorn.Server, socket.socket, str]:
    """A uvicorn server for the lab on a bound socket, and its URL. With ``open_browser`` the default web
    browser is pointed at the URL once the server has started."""
    sock = bind(host, port)
    url = url_for(sock)
    config = uvicorn.Config(create_app(), log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    if open_browser:
        def _open() -> None:
            while not server.started and not server.should_exit:
                time.sleep(0.05)
            if server.started:
                webbrowser.open(url)
        threading.Thread(target=_open, name="kvledger-lab-open", daemon=True).start()
    return server, sock, url


def serve(host: str, port: int, open_browser: bool = False) -> None:
    """Run the lab until interrupted; prints one line with the URL first."""
    server, sock, url = make_server(host, port, open_browser)
    if not is_loopback(host):
        print(f"kvledger lab: warning: listening on {host}, reachable from other machines; the lab has no "
              f"authentication", file=sys.stderr)
    print(f"kvledger lab: serving on {url} (Ctrl-C stops it)", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if server.should_exit:
        # Stopped by Ctrl-C. uvicorn re-raises the signal as it returns, but asyncio.run turns that into a
        # cancellation of a task that is already finishing, so the interrupt is lost now and then and the
        # command exited 0; say it ourselves (exit code 130, as every kvledger command).
        raise KeyboardInterrupt
