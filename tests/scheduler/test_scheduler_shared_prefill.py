"""Same-step prefix sharing: a request admitted with prefix hits that another request is still filling.

A hit block is *pending* from the moment its filler is admitted (it is indexed then) until the step that
writes it is confirmed. A request that finds such hits reads them in the step its filler's prefill writes
them (the executor contract: every work's K/V of a layer is written before any work reads that layer),
waits for a filler admitted before it that will write them in a later step, and computes them itself only
when nobody will. Every plan is carried out by ``FakeEngine`` (tests/scheduler/test_scheduler.py), which checks the
value of every position a work reads and that every read of a slot written in the same step is declared
in ``StepPlan.shared_reads``; counted prefill tokens are the sum of the works' lengths.
"""

from __future__ import annotations

import pytest

from kvledger.core.ledger import KVLedger
from kvledger.errors import InvariantError
from kvledger.scheduler import (
    Driver,
    GenRequest,
    Scheduler,
    SchedulerConfig,
    SharedRead,
    StepOutput,
    StepPlan,
)

try:  # the module name pytest gives tests/scheduler/test_scheduler.py depends on its import mode
    from tests.scheduler.test_scheduler import BS, FakeEngine, assert_drained, expected_output, toks
except ImportError:  # pragma: no cover
    from test_scheduler import BS, FakeEngine, assert_drained, expected_output, toks

HEAD = toks(12, 500)  # 3 full blocks of 4


class FakeExecutor:
    """``FakeEngine`` behind the driver's executor protocol; counts computed tokens per step."""

    def __init__(self, s: Scheduler, fail: set[str] | None = None) -> None:
        self.engine = FakeEngine(s)
        self.fail = fail or set()  # requests whose part raises (only when run apart by the driver)
        self.tokens: list[int] = []  # tokens each executed plan computes
        self.calls: list[list[str]] = []  # request ids of each execute()

    def execute(self, plan: StepPlan) -> StepOutput:
        rids = sorted({w.request_id for w in plan.works})
        self.calls.append(rids)
        bad = self.fail & set(rids)
        if bad:
            raise RuntimeError(f"part of {sorted(bad)} failed")
        self.tokens.append(plan.num_tokens)
        return StepOutput(self.engine.run(plan))


def prefill_tokens(plans: list[StepPlan]) -> int:
    return sum(w.end - w.start for p in plans for w in p.prefills)


def computed(plans: list[StepPlan], seq_id: str) -> list[tuple[int, int]]:
    return [(w.start, w.end) for p in plans for w in p.works if w.seq_id == seq_id]


def test_requests_admitted_with_the_first_filler_read_its_prefix_in_the_same_step() -> None:
    """A writes the 12-token head; B, D and E are admitted in the same step and read it from A's work
    instead of computing it again. E's prompt is exactly the head: it computes only its last token (its
    logits give the first output token). Step 0 computes 17 + 3 + 7 + 6 + 1 = 34 tokens, not 17 + 15 +
    7 + 18 + 12 = 69; the outputs are the model's own tokens (FakeEngine checked every position read)."""
    s = Scheduler(KVLedger(64, BS), SchedulerConfig(policy="full"))
    prompts = {"A": HEAD + toks(5, 100), "B": HEAD + toks(3, 200), "C": toks(7, 300),
               "D": HEAD + toks(6, 400), "E": list(HEAD)}
    for rid, p in prompts.items():
        s.add(GenRequest(rid, p, 4))
    engine = FakeEngine(s)
    plans = engine.drain()
    first = plans[0]
    assert first.admitted == list("ABCDE")
    assert [(w.seq_id, w.start, w.end) for w in first.works] == [
        ("A", 0, 17), ("B", 12, 15), ("C", 0, 7), ("D", 12, 18), ("E", 11, 12)]
    assert first.num_tokens == 34
    assert first.shared_reads == [SharedRead("B", "A", 0, 12), SharedRead("D", "A", 0, 12),
                                  SharedRead("E", "A", 0, 11)]
    assert first.shared_hits == [("B", 12), ("D", 12), ("E", 11)]
    assert [a.cached_tokens for a in first.admissions] == [0] * 5  # nothing was written at admission
    assert engine.shared_tokens == 12 + 12 + 11
    for rid, p in prompts.items():
        assert s.branches(rid)[0].output == expected_output(rid, len(p), 4)
        assert s.branches(rid)[0].finish_reason == "length"
    assert_drained(s)


def test_the_branches_of_a_family_keep_identical_works() -> None:
    """F (n=2) reads A's head in the step A writes it: both branches get the same work (an executor
    computes identical works once). G (n=2) waits for W, which is then cancelled: nobody will write the
    rest of the shared prefix, so branch 0 computes it -- and branch 1 does not read it from its own
    sibling, it gets the same work again instead of a shorter one that would be computed apart."""
    s = Scheduler(KVLedger(64, BS), SchedulerConfig(policy="full", prefill_chunk=8))
    s.add(GenRequest("A", HEAD + toks(2, 100), 3))
    s.add(GenRequest("F", HEAD + toks(3, 200), 3, n=2))
    engine = FakeEngine(s)
    first = engine.step()
    # A's first chunk covers blocks 0-1; block 2 is A's to write next step: F waits.
    assert [(w.seq_id, w.start, w.end) for w in first.works] == [("A", 0, 8)]
    second = engine.step()
    assert [(w.seq_id, w.start, w.end) for w in second.works] == [("A", 8, 14), ("F", 12, 15), ("F/1", 12, 15)]
    assert second.shared_reads == [SharedRead("F", "A", 8, 12), SharedRead("F/1", "A", 8, 12)]
    assert second.shared_hits == [("F", 12)]
    engine.drain()

    L = toks(24, 800)
    s.add(GenRequest("W", L + toks(2, 100), 3))
    s.add(GenRequest("G", L + toks(3, 200), 3, n=2))
    plan = engine.step()
    assert [(w.seq_id, w.start, w.end) for w in plan.works] == [("W", 0, 8)]  # G waits for W
    s.cancel("W")
    plan = engine.step()
    assert [(w.seq_id, w.start, w.end) for w in plan.works] == [("G", 8, 16), ("G/1", 8, 16)]
    assert plan.shared_reads == []
    engine.drain()
    assert [br.finish_reason for br in s.branches("G")] == ["length", "length"]
    assert_drained(s)


def test_a_reader_of_two_writers_reads_each_run_from_its_own_writer() -> None:
    """A writes the head; B (head + 8 tokens of its own + 1) writes blocks 3-4; C shares head + those 8
    tokens, so in the same step it reads blocks 0-2 from A's work and blocks 3-4 from B's."""
    mid = toks(8, 600)
    s = Scheduler(KVLedger(64, BS), SchedulerConfig(policy="full"))
    s.add(GenRequest("A", HEAD + toks(2, 100), 3))
    s.add(GenRequest("B", HEAD + mid + toks(1, 200), 3))
    s.add(GenRequest("C", HEAD + mid + toks(3, 300), 3))
    engine = FakeEngine(s)
    plans = engine.drain()
    assert plans[0].shared_reads == [SharedRead("B", "A", 0, 12), SharedRead("C", "A", 0, 12),
                                     SharedRead("C", "B", 12, 20)]
    assert computed(plans, "C")[0] == (20, 23)
    assert prefill_tokens(plans[:1]) == 14 + 9 + 3
    for rid in "ABC":
        assert s.branches(rid)[0].finish_reason == "length"
    assert_drained(s)


def test_a_reader_waits_for_an_earlier_filler_instead_of_computing_the_prefix_again() -> None:
    """Prefill chunks of 8 tokens: A (24-token prefix L + 2) fills L over three steps. B (L + 3) arrives
    with A. In step 0 it could read A's first chunk but block 2 is A's to write next step, so it waits;
    in step 1 likewise; in step 2 A writes the rest of L and B reads it in that very step and computes
    only its own 3 tokens. B computes 3 prompt tokens instead of 27 and samples its first token in step
    2, as it would have by recomputing (chunks of 8: 27 tokens in steps 0-3, its own budget allowing)
    -- one step before A, which still has its own 2 tokens to go."""
    L = toks(24, 700)
    s = Scheduler(KVLedger(64, BS), SchedulerConfig(policy="full", prefill_chunk=8))
    s.add(GenRequest("A", L + toks(2, 100), 3))
    s.add(GenRequest("B", L + toks(3, 200), 3))
    engine = FakeEngine(s)
    plans = engine.drain()
    assert computed(plans[:4], "A") == [(0, 8), (8, 16), (16, 24), (24, 26)]
    assert computed(plans[:3], "B") == [(24, 27)]
    assert [p.shared_reads for p in plans[:3]] == [[], [], [SharedRead("B", "A", 16, 24)]]
    assert plans[2].shared_hits == [("B", 24)]  # 0..16 written while it waited, 16..24 read in step 2
    first_token = {rid: next(i for i, p in enumerate(plans) for w in p.works if w.seq_id == rid and w.sample)
                   for rid in "AB"}
    assert first_token == {"A": 3, "B": 2}
    assert prefill_tokens(plans) == 26 + 3
    assert all(s.branches(r)[0].finish_reason == "length" for r in "AB")
    assert_drained(s)


def test_a_reader_reads_the_filler_s_last_chunk_in_the_step_it_is_written() -> None:
    """Chunks of 8: A's prompt is L (24 tokens) + 6, B arrives one step later, when A has written
    [0, 8): B skips the written blocks, waits a step, then reads [16, 24) from A's chunk in step 2 and
    computes its own tokens in that step."""
    L = toks(24, 700)
    s = Scheduler(KVLedger(64, BS), SchedulerConfig(policy="full", prefill_chunk=8))
    s.add(GenRequest("A", L + toks(6, 100), 3))
    engine = FakeEngine(s)
    plans = [engine.step()]
    s.add(GenRequest("B", L + toks(3, 200), 3))
    plans += engine.drain()
    assert computed(plans[:3], "A") == [(0, 8), (8, 16), (16, 24)]
    assert plans[1].admissions[0].cached_tokens == 8  # written at its admission
    assert computed(plans[:3], "B") == [(24, 27)]  # waited in step 1, then read A's chunk of step 2
    assert plans[2].shared_reads == [SharedRead("B", "A", 16, 24)]
    assert plans[2].shared_hits == [("B", 16)]  # 8..16 written while it waited, 16..24 read this step
    assert all(s.branches(r)[0].finish_reason == "length" for r in "AB")
    assert_drained(s)


def test_with_no_filler_left_the_reader_computes_the_prefix_itself() -> None:
    """A is cancelled after its first 8-token chunk: nobody will write the rest of L, so B (admitted with
    A, waiting for it) computes blocks 2-5 itself from the next step on."""
    L = toks(24, 700)
    s = Scheduler(KVLedger(64, BS), SchedulerConfig(policy="full", prefill_chunk=8))
    s.add(GenRequest("A", L + toks(2, 100), 3))
    s.add(GenRequest("B", L + toks(3, 200), 3))
    engine = FakeEngine(s)
    plans = [engine.step()]
    assert computed(plans, "B") == []  # waiting for A
    s.cancel("A")
    plans += engine.drain()
    assert computed(plans, "B")[:3] == [(8, 16), (16, 24), (24, 27)]
    assert s.branches("B")[0].finish_reason == "length"
    assert_drained(s)


def test_driver_counts_shared_tokens_as_hits_and_the_step_computes_fewer_tokens() -> None:
    """Through the driver: B's and D's 12 head tokens read from A count as hit tokens (what a client sees
    as cached prompt tokens), and the first step computes 34 tokens instead of 69."""
    s = Scheduler(KVLedger(64, BS), SchedulerConfig(policy="full"))
    ex = FakeExecutor(s)
    driver = Driver(s, ex, check_every=1, keep_records=True)
    prompts = {"A": HEAD + toks(5, 100), "B": HEAD + toks(3, 200), "C": toks(7, 300),
               "D": HEAD + toks(6, 400), "E": list(HEAD)}
    for rid, p in prompts.items():
        driver.submit(GenRequest(rid, p, 4))
    driver.run()
    assert ex.tokens[0] == 34
    hits = {m.request_id: m.hit_tokens for m in driver.records}
    assert hits == {"A": 0, "B": 12, "C": 0, "D": 12, "E": 11}
    assert_drained(s)


def test_a_failing_writer_sends_its_readers_back_to_the_queue() -> None:
    """A's part of the step fails. The driver runs the step again one request at a time: A ends with the
    error, B and D -- which read A's head in that step -- do not run (what they would read was never
    written) and go back to the waiting queue; C, independent, completes. B and D are then admitted
    again, find nobody writing the head, compute it, and finish with the model's own tokens."""
    s = Scheduler(KVLedger(64, BS), SchedulerConfig(policy="full"))
    ex = FakeExecutor(s, fail={"A"})
    driver = Driver(s, ex, check_every=1, keep_records=True)
    prompts = {"A": HEAD + toks(5, 100), "B": HEAD + toks(3, 200), "C": toks(7, 300),
               "D": HEAD + toks(6, 400)}
    for rid, p in prompts.items():
        driver.submit(GenRequest(rid, p, 4))
    result = driver.step()
    assert [rid for rid, _ in result.failed] == ["A"]
    # the batch, then the parts: A (fails), C; B and D are never run
    assert ex.calls[0] == ["A", "B", "C", "D"]
    assert sorted(map(tuple, ex.calls[1:])) == [("A",), ("C",)]
    assert [u[0].request.request_id for u in s.waiting] == ["B", "D"]  # in their order, at the front
    assert s.preemptions == 0
    ex.fail.clear()
    driver.run()
    records = {m.request_id: m for m in driver.records}
    assert records["A"].finish_reason.startswith("error: RuntimeError: part of ['A'] failed")
    for rid in prompts:
        if rid != "A":
            assert records[rid].finish_reason == "length"
            assert records[rid].generated == 4
    # Re-admitted in one step: B computes the head (nobody else will), D reads it from B's work.
    assert records["D"].readmit_hit_tokens == 12 and records["B"].readmit_hit_tokens == 0
    assert_drained(s)


def test_circular_shared_reads_are_an_invariant_error() -> None:
    """A plan never has them (a writer is always scheduled before its readers); the driver refuses to
    guess an order if one is handed to it."""
    s = Scheduler(KVLedger(64, BS), SchedulerConfig(policy="full"))
    ex = FakeExecutor(s, fail={"C"})
    driver = Driver(s, ex)
    for rid, p in {"A": HEAD + toks(5, 100), "B": HEAD + toks(3, 200), "C": toks(7, 300)}.items():
        driver.submit(GenRequest(rid, p, 4))
    original = s.schedule

    def schedule() -> StepPlan:
        plan = original()
        plan.shared_reads.append(SharedRead("A", "B", 0, 4))  # A reads B while B reads A: a cycle
        return plan

    s.schedule = schedule  # type: ignore[method-assign]
    with pytest.raises(InvariantError, match="circular shared reads"):
        driver.step()


def test_the_peer_workload_shape_computes_a_shared_header_once() -> None:
    """The shape of the peer workload (benchmarks/peers.py), scaled to this file's 4-token blocks: 32
    prompts of 16..128 tokens submitted at once, the even ones opening with one 64-token header (16
    blocks, as the peers' 256 tokens are 16 blocks of 16), a step budget of 256 blocks' worth of tokens,
    32 running. Before, the requests admitted in the header writer's step computed the header again;
    now it is computed exactly once: 15 x 64 prompt tokens are skipped -- every full block two prompts
    share -- and they count as the requests' hit tokens."""
    import random

    rng = random.Random(3)
    header = [rng.randrange(32000) for _ in range(64)]
    prompts = []
    for i in range(32):
        n = rng.randrange(16, 129)
        prompts.append(header + [rng.randrange(32000) for _ in range(max(n - 64, 11))] if i % 2 == 0
                       else [rng.randrange(32000) for _ in range(n)])
    s = Scheduler(KVLedger(2048, BS), SchedulerConfig(policy="full", token_budget=1024, max_running=32))
    ex = FakeExecutor(s)
    driver = Driver(s, ex, keep_records=True, check_every=1)
    for i, p in enumerate(prompts):
        driver.submit(GenRequest(f"p{i}", p, 2))
    driver.run(max_steps=400)
    assert len(driver.records) == 32 and all(m.finish_reason == "length" for m in driver.records)
    assert sum(ex.tokens) == sum(len(p) for p in prompts) - 15 * 64 + 32  # + one decode each
    assert sum(m.hit_tokens for m in driver.records) == 15 * 64
    assert_drained(s)


def test_after_a_part_fails_the_other_ready_parts_run_before_the_readers_that_waited() -> None:
    """Step 1 admits W, X, R, Y (in that order); R's prompt opens with W's 12-token head, which it reads
    from W's work of the same step. X's part raises, so the driver runs the step again one request at a
    time: a pass runs every part that is ready, in plan order -- W, X (fails), Y -- and R, which waited
    for its writer W, runs in the next pass. X ends with the error; W, R and Y finish normally."""
    head = toks(12, 500)  # 3 full blocks of 4
    s = Scheduler(KVLedger(64, BS), SchedulerConfig(policy="full"))
    ex = FakeExecutor(s, fail={"X"})
    driver = Driver(s, ex, check_every=1, keep_records=True)
    prompts = {"W": head + toks(5, 100), "X": toks(7, 300), "R": head + toks(3, 200), "Y": toks(6, 400)}
    for rid, p in prompts.items():
        driver.submit(GenRequest(rid, p, 4))
    result = driver.step()
    assert [rid for rid, _ in result.failed] == ["X"]
    assert ex.calls == [["R", "W", "X", "Y"], ["W"], ["X"], ["Y"], ["R"]]
    driver.run()
    reasons = {m.request_id: m.finish_reason for m in driver.records}
    assert reasons == {"X": "error: RuntimeError: part of ['X'] failed", "W": "length", "R": "length",
                       "Y": "length"}
