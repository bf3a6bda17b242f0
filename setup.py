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
    """A failed compile is one warning, never a failed install: the extension is then left out."""

    def initialize_options(self) -> None:
        super().initialize_options()
        self.failed: set[str] = set()

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 -- any failure: fall back to the pure-Python core
            self._warn(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self.failed.add(ext.name)
            self._warn(exc)

    def _built(self) -> list[Extension]:
        return [ext for ext in self.extensions if ext.name not in self.failed]

    # What comes after the compile (in-place copy, editable and wheel file lists) sees built ones only.
    def copy_extensions_to_source(self) -> None:
        kept, self.extensions = self.extensions, self._built()
        try:
            super().copy_extensions_to_source()
        finally:
            self.extensions = kept

    def get_outputs(self) -> list[str]:
        kept, self.extensions = self.extensions, self._built()
        try:
            return super().get_outputs()
        finally:
            self.extensions = kept

    def get_output_mapping(self) -> dict[str, str]:
        kept, self.extensions = self.extensions, self._built()
        try:
            return super().get_output_mapping()
        finally:
            self.extensions = kept

    def _warn(self, exc: BaseException) -> None:
        if getattr(self, "_warned", False):
            return
        self._warned = True
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"WARNING: kvledger: the native core was not built ({first[:200]}); the pure-Python core is used",
              file=sys.stderr)


extensions = []
if os.environ.get("KVLEDGER_NATIVE", "1") != "0":
    extensions.append(Extension(
        "kvledger.core._native", ["src/kvledger/core/_native.c"],
        # no fused multiply-add: the policies' float keys must round as the pure-Python ones do
        extra_compile_args=["-O3", "-ffp-contract=off"] if os.name == "posix" else [],
    ))

setup(ext_modules=extensions, cmdclass={"build_ext": OptionalBuildExt})
