"""Optional C++ CPU kernels (paged decode attention, KV write, RMSNorm, RoPE), built once, loaded if present.

``make install`` runs ``python -m kvledger.runtime.native build``, which compiles ``csrc/kvledger_native.cpp``
with torch's C++ extension tooling (ninja + the system C++ compiler, ``-O3 -march=native``) into a folder
keyed by everything the binary depends on: the source, the torch and Python versions, the flags and the
CPU's instruction-set flags. At run time :func:`load` only imports that binary; it never compiles. When
it is missing (no compiler at install time, another CPU, ``KVLEDGER_NATIVE=0``) the runtime uses its
pure-torch paths, which compute the same thing; :func:`status` says which is active and why.

Where the binary lives: ``$KVLEDGER_NATIVE_DIR`` if set, else ``_build/`` beside this file when that is
writable (an editable install: one per checkout), else ``<kvledger cache>/native/``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import sys
import threading
from pathlib import Path
from types import ModuleType

from ...errors import ConfigError

NATIVE_ENV = "KVLEDGER_NATIVE"  # "0" = never load the kernels (pure torch)
DIR_ENV = "KVLEDGER_NATIVE_DIR"
SOURCE = Path(__file__).resolve().parent / "csrc" / "kvledger_native.cpp"
HEADERS = tuple(sorted(SOURCE.parent.glob("*.h")))  # included by SOURCE: part of what the binary depends on
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")
LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> str:
    """The CPU's instruction-set flags (the binary is built with -march=native)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_key() -> str:
    import torch

    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), *(hdr.read_bytes() for hdr in HEADERS), torch.__version__.encode(),
                 sys.version.encode(), platform.machine().encode(),
                 " ".join(CFLAGS + LDFLAGS).encode(), _cpu_flags().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def module_name() -> str:
    return f"kvledger_native_{build_key()}"


def build_root() -> Path:
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV]).expanduser()
    local = Path(__file__).resolve().parent / "_build"
    parent = local if local.exists() else local.parent
    if os.access(parent, os.W_OK):
        return local
    from ..weights import cache_root

    return cache_root() / "native"


def binary_path() -> Path:
    name = module_name()
    return build_root() / name / f"{name}.so"


def _import(path: Path, name: str) -> ModuleType:
    import torch  # noqa: F401 -- libtorch must be loaded before the extension resolves its symbols

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(verbose: bool = False) -> Path:
    """Compile the kernels for this machine (idempotent: an up-to-date build is reused)."""
    import torch.utils.cpp_extension as cpp

    try:
        import ninja  # the PyPI package ships the binary; put it on PATH for torch's build driver

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    name = module_name()
    folder = build_root() / name
    folder.mkdir(parents=True, exist_ok=True)
    cpp.load(name=name, sources=[str(SOURCE)], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
             build_directory=str(folder), verbose=verbose, with_cuda=False)
    path = folder / f"{name}.so"
    if not path.exists():
        raise ConfigError(f"the native build finished but {path} is missing")
    with _lock:
        _state.clear()  # the next load() picks up the fresh binary
    return path


def load() -> ModuleType | None:
    """The compiled kernels, or None (then :func:`status` says why). Never compiles."""
    with _lock:
        if "module" in _state:
            return _state["module"]  # type: ignore[return-value]
        module: ModuleType | None = None
        if os.environ.get(NATIVE_ENV, "1") == "0":
            reason = f"disabled by {NATIVE_ENV}=0"
        else:
            try:
                path = binary_path()
                if not path.exists():
                    reason = f"not built for this machine (run `make install` or `python -m {__name__} build`)"
                else:
                    module = _import(path, module_name())
                    reason = f"loaded {path}"
            except Exception as exc:  # noqa: BLE001 -- any failure means: use the torch paths
                reason = f"failed to load: {str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}"
                module = None
        _state["module"], _state["reason"] = module, reason
        return module


def available() -> bool:
    return load() is not None


def status() -> str:
    load()
    return str(_state["reason"])


def require() -> ModuleType:
    """The kernels, or a :class:`ConfigError` saying why they are unavailable."""
    module = load()
    if module is None:
        raise ConfigError(f"the native CPU kernels are unavailable: {status()}")
    return module


__all__ = ["DIR_ENV", "NATIVE_ENV", "available", "binary_path", "build", "build_key", "load", "require", "status"]
