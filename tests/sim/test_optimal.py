"""The offline references of issue 38 against brute force on small traces: Belady's MIN under the prefix-tree
constraint is the honest optimum of hit blocks; the cost-aware flow bound brackets the honest optimum of
saved time (its relaxation above, its repaired schedule below) and equals Belady when every block costs
the same; no online policy on the real ledger ever beats Belady on the same trace and cache."""

from __future__ import annotations

import random

import pytest

from kvledger.core.eviction import policy_names
from kvledger.errors import ConfigError
from kvledger.sim.optimal import (
    Accesses,
    belady,
    brute_force,
    cost_bound,
    prompts_of_chains,
    replay_policy,
)


def random_trace(rng: random.Random, requests: int) -> Accesses:
    """Root paths of a small random tree (two roots, two children per node, depth up to 3); a request
    sometimes has a partial last block as well."""
    chains, feet = [], []
    for _ in range(requests):
        depth = rng.randint(1, 3)
        chain = [(rng.randrange(2),)]
        for _ in range(depth - 1):
            chain.append(chain[-1] + (rng.randrange(2),))
        chains.append(chain)
        feet.append(len(chain) + rng.randrange(2))
    return Accesses.of_chains(chains, block_size=2, footprints=feet)


CASES = [(seed, random_trace(random.Random(seed), random.Random(seed + 99).randint(3, 7))) for seed in range(40)]


@pytest.mark.parametrize(("seed", "acc"), CASES[:25])
def test_belady_reaches_the_honest_optimum_of_hit_blocks(seed: int, acc: Accesses) -> None:
    for cap in range(acc.largest_footprint, acc.largest_footprint + 3):
        assert sum(belady(acc, cap).hits) == brute_force(acc, cap), (seed, cap)


@pytest.mark.parametrize(("seed", "acc"), CASES[:25])
def test_the_cost_bound_brackets_the_honest_optimum_of_saved_time(seed: int, acc: Accesses) -> None:
    rng = random.Random(seed)
    costs = [1.0 + rng.random() * 3 * d for d in range(4)]  # deeper blocks cost more (attention)
    caps = list(range(acc.largest_footprint, acc.largest_footprint + 3))
    for bound in cost_bound(acc, caps, costs):
        honest = brute_force(acc, bound.capacity, costs)
        assert bound.lower <= honest + 1e-9 and honest <= bound.upper + 1e-6 * bound.upper + 1e-9, (seed, bound)


@pytest.mark.parametrize(("seed", "acc"), CASES[:15])
def test_with_equal_costs_the_bound_is_belady(seed: int, acc: Accesses) -> None:
    caps = [acc.largest_footprint, acc.largest_footprint + 2]
    for bound in cost_bound(acc, caps, [1.0] * 4):
        hits = sum(belady(acc, bound.capacity).hits)
        assert bound.upper == pytest.approx(hits) and bound.lower == pytest.approx(hits)


def test_the_relaxation_can_overstate_and_its_repair_is_honest() -> None:
    """Two requests share 'a' -> 'ab'; a third reuses only 'x'. With room for one cached block between
    them, the flow keeps the costlier 'ab' without its parent: the upper bound counts it, the honest
    optimum and the repaired schedule keep 'a' (or 'x')."""
    acc = Accesses.of_chains([["a", "ab"], ["x"], ["a", "ab"]], footprints=[2, 2, 2])
    costs = [1.0, 5.0]
    (bound,) = cost_bound(acc, [3], costs)
    honest = brute_force(acc, 3, costs)
    assert honest == 1.0 and bound.upper == pytest.approx(5.0, rel=0.006) and bound.lower == 0.0


@pytest.mark.parametrize("name", policy_names())
def test_no_online_policy_beats_belady_on_the_ledger(name: str) -> None:
    for seed, acc in CASES[::4]:
        prompts = prompts_of_chains(acc)
        for cap in (acc.largest_footprint + 1, acc.largest_footprint + 2):
            online = sum(replay_policy(prompts, acc.block_size, cap, name).hits)
            assert online <= sum(belady(acc, cap).hits), (seed, cap)


def test_lru_on_the_ledger_matches_a_hand_computed_run() -> None:
    """Cache of 3 blocks: [a ab] [x xy] [a ab]. The second request needs 2 blocks, so one of the first
    request's goes: LRU takes 'ab' (the tail is released first), keeping 'a' for the third request's hit;
    Belady does the same ('ab' and 'a' are next used together; the deeper goes). With 4 blocks both hit
    all of it."""
    acc = Accesses.of_chains([["a", "ab"], ["x", "xy"], ["a", "ab"]], block_size=2)
    assert replay_policy(prompts_of_chains(acc), 2, 3, "lru").hits == [0, 0, 1]
    assert replay_policy(prompts_of_chains(acc), 2, 4, "lru").hits == [0, 0, 2]
    assert belady(acc, 3).hits == [0, 0, 1] and belady(acc, 4).hits == [0, 0, 2]


def test_a_request_larger_than_the_cache_is_refused_by_name() -> None:
    acc = Accesses.of_chains([["a", "ab", "abc"]])
    with pytest.raises(ConfigError, match="more than the cache"):
        belady(acc, 2)
    with pytest.raises(ConfigError, match="longest chain"):
        cost_bound(acc, [3], [1.0])
