"""`kvledger lab`: serve the prefix ownership lab in a browser. FastAPI and uvicorn are imported only when
the command runs, so the other commands stay fast."""

from __future__ import annotations

import click

from .options import epilog


@click.command("lab", epilog=epilog(
    "kvledger lab --open                  # http://127.0.0.1:8765/ in the default browser",
    "kvledger lab --port 0                # any free port; the URL is printed",
))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback makes the lab reachable from other machines.")
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True,
              help="Port to listen on; 0 picks a free one (the URL is printed).")
@click.option("--open", "open_browser", is_flag=True, help="Open the lab in the default web browser.")
def lab_cmd(host: str, port: int, open_browser: bool) -> None:
    """Serve the prefix ownership lab: predict, reveal and explain admissions on the real ledger."""
    from ..weblab.server import serve

    serve(host, port, open_browser)
