"""The ledger core's optional C part: whether the hot paths use it, and why (not).

``kvledger.core._native`` (``_native.c`` beside this file) is a plain CPython extension built by
``pip install`` / ``make install`` when a C compiler is present (``setup.py``; a failed build is a
warning, never a failed install). It computes exactly what the pure-Python core computes -- the tests
run both on the same operation sequences -- only faster: the chained BLAKE2b over a prompt in one
call, and the per-block bookkeeping of allocation and release.

``KVLEDGER_NATIVE=0`` switches it off (as it does the runtime's kernels); a build for another
interface version (a stale binary left by an older checkout) is ignored. :data:`MODULE` is read when a
ledger (its pool, its LRU policy) is built -- the ledger keeps what it found, so two ledgers built
either side of a swap run on different cores, which is how the tests compare them -- and by
``identity.chain_digests`` at each call.

:func:`main` prints which core is in use (``make install`` runs it, so a failed build is reported once,
in one line).
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

NATIVE_ENV = "KVLEDGER_NATIVE"  # "0" = never use the C part
ABI = 3  # the interface version this Python code expects (NATIVE_ABI in _native.c)


def _load() -> tuple[ModuleType | None, str]:
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return None, f"disabled by {NATIVE_ENV}=0"
    try:
        from . import _native  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, f"not built ({str(exc).splitlines()[0][:160] if str(exc) else 'no binary'})"
    abi = getattr(_native, "ABI", None)
    if abi != ABI:
        return None, f"stale build (interface {abi}, this code needs {ABI}): run `make install` again"
    return _native, f"loaded {getattr(_native, '__file__', '_native')}"


MODULE, REASON = _load()


def available() -> bool:
    return MODULE is not None


def status() -> str:
    """One line: which core the ledger uses and why."""
    if MODULE is not None:
        return f"native core in use ({REASON})"
    return f"pure-Python core in use: native part {REASON}"


def main() -> int:
    if MODULE is None and REASON.startswith(("not built", "stale")):
        print(f"WARNING: kvledger: {status()}; results are identical, the ledger is slower", file=sys.stderr)
    else:
        print(f"kvledger: {status()}")
    return 0
