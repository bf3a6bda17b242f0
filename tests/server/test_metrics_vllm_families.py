"""vLLM's metric families on a live server after real requests (the app `kvledger serve` runs, in-process,
real SmolLM2), read with prometheus_client's own parser: each family's name, type and label set as vLLM v1
exposes them, values that add up to what the requests did, and every query of vLLM's example Grafana
dashboard (``data/vllm_grafana_queries.json``, copied verbatim) finds a series for the served model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .inproc import MODEL, InProcServer, standard_server

pytestmark = pytest.mark.model

QUERIES = json.loads((Path(__file__).parent / "data" / "vllm_grafana_queries.json").read_text(encoding="utf-8"))
ME = {"model_name": MODEL, "engine": "0"}  # vLLM v1's labels: the served name and the engine core's index
K = 6  # tokens per choice (ignore_eos: exactly K)

# vLLM v1 (vllm/v1/metrics/loggers.py, 0.32): family -> (type, extra labels beside model_name and engine)
FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm:num_requests_running": ("gauge", ()),
    "vllm:num_requests_waiting": ("gauge", ()),
    "vllm:kv_cache_usage_perc": ("gauge", ()),
    "vllm:prefix_cache_queries": ("counter", ()),
    "vllm:prefix_cache_hits": ("counter", ()),
    "vllm:num_preemptions": ("counter", ()),
    "vllm:prompt_tokens": ("counter", ()),
    "vllm:prompt_tokens_cached": ("counter", ()),
    "vllm:prompt_tokens_by_source": ("counter", ("source",)),
    "vllm:generation_tokens": ("counter", ()),
    "vllm:request_success": ("counter", ("finished_reason",)),
    "vllm:request_prompt_tokens": ("histogram", ()),
    "vllm:request_generation_tokens": ("histogram", ()),
    "vllm:iteration_tokens_total": ("histogram", ()),
    "vllm:request_max_num_generation_tokens": ("histogram", ()),
    "vllm:request_params_n": ("histogram", ()),
    "vllm:request_params_max_tokens": ("histogram", ()),
    "vllm:time_to_first_token_seconds": ("histogram", ()),
    "vllm:inter_token_latency_seconds": ("histogram", ()),
    "vllm:request_time_per_output_token_seconds": ("histogram", ()),
    "vllm:e2e_request_latency_seconds": ("histogram", ()),
    "vllm:request_queue_time_seconds": ("histogram", ()),
    "vllm:request_inference_time_seconds": ("histogram", ()),
    "vllm:request_prefill_time_seconds": ("histogram", ()),
    "vllm:request_decode_time_seconds": ("histogram", ()),
    "vllm:request_num_preemptions": ("histogram", ()),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", ()),
}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcServer]:
    yield from standard_server(tmp_path_factory.mktemp("vllm-metrics"))


def scrape(srv: InProcServer) -> tuple[dict[str, Any], dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    families = {f.name: f for f in text_string_to_metric_families(srv.get("/metrics").text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    return families, samples


def one(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **extra: str) -> float:
    return samples[(name, tuple(sorted({**ME, **extra}.items())))]


def traffic(srv: InProcServer) -> tuple[int, int]:
    """Four completions of K tokens (one with n = 2, one sharing the first's prompt), all in flight
    together, and a chat; returns (choices, prompt tokens over the choices)."""
    prompt = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Spain is"
    bodies = [{"prompt": prompt, "max_tokens": K, "ignore_eos": True, "temperature": 0},
              {"prompt": prompt, "max_tokens": K, "ignore_eos": True, "temperature": 0},
              {"prompt": "Once upon a time", "max_tokens": K, "ignore_eos": True, "temperature": 0.7, "seed": 3,
               "n": 2},
              {"prompt": "1, 2, 3,", "max_tokens": K, "ignore_eos": True, "temperature": 0}]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda b: srv.post("/v1/completions", b), bodies))
    chat = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": K,
                                             "ignore_eos": True, "temperature": 0})
    assert [r.status_code for r in (*got, chat)] == [200] * 5
    usage = [r.json()["usage"] for r in (*got, chat)]
    assert all(u["completion_tokens"] == K * len(r.json()["choices"]) for u, r in zip(usage, (*got, chat),
                                                                                      strict=True))
    choices = sum(len(r.json()["choices"]) for r in (*got, chat))
    # usage counts a prompt once per request; vLLM's per-request histograms count it per choice
    prompt_tokens = sum(u["prompt_tokens"] * len(r.json()["choices"]) for u, r in zip(usage, (*got, chat),
                                                                                        strict=True))
    srv.wait_idle()
    return choices, prompt_tokens


def test_vllm_families_names_types_labels_and_values(srv: InProcServer) -> None:
    families, before = scrape(srv)
    for name, (kind, extra) in FAMILIES.items():
        assert name in families, name
        assert families[name].type == kind, (name, families[name].type)
        labels = {k for s in families[name].samples for k in s.labels if k != "le"}
        assert labels == {"model_name", "engine", *extra}, (name, labels)
    assert {s.labels["finished_reason"] for s in families["vllm:request_success"].samples} == {
        "stop", "length", "abort", "error", "repetition"}
    choices, prompt_tokens = traffic(srv)
    _, after = scrape(srv)

    def moved(name: str, **extra: str) -> float:
        key = (name, tuple(sorted({**ME, **extra}.items())))
        return after[key] - before.get(key, 0.0)

    requests = 5  # engine requests (the n = 2 one is one request with two choices)
    for phase in ("queue", "prefill", "decode", "inference"):
        assert moved(f"vllm:request_{phase}_time_seconds_count") == requests, phase
        assert moved(f"vllm:request_{phase}_time_seconds_sum") > 0 or phase == "queue", phase
    # inference = prefill + decode, per request; the server's e2e holds the engine's queue and inference
    inference = moved("vllm:request_inference_time_seconds_sum")
    assert inference == pytest.approx(moved("vllm:request_prefill_time_seconds_sum")
                                      + moved("vllm:request_decode_time_seconds_sum"), abs=1e-6)
    assert moved("vllm:e2e_request_latency_seconds_sum") >= moved("vllm:request_queue_time_seconds_sum") + inference
    # TPOT: each request's decode time over its K - 1 later tokens
    assert moved("vllm:request_time_per_output_token_seconds_count") == requests
    assert moved("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(
        moved("vllm:request_decode_time_seconds_sum") / (K - 1), rel=1e-9)
    # per choice (vLLM's child requests): token counts and parameters
    assert moved("vllm:request_generation_tokens_count") == choices == 6
    assert moved("vllm:request_generation_tokens_sum") == choices * K == moved("vllm:generation_tokens_total")
    assert moved("vllm:request_prompt_tokens_count") == choices
    assert moved("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert moved("vllm:request_params_max_tokens_sum") == choices * K
    assert moved("vllm:request_num_preemptions_count") == choices
    assert moved("vllm:request_num_preemptions_sum") == moved("vllm:num_preemptions_total") == 0
    assert moved("vllm:request_success_total", finished_reason="length") == choices
    # per engine request (vLLM's parent request): n and the longest choice
    assert (moved("vllm:request_params_n_count"), moved("vllm:request_params_n_sum")) == (requests, 6)
    assert moved("vllm:request_max_num_generation_tokens_sum") == requests * K
    # prompt tokens by source: computed + read from the cache = every prompt token of the engine requests
    computed = moved("vllm:prompt_tokens_by_source_total", source="local_compute")
    cached = moved("vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    assert cached == moved("vllm:prompt_tokens_cached_total") > 0  # the second completion read the first's
    assert computed + cached == moved("vllm:prompt_tokens_total")
    assert moved("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert moved("vllm:request_prefill_kv_computed_tokens_sum") == prompt_tokens - cached
    # every step's tokens: the steps ran every computed prompt token and sampled every generated one
    steps = moved("vllm:iteration_tokens_total_count")
    assert 0 < steps <= moved("vllm:iteration_tokens_total_sum")
    assert moved("vllm:iteration_tokens_total_sum") >= computed + choices * K
    assert moved('vllm:iteration_tokens_total_bucket', le="+Inf") == steps


def test_every_query_of_vllms_grafana_dashboard_finds_a_series(srv: InProcServer) -> None:
    """Each series a panel of vLLM's example dashboard selects (``{model_name="$model_name"}``) exists for
    the served model, with data behind it once requests ran; the dashboard's model picker
    (label_values of every ``vllm:`` series' model_name) offers exactly the served model."""
    srv.post("/v1/completions", {"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    srv.wait_idle()
    _, samples = scrape(srv)
    picked = {dict(labels).get("model_name") for name, labels in samples if name.startswith("vllm:")}
    assert picked == {MODEL}
    selectors = {m for expr in QUERIES["exprs"] for m in re.findall(r'(vllm:[a-z0-9_:]+)\{model_name="\$model_name"\}',
                                                                    expr)}
    assert len(selectors) == 24
    for series in sorted(selectors):
        found = [v for (name, labels), v in samples.items() if name == series and dict(labels)["model_name"] == MODEL]
        assert found, series
        if not series.startswith(("vllm:num_requests_", "vllm:kv_cache_usage_perc")):
            assert max(found) > 0, series  # a rate or a quantile over it has something to show
