"""Typed errors. The CLI turns every `KVLedgerError` into one line on stderr and exit code 2."""

from __future__ import annotations


class KVLedgerError(Exception):
    """Base class of every error kvledger raises on purpose."""


class ConfigError(KVLedgerError, ValueError):
    """A model, geometry, size or option that cannot be used as given."""


class AdmissionError(KVLedgerError):
    """A request that cannot be admitted (now, or ever)."""


class QuotaError(AdmissionError):
    """A request its trust group's quota can never hold (larger than the cap on its own)."""


class OutOfBlocksError(KVLedgerError):
    """Growth needed a block that neither a promise nor free/evictable capacity can supply."""


class LedgerError(KVLedgerError):
    """A ledger operation that breaks the ledger's rules (unknown sequence, double release, ...)."""


class InvariantError(LedgerError, AssertionError):
    """A conservation law does not hold: a bug in kvledger, never a user error."""
