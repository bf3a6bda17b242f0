"""Finding a checkpoint on disk: a Hugging Face folder (config.json + safetensors) or a GGUF file.

GGUF files are dequantised once through transformers (which needs the ``gguf`` package) and saved as
an ordinary Hugging Face folder in the kvledger cache, named by the GGUF's sha256 and shared by every
clone and venv (kvledger/cachedir.py; `kvledger cache` lists and clears it), so every later load is a plain
safetensors read. transformers is imported only for that conversion: serving a safetensors folder needs torch and
safetensors alone.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..cachedir import CACHE_ENV, MODELS_DIR, cache_root, discard, file_sha256, model_key, model_problem, write_source
from ..errors import ConfigError


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A Hugging Face style folder: ``config.json`` plus one or more ``*.safetensors`` files."""

    path: Path
    config: dict[str, Any]

    @property
    def files(self) -> list[Path]:
        return sorted(self.path.glob("*.safetensors"))

    def tensors(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Every tensor of every shard, by its Hugging Face name."""
        from safetensors.torch import load_file

        out: dict[str, torch.Tensor] = {}
        for f in self.files:
            check_safetensors(f)
            try:
                out.update(load_file(str(f), device=str(device)))
            except Exception as e:  # noqa: BLE001 -- safetensors raises its own (Rust) error types
                raise ConfigError(f"{f} is not a readable safetensors file: {_first_line(e)}") from None
        return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


def check_safetensors(path: Path) -> None:
    """Refuse a file that cannot be a safetensors file before handing it to the loader: an 8-byte header
    length, then a JSON header of that length inside the file."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= min(size - 8, 100 * 2**20):
                raise ConfigError(f"{path} is not a safetensors file (truncated or corrupt header)")
            if fh.read(1) != b"{":
                raise ConfigError(f"{path} is not a safetensors file (its header is not JSON)")
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None


def check_gguf(path: Path) -> None:
    """Refuse a file that cannot be a GGUF file: the magic bytes, a known version (1-3) and counts that fit."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(24)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    if head[:4] != b"GGUF":
        raise ConfigError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    version = int.from_bytes(head[4:8], "little") if len(head) >= 8 else 0
    if version not in (1, 2, 3) or len(head) < 24:
        raise ConfigError(f"{path} is not a usable GGUF file (version {version}, {size} bytes: truncated or corrupt)")
    tensors, keys = int.from_bytes(head[8:16], "little"), int.from_bytes(head[16:24], "little")
    if tensors > size or keys > size:
        raise ConfigError(f"{path} is a corrupt GGUF file (its header counts {tensors} tensors and {keys} keys in "
                          f"{size} bytes)")


def _read_config(folder: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {folder / 'config.json'}: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{folder / 'config.json'} is not a JSON object")
    return cfg


def resolve_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """The safetensors checkpoint behind ``path``: a folder with config.json, a ``.gguf`` file, or a
    folder holding exactly one ``.gguf`` file (converted on first use, see :func:`convert_gguf`)."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return convert_gguf(p)
    if not p.is_dir():
        raise ConfigError(f"model path {str(path)!r} is neither a model folder nor a .gguf file")
    if (p / "config.json").is_file():
        ckpt = Checkpoint(p, _read_config(p))
        if not ckpt.files:
            raise ConfigError(f"{p} has a config.json but no *.safetensors weights (the only format read)")
        return ckpt
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return convert_gguf(ggufs[0])
    if ggufs:
        names = ", ".join(g.name for g in ggufs)
        raise ConfigError(f"{p} holds several GGUF files ({names}); pass the one to load")
    raise ConfigError(f"{p} has neither config.json + safetensors nor a .gguf file")


def _save_plain(model: torch.nn.Module, folder: Path) -> None:
    """Write a loaded transformers model as config.json + model.safetensors.

    transformers refuses ``save_pretrained`` on a GGUF-loaded model (it still counts as quantised),
    but its weights are plain dequantised fp32 tensors by now, so they are written directly.
    """
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:  # tied lm_head: safetensors stores a tensor once
            continue
        seen.add(t.data_ptr())
        tensors[name] = t.detach().contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the GGUF marker: these weights are not quantised
    config["architectures"] = [type(model).__name__]  # lets AutoModel pick the class again
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def convert_gguf(gguf: Path, root: Path | None = None) -> Checkpoint:
    """Dequantise ``gguf`` to fp32 safetensors under the cache root (once) and return that checkpoint.

    The entry is named by the GGUF's sha256 (``models/gguf-<16 hex>``), so every clone, venv and reinstall
    holding the same GGUF shares one copy. The conversion is written to a temporary folder and renamed into
    place, so an interrupted or concurrent conversion never leaves a half-written entry; an entry found
    incomplete (a file missing or of the wrong size) is removed and converted again.
    """
    root = cache_root() if root is None else root
    check_gguf(gguf)
    models = root / MODELS_DIR
    sha = file_sha256(gguf, root)
    target = models / model_key(sha)
    problem = model_problem(target, sha)
    if problem is None:
        return Checkpoint(target, _read_config(target))
    if target.exists():
        if sys.stderr.isatty():
            print(f"kvledger: {target} is incomplete ({problem}); converting again", file=sys.stderr)
        discard(target)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise ConfigError("loading a GGUF file needs the transformers and gguf packages") from None
    if sys.stderr.isatty():  # progress for a person; a failed conversion is then one error line in logs
        print(f"kvledger: converting {gguf.resolve()} to safetensors in {target} (first load on this machine "
              "only; this can take a minute)", file=sys.stderr)
    models.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=models))
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        except (ValueError, KeyError, OSError, ImportError, EOFError, IndexError, TypeError, struct.error) as e:
            raise ConfigError(f"transformers cannot load {gguf.name}: {_first_line(e)}") from None
        _save_plain(model, tmp)
        del model
        try:  # the tokenizer is a convenience for callers; the weights do not depend on it
            AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        except Exception as e:  # noqa: BLE001 -- any tokenizer failure only costs the convenience
            print(f"kvledger: tokenizer of {gguf.name} not converted: {e}", file=sys.stderr)
        write_source(tmp, sha, gguf)  # last: its file list is what makes the entry complete
        try:
            tmp.rename(target)
        except OSError:
            if model_problem(target, sha) is not None:  # not a lost race with another converter
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Checkpoint(target, _read_config(target))


__all__ = ["CACHE_ENV", "Checkpoint", "cache_root", "convert_gguf", "resolve_checkpoint"]
