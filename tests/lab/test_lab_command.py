"""`kvledger lab`: serves on loopback, reports the port it got, stops on Ctrl-C, opens a browser on request,
and turns a busy port or a bad flag into one line and exit code 2."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

from kvledger.cli.main import main
from kvledger.weblab import server as lab_server_module


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 -- a loopback URL we started
        return r.status, r.read().decode()


def test_lab_serves_the_page_and_the_api_then_stops_on_ctrl_c(start_lab_server):
    server = start_lab_server()
    status, page = _get(server.url)
    assert status == 200 and "Prefix ownership lab" in page
    status, body = _get(server.url + "api/health")
    assert (status, json.loads(body)) == (200, {"status": "ok"})
    body = {"layers": 32, "kv_heads": 8, "head_dim": 128, "pool": "512MiB", "shared_prefix": 2048}
    request = urllib.request.Request(server.url + "api/admit", method="POST", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:  # noqa: S310
        got = json.loads(r.read())
    assert (got["admitted"], got["admitted_blocks"], got["free_blocks_after"]) == (7, 247, 9)
    assert server.stop() == 130  # Ctrl-C, as for every kvledger command
    assert "Traceback" not in "".join(server.stderr)


def test_a_busy_port_is_one_line(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["lab", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err == f"kvledger: error: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_a_bad_port_is_one_line(capsys):
    assert main(["lab", "--port", "70000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvledger: error: Invalid value for '--port'") and err.count("\n") == 1


def test_open_points_the_browser_at_the_lab_once_it_serves(monkeypatch):
    opened: list[str] = []
    monkeypatch.setattr(lab_server_module.webbrowser, "open", opened.append)
    server, sock, url = lab_server_module.make_server("127.0.0.1", 0, open_browser=True)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not opened and time.monotonic() < deadline:
            time.sleep(0.05)
        assert opened == [url] and url.startswith("http://127.0.0.1:")
        assert _get(url + "api/health")[0] == 200  # it was serving when the browser was pointed at it
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        sock.close()
    assert not thread.is_alive()


def test_only_loopback_counts_as_local():
    assert lab_server_module.is_loopback("127.0.0.1") and lab_server_module.is_loopback("::1")
    assert lab_server_module.is_loopback("localhost")
    assert not lab_server_module.is_loopback("0.0.0.0") and not lab_server_module.is_loopback("10.1.2.3")


def test_lab_help_lists_its_options(capsys):
    assert main(["lab", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--open", "127.0.0.1", "8765"):
        assert flag in out


def test_ctrl_c_is_exit_130_even_when_asyncio_swallows_the_reraised_signal(monkeypatch, capsys):
    """uvicorn stops on SIGINT and re-raises it as it returns; asyncio.run can turn that into a cancel of
    a task that is already finishing, and then `run()` simply returns. The command exited 0 then (a flaky
    Ctrl-C test under load); a server that stopped on a signal is now always exit code 130."""
    class StoppedBySignal:
        should_exit = False

        def run(self, sockets):
            self.should_exit = True  # what uvicorn's signal handler sets; the interrupt itself is lost

    sock = socket.socket()
    monkeypatch.setattr(lab_server_module, "make_server",
                        lambda host, port, open_browser=False: (StoppedBySignal(), sock, "http://127.0.0.1:1/"))
    assert main(["lab", "--port", "0"]) == 130
    assert sock.fileno() == -1  # the listening socket was closed
    assert "Traceback" not in capsys.readouterr().err
