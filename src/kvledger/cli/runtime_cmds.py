"""`kvledger generate` and `kvledger serve-trace`: the real runtime's faces (torch imported lazily)."""

from __future__ import annotations

import click

from ..errors import ConfigError


@click.command("generate")
def generate_cmd() -> None:
    """Generate text with the real runtime (being built)."""
    raise ConfigError("generate is not available yet")


@click.command("serve-trace")
def serve_trace_cmd() -> None:
    """Replay a slice of a real trace through the engine (being built)."""
    raise ConfigError("serve-trace is not available yet")
