"""Builds the ledger core's optional C part, ``kvledger.core._native`` (metadata lives in pyproject.toml).

The package is complete without it: when there is no C compiler, or the build fails, the install goes on
with one warning and the ledger uses its pure-Python core (same results). ``KVLEDGER_NATIVE=0`` at
install time skips the build.
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """A failed compile is a warning, never a failed install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 -- any failure: fall back to the pure-Python core
            self._warn(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self._warn(exc)

    @staticmethod
    def _warn(exc: BaseException) -> None:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"WARNING: kvledger: the native core was not built ({first}); the pure-Python core is used",
              file=sys.stderr)


extensions = []
if os.environ.get("KVLEDGER_NATIVE", "1") != "0":
    extensions.append(Extension(
        "kvledger.core._native", ["src/kvledger/core/_native.c"],
        extra_compile_args=["-O3"] if os.name == "posix" else [],
    ))

setup(ext_modules=extensions, cmdclass={"build_ext": OptionalBuildExt})
