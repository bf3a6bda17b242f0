"""`kvledger simulate` and `kvledger calibrate`: the simulator's faces (heavy imports lazily)."""

from __future__ import annotations

import click

from ..errors import ConfigError


@click.command("simulate")
def simulate_cmd() -> None:
    """Simulate a trace on a model, GPU and policy (being built)."""
    raise ConfigError("simulate is not available yet")


@click.command("calibrate")
def calibrate_cmd() -> None:
    """Fit the cpu-local cost profile by measuring the real runtime (being built)."""
    raise ConfigError("calibrate is not available yet")
