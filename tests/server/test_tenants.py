"""Tenants are trust groups: no cross-tenant cache hit, no view of anyone else, a cap of their own."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import openai
import pytest

pytestmark = pytest.mark.model


def long_prompt() -> str:
    return f"[{uuid.uuid4().hex[:8]}] " + "A ledger records every block that a request holds or is promised. " * 10


def cached(client, prompt: str, **kw) -> int:  # noqa: ANN001
    out = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=2, temperature=0, **kw)
    return out.usage.prompt_tokens_details.cached_tokens


def test_no_cross_tenant_cache_hit(server) -> None:
    acme, globex = server.client(server.keys["acme"]), server.client(server.keys["globex"])
    prompt = long_prompt()
    assert cached(acme, prompt) == 0
    within = cached(acme, prompt)
    assert within > 0  # the same tenant hits its own prefix
    assert cached(globex, prompt) == 0  # the same tokens from another tenant: a separate copy
    assert cached(globex, prompt) == within  # ... which globex then hits itself
    # A cache salt splits a tenant's cache further (vLLM's cache_salt), never joins two tenants.
    assert cached(acme, prompt, extra_body={"cache_salt": "user-7"}) == 0
    assert cached(acme, prompt, extra_body={"cache_salt": "user-7"}) == within


def test_tenants_cannot_read_server_state(server) -> None:
    for key in server.keys.values():
        assert server.get("/metrics", key=key).status_code == 403
        assert server.get("/admin/ledger", key=key).status_code == 403
    assert server.get("/metrics", key=None).status_code == 401
    assert server.get("/metrics", key="sk-wrong").status_code == 401
    assert server.get("/metrics").status_code == 200  # the operator's key
    # An operator key is not a tenant: it cannot generate (there is no trust group to put it in).
    with pytest.raises(openai.PermissionDeniedError):
        server.client(server.operator_key).completions.create(model="smollm2-135m", prompt="hi", max_tokens=1)


def test_tenant_block_cap(server) -> None:
    capped = server.client(server.keys["capped"])
    cap, bs = server.capped_blocks, server.block_size
    # Larger than the cap on its own: never (400), with the tenant's own cap as the reason.
    with pytest.raises(openai.BadRequestError) as err:
        capped.completions.create(model="smollm2-135m", prompt="hi", max_tokens=cap * bs)
    assert "Your tenant's KV block cap can never hold this request" in err.value.message
    assert f"its trust group's quota is {cap} blocks" in err.value.message
    # Without max_tokens, chat gets the most the cap allows, not a refusal.
    out = capped.chat.completions.create(model="smollm2-135m", temperature=0,
                                         messages=[{"role": "user", "content": "Say yes."}])
    assert out.usage.prompt_tokens + out.usage.completion_tokens <= cap * bs


def test_tenant_over_its_cap_waits_and_then_runs(server) -> None:
    """Requests that each fit the cap but not together: the later ones wait in the engine (not a 429, not
    another tenant's problem: the ledger's quota says "not now" for this tenant only) and run once the
    earlier ones are done. Distinct prompts, so that no prefix is shared (a shared prefix is charged once)."""
    cap, bs = server.capped_blocks, server.block_size
    prompts = [f"{word}: " + "one two three four five six seven eight nine ten " * 5 for word in ("Count", "Say",
                                                                                              "Read")]
    client = server.client(server.keys["capped"])
    plen = max(client.completions.create(model="smollm2-135m", prompt=p, max_tokens=1).usage.prompt_tokens
               for p in prompts)
    need = -(-(plen + 2) // bs)
    assert 2 * need > cap >= need  # one fits the cap, two do not
    before = _quota_refusals(server)

    async def go() -> list[int]:
        aclient = server.client(server.keys["capped"], async_=True)
        outs = await asyncio.gather(*[aclient.completions.create(
            model="smollm2-135m", prompt=p, max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
            for p in prompts])
        return [o.usage.completion_tokens for o in outs]

    assert asyncio.run(go()) == [2, 2, 2]
    report = server.wait_idle()
    assert report["clean"], report
    assert report["groups"]["capped"]["charged"] == 0 and report["groups"]["capped"]["cap"] == cap
    assert _quota_refusals(server) > before  # they waited on the cap, in the engine


def _quota_refusals(server) -> float:  # noqa: ANN001
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(server.get("/metrics").text):
        for s in family.samples:
            if s.name == "kvledger:tenant_quota_refusals_total" and s.labels.get("tenant") == "capped":
                return s.value
    raise AssertionError("kvledger:tenant_quota_refusals has no sample for tenant capped")


def test_errors_do_not_reveal_other_tenants(server) -> None:
    body = {"model": "smollm2-135m", "prompt": "hi", "max_tokens": 100000}
    resp = httpx.post(f"{server.v1}/completions", json=body, trust_env=False,
                      headers={"Authorization": f"Bearer {server.keys['globex']}"})
    assert resp.status_code == 400
    text = resp.text
    for other in ("acme", "capped", "operator", "sequences", "free"):
        assert other not in text
