"""Bundled model configs: subsets of published Hugging Face `config.json` files.

They live as JSON under `kvledger/data/models/` and are read through `importlib.resources`, so
they work from a source checkout, an installed wheel or a zip. Each carries a `_source` key
naming the Hugging Face repository its numbers come from; HF ignores underscore keys and so do we.
"""

from __future__ import annotations

import json
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from ...errors import ConfigError

_SUFFIX = ".json"
MAX_CONFIG_BYTES = 16 * 2**20  # a config.json is a few KiB; anything this large is not one


def _models_dir() -> Traversable:
    return resources.files("kvledger").joinpath("data", "models")


def list_models() -> list[str]:
    """Short names of the bundled model configs, sorted."""
    folder = _models_dir()
    if not folder.is_dir():
        return []
    return sorted(p.name[: -len(_SUFFIX)] for p in folder.iterdir() if p.name.endswith(_SUFFIX))


def _parse(text: str, origin: str) -> dict[str, Any]:
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{origin} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        ) from None
    except RecursionError:
        raise ConfigError(f"{origin} is nested too deeply to be a model config") from None
    except ValueError as exc:  # e.g. an integer past Python's 4,300-digit conversion limit
        raise ConfigError(f"{origin} is not usable JSON: {str(exc)[:100]}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{origin} must hold a JSON object, got a {type(cfg).__name__}")
    return cfg


def _bundled(name: str) -> dict[str, Any]:
    resource = _models_dir().joinpath(name + _SUFFIX)
    return _parse(resource.read_text(encoding="utf-8"), f"bundled model config {name!r}")


def load_model_config(name_or_path: str | Path) -> dict[str, Any]:
    """Load a model config: a bundled short name (see `list_models`), a `config.json` path, or a
    directory holding `config.json` (a downloaded Hugging Face snapshot)."""
    text = str(name_or_path)
    if text in list_models():
        return _bundled(text)
    path = Path(text).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            if path.stat().st_size > MAX_CONFIG_BYTES:
                raise ConfigError(f"model config {path} is larger than {MAX_CONFIG_BYTES // 2**20} MiB")
            raw = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read model config {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"model config {path} is not UTF-8 text") from None
        return _parse(raw, str(path))
    # Something shaped like a path gets a path error; a bare word gets the list of names.
    if path.suffix == _SUFFIX or "/" in text or path.exists():
        raise ConfigError(f"no model config at {path}")
    known = ", ".join(list_models()) or "none"
    raise ConfigError(f"unknown model {text!r}; bundled models are: {known} (or give a path to config.json)")


def model_source(name: str) -> str:
    """Where a bundled config's numbers come from (a Hugging Face repo id), or the file path for
    a config loaded from disk."""
    if name in list_models():
        return str(_bundled(name).get("_source", "unknown source"))
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "config.json"
    load_model_config(path)  # raises the same clear errors as loading would
    return str(path.resolve())


__all__ = ["list_models", "load_model_config", "model_source"]
