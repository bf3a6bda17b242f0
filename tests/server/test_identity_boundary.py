"""Identity at the boundary: only the API key says who a request is from.

A second tenant puts the first tenant's name, key, cache salt and trust group into every other place a
request can carry them -- the ``user`` field, ``cache_salt``, ``model``, unknown body fields, the query
string, headers -- and still gets 0 cached tokens for a prompt the first tenant has cached (which the
first tenant, asked again, still hits), still has its own block cap, is billed as itself in the
operator's metrics, and never sees the other tenant's name or figures in anything it gets back. (The
request limit under the same spoofing is checked on a server with such a limit: test_gate_edges.py.)
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.model

MODEL = "smollm2-135m"
VICTIM = "acme"
VICTIM_SALT = "acme-team-7"


def _spoof(victim_key: str) -> dict[str, dict]:
    """Every field but the credential, naming the victim tenant: name -> (body fields, headers, query)."""
    body = {"trust_group": VICTIM, "tenant": VICTIM, "tenant_id": VICTIM, "principal": VICTIM, "org": VICTIM,
            "organization": VICTIM, "project": VICTIM, "api_key": victim_key, "key": victim_key, "key_id": VICTIM,
            "metadata": {"tenant": VICTIM, "trust_group": VICTIM}, "priority": -1000,
            "cache_context": {"trust_group": VICTIM}, "salt": VICTIM_SALT}
    headers = {"X-Tenant": VICTIM, "X-Trust-Group": VICTIM, "OpenAI-Organization": VICTIM,
               "OpenAI-Project": VICTIM, "X-API-Key": victim_key, "api-key": victim_key,
               "Proxy-Authorization": f"Bearer {victim_key}", "X-Forwarded-User": VICTIM,
               "Cookie": f"tenant={VICTIM}; api_key={victim_key}"}
    query = {"tenant": VICTIM, "trust_group": VICTIM, "api_key": victim_key}
    return {
        "user": {"body": {"user": VICTIM}},
        "cache_salt=victim's name": {"body": {"cache_salt": VICTIM}},
        "cache_salt=victim's salt": {"body": {"cache_salt": VICTIM_SALT}, "victim_salt": True},
        "extra_body": {"body": body},
        "headers": {"headers": headers},
        "query": {"query": query},
        "everything": {"body": {**body, "user": VICTIM, "cache_salt": VICTIM_SALT}, "headers": headers,
                       "query": query, "victim_salt": True},
    }


def _prompt() -> str:
    """Three full blocks and more of text no other request has sent."""
    return f"[{uuid.uuid4().hex[:8]}] " + "Every block a request holds is in the ledger, and so is every promise. " * 4


def _complete(server, key: str, prompt: str, body: dict | None = None, headers: dict | None = None,  # noqa: ANN001
              query: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.v1}/completions", params=query, trust_env=False, timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, **(body or {})},
                      headers={**(headers or {}), "Authorization": f"Bearer {key}"})


def _cached(resp: httpx.Response) -> int:
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _tenant_counters(server) -> dict[tuple[str, str], float]:  # noqa: ANN001
    """(metric, tenant) -> value of the operator's per-tenant counters."""
    out = {}
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for s in family.samples:
            if s.name.startswith("kvledger:tenant_") and s.name.endswith("_total") and "tenant" in s.labels:
                out[(s.name, s.labels["tenant"])] = s.value
    return out


def test_no_field_but_the_key_joins_another_tenants_cache(server) -> None:  # noqa: ANN001
    intruder = "globex"
    victim_key, intruder_key = server.keys[VICTIM], server.keys[intruder]
    before = _tenant_counters(server)
    sent = {VICTIM: [0, 0, 0], intruder: [0, 0, 0]}  # tenant -> [requests, prompt tokens, cached tokens]
    for name, spoof in _spoof(victim_key).items():
        prompt = _prompt()
        victim_body = {"cache_salt": VICTIM_SALT} if spoof.get("victim_salt") else {}
        first = _complete(server, victim_key, prompt, victim_body)
        assert _cached(first) == 0
        plen = first.json()["usage"]["prompt_tokens"]
        full = min(plen // server.block_size * server.block_size, plen - 1)
        assert full >= 3 * server.block_size
        spoofed = _complete(server, intruder_key, prompt, spoof.get("body"), spoof.get("headers"), spoof.get("query"))
        assert _cached(spoofed) == 0, f"{intruder} read {VICTIM}'s cache through {name}"
        # The victim's copy was there all along: it still hits it in full.
        assert _cached(_complete(server, victim_key, prompt, victim_body)) == full, name
        sent[VICTIM][0] += 2
        sent[VICTIM][1] += 2 * plen
        sent[VICTIM][2] += full
        sent[intruder][0] += 1
        sent[intruder][1] += spoofed.json()["usage"]["prompt_tokens"]
    # The model field names a model, never a tenant: naming the victim there is an unknown model.
    for model in (VICTIM, f"{VICTIM}/{MODEL}"):
        resp = _complete(server, intruder_key, _prompt(), {"model": model})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found", resp.text
    # Each tenant is billed for exactly its own requests: the spoofed ones are the intruder's.
    after = _tenant_counters(server)
    for tenant, figures in sent.items():
        for metric, value in zip(("requests", "prompt_tokens", "cached_tokens"), figures, strict=True):
            key = (f"kvledger:tenant_{metric}_total", tenant)
            assert after[key] - before.get(key, 0) == value, (tenant, metric)


def test_no_field_but_the_key_lifts_a_tenants_block_cap(server) -> None:  # noqa: ANN001
    """The capped tenant, naming the uncapped one everywhere, is still held to its own cap: a request its
    cap can never hold is a 400 naming that cap (the uncapped tenant would have run it)."""
    cap, bs = server.capped_blocks, server.block_size
    prompt = "Count to twenty:"
    for name, spoof in _spoof(server.keys[VICTIM]).items():
        resp = _complete(server, server.keys["capped"], prompt, {**spoof.get("body", {}), "max_tokens": cap * bs},
                         spoof.get("headers"), spoof.get("query"))
        assert resp.status_code == 400, (name, resp.text)
        message = resp.json()["error"]["message"]
        assert "Your tenant's KV block cap can never hold this request" in message, name
        assert f"its trust group's quota is {cap} blocks" in message, name
    with httpx.stream("POST", f"{server.v1}/completions", trust_env=False, timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": cap * bs, "stream": True},
                      headers={"Authorization": f"Bearer {server.keys[VICTIM]}"}) as victim:
        assert victim.status_code == 200  # admitted; closing the stream cancels it


def _scrub(resp: httpx.Response) -> str:
    """Everything a response shows its client -- status, headers, body -- less the generated text (a
    model may write any word)."""
    body = resp.text
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        events = []
        for line in body.splitlines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                for c in chunk.get("choices", []):
                    c.pop("text", None)
                    c.get("delta", {}).pop("content", None)
                events.append(json.dumps(chunk))
        body = "\n".join(events)
    elif resp.headers.get("content-type", "").startswith("application/json"):
        doc = resp.json()
        for c in doc.get("choices", []) if isinstance(doc, dict) else []:
            c.pop("text", None)
            c.get("message", {}).pop("content", None)
        body = json.dumps(doc)
    return f"{resp.status_code}\n{dict(resp.headers)}\n{body}"


@pytest.mark.parametrize("viewer", ["globex", "capped"])
def test_a_tenant_never_sees_another_tenants_name_key_or_figures(server, viewer: str) -> None:  # noqa: ANN001
    """Everything one tenant can reach -- successes, streams, every error, the read endpoints -- while the
    others have cached and billed work on the server, names no other tenant, key or cap."""
    key = server.keys[viewer]
    others = [t for t in server.keys if t != viewer]
    # The others' activity (cached prompts, billed tokens) is on the server while the viewer looks.
    for other in others:
        _complete(server, server.keys[other], _prompt(), {"max_tokens": 2, "cache_salt": f"{other}-salt"})
    auth = {"Authorization": f"Bearer {key}"}
    prompt = _prompt()

    def post(path: str, body: dict, headers: dict | None = None) -> httpx.Response:
        return httpx.post(f"{server.v1}{path}", json=body, trust_env=False, timeout=120,
                          headers=auth if headers is None else headers)

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3}
    responses = {
        "completion": post("/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 3, "n": 2, "seed": 1}),
        "completion again (cached)": post("/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 3}),
        "stream": post("/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 3, "stream": True,
                                        "stream_options": {"include_usage": True}}),
        "chat": post("/chat/completions", chat),
        "chat stream": post("/chat/completions", {**chat, "stream": True, "stream_options": {"include_usage": True}}),
        "longer than the model": post("/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**6}),
        "larger than the pool": post("/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2000, "n": 2}),
        "unsupported": post("/completions", {"model": MODEL, "prompt": "hi", "suffix": "!"}),
        "malformed": httpx.post(f"{server.v1}/completions", content=b"{nope", trust_env=False, timeout=60,
                                headers={**auth, "Content-Type": "application/json"}),
        "bad token id": post("/completions", {"model": MODEL, "prompt": [10**9]}),
        "models": httpx.get(f"{server.v1}/models", headers=auth, trust_env=False),
        "health": httpx.get(f"{server.url}/health", trust_env=False),
        "metrics": server.get("/metrics", key=key),
        "ledger": server.get("/admin/ledger", key=key),
        "unknown key": post("/completions", {"model": MODEL, "prompt": "hi"},
                            headers={"Authorization": f"Bearer {key}-x"}),
    }
    if viewer == "capped":  # its own cap, named in its own 400
        responses["at its cap"] = post("/completions", {"model": MODEL, "prompt": "hi",
                                                        "max_tokens": server.capped_blocks * server.block_size})
        assert responses["at its cap"].status_code == 400
    assert responses["completion again (cached)"].json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert responses["metrics"].status_code == responses["ledger"].status_code == 403
    secrets = [*others, *(server.keys[o] for o in others), server.operator_key,
               *(f"{o}-salt" for o in others), VICTIM_SALT]
    if viewer != "capped":  # the cap is the capped tenant's own figure; anyone else must not see it
        secrets.append(f"{server.capped_blocks} blocks")
    for what, resp in responses.items():
        assert resp.status_code < 500, (what, resp.text)
        seen = _scrub(resp)
        for secret in secrets:
            assert secret not in seen, f"{viewer} sees {secret!r} in {what}: {seen}"
