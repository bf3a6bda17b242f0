"""Bundled model configs: subsets of published Hugging Face `config.json` files.

They live as JSON under `kvledger/data/models/` and are read through `importlib.resources`, so
they work from a source checkout, an installed wheel or a zip. Each carries a `_source` key
naming the Hugging Face repository its numbers come from; HF ignores underscore keys and so do we.
"""

from __future__ import annotations

import difflib
import json
import re
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


def _hf_key(text: str) -> str:
    """The part of a model name that picks its config: a Hugging Face id without its organisation, case,
    ``Meta-`` prefix or instruction-tuned suffix (``meta-llama/Meta-Llama-3.1-8B-Instruct`` -> ``llama-3.1-8b``;
    the tuned model shares its base's config.json)."""
    name = text.strip().split()[0].lower().rsplit("/", 1)[-1] if text.strip() else ""
    name = name.removeprefix("meta-")
    return re.sub(r"-(instruct|chat|it)(?=-|$)", "", name)


def resolve_model_name(text: str) -> str | None:
    """The bundled config a name or Hugging Face id means (case-insensitive: ``meta-llama/Llama-3.1-8B``,
    ``Llama-3.1-8B-Instruct`` and ``meta-llama/Meta-Llama-3.1-8B`` are ``llama-3.1-8b``), or None."""
    if not isinstance(text, str) or len(text) > 200:
        return None
    names = list_models()
    if text.strip().lower() in names:
        return text.strip().lower()
    key = _hf_key(text)
    for name in names:
        if key in (name, _hf_key(str(_bundled(name).get("_source", "")))):
            return name
    return None


def closest_models(text: str, n: int = 3) -> list[str]:
    """The bundled names nearest to ``text`` (difflib), for an error that says what was probably meant."""
    return difflib.get_close_matches(_hf_key(text), list_models(), n=n, cutoff=0.4)


def _unknown(text: str, path_shaped: bool) -> str:
    close = closest_models(text)
    hint = f"closest bundled: {', '.join(close)}" if close else f"bundled models are: {', '.join(list_models())}"
    where = " and no config.json at that path" if path_shaped else " (or give a path to config.json)"
    return f"unknown model {text[:80]!r}; {hint} (`kvledger models` lists them){where}"


def load_model_config(name_or_path: str | Path) -> dict[str, Any]:
    """Load a model config: a bundled short name (see `list_models`) or the Hugging Face id it comes from
    (`resolve_model_name`), a `config.json` path, or a directory holding `config.json` (a downloaded
    Hugging Face snapshot)."""
    text = str(name_or_path)
    if text in list_models():
        return _bundled(text)
    path = Path(text).expanduser()
    bundled = None if path.exists() else resolve_model_name(text)
    if bundled is not None:
        return _bundled(bundled)
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
    # Something shaped like a file path gets a path error; a Hugging Face id (org/name) or a bare word gets
    # the nearest bundled names.
    hf_id = re.fullmatch(r"[\w.-]+/[\w.-]+", text) is not None and path.suffix != _SUFFIX
    if path.suffix == _SUFFIX or ("/" in text and not hf_id) or path.exists():
        raise ConfigError(f"no model config at {path}")
    raise ConfigError(_unknown(text, hf_id))


def model_source(name: str) -> str:
    """Where a bundled config's numbers come from (a Hugging Face repo id), or the file path for
    a config loaded from disk."""
    bundled = name if name in list_models() else (None if Path(name).expanduser().exists()
                                                    else resolve_model_name(name))
    if bundled is not None:
        return str(_bundled(bundled).get("_source", "unknown source"))
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "config.json"
    load_model_config(path)  # raises the same clear errors as loading would
    return str(path.resolve())


def model_hf_id(name: str) -> str | None:
    """The Hugging Face id a bundled config comes from (``llama-3.1-8b`` -> ``meta-llama/Llama-3.1-8B``), which
    ``--model`` accepts as well as the short name; None for a config that is not bundled or names no repo."""
    bundled = resolve_model_name(name)
    if bundled is None:
        return None
    head = str(_bundled(bundled).get("_source", "")).split(maxsplit=1)
    return head[0] if head and re.fullmatch(r"[\w.-]+/[\w.-]+", head[0]) else None


__all__ = ["closest_models", "list_models", "load_model_config", "model_hf_id", "model_source", "resolve_model_name"]
