"""The OpenAI-compatible server (FastAPI + uvicorn).

``create_app(backend, codec, tenants, settings)`` builds the app over any engine-like
:class:`~kvledger.server.backend.Backend`; ``kvledger serve`` runs it over one local engine, and
``kvledger bench serve`` (:mod:`kvledger.loadgen`: a client beside the server package, which replays
traces read by :mod:`kvledger.workloads`; the server itself never imports the simulator) measures any
OpenAI-compatible server.
Imports stay lazy: importing this package does not load FastAPI or torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def create_app(*args: Any, **kwargs: Any) -> Any:
    from .app import create_app as _create_app

    return _create_app(*args, **kwargs)
