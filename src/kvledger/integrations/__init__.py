"""Bridges to engines kvledger does not run itself (vLLM). Optional: nothing in the core, the scheduler or
the placement package imports them, and each imports its third-party packages lazily, naming the extra
that provides them when they are missing."""
