"""kvledger: KV-cache memory ledger, admission and planning for concurrent LLM generation."""

from __future__ import annotations

__version__ = "0.1.0"
