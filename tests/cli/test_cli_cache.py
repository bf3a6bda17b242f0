"""`kvledger cache` lists what kvledger keeps outside the clone; `--clear` removes the converted models only
(saying what and how many bytes), `--clear --all` every kvledger entry, never a file that is not kvledger's;
`make clean-cache` runs it. Each test points KVLEDGER_CACHE at its own folder: the user's cache is never
touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvledger
from cli_run import one_error_line, run

ROOT = Path(__file__).resolve().parents[2]


def _file(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    return path


def _model(root: Path, sha: str, weights: int) -> Path:
    """A complete converted model as runtime/weights.py writes it."""
    folder = root / "models" / f"gguf-{sha[:16]}"
    _file(folder / "model.safetensors", weights)
    _file(folder / "config.json", 10)
    source = {"sha256": sha, "gguf": "/gone/smol.gguf", "gguf_name": "smol.gguf", "size": 1,
              "files": {"model.safetensors": weights, "config.json": 10}}
    (folder / "kvledger-source.json").write_text(json.dumps(source))
    return folder


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache holding one of everything: a converted model, an unfinished conversion, a model of the old
    layout, the GGUF hashes, the calibrated profile, quality records and reports, and a stranger's file."""
    root = tmp_path / "cache"
    monkeypatch.setenv("KVLEDGER_CACHE", str(root))
    _model(root, "ab" * 32, 5000)
    _file(root / "models" / ".convert-x1" / "model.safetensors", 700)
    _file(root / "models" / "gguf-0123456789abcdef" / "model.safetensors", 100)  # a half copy: no record
    _file(root / "models" / "gguf-hashes.json", 30)
    old = root / "SmolLM2-135M-Instruct.Q4_1-145ab74ded2e9e86"
    _file(old / "model.safetensors", 3000)
    (old / "kvledger-source.json").write_text("{}")
    _file(root / "cpu-local.json", 200)
    _file(root / "quality" / "records" / "int8.json", 40)
    _file(root / "quality" / "reports" / "r1" / "report.json", 50)
    _file(root / "notes.txt", 7)
    return root


def test_cache_lists_every_entry_with_its_size(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "cache", "--json")
    data = json.loads(out)
    assert rc == 0 and data["root"] == str(cache)
    kinds = {(e["kind"], Path(e["path"]).relative_to(cache).as_posix(), e["bytes"]) for e in data["entries"]}
    assert kinds == {
        ("converted model", "models/gguf-abababababababab", 5000 + 10 + len((cache / "models/gguf-abababababababab"
                                                                            / "kvledger-source.json").read_bytes())),
        ("unfinished conversion", "models/.convert-x1", 700),
        ("unfinished conversion", "models/gguf-0123456789abcdef", 100),
        ("GGUF hash file", "models/gguf-hashes.json", 30),
        ("old-layout model", "SmolLM2-135M-Instruct.Q4_1-145ab74ded2e9e86", 3002),
        ("calibration profile", "cpu-local.json", 200),
        ("quality records", "quality/records", 40),
        ("quality reports", "quality/reports", 50),
        ("other", "notes.txt", 7),
    }
    assert data["total_bytes"] == sum(e["bytes"] for e in data["entries"])
    rc, out, _ = run(capsys, "cache")
    assert rc == 0 and "converted model" in out and "old-layout model" in out and "--clear" in out


def test_clear_removes_the_models_only_and_says_how_many_bytes(cache: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "cache", "--json")
    models = ("converted model", "unfinished conversion", "GGUF hash file", "old-layout model")
    model_bytes = sum(e["bytes"] for e in json.loads(out)["entries"] if e["kind"] in models)
    rc, out, err = run(capsys, "cache", "--clear", "--json")
    assert rc == 0 and err == ""
    data = json.loads(out)
    assert data["removed_bytes"] == model_bytes
    assert not (cache / "models").exists() and not (cache / "SmolLM2-135M-Instruct.Q4_1-145ab74ded2e9e86").exists()
    assert (cache / "cpu-local.json").is_file() and (cache / "quality/records/int8.json").is_file()
    assert (cache / "quality/reports/r1/report.json").is_file() and (cache / "notes.txt").is_file()
    rc, out, _ = run(capsys, "cache", "--clear")
    assert rc == 0 and out.startswith(f"removed nothing from {cache}: 0 B freed")
    assert "kept calibration profile, quality records, quality reports" in out and "--clear --all" in out


def test_clear_prints_what_it_removed(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "cache", "--clear")
    assert rc == 0
    first = out.splitlines()[0]
    assert first.startswith("removed 1 converted model, 1 old-layout model, 2 unfinished conversions, 1 GGUF hash "
                            f"file from {cache}: ") and first.endswith(" freed"), first


def test_clear_all_removes_everything_of_kvledgers_but_not_a_strangers_file(
        cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "cache", "--clear", "--all", "--json")
    assert rc == 0
    data = json.loads(out)
    assert [e["kind"] for e in data["kept"]] == ["other"]
    assert sorted(p.name for p in cache.iterdir()) == ["notes.txt"]
    (cache / "notes.txt").unlink()
    assert run(capsys, "cache", "--clear", "--all")[0] == 0
    assert not cache.exists()  # an emptied cache folder goes too
    rc, out, _ = run(capsys, "cache")
    assert rc == 0 and out.strip() == f"nothing cached in {cache}"


def test_all_without_clear_is_one_error_line(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "cache", "--all")
    assert rc == 2 and "--all goes with --clear" in one_error_line(err)
    assert (cache / "models").exists()


def test_make_clean_cache_runs_the_clear(cache: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    shim = venv / "bin" / "kvledger"
    shim.parent.mkdir(parents=True)
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m kvledger \"$@\"\n")
    shim.chmod(0o755)
    env = dict(os.environ, KVLEDGER_CACHE=str(cache), PYTHONPATH=str(Path(kvledger.__file__).parents[1]))
    proc = subprocess.run(["make", "-s", "-C", str(ROOT), "clean-cache", f"VENV={venv}"], env=env,
                          capture_output=True, text=True, check=False, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("removed 1 converted model") and not (cache / "models").exists()
    assert (cache / "cpu-local.json").is_file()
    proc = subprocess.run(["make", "-s", "-C", str(ROOT), "clean-cache", f"VENV={tmp_path / 'none'}"], env=env,
                          capture_output=True, text=True, check=False, timeout=60)
    assert proc.returncode != 0 and "kvledger is missing (run make install first)" in proc.stderr


def test_make_clean_leaves_the_shared_cache_and_says_where_it_is() -> None:
    makefile = (ROOT / "Makefile").read_text()
    clean = makefile.split("\nclean:", 1)[1].split("\n\n", 1)[0]
    assert "KVLEDGER_CACHE" not in clean and "cache --clear" not in clean and ".cache/" not in clean
    assert "kvledger cache --clear" in makefile.split("\nclean:", 1)[0][-600:]  # its comment says how


def test_make_install_says_what_it_installs_and_lets_pip_show_progress(tmp_path: Path) -> None:
    proc = subprocess.run(["make", "-n", "-C", str(ROOT), "install", f"VENV={tmp_path / 'venv'}"],
                          capture_output=True, text=True, check=False, timeout=60)
    assert proc.returncode == 0, proc.stderr
    pips = [line for line in proc.stdout.splitlines() if "pip install" in line]
    assert len(pips) == 2 and not any(" -q" in line for line in pips)  # -q hid minutes of work
    assert "make install: installing kvledger and its dependencies" in proc.stdout and "torch 2.13" in proc.stdout
