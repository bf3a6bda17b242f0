"""Property test: random workloads through every policy x growth action x victim x recovery.

Each example draws a configuration, a small pool (4-token blocks), a host tier, prompts built from two
shared prefixes, ``max_new_tokens``, ``n`` in 1..3, optional speculative lookahead, arrival steps and
at most one cancellation mid-flight, and drives them through ``FakeEngine`` (tests/scheduler/test_scheduler.py),
which checks every KV position a step reads. After every schedule and confirm: ``Scheduler.check``
(ledger and host conservation). At the end: nothing leaked, and every branch ended with a reason --
exactly ``max_new_tokens`` tokens for ``length``, the model's deterministic tokens in any case.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.core.ledger import KVLedger
from kvledger.scheduler import (
    ADMISSION_POLICIES,
    GROWTH_ACTIONS,
    RECOVERY_MODES,
    VICTIM_POLICIES,
    GenRequest,
    HostPool,
    RecoveryCosts,
    Scheduler,
    SchedulerConfig,
    Status,
    TransferModel,
)

try:  # the module name pytest gives tests/scheduler/test_scheduler.py depends on its import mode
    from tests.scheduler.test_scheduler import BS, FakeEngine, sample_token
except ImportError:  # pragma: no cover
    from test_scheduler import BS, FakeEngine, sample_token

MAX_STEPS = 2000  # no example needs more than a few hundred steps
STALL_STEPS = 50  # steps without a token, a finish or an arrival: the scheduler is stuck


def never_blocks(prompt_len: int, max_new: int, lookahead: int, n: int) -> int:
    """Blocks the whole pool must have for the request to ever fit (the ledger's NEVER rule)."""
    longest = -(-(prompt_len + max_new + lookahead) // BS)
    return longest + (n - 1) * (longest - prompt_len // BS)


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    cfg = SchedulerConfig(
        policy=draw(st.sampled_from(ADMISSION_POLICIES.names())),
        on_growth_failure=draw(st.sampled_from(GROWTH_ACTIONS.names())),
        victim=draw(st.sampled_from(VICTIM_POLICIES.names())),
        recovery=draw(st.sampled_from(RECOVERY_MODES.names())),
        max_running=draw(st.integers(1, 8)),
        token_budget=draw(st.integers(3, 24)),
        prefill_chunk=draw(st.integers(2, 8)),
        watermark=draw(st.sampled_from([0.0, 0.1])),
        headroom_blocks=draw(st.integers(0, 2)),
        predicted_quantile=draw(st.sampled_from([0.5, 1.0])),
        predicted_min_samples=draw(st.integers(1, 3)),
    )
    prefixes = [list(range(1000 * (i + 1), 1000 * (i + 1) + draw(st.integers(0, 9)))) for i in range(2)]
    requests = []
    for i in range(draw(st.integers(1, 7))):
        head = draw(st.sampled_from([[], *prefixes]))
        prompt = head + list(range(100 * i, 100 * i + draw(st.integers(1, 7))))
        rid = f"r{i}"
        stop = frozenset()
        if draw(st.integers(0, 4)) == 0:  # stop early, on the token branch 0 samples at a drawn position
            stop = frozenset({sample_token(rid, len(prompt) + draw(st.integers(0, 5)))})
        requests.append((draw(st.integers(0, 8)), GenRequest(
            rid, prompt, draw(st.integers(1, 32)), n=draw(st.sampled_from([1, 1, 2, 3])),
            priority=draw(st.integers(0, 2)), lookahead=draw(st.sampled_from([0, 0, 1, 2])),
            stop_token_ids=stop)))
    # A pool between the median request's need and the largest's: most fit alone, few fit together.
    needs = sorted(never_blocks(len(r.prompt), r.max_new_tokens, r.lookahead, r.n) for _, r in requests)
    num_blocks = draw(st.integers(max(2, needs[len(needs) // 2]), max(2, needs[-1] + 1)))
    cancel = draw(st.none() | st.tuples(st.integers(0, len(requests) - 1), st.integers(0, 20)))
    return {
        "config": cfg,
        "num_blocks": num_blocks,
        "host_blocks": draw(st.sampled_from([0, 4, 16, 64])),
        "link_Bps": draw(st.sampled_from([1e8, 1e12])),  # auto: recompute / swap
        "requests": requests,
        "cancel": cancel,
        "seed": draw(st.integers(0, 2**16)),
    }


def run(sc: dict) -> Scheduler:
    cfg: SchedulerConfig = sc["config"]
    led = KVLedger(sc["num_blocks"], BS)
    host = HostPool(sc["host_blocks"])
    costs = RecoveryCosts(flops_per_token=1e9, flops_per_s=1e12, block_bytes=1_000_000,
                          transfer=TransferModel(link_Bps=sc["link_Bps"], staging_blocks=2))
    s = Scheduler(led, cfg, host=host, costs=costs)
    rng = random.Random(sc["seed"])
    engine = FakeEngine(s, accept=lambda w: rng.randint(1, w.lookahead + 1))
    pending = sorted(sc["requests"], key=lambda r: r[0])
    cancel_rid, cancel_step = (None, -1) if sc["cancel"] is None else (f"r{sc['cancel'][0]}", sc["cancel"][1])
    step = stalled = 0
    progress = None
    while pending or s.has_work():
        assert step < MAX_STEPS, "the scheduler did not finish"
        now = (sum(len(b.tokens) for brs in s._all.values() for b in brs), len(s.finished), len(pending))
        stalled = stalled + 1 if now == progress else 0
        progress = now
        assert stalled < STALL_STEPS, (
            f"no progress for {STALL_STEPS} steps: waiting {[u[0].seq_id for u in s.waiting]}, "
            f"swapped {[u[0].seq_id for u in s.swapped]}, running {list(s.running)}")
        while pending and pending[0][0] <= step:
            s.add(pending.pop(0)[1])
        plan = s.schedule()
        s.check()
        sampled = engine.run(plan)
        if step == cancel_step and cancel_rid in s._all:
            s.cancel(cancel_rid)  # mid-flight: the plan still names its blocks
            s.check()
        s.confirm(plan, sampled)
        s.check()
        step += 1
    return s


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_workloads_keep_every_law_and_leak_nothing(sc: dict) -> None:
    s = run(sc)
    cfg: SchedulerConfig = sc["config"]
    u = s.ledger.usage()
    assert (u.active, u.promised, u.deferred, u.sequences) == (0, 0, 0, 0), u
    assert s.ledger.outstanding_leases() == 0
    assert s.host.num_free == s.host.num_blocks
    assert not (s.running or s.waiting or s.swapped)
    if cfg.policy == "full":
        assert s.preemptions == 0
    for _, req in sc["requests"]:
        for br in s.branches(req.request_id):
            reason = br.finish_reason
            assert br.status is Status.FINISHED and reason, (br.seq_id, reason)
            out = br.output
            # Whatever happened (preemption, swap, drafts), the tokens are the model's own.
            assert out == [sample_token(br.seq_id, len(req.prompt) + i) for i in range(len(out))], br.seq_id
            if reason == "length":
                assert len(out) == req.max_new_tokens
            elif reason == "stop":
                assert out and out[-1] in req.stop_token_ids and len(out) <= req.max_new_tokens
            elif reason.startswith("never"):
                assert out == []
            elif reason.startswith("rejected"):
                assert cfg.policy != "full" and len(out) < req.max_new_tokens
            else:
                assert reason == "cancelled" and sc["cancel"] is not None, (br.seq_id, reason)
