"""The fleet's ingress (:class:`~kvledger.fleet.serve.FleetIngress`): the OpenAI-compatible server over the
fleet's backend, built from ``fleet_app``'s ingress deployment with its engine deployment's handle (as Ray
Serve passes it), over engine replicas of a tiny random model, all in this process and driven over ASGI:
what a client and an operator get from it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvledger.fleet.serve import FleetIngress, fleet_app

from .inproc import InprocDeployment, engine_deployment, fleet_spec, replica_context, run_fleet, shared_tiny_model

OPERATOR, ACME, SMALL = "sk-op", "sk-acme", "sk-small"
TENANTS = {"operator": {"api_keys": [OPERATOR]},
           "tenants": {"acme": {"api_keys": [ACME]}, "small": {"api_keys": [SMALL], "max_blocks": 5}}}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return shared_tiny_model(tmp_path_factory)


run = run_fleet


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_the_ingress_serves_completions_over_the_fleet_and_shows_the_operator_its_view(model):
    """The ingress's backend is built as the engines name things (vocabulary and context from the
    checkpoint, the KV dtype by its canonical name), the server's context length is the model's, a
    tenant's cap reaches the ingress's own "never"; a completion runs on a replica; ``/admin/fleet``
    shows the operator (only) this ingress's counters and view of every replica."""
    async def go() -> None:
        spec = fleet_spec(model, dtype="float32")
        app = fleet_app(spec, tenants=TENANTS, max_queue=7)
        engines = InprocDeployment(engine_deployment(app))
        bound = app._bound_deployment
        ingresses = InprocDeployment(bound, args=(engines.handle(), *bound.init_args[1:]))
        ingress = ingresses.replicas[0].servable
        try:
            assert type(ingress) is FleetIngress and ingress.spec is spec and ingress.max_queue == 7
            backend = ingress.backend
            assert (backend.vocab_size, backend.max_context) == (256, 256)
            # The router's cache identities are built from the engines' own KV spec (the exact format id).
            replica_spec = engines.replicas[0].servable.engine.spec
            assert backend.kv_spec.kv_format_id == replica_spec.kv_format_id == "fp32"
            assert backend._context("acme", "s").root_digest() == \
                replica_spec.cache_context("acme", model, "s").root_digest()
            assert (backend.block_size, backend.pool_blocks, backend.model_name, backend.max_num_seqs) == (
                4, 16, model, 8)
            assert backend.retries == 1 and backend.handle is not None
            assert set(ingress.tenants.by_name) == {"acme", "small"}
            assert ingress.codec.encode("t5 t6 t7") == [5, 6, 7]
            asgi = ingress.__serve_build_asgi_app__()
            with replica_context(ingresses.replicas[0].replica_id):
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://fleet") as http:
                    health = await http.get("/health")
                    assert (health.status_code, health.json()) == (200, {"status": "ok"})
                    models = (await http.get("/v1/models", headers=auth(ACME))).json()
                    assert models["data"][0]["max_model_len"] == 256 and models["data"][0]["root"] == model
                    body = {"model": spec.model, "prompt": list(range(1, 20)), "max_tokens": 4, "temperature": 0}
                    first = await http.post("/v1/completions", json=body, headers=auth(ACME))
                    assert first.status_code == 200, first.text
                    usage = first.json()["usage"]
                    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (19, 4)
                    again = (await http.post("/v1/completions", json=body, headers=auth(ACME))).json()
                    assert again["choices"][0]["text"] == first.json()["choices"][0]["text"]
                    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 16

                    over = await http.post("/v1/completions", json={**body, "prompt": [7] * 24},
                                           headers=auth(SMALL))
                    assert over.status_code in (400, 413, 429) and "quota" in over.text
                    assert backend.counters["accepted"] == 2  # the ingress answered that one itself

                    assert (await http.get("/admin/fleet", headers=auth(ACME))).status_code == 403
                    state = (await http.get("/admin/fleet", headers=auth(OPERATOR))).json()
                    assert state["ingress"] == ingresses.replicas[0].name
                    assert state["counters"] == backend.counters and state["running"] == 0
                    assert set(state["ages_s"]) == {r.name for r in engines.replicas}
                    assert all(age is None or age >= 0 for age in state["ages_s"].values())
                    assert sorted(state["known_blocks"].values()) == [0, 5]
                    assert state["prefix_digests"] == 5
                    ledger = (await http.get("/admin/ledger", headers=auth(OPERATOR))).json()
                    assert ledger["clean"] is True and ledger["fleet"] == backend.counters
        finally:
            ingress.backend.stop()
            await asyncio.sleep(0)
            engines.close()
    run(go())
