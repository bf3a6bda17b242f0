"""How a process that runs the engine sets torch up, before torch starts OpenMP: one owner for the CLI's engine
commands and the server's engine process (which is not a CLI command, so it cannot read ``cli``)."""

from __future__ import annotations

import os


def prepare_torch(threads: int | None = None) -> None:
    """Passive OpenMP waits (on shared cores, spinning worker threads wait for each other's time slices and a
    small matmul can take 100x longer), quiet profiler and transformers logs, then ``threads`` CPU threads.
    The environment settings have no effect once torch is running; the thread count always does."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
