"""The admission lab (`kvledger.lab.run_lab`): the seed's numbers and their internal consistency."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.core.identity import CacheContext
from kvledger.errors import ConfigError
from kvledger.lab import LabSpec, growth_bound, lab_requests, run_growth, run_lab
from kvledger.scheduler import Scheduler


def seed(**overrides) -> LabSpec:
    """The seed's lab: 256 blocks of 16 tokens, 8 requests of 2,048 + 257 sharing the whole prompt."""
    spec = dict(pool_blocks=256, block_size=16, requests=8, prompt=2048, shared_prefix=2048, max_new=257)
    spec.update(overrides)
    return LabSpec(**spec)


def pick(result: dict, *keys: str) -> tuple:
    return tuple(result[key] for key in keys)


FIGURES = ("blocks_per_request", "shared_prefix_blocks", "private_blocks_per_request", "blocks_needed_all",
           "blocks_needed_unshared", "admitted", "admitted_blocks", "free_blocks_after")


def assert_consistent(spec: LabSpec, r: dict) -> None:
    """Every figure of a lab result agrees with its decisions and with the seed's ownership arithmetic."""
    bs = spec.block_size
    per_request = -(-(spec.prompt + spec.max_new) // bs)
    assert r["blocks_per_request"] == per_request
    # two same-group requests share the full blocks of the common prefix (never a partial one)
    shared = spec.shared_prefix // bs if spec.prefix_caching else 0
    assert r["shared_prefix_blocks"] == shared
    private = per_request - shared
    assert r["private_blocks_per_request"] == private

    decisions = r["decisions"]
    assert len(decisions) == spec.requests
    admitted = [d for d in decisions if d["outcome"] == "admitted"]
    assert r["admitted"] == len(admitted)
    for i, d in enumerate(decisions):
        assert d["request"] == f"req-{i}" and d["group"] == f"group-{i % spec.groups}"
        if d["outcome"] == "never":
            assert per_request > spec.pool_blocks and d["blocks_new"] == d["blocks_promised"] == 0
            continue
        # a decision's blocks are shared hits + newly allocated prompt blocks + promised output blocks
        assert d["blocks_total"] == per_request
        assert d["blocks_shared"] + d["blocks_new"] + d["blocks_promised"] == d["blocks_total"]
        assert d["blocks_promised"] == per_request - -(-spec.prompt // bs)
        assert d["blocks_shared"] <= shared
    # shared blocks are charged once: to the first admitted request of each group, as its new blocks
    assert r["admitted_blocks"] == sum(d["blocks_new"] + d["blocks_promised"] for d in admitted)
    groups_in = {d["group"] for d in admitted}
    assert r["admitted_blocks"] == len(groups_in) * shared + len(admitted) * private
    assert r["admitted_blocks"] <= spec.pool_blocks
    u = r["usage"]
    assert (u["total"], u["sequences"], u["retained"]) == (spec.pool_blocks, len(admitted), 0)
    assert u["active"] + u["promised"] == r["admitted_blocks"]  # live blocks + unmaterialised promises
    assert r["free_blocks_after"] == u["available"] == spec.pool_blocks - r["admitted_blocks"]
    # what all of them would need together, and without any sharing
    groups_used = min(spec.groups, spec.requests)
    assert r["blocks_needed_all"] == groups_used * shared + spec.requests * private
    assert r["blocks_needed_unshared"] == spec.requests * per_request
    # admission goes in arrival order and a refusal does not block later requests: any not_now
    # request really did not fit beside what was admitted before it
    used = 0
    seen: set[str] = set()
    for d in decisions:
        cost = d["blocks_new"] + d["blocks_promised"]
        if d["outcome"] == "admitted":
            used += cost
            seen.add(d["group"])
        elif d["outcome"] == "not_now":
            assert used + cost > spec.pool_blocks
            assert d["blocks_shared"] == (shared if d["group"] in seen else 0)


# ---- the seed --------------------------------------------------------------------------------------

def test_seed_shared_prefix_one_group():
    spec = seed()
    r = run_lab(spec)
    assert pick(r, *FIGURES) == (145, 128, 17, 264, 1160, 7, 247, 9)
    assert [d["outcome"] for d in r["decisions"]] == ["admitted"] * 7 + ["not_now"]
    assert pick(r["decisions"][0], "blocks_shared", "blocks_new", "blocks_promised") == (0, 128, 17)
    assert all(pick(d, "blocks_shared", "blocks_new", "blocks_promised") == (128, 0, 17)
               for d in r["decisions"][1:])
    assert (r["usage"]["active"], r["usage"]["promised"]) == (128, 7 * 17)
    assert_consistent(spec, r)


def test_seed_every_request_its_own_trust_group():
    spec = seed(groups=8)
    r = run_lab(spec)
    assert pick(r, "blocks_needed_all", "blocks_needed_unshared", "admitted", "admitted_blocks",
                "free_blocks_after") == (1160, 1160, 1, 145, 111)
    assert all(d["blocks_shared"] == 0 for d in r["decisions"])
    # shared_prefix_blocks describes two requests of ONE group; with 8 groups of 1 nobody shares it
    assert r["shared_prefix_blocks"] == 128
    assert_consistent(spec, r)


def test_two_groups_share_within_and_copy_across():
    spec = seed(groups=2)
    r = run_lab(spec)
    assert r["blocks_needed_all"] == 2 * 128 + 8 * 17 == 392
    # req-0 (group-0) fits; req-1 (group-1) needs its own 145; group-0's later requests need only 17
    assert [d["outcome"] for d in r["decisions"]] == ["admitted", "not_now"] * 4
    assert pick(r, "admitted", "admitted_blocks", "free_blocks_after") == (4, 128 + 4 * 17, 60)
    assert_consistent(spec, r)
    roomy = seed(groups=2, pool_blocks=392)
    r = run_lab(roomy)
    assert pick(r, "admitted", "admitted_blocks", "free_blocks_after") == (8, 392, 0)
    assert_consistent(roomy, r)


@pytest.mark.parametrize(
    ("max_new", "figures"),
    [
        (257, (145, 128, 17, 264, 1160, 7, 247, 9)),
        (256, (144, 128, 16, 256, 1152, 8, 256, 0)),  # 2,304 tokens is exactly 144 blocks: all eight fit
        (129, (137, 128, 9, 200, 1096, 8, 200, 56)),
        (0, (128, 128, 0, 128, 1024, 8, 128, 128)),
    ],
)
def test_shorter_output_allowance(max_new, figures):
    spec = seed(max_new=max_new)
    r = run_lab(spec)
    assert pick(r, *FIGURES) == figures
    assert_consistent(spec, r)


def test_prefix_not_block_aligned_shares_only_full_blocks():
    spec = seed(shared_prefix=1000)  # 62 full blocks (992 tokens); the 63rd mixes in private tokens
    r = run_lab(spec)
    assert pick(r, *FIGURES) == (145, 62, 83, 62 + 8 * 83, 1160, 2, 62 + 2 * 83, 256 - 228)
    assert pick(r["decisions"][1], "blocks_shared", "blocks_new", "blocks_promised") == (62, 66, 17)
    assert_consistent(spec, r)


def test_prompt_not_block_aligned_keeps_a_private_tail():
    spec = seed(prompt=2040, shared_prefix=2040)  # 127 full shared blocks + an 8-token partial tail each
    r = run_lab(spec)
    assert pick(r, *FIGURES) == (144, 127, 17, 127 + 8 * 17, 8 * 144, 7, 127 + 7 * 17, 10)
    # the identical partial tail is never indexed, so every request allocates its own
    assert all(pick(d, "blocks_shared", "blocks_new", "blocks_promised") == (127, 1, 16)
               for d in r["decisions"][1:])
    assert_consistent(spec, r)


def test_prefix_caching_off_means_no_sharing():
    spec = seed(prefix_caching=False)
    r = run_lab(spec)
    assert pick(r, *FIGURES) == (145, 0, 145, 1160, 1160, 1, 145, 111)
    assert all(d["blocks_shared"] == 0 for d in r["decisions"])
    assert_consistent(spec, r)


def test_no_common_prefix_means_no_sharing():
    for shared_prefix in (0, 15):  # shorter than a block: nothing to index
        spec = seed(shared_prefix=shared_prefix)
        r = run_lab(spec)
        assert pick(r, "shared_prefix_blocks", "blocks_needed_all", "admitted") == (0, 1160, 1)
        assert_consistent(spec, r)


def test_request_larger_than_the_pool_is_never_admitted():
    spec = seed(pool_blocks=144)  # one block short of one request
    r = run_lab(spec)
    assert r["admitted"] == r["admitted_blocks"] == 0
    assert {d["outcome"] for d in r["decisions"]} == {"never"}
    assert r["free_blocks_after"] == 144
    assert_consistent(spec, r)
    exact = seed(pool_blocks=145)
    assert run_lab(exact)["admitted"] == 1


def test_a_single_request():
    spec = seed(requests=1)
    r = run_lab(spec)
    assert pick(r, "admitted", "admitted_blocks", "blocks_needed_all", "blocks_needed_unshared") == (
        1, 145, 145, 145)
    assert len(r["decisions"]) == 1


# ---- the requests the lab builds -------------------------------------------------------------------

def test_lab_requests_share_tokens_across_groups_but_not_contexts():
    spec = seed(prompt=40, shared_prefix=20, max_new=3, groups=3, requests=6)
    reqs = lab_requests(spec)
    assert [r.request_id for r in reqs] == [f"req-{i}" for i in range(6)]
    assert all(len(r.prompt) == 40 and r.max_new_tokens == 3 for r in reqs)
    assert len({tuple(r.prompt[:20]) for r in reqs}) == 1  # the same prefix tokens in every group
    assert len({tuple(r.prompt[20:]) for r in reqs}) == 6  # private suffixes all differ
    assert [r.context.trust_group for r in reqs] == ["group-0", "group-1", "group-2"] * 2
    assert all(isinstance(r.context, CacheContext) and r.context.model == "lab" for r in reqs)
    assert len({r.context.root_digest() for r in reqs}) == 3


@pytest.mark.parametrize(
    "overrides",
    [
        {"pool_blocks": 0}, {"block_size": 0}, {"requests": 0}, {"prompt": 0}, {"groups": 0},
        {"shared_prefix": -1}, {"max_new": -1}, {"shared_prefix": 2049}, {"groups": 9},
        {"requests": True}, {"prompt": 2048.0},
    ],
)
def test_bad_lab_specs_are_config_errors(overrides):
    with pytest.raises(ConfigError):
        seed(**overrides)


# ---- consistency over many shapes ------------------------------------------------------------------

@st.composite
def lab_specs(draw) -> LabSpec:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    requests = draw(st.integers(1, 6))
    prompt = draw(st.integers(1, 80))
    return LabSpec(
        pool_blocks=draw(st.integers(1, 120)),
        block_size=block_size,
        requests=requests,
        prompt=prompt,
        shared_prefix=draw(st.integers(0, prompt)),
        max_new=draw(st.integers(1, 40)),  # max_new=0 has its own tests (test_shorter_output_allowance)
        groups=draw(st.integers(1, requests)),
        prefix_caching=draw(st.booleans()),
    )


@settings(max_examples=150, deadline=None)
@given(lab_specs())
def test_every_lab_result_is_internally_consistent(spec):
    assert_consistent(spec, run_lab(spec))


# ---- the growth run's bound, worked out before it runs ----------------------------------------------

@st.composite
def growth_specs(draw) -> LabSpec:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    requests = draw(st.integers(1, 12))
    branches = draw(st.sampled_from([1, 1, 2, 3]))
    prompt = draw(st.integers(1, 80))
    max_new = draw(st.integers(1, 30))
    per_request = -(-(prompt + max_new) // block_size) * branches
    return LabSpec(
        pool_blocks=draw(st.integers(max(1, per_request // 2), per_request * requests + 4)),
        block_size=block_size, requests=requests, prompt=prompt,
        shared_prefix=draw(st.sampled_from([prompt, prompt // 2, 0])), max_new=max_new,
        groups=draw(st.sampled_from([1, 1, requests, max(1, requests // 2)])),
        prefix_caching=draw(st.booleans()), branches=branches,
        policy=draw(st.sampled_from(["full", "incremental", "predicted"])),
    )


@settings(max_examples=150, deadline=None)
@given(growth_specs())
def test_growth_bound_covers_the_real_run(spec):
    """The web lab refuses controls by `growth_bound` before running them: the run never takes more
    steps, nor has its per-step audits visit more blocks, than the bound says."""
    audited = 0
    check = Scheduler.check

    def counting_check(sched: Scheduler) -> None:
        nonlocal audited
        ledger = sched.ledger
        audited += ledger.pool.num_blocks + sum(len(ledger.sequence(r).table.blocks) for r in ledger.sequences())
        check(sched)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Scheduler, "check", counting_check)
        growth = run_growth(spec)
    bound = growth_bound(spec)
    assert growth["steps"] <= bound.steps
    assert audited <= bound.audited_blocks


def test_run_lab_is_deterministic():
    assert run_lab(seed(groups=2, shared_prefix=1000)) == run_lab(seed(groups=2, shared_prefix=1000))


# ---- a ledger bug found while writing these tests ---------------------------------------------------
# (A KVLedger test, kept here because this file is the one its author owns; it belongs in test_ledger.py.)

def test_prefix_identity_follows_the_prompt_tokens_not_a_cached_request_id():
    """A prompt's block digests must describe the tokens admitted, whatever was asked before.

    Fails with the per-request-id digest cache in KVLedger._digests: a refused request's digests are
    remembered by request id and reused when the *same list object* comes back, even if its contents
    changed in place. The admitted blocks are then indexed under the old tokens' digests, and a later
    request with those old tokens is handed blocks that hold other tokens' KV.
    """
    from kvledger.core.ledger import KVLedger, Outcome, Request

    ledger = KVLedger(4, 4)
    prompt = list(range(1, 9))  # two full blocks
    assert ledger.admit(Request("x", prompt, 100)).outcome is Outcome.NEVER  # refused: nothing admitted
    prompt[:] = list(range(100, 108))  # the caller reuses its buffer for the real prompt
    assert ledger.admit(Request("x", prompt, 0)).admitted
    ledger.mark_computed("x", 8)
    ledger.release("x")
    ledger.check()
    # [1..8] was never computed, so it must not hit blocks that hold the KV of [100..107]
    assert ledger.admit(Request("y", list(range(1, 9)), 0)).blocks_hit == 0
    # and the identical tokens must hit them
    assert ledger.admit(Request("z", list(range(100, 108)), 0)).blocks_hit == 2
