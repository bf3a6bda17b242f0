"""The prefix ownership lab as a web application: a FastAPI app whose JSON endpoints run the real ledger
and scheduler, and a static page (HTML, CSS and JavaScript shipped in this package, nothing fetched from
elsewhere) that is only a view over them. `kvledger lab` serves it.

FastAPI and uvicorn are imported only here, so the rest of kvledger never needs them.
"""

from __future__ import annotations

from .app import create_app

__all__ = ["create_app"]
