"""The growth pass picks its victims from a lazily re-scored heap (``VictimQueue``) instead of scoring
every running request again for each preemption. That is exact only because no victim key goes down
while requests grow; these runs check it: at every preemption, under pressure, with shared prefixes,
branches and swaps, the victim is the one a full scan (``pick_victim``) names at that instant."""

from __future__ import annotations

import random

import pytest

from kvledger.core.ledger import KVLedger
from kvledger.scheduler import (
    GenRequest,
    HostPool,
    RecoveryCosts,
    Scheduler,
    SchedulerConfig,
    TransferModel,
)
from kvledger.scheduler.victims import VICTIM_POLICIES, held_blocks, pick_victim, replay_tokens

try:  # the module name pytest gives tests/scheduler/test_scheduler.py depends on its import mode
    from tests.scheduler.test_scheduler import BS, FakeEngine, assert_drained, toks
except ImportError:  # pragma: no cover
    from test_scheduler import BS, FakeEngine, assert_drained, toks


def _requests(rng: random.Random, count: int) -> list[GenRequest]:
    heads = [[rng.randrange(1000) for _ in range(rng.choice((4, 8, 13)))] for _ in range(3)]
    out = []
    for i in range(count):
        own = [rng.randrange(1000) for _ in range(rng.randrange(1, 12))]
        prompt = (heads[i % 3] + own) if i % 2 else own
        out.append(GenRequest(f"r{i}", prompt, rng.randrange(4, 30), n=1 + (i % 5 == 0),
                              priority=rng.randrange(3)))
    return out


@pytest.mark.parametrize("recovery", ["recompute", "swap"])
@pytest.mark.parametrize("victim", [v for v in VICTIM_POLICIES.names() if v != "latest"])
@pytest.mark.parametrize("seed", range(4))
def test_every_pick_equals_a_full_scan(victim: str, recovery: str, seed: int) -> None:
    rng = random.Random(seed)
    cfg = SchedulerConfig(policy="incremental", on_growth_failure="preempt", victim=victim, recovery=recovery,
                          watermark=0.0, max_running=12, token_budget=24, prefill_chunk=8)
    s = Scheduler(KVLedger(40, BS), cfg, host=HostPool(400),
                  costs=RecoveryCosts(transfer=TransferModel(link_Bps=25e9)))
    picks: list[str | None] = []
    original = s.pick_victim

    def checked() -> str | None:
        expected = pick_victim(victim, s.ledger, s.running)
        got = original()
        assert got == expected, f"step {s._step}: the queue picked {got}, a full scan {expected}"
        picks.append(got)
        return got

    s.pick_victim = checked  # type: ignore[method-assign]
    for r in _requests(rng, 24):
        s.add(r)
    engine = FakeEngine(s)
    engine.drain(limit=2000)
    assert len(picks) >= 3, "the workload must preempt"
    assert all(br.finish_reason in ("length", "rejected: the request outgrew the whole pool")
               for rid in s.finished for br in s.branches(rid))
    assert_drained(s)


def test_pick_victim_between_steps_sees_what_the_last_step_confirmed() -> None:
    """min_waste (held blocks x tokens a recompute replays). P and Q share an 8-token prompt (2 blocks),
    R has a 2-token prompt (1 block). Planned but not run: P holds 2 blocks and would replay 8 tokens,
    16; R 1 x 2 = 2: R is the victim. Once the step is confirmed P's two blocks are written and Q holds
    them too, so P replays only its sampled token: 2 x (9 - 8) = 2, less than R's 1 x 3 = 3 -- P is now
    the victim, as a full scan says."""
    led = KVLedger(32, BS)
    s = Scheduler(led, SchedulerConfig(policy="full", victim="min_waste"))
    s.add(GenRequest("P", toks(8, 100), 8))
    s.add(GenRequest("Q", toks(8, 100), 8))
    s.add(GenRequest("R", toks(2, 900), 8))
    engine = FakeEngine(s)
    plan = s.schedule()
    assert s.pick_victim() == "R"
    s.confirm(plan, engine.run(plan))
    assert pick_victim("min_waste", led, s.running) == "P"
    assert s.pick_victim() == "P"


def test_min_waste_counts_a_family_once_and_keeps_only_blocks_others_hold() -> None:
    """Blocks of 4. F (6-token prompt, n=2) and P (8 tokens) run a step; then Q (P's prompt: both its
    blocks are hits) and R (P's first block, then its own) join. After the second step, by hand:

    * F: its branches hold blocks {f0 shared, f1, f1'} = 3 distinct; the shared head is held only by
      F itself, so both branches replay all 8 tokens: 3 x 16 = 48 (branch 0 alone would say 2 x 4);
    * P: 3 blocks, its 2 written blocks are held by Q too, 10 - 8 = 2 tokens to replay: 6;
    * Q: 2 blocks, both written and shared -- every block kept, 9 - 8 = 1 token: 2;
    * R: 2 blocks, the first shared and written, the second its own: 9 - 4 = 5 tokens: 10."""
    led = KVLedger(32, BS)
    s = Scheduler(led, SchedulerConfig(policy="full", victim="min_waste"))
    s.add(GenRequest("F", toks(6, 0), 8, n=2))
    s.add(GenRequest("P", toks(8, 100), 8))
    engine = FakeEngine(s)
    engine.step()
    s.add(GenRequest("Q", toks(8, 100), 8))
    s.add(GenRequest("R", toks(4, 100) + toks(4, 300), 8))
    engine.step()
    key = VICTIM_POLICIES["min_waste"]
    assert {rid: key(led, brs) for rid, brs in s.running.items()} == {"F": 48, "P": 6, "Q": 2, "R": 10}
    assert {rid: held_blocks(led, brs) for rid, brs in s.running.items()} == {"F": 3, "P": 3, "Q": 2, "R": 2}
    assert {rid: replay_tokens(led, brs) for rid, brs in s.running.items()} == {"F": 16, "P": 2, "Q": 1, "R": 5}
    assert s.pick_victim() == "Q"
    engine.drain()
    assert_drained(s)
