"""The CLI bad-input corpus: every case is one stderr line `kvledger: error: ...`, exit code 2, no traceback.

Each case runs through the CLI's entry point (`kvledger.cli.main.main`, what the console script calls)
with file-descriptor capture, so output written below Python (C extensions, subprocess-style prints) is
seen too. The cases are issue 9's defect 10: sizes with hundreds of digits, huge integers for every
numeric option, deeply nested JSON and integers over 4,300 digits in configs, traces and requests files,
binary and non-UTF-8 CSV traces, a corrupt model.safetensors and .gguf, `--frag-block-sizes 0`, and the
unbounded `--requests`/`--branches` that used to hang. A few run as real subprocesses of the console
script, with a time limit, to prove they neither hang nor print a second line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvledger.cli.main import main

HUGE = "9" * 23  # 99999999999999999999999
ENORMOUS = "7" * 5000  # past Python's 4,300-digit int conversion limit
SIZE_300 = "9" * 300 + "MiB"
SEED = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128"]
TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
AZURE = str(TRACES / "azure_conv_head500.csv")
SHAREGPT = str(TRACES / "sharegpt_lengths_head1000.csv")


def _files(tmp: Path) -> dict[str, str]:
    """Hostile inputs on disk, by name."""
    files: dict[str, bytes] = {
        "deep-config/config.json": b"{\"a\": " + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "huge-int-config/config.json": b'{"num_hidden_layers": ' + ENORMOUS.encode() + b"}",
        "big-layers-config/config.json": json.dumps({
            "num_hidden_layers": 10**300, "num_attention_heads": 8, "hidden_size": 64, "vocab_size": 10,
            "intermediate_size": 64}).encode(),
        "binary-config/config.json": b"\x00\xff\xfe\x00binary",
        "binary.csv": b"\x00\x01\x02\x03\xff\xfe binary \x00",
        "latin1.csv": b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,5,1\ncaf\xe9,1,1\n",
        "latin1-header.csv": b"TIMESTAMP,Cont\xe9xtTokens,GeneratedTokens\n",
        "deep.jsonl": b'{"timestamp": 1, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
        "huge-int.jsonl": b'{"timestamp": 1, "input_length": ' + ENORMOUS.encode()
                          + b', "output_length": 1, "hash_ids": [1]}\n',
        "huge-len.jsonl": b'{"timestamp": 1, "input_length": ' + HUGE.encode()
                          + b', "output_length": 1, "hash_ids": [1]}\n',
        "huge-row.csv": b"num_prefill_tokens,num_decode_tokens\n" + ENORMOUS.encode() + b",1\n",
        "requests-deep.jsonl": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
        "requests-huge.jsonl": b'{"prompt": ' + ENORMOUS.encode() + b', "max_new": 1}\n',
        "requests-branches.jsonl": b'{"prompt": 10, "max_new": 1, "branches": ' + HUGE.encode() + b"}\n",
        "requests.csv": b"prompt,max_new,colour\n1,1,red\n",
        "peaks-deep.json": b'{"peaks": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "st/config.json": json.dumps({
            "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100,
            "max_position_embeddings": 128, "torch_dtype": "float32"}).encode(),
        "st/model.safetensors": b"\xff" * 300,
        "random.gguf": bytes(range(256)) * 4,
        "truncated.gguf": b"GGUF\x03\x00\x00\x00garbage",
        "report/metrics.json": b"[" * 100_000 + b"]" * 100_000,
    }
    out = {}
    for name, data in files.items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        out[name] = str(path)
    return out


def _cases(f: dict[str, str]) -> list[tuple[str, list[str]]]:
    plan = ["plan", *SEED]
    admit = ["admit", *SEED, "--pool", "512MiB"]
    sim = ["simulate", "--trace", AZURE, "--limit", "3", "--no-report"]
    return [
        # sizes with hundreds of digits
        ("plan --pool 300 digits", [*plan, "--pool", SIZE_300]),
        ("plan --device-memory 300 digits", ["plan", "--model", "llama-3.1-8b", "--device-memory", SIZE_300]),
        ("plan --reserve 300 digits", [*plan, "--gpu", "l4", "--params", "1B", "--reserve", SIZE_300]),
        ("admit --pool 300 digits", ["admit", *SEED, "--pool", SIZE_300]),
        ("simulate --host-pool 300 digits", [*sim, "--host-pool", SIZE_300]),
        ("simulate --device-memory 300 digits", [*sim, "--gpu", "cpu-local", "--device-memory", SIZE_300]),
        ("generate --pool 300 digits", ["generate", "hi", "--pool", SIZE_300]),
        ("plan --pool 1EiB", [*plan, "--pool", "2EiB"]),
        # huge integers for every numeric option
        ("plan --prompt", [*plan, "--pool", "1GiB", "--prompt", HUGE, "--max-new", "1"]),
        ("plan --max-new", [*plan, "--pool", "1GiB", "--prompt", "1", "--max-new", HUGE]),
        ("plan --block-size", [*plan, "--pool", "1GiB", "--block-size", HUGE]),
        ("plan --tp", [*plan, "--pool", "1GiB", "--tp", HUGE]),
        ("plan --layers", ["plan", "--layers", HUGE, "--kv-heads", "8", "--head-dim", "128", "--pool", "1GiB"]),
        ("plan --concurrency", ["plan", "--model", "llama-3.1-8b", "--matrix", "--prompt", "1", "--max-new", "1",
                                "--concurrency", HUGE]),
        ("plan --params", [*plan, "--gpu", "l4", "--params", HUGE]),
        ("plan --max-num-seqs", ["plan", "--model", "llama-3.1-8b", "--gpu", "l4", "--max-num-seqs", HUGE]),
        ("plan --utilization nan", [*plan, "--pool", "1GiB", "--utilization", "nan"]),
        ("plan --utilization inf", ["plan", "--model", "llama-3.1-8b", "--gpu", "l4", "--utilization", "inf"]),
        ("plan --tps", ["plan", "--model", "llama-3.1-8b", "--matrix", "--prompt", "1", "--max-new", "1",
                        "--concurrency", "1", "--tps", HUGE]),
        ("admit --requests", [*admit, "--requests", HUGE]),
        ("admit --branches", [*admit, "--branches", HUGE]),
        ("admit --requests x --prompt", [*admit, "--requests", "100000", "--prompt", "100000"]),
        ("admit --prompt", [*admit, "--prompt", HUGE]),
        ("admit --max-new", [*admit, "--max-new", HUGE]),
        ("admit --groups", [*admit, "--groups", HUGE]),
        ("admit --block-size", [*admit, "--block-size", HUGE]),
        ("admit --pool of 10^12 blocks", ["admit", "--layers", "1", "--kv-heads", "1", "--head-dim", "1",
                                          "--kv-dtype", "fp8", "--block-size", "1", "--pool", "1PiB"]),
        ("simulate --trust-groups", [*sim, "--trust-groups", HUGE]),
        ("simulate --capacity-tokens", ["simulate", "--fragmentation", "--trace", SHAREGPT, "--capacity-tokens",
                                        HUGE]),
        ("simulate --pool-blocks", [*sim, "--pool-blocks", HUGE]),
        ("simulate --max-running", [*sim, "--max-running", HUGE]),
        ("simulate --token-budget", [*sim, "--token-budget", HUGE]),
        ("simulate --requests", ["simulate", "--workload", "synthetic", "--requests", HUGE]),
        ("simulate --input-len", ["simulate", "--workload", "synthetic", "--input-len", HUGE]),
        ("simulate --seed", [*sim, "--seed", HUGE]),
        ("simulate --rate 1e999", ["simulate", "--workload", "synthetic", "--rate", "1e999"]),
        ("simulate --sweep rate=1e999", [*sim, "--sweep", "rate=1e999"]),
        ("simulate --sweep max_running", [*sim, "--sweep", f"max_running=1,{HUGE}"]),
        ("simulate --frag-block-sizes 0", ["simulate", "--fragmentation", "--trace", SHAREGPT, "--frag-block-sizes",
                                           "0"]),
        ("simulate --frag-block-sizes huge", ["simulate", "--fragmentation", "--trace", SHAREGPT,
                                              "--frag-block-sizes", HUGE]),
        ("generate --max-new", ["generate", "hi", "--max-new", HUGE]),
        ("generate --n", ["generate", "hi", "--n", HUGE]),
        ("generate --beam-width", ["generate", "hi", "--beam-width", HUGE]),
        ("generate --pool-blocks", ["generate", "hi", "--pool-blocks", HUGE]),
        ("generate --block-size", ["generate", "hi", "--block-size", HUGE]),
        ("generate --threads", ["generate", "hi", "--threads", HUGE]),
        ("generate --top-k", ["generate", "hi", "--top-k", HUGE]),
        ("serve-trace --limit", ["serve-trace", "--trace", AZURE, "--limit", HUGE]),
        ("serve-trace --pool-blocks", ["serve-trace", "--trace", AZURE, "--pool-blocks", HUGE]),
        ("serve-trace --threads", ["serve-trace", "--trace", AZURE, "--threads", HUGE]),
        ("calibrate --repeats", ["calibrate", "--repeats", HUGE]),
        # configs: deeply nested JSON, 4,300-digit integers, absurd values, binary
        ("config deep JSON", ["plan", "--model", f["deep-config/config.json"], "--pool", "1GiB"]),
        ("config 5,000-digit integer", ["plan", "--model", f["huge-int-config/config.json"], "--pool", "1GiB"]),
        ("config 10^300 layers", ["plan", "--model", f["big-layers-config/config.json"], "--pool", "1GiB"]),
        ("config binary", ["admit", "--model", f["binary-config/config.json"], "--pool", "1GiB"]),
        ("simulate config deep JSON", [*sim, "--model", f["deep-config/config.json"]]),
        # traces: binary and non-UTF-8 CSVs, deep JSON, huge integers
        ("trace binary CSV", ["simulate", "--trace", f["binary.csv"]]),
        ("trace non-UTF-8 CSV row", ["simulate", "--trace", f["latin1.csv"]]),
        ("trace non-UTF-8 CSV header", ["simulate", "--trace", f["latin1-header.csv"]]),
        ("trace deep JSON", ["simulate", "--trace", f["deep.jsonl"]]),
        ("trace 5,000-digit integer", ["simulate", "--trace", f["huge-int.jsonl"]]),
        ("trace huge length", ["simulate", "--trace", f["huge-len.jsonl"]]),
        ("length table 5,000-digit integer", ["simulate", "--trace", f["huge-row.csv"]]),
        ("fragmentation binary CSV", ["simulate", "--fragmentation", "--trace", f["binary.csv"]]),
        ("serve-trace binary CSV", ["serve-trace", "--trace", f["binary.csv"]]),
        ("serve-trace deep JSON", ["serve-trace", "--trace", f["deep.jsonl"]]),
        # requests files, peaks files, reports
        ("requests file deep JSON", [*admit, "--requests-file", f["requests-deep.jsonl"]]),
        ("requests file 5,000-digit integer", [*admit, "--requests-file", f["requests-huge.jsonl"]]),
        ("requests file huge branches", [*admit, "--requests-file", f["requests-branches.jsonl"]]),
        ("requests file unknown column", [*admit, "--requests-file", f["requests.csv"]]),
        ("requests file binary", [*admit, "--requests-file", f["binary.csv"]]),
        ("peaks deep JSON", ["plan", "--model", "llama-3.1-8b", "--gpu", "l4", "--engine", "kvledger", "--peaks",
                             f["peaks-deep.json"]]),
        ("compare deep JSON", ["compare", str(Path(f["report/metrics.json"]).parent),
                               str(Path(f["report/metrics.json"]).parent)]),
        # corrupt weights
        ("corrupt model.safetensors", ["generate", "hi", "--model", str(Path(f["st/config.json"]).parent)]),
        ("corrupt .gguf", ["generate", "hi", "--model", f["random.gguf"]]),
        ("truncated .gguf", ["generate", "hi", "--model", f["truncated.gguf"]]),
    ]


def test_every_case_is_one_line_and_exit_code_2(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("KVLEDGER_CACHE", str(tmp_path / "cache"))  # never touch the user's cache
    failures = []
    cases = _cases(_files(tmp_path))
    assert len(cases) >= 70
    for name, argv in cases:
        rc = main(argv)
        out, err = capfd.readouterr()
        ok = (rc == 2 and out == "" and err.startswith("kvledger: error: ") and err.endswith("\n")
              and err.count("\n") == 1 and "Traceback" not in err)
        if not ok:
            failures.append(f"{name}: rc={rc} out={out[:80]!r} err={err[:300]!r}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("argv", [
    ["admit", *SEED, "--pool", "512MiB", "--requests", HUGE],
    ["admit", *SEED, "--pool", "512MiB", "--branches", HUGE],
    ["admit", *SEED, "--pool", "512MiB", "--requests", "100000", "--prompt", "100000"],
    ["plan", *SEED, "--pool", SIZE_300],
])
def test_unbounded_inputs_end_quickly_in_the_console_script(argv):
    """The installed entry point, as a user runs it: these used to hang (or print a traceback)."""
    proc = subprocess.run([sys.executable, "-m", "kvledger", *argv], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("kvledger: error: ") and proc.stderr.count("\n") == 1, proc.stderr


def test_a_corrupt_gguf_is_one_line_in_the_console_script(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 8 + b"\xff" * 64)
    env = {"KVLEDGER_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "kvledger", "generate", "hi", "--model", str(bad)],
                          capture_output=True, text=True, timeout=300, check=False, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("kvledger: error: ") and proc.stderr.count("\n") == 1, proc.stderr
