"""The server's pieces without a model or a socket: tenants config, the admission gate (its conservation
laws under bounded random fuzzing), incremental text with stop strings, and the load client's maths."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.errors import ConfigError
from kvledger.loadgen import LoadSpec, check_loopback, percentile, synthetic_workload, to_vocab
from kvledger.server.gate import AdmissionGate, NeverFits, QueueFull
from kvledger.server.tenants import DEFAULT_TENANT, Tenant, Tenants
from kvledger.server.text import Detokenizer, StopMatcher


# ---- tenants ---------------------------------------------------------------------------------------
def test_tenants_map_keys_to_trust_groups() -> None:
    t = Tenants.from_dict({"operator": {"api_keys": ["op"]},
                           "tenants": {"acme": {"api_keys": ["k1", "k2"], "max_blocks": 8, "priority": 1},
                                       "globex": {"api_keys": ["k3"]}}})
    assert t.authenticate("Bearer k2").tenant == Tenant("acme", max_blocks=8, priority=1)
    assert t.authenticate("bearer k3").tenant.name == "globex"
    assert not t.authenticate("Bearer k3").operator
    assert t.authenticate("Bearer op").operator and t.authenticate("Bearer op").tenant is None
    for bad in (None, "", "Bearer", "Bearer nope", "Basic k1", "k1"):
        assert t.authenticate(bad) is None
    assert "k1" not in t.describe() and "acme" in t.describe()


def test_single_tenant_mode() -> None:
    open_ = Tenants.single_tenant()
    assert open_.authenticate(None).tenant.name == DEFAULT_TENANT
    assert "single-tenant" in open_.describe()
    keyed = Tenants.single_tenant("s3cret")
    assert keyed.authenticate(None) is None
    assert keyed.authenticate("Bearer s3cret").tenant.name == DEFAULT_TENANT


@pytest.mark.parametrize("data, message", [
    ({}, "no tenants"),
    ({"tenants": {"a": {"api_keys": ["k"]}, "b": {"api_keys": ["k"]}}}, "also a key of"),
    ({"tenants": {"a#b": {"api_keys": ["k"]}}}, "tenant name"),
    ({"tenants": {"a": {"api_keys": []}}}, "empty"),
    ({"tenants": {"a": {"api_keys": ["k"], "max_blocks": 0}}}, "max_blocks"),
    ({"tenants": {"a": {"api_keys": ["k"], "max_blocs": 3}}}, "unknown key"),
    ({"tenants": {"a": {"api_keys": ["k"]}}, "operators": {}}, "unknown section"),
    ({"tenants": {"a": {"api_keys": ["k"]}}, "operator": {"api_keys": ["k"]}}, "operator key"),
])
def test_bad_tenant_configs_are_one_clear_error(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Tenants.from_dict(data)


def test_tenants_file_errors(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match="no tenants file"):
        Tenants.from_file(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[tenants\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        Tenants.from_file(bad)


# ---- the gate ----------------------------------------------------------------------------------------
def test_gate_queue_full_and_tenant_limits() -> None:
    running = [0]
    gate = AdmissionGate(2, lambda: running[0])
    t = Tenant("a")
    first = gate.enter(t, 1)
    running[0] = 1  # the engine took it
    gate.enter(t, 1)
    gate.enter(t, 1)  # two wait now
    with pytest.raises(QueueFull):
        gate.enter(t, 1)
    running[0] = 3  # all three running: a tenant's block cap is not the gate's business (the ledger's)
    gate.enter(Tenant("b", max_blocks=3), 1)
    with pytest.raises(NeverFits, match="limit of 1 requests"):  # more than the limit alone: never, not 429
        AdmissionGate(10, lambda: 0).enter(Tenant("c", max_requests=1), 2)
    gate.release(first, 0)
    gate.release(first, 0)  # idempotent
    gate.check()
    assert gate.in_flight == 3 and gate.tenant_in_flight("a") == 2 and gate.tenant_in_flight("b") == 1
    with pytest.raises(ValueError):
        gate.enter(t, 0)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(0, 2**32 - 1))
def test_gate_conservation_under_random_operations(seed: int) -> None:
    """in_flight per tenant == its live tickets' entries, and the server's in_flight their sum, after
    every operation, whatever the order of enters and releases (each release idempotent)."""
    rng = random.Random(seed)
    running = [0]
    gate = AdmissionGate(rng.randint(1, 12), lambda: running[0])
    tenants = [Tenant("a", max_requests=rng.randint(1, 6)), Tenant("b"), Tenant("c", max_requests=3)]
    live = []
    for _ in range(80):
        if rng.random() < 0.5:
            try:
                live.append(gate.enter(rng.choice(tenants), rng.randint(1, 3)))
                assert gate.waiting() <= gate.max_queue  # what waits never passes the bound it entered under
            except (QueueFull, NeverFits):
                pass
        elif live:
            ticket = rng.choice(live)
            gate.release(ticket, rng.randrange(ticket.count + 1))  # past the end: nothing
            if not any(ticket.live):
                live.remove(ticket)
        running[0] = rng.randint(0, gate.in_flight)
        gate.check()
        for t in tenants:
            if t.max_requests is not None:
                assert gate.tenant_in_flight(t.name) <= t.max_requests
    for ticket in live:
        for i in range(ticket.count):
            gate.release(ticket, i)
    gate.check()
    assert gate.in_flight == 0 and all(gate.tenant_in_flight(t.name) == 0 for t in tenants)


# ---- text ------------------------------------------------------------------------------------------
# A byte-level toy vocabulary: token i is one byte of UTF-8 text, so characters split across tokens.
_TEXT = "naïve café — 東京 ok 🙂 stop here. done"
_BYTES = list(_TEXT.encode())


def _decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_streams_exactly_the_full_text() -> None:
    d = Detokenizer(_decode)
    pieces = [d.push(b) for b in _BYTES] + [d.flush()]
    assert "".join(pieces) == _TEXT
    assert all("\ufffd" not in p for p in pieces)  # a split character is never emitted half-made


@settings(derandomize=True)
@given(st.lists(st.integers(1, 8), min_size=1, max_size=12))
def test_stop_matcher_never_leaks_a_stop_string(cuts: list[int]) -> None:
    m = StopMatcher(["stop here", "🙂 x"])
    out, i, k = [], 0, 0
    while i < len(_TEXT) and not m.stopped:
        c = cuts[k % len(cuts)]
        out.append(m.feed(_TEXT[i:i + c]))
        i, k = i + c, k + 1
    out.append(m.flush())
    assert m.stopped
    assert "".join(out) == _TEXT[:_TEXT.index("stop here")]


def test_stop_matcher_releases_held_text_at_the_end() -> None:
    m = StopMatcher(["abcd"])
    assert m.feed("xxab") == "xx"  # "ab" may start "abcd": held
    assert m.feed("c") == ""
    assert m.flush() == "abc"  # the stream ended: it was never a stop string
    assert not m.stopped


# ---- load client -------------------------------------------------------------------------------------
def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)


def test_vocab_mapping_keeps_prefixes() -> None:
    a, b = to_vocab([1, 2, 3, 4], 32000), to_vocab([1, 2, 3, 9], 32000)
    assert a[:3] == b[:3] and a[3] != b[3]
    assert all(1000 <= t < 32000 for t in a + b)
    assert to_vocab([1, 2, 3, 4], 32000, salt=1) != a  # another run: other tokens, no cross-run cache hits


def test_synthetic_workload_is_open_loop_and_bounded() -> None:
    spec = LoadSpec("http://127.0.0.1:1", rate=10.0, duration_s=2.0, seed=3)
    items = synthetic_workload(spec, prompt_len=8, output_len=4, shared_prefix=16)
    assert items == synthetic_workload(spec, prompt_len=8, output_len=4, shared_prefix=16)  # seeded
    assert all(0 < i.arrival_s < 2.0 for i in items) and 5 < len(items) < 60
    assert all(i.prompt[:16] == items[0].prompt[:16] and len(i.prompt) == 24 for i in items)


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://192.168.1.2", "http://8.8.8.8:80", "ftp://127.0.0.1"])
def test_load_client_refuses_non_loopback(url: str) -> None:
    with pytest.raises(ConfigError):
        check_loopback(url)


def test_load_client_accepts_loopback() -> None:
    assert check_loopback("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert check_loopback("http://localhost:9") == "http://localhost:9"
    assert check_loopback("http://[::1]:9") == "http://[::1]:9"


# ---- tenants ------------------------------------------------------------------------------------
def test_a_tenants_file_without_an_operator_section_is_valid_and_says_metrics_are_closed() -> None:
    tenants = Tenants.from_dict({"tenants": {"acme": {"api_keys": ["k"]}}})
    assert not tenants.has_operator and tenants.authenticate("Bearer k").tenant.name == "acme"
    assert tenants.describe().endswith("no [operator] keys: /metrics and /admin/ledger are closed")
    with_ops = Tenants.from_dict({"tenants": {"acme": {"api_keys": ["k"]}}, "operator": {"api_keys": ["op"]}})
    assert with_ops.describe().endswith("operator keys may read /metrics and /admin/ledger")


def test_the_smallest_limits_are_one_block_and_one_request() -> None:
    tenants = Tenants.from_dict({"tenants": {"acme": {"api_keys": ["k"], "max_blocks": 1, "max_requests": 1}}})
    assert tenants.by_name["acme"] == Tenant("acme", max_blocks=1, max_requests=1)
    with pytest.raises(ConfigError, match=r"\[tenants.acme\] max_requests must be an integer >= 1, got 0"):
        Tenants.from_dict({"tenants": {"acme": {"api_keys": ["k"], "max_requests": 0}}})


def test_config_errors_say_what_to_fix() -> None:
    with pytest.raises(ConfigError, match=r"^tenants: \[operator\] takes only api_keys = \[\.\.\.\]$"):
        Tenants.from_dict({"tenants": {"acme": {"api_keys": ["k"]}}, "operator": {"keys": ["op"]}})
    with pytest.raises(ConfigError, match="^--api-key must not be empty$"):
        Tenants.single_tenant("")


def test_single_tenant_mode_says_whether_a_key_is_checked() -> None:
    assert Tenants.single_tenant().describe().endswith("no API key is checked")
    assert Tenants.single_tenant("s3cret").describe().endswith("one API key (--api-key) is required")


# ---- the gate and the stop strings --------------------------------------------------------------
@pytest.mark.parametrize("count", [1.5, "2", None])
def test_a_ticket_for_a_count_that_is_not_an_integer_is_a_value_error(count: object) -> None:
    gate = AdmissionGate(8, lambda: 0)
    with pytest.raises(ValueError, match="at least one engine request"):
        gate.enter(Tenant("acme"), count)  # type: ignore[arg-type]
    assert gate.in_flight == 0


def test_no_stop_strings_pass_the_text_through() -> None:
    for stops in ([], [""]):
        matcher = StopMatcher(stops)
        assert matcher.feed("Hello") == "Hello" and matcher.feed(" world") == " world" and not matcher.stopped
