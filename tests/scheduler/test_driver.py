"""The one step loop (``kvledger.scheduler.driver``) and the one request-metrics definition.

Timings run on a virtual clock with executors whose step time is fixed, so every TTFT, TPOT and
end-to-end figure below is worked out by hand. Faults are injected into the executor: the failing
request ends with the error, every other request's tokens equal an undisturbed run, nothing leaks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvledger.core.ledger import KVLedger
from kvledger.errors import ConfigError, InvariantError, LedgerError
from kvledger.scheduler import (
    ADMISSION_POLICIES,
    GROWTH_ACTIONS,
    RECOVERY_MODES,
    VICTIM_POLICIES,
    ConstantExecutor,
    Driver,
    GenRequest,
    HostPool,
    Registry,
    RequestMetrics,
    Scheduler,
    SchedulerConfig,
    StepOutput,
    StepPlan,
    VirtualClock,
    WallClock,
    distribution,
    percentile,
    summarize_requests,
)

BS = 4
SRC = Path(__file__).resolve().parents[2] / "src" / "kvledger"


def toks(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


class Scripted:
    """Token = f(branch, position) (never a draft); a fixed step time; optional faults."""

    def __init__(self, step_s: float = 0.01, stops: dict[tuple[str, int], int] | None = None) -> None:
        self.step_s = step_s
        self.stops = stops or {}
        self.calls: list[StepPlan] = []

    @staticmethod
    def token(seq_id: str, position: int) -> int:
        return 10 + (sum(map(ord, seq_id)) * 31 + position * 7) % 900

    def execute(self, plan: StepPlan) -> StepOutput:
        self.calls.append(plan)
        out = StepOutput(elapsed_s=self.step_s)
        for w in (*plan.prefills, *plan.decodes):
            if w.sample:
                out.sampled[w.seq_id] = [self.stops.get((w.seq_id, w.end), self.token(w.seq_id, w.end))]
        return out


def make(num_blocks: int = 32, executor=None, config: SchedulerConfig | None = None, host: HostPool | None = None,
         **driver_kw) -> Driver:
    sched = Scheduler(KVLedger(num_blocks, BS), config or SchedulerConfig(), host=host)
    return Driver(sched, executor or Scripted(), check_every=1, keep_records=True, **driver_kw)


def assert_clean(driver: Driver) -> None:
    s = driver.scheduler
    s.check()
    u = s.ledger.usage()
    assert (u.active, u.promised, u.deferred, u.sequences) == (0, 0, 0, 0), u
    assert s.ledger.outstanding_leases() == 0
    if s.host is not None:
        assert s.host.num_used == 0
    assert not driver.has_work()


# ---- one loop -------------------------------------------------------------------------------------
def _calls(path: Path, names: set[str]) -> list[int]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr in names]


# Files allowed a schedule/confirm call outside the Driver, each with why. vLLM's integration steps vLLM's own
# scheduler (its schedule()), not ours. The lab's hybrid-pool view steps a GroupLedger directly (it shows the
# prefix hits the Scheduler's hybrid pool does not keep yet); the hybrid-pool simulation runs on the Driver.
NOT_OUR_SCHEDULER = {
    "integrations/vllm/harness.py": "vLLM's Scheduler.schedule() on a fake model output",
    "integrations/vllm/scheduler.py": "vLLM's AsyncScheduler.schedule() (the plugin's base class)",
    "weblab/hybrid_view.py": "a GroupLedger stepped by hand (prefix hits the Scheduler's hybrid pool lacks)",
}


def test_only_the_driver_calls_schedule_and_confirm() -> None:
    """The engine, the simulator, the lab (and any face) step the scheduler through the Driver."""
    offenders, allowed = {}, set()
    for path in sorted(SRC.rglob("*.py")):
        if path == SRC / "scheduler" / "driver.py":
            continue
        lines = _calls(path, {"schedule", "confirm"})
        name = str(path.relative_to(SRC))
        if lines and name in NOT_OUR_SCHEDULER:
            allowed.add(name)
        elif lines:
            offenders[name] = lines
    assert offenders == {}
    assert allowed == set(NOT_OUR_SCHEDULER)  # an exception no longer needed is removed from the list
    assert _calls(SRC / "scheduler" / "driver.py", {"schedule"})  # the check itself can fail


def test_metrics_on_a_virtual_clock_are_exact() -> None:
    """Every step takes 10 ms. a: 8-token prompt, 3 tokens; b arrives at 15 ms; c after an idle gap;
    d has two branches, branch 1 stops after 2 tokens (TPOT follows the longest branch)."""
    stop = Scripted.token("d/1", 5) + 1000  # a token only branch 1 samples, at position 5
    driver = make(executor=Scripted(stops={("d/1", 5): stop}))
    out = driver.run([
        GenRequest("a", toks(8, 100), 3, arrival_s=0.0),
        GenRequest("b", toks(4, 200), 2, arrival_s=0.015),
        GenRequest("c", toks(4, 300), 1, arrival_s=1.0),
        GenRequest("d", toks(4, 400), 4, n=2, arrival_s=2.0, stop_token_ids=frozenset({stop})),
    ])
    m = {r.request_id: r for r in out}
    # a: prefill [0, 10 ms) gives token 1; decodes end at 20 and 30 ms.
    assert (m["a"].admitted_s, m["a"].ttft_s, m["a"].tpot_s, m["a"].e2e_s) == pytest.approx((0, 0.01, 0.01, 0.03))
    # b is due at 15 ms and joins the step that starts at 20 ms: token 1 at 30, token 2 at 40 ms.
    assert (m["b"].admitted_s, m["b"].ttft_s, m["b"].tpot_s, m["b"].e2e_s) == pytest.approx((0.02, 0.015, 0.01, 0.025))
    # c: the clock jumps to 1 s; one step is its whole life; one token has no TPOT.
    assert (m["c"].admitted_s, m["c"].ttft_s, m["c"].tpot_s, m["c"].e2e_s) == (1.0, pytest.approx(0.01), None,
                                                                              pytest.approx(0.01))
    # d: branch 0 makes 4 tokens (last at 2.04 s), branch 1 stops at its second (2.02 s).
    d = m["d"]
    assert (d.generated, d.longest, d.finish_reason) == (6, 4, "length,stop")
    assert (d.ttft_s, d.tpot_s, d.e2e_s) == pytest.approx((0.01, 0.03 / 3, 0.04))
    assert driver.steps == 3 + 1 + 1 + 4  # a's 3 (b rides along), b's last, c, d's 4
    s = summarize_requests(out)
    assert s["output_tokens"] == 3 + 2 + 1 + 6
    assert s["duration_s"] == pytest.approx(2.04)
    assert s["ttft_s"]["max"] == pytest.approx(0.015)
    assert s["completed"] == 3  # d ended "length,stop": a mix is not one completion reason
    assert_clean(driver)


def test_one_percentile_definition() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)  # linear between order statistics
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    assert distribution([1.0, 2.0, 3.0, 4.0]) == pytest.approx(
        {"mean": 2.5, "p50": 2.5, "p90": 3.7, "p99": 3.97, "max": 4.0})
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    m = RequestMetrics("x", "g", arrival_s=1.0, prompt_len=4, output_len=3, first_token_s=1.5, finish_s=2.5,
                       generated=3, longest=3)
    assert (m.ttft_s, m.tpot_s, m.e2e_s) == (0.5, 0.5, 1.5)


def test_wall_clock_replay_waits_for_arrivals() -> None:
    now = [100.0]
    slept: list[float] = []

    def sleep(dt: float) -> None:
        slept.append(dt)
        now[0] += dt

    driver = make(executor=Scripted(step_s=0.0), clock=WallClock(lambda: now[0], sleep), idle_wait_s=0.5)
    out = driver.run([GenRequest("a", toks(4, 1), 1, arrival_s=1.2)])
    # Nothing before the arrival: the driver sleeps towards it in slices of at most idle_wait_s.
    assert slept == pytest.approx([0.5, 0.5, 0.2])
    assert out[0].arrival_s == pytest.approx(101.2) and out[0].finish_reason == "length"


# ---- submit and cancel ----------------------------------------------------------------------------
def test_cancel_before_arrival_while_waiting_and_mid_flight() -> None:
    class CancelInFlight(Scripted):
        def execute(self, plan: StepPlan) -> StepOutput:
            if any(w.request_id == "flight" for w in plan.decodes):
                driver.cancel("flight")  # another thread, while the step runs
            return super().execute(plan)

    driver = make(num_blocks=12, executor=CancelInFlight())
    driver.submit(GenRequest("flight", toks(6, 100), 8))
    driver.submit(GenRequest("keep", toks(6, 200), 3))
    driver.submit(GenRequest("big", toks(30, 300), 4))  # waits: the pool is busy
    driver.submit(GenRequest("later", toks(4, 400), 2, n=2, arrival_s=5.0))
    first = driver.step()
    assert first.plan is not None and set(first.plan.admitted) == {"flight", "keep"}
    assert driver.cancel("big") and driver.cancel("later")
    assert not driver.cancel("nobody")
    second = driver.step()  # flight decodes and is cancelled while its step is in flight
    got = {f.request.request_id: f for f in (*first.finished, *second.finished)}
    assert got["big"].finish_reasons == ["cancelled"] and got["big"].outputs == [[]]
    assert got["later"].finish_reasons == ["cancelled", "cancelled"] and got["later"].outputs == [[], []]
    assert got["flight"].finish_reasons == ["cancelled"]
    assert got["flight"].outputs == [[Scripted.token("flight", 6)]]  # the in-flight token is dropped
    assert not driver.cancel("flight")
    driver.run()
    assert [r.request_id for r in driver.records][-1] == "keep" and driver.records[-1].finish_reason == "length"
    assert_clean(driver)


def test_bad_requests_are_refused_before_anything_changes() -> None:
    driver = make()
    for bad in (GenRequest("", [1], 1), GenRequest("a/1", [1], 1), GenRequest("a", [], 1),
                GenRequest("a", [1], 0), GenRequest("a", [1], 1.5), GenRequest("a", [1], 1, n=0),
                GenRequest("a", [1], 1, priority=1.5), GenRequest("a", [1], 1, arrival_s=float("nan"))):
        with pytest.raises(ConfigError):
            driver.submit(bad)
    assert not driver.has_work()
    driver.submit(GenRequest("a", [1], 1))
    with pytest.raises(LedgerError, match="already submitted"):
        driver.submit(GenRequest("a", [2], 1))
    driver.run()
    driver.submit(GenRequest("a", [3], 1))  # finished: the id may be used again
    driver.run()
    assert [r.request_id for r in driver.records] == ["a", "a"]
    assert_clean(driver)


# ---- faults ---------------------------------------------------------------------------------------
class Faulty(Scripted):
    """Raises whenever the plan runs a work of ``culprit`` (or, with ``once``, on the first step only)."""

    def __init__(self, culprit: str | None, once: bool = False, on: str = "works") -> None:
        super().__init__()
        self.culprit, self.once, self.on, self.raised = culprit, once, on, 0

    def execute(self, plan: StepPlan) -> StepOutput:
        hit = (any(w.request_id == self.culprit for w in (*plan.prefills, *plan.decodes)) if self.on == "works"
               else bool(plan.swap_out))
        if (hit and not self.once) or (self.once and not self.raised):
            self.raised += 1
            raise RuntimeError(f"boom {self.raised}")
        return super().execute(plan)


def _outputs(driver: Driver, requests: list[GenRequest]) -> dict[str, list[list[int]]]:
    outs: dict[str, list[list[int]]] = {}
    for r in requests:
        driver.submit(r)
    while driver.has_work():
        for f in driver.step().finished:
            outs[f.request.request_id] = f.outputs
    return outs


def _mixed() -> list[GenRequest]:
    return [GenRequest("a", toks(9, 100), 6), GenRequest("bad", toks(5, 200), 6, n=2),
            GenRequest("c", [*toks(8, 100), 7], 5, n=2)]


def test_a_failing_request_fails_alone_and_the_others_are_undisturbed() -> None:
    reference = _outputs(make(), _mixed())
    driver = make(executor=Faulty("bad"))
    outs = _outputs(driver, _mixed())
    assert outs["a"] == reference["a"] and outs["c"] == reference["c"]
    reasons = {r.request_id: r.finish_reason for r in driver.records}
    # boom 1: the whole step; boom 2: bad's own part when the step is run again request by request
    assert reasons["bad"] == "error: RuntimeError: boom 2" and reasons["a"] == reasons["c"] == "length"
    assert outs["bad"] == [[], []]
    assert_clean(driver)


class Index:
    """An integer type that is not ``int`` (as numpy's are): a token id of it is accepted."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


class Garbling(Scripted):
    """Samples ``value`` for every branch of ``rid`` once it has produced one token."""

    def __init__(self, rid: str, value) -> None:
        super().__init__()
        self.rid, self.value = rid, value

    def execute(self, plan: StepPlan) -> StepOutput:
        out = super().execute(plan)
        for w in plan.decodes:
            if w.request_id == self.rid and w.seq_id in out.sampled:
                out.sampled[w.seq_id] = self.value if isinstance(self.value, tuple) else [self.value]
        return out


@pytest.mark.parametrize("value", [-1, 2**32, "7", None, 3.0, True, b"x", ("7",)], ids=repr)
def test_an_executor_sampling_what_is_no_token_id_fails_that_request_alone(value) -> None:
    """Regression: the scheduler appended whatever the executor sampled -- 3.0 and True silently became
    tokens 3 and 1, "7" became 7, None and "x" raised an untyped error out of confirm that failed every
    request of the step, and -1 or 2**32 surfaced a step later from the ledger and ended the run. The
    executor is code an embedder writes: a request whose sampled tokens are no token ids now fails alone
    with a ConfigError naming it, the others' outputs are those of an undisturbed run, nothing leaks."""
    reference = _outputs(make(), _mixed())
    driver = make(executor=Garbling("bad", value))
    outs = _outputs(driver, _mixed())
    assert outs["a"] == reference["a"] and outs["c"] == reference["c"]
    reasons = {r.request_id: r.finish_reason for r in driver.records}
    assert reasons["a"] == reasons["c"] == "length"
    assert reasons["bad"].startswith("error: ConfigError: the executor's output: 'bad"), reasons["bad"]
    assert_clean(driver)


def test_an_integer_type_that_is_not_int_is_a_token_id() -> None:
    reference = _outputs(make(), _mixed())
    driver = make(executor=Garbling("bad", Index(7)))
    outs = _outputs(driver, _mixed())
    assert outs["a"] == reference["a"] and outs["c"] == reference["c"]
    assert {r.finish_reason for r in driver.records} == {"length"}
    assert all(type(t) is int and t == 7 for branch in outs["bad"] for t in branch[1:])
    assert_clean(driver)


def test_a_transient_step_failure_fails_nobody() -> None:
    reference = _outputs(make(), _mixed())
    driver = make(executor=Faulty(None, once=True))
    assert _outputs(driver, _mixed()) == reference
    assert {r.finish_reason for r in driver.records} == {"length"}
    assert_clean(driver)


def test_a_failing_swap_fails_the_victim_only() -> None:
    """Pool of 6: G and V grow until V (the latest) swaps itself out; the swap-out copy raises."""
    cfg = SchedulerConfig(policy="incremental", victim="latest", recovery="swap", watermark=0.0)
    requests = [GenRequest("G", toks(4, 100), 12), GenRequest("V", toks(6, 200), 9)]
    undisturbed = make(6, config=cfg, host=HostPool(16))
    reference = _outputs(undisturbed, requests)
    assert undisturbed.scheduler.preemptions == 1
    driver = make(6, executor=Faulty(None, on="swap"), config=cfg, host=HostPool(16))
    outs = _outputs(driver, requests)
    reasons = {r.request_id: r.finish_reason for r in driver.records}
    assert reasons == {"G": "length", "V": "error: RuntimeError: boom 2"}  # boom 1: the whole step
    assert outs["G"] == reference["G"]
    assert_clean(driver)


def test_an_exception_after_schedule_releases_what_the_step_took() -> None:
    """Regression (defect 5): an exception between schedule and confirm left the step's lease
    outstanding forever. Now the step's requests end with the error and everything is released."""
    def explode(plan: StepPlan, output: StepOutput) -> None:
        if plan.step == 1:
            raise KeyboardInterrupt

    driver = make(on_executed=explode)
    driver.submit(GenRequest("a", toks(6, 1), 4))
    driver.step()
    with pytest.raises(KeyboardInterrupt):
        driver.step()
    driver.scheduler.check()  # no lease outlives the step
    assert driver.scheduler.ledger.outstanding_leases() == 0
    driver.run()
    assert driver.records[0].finish_reason == "error: KeyboardInterrupt: "
    assert_clean(driver)


def test_check_notices_leases_nobody_owns() -> None:
    """Regression (defect 5): a lease that outlived its step went unnoticed by check()."""
    driver = make()
    driver.submit(GenRequest("a", toks(6, 1), 8))
    driver.step()
    s = driver.scheduler
    stray = s.ledger.lease(request_ids=["a"])  # no owner
    with pytest.raises(InvariantError, match="no owner"):
        s.check()
    s.ledger.end_lease(stray)
    lost = s.ledger.lease(request_ids=["a"], owner=f"{s.lease_owner} step 0")  # a step that is over
    with pytest.raises(InvariantError, match="outlived its step"):
        s.check()
    s.ledger.end_lease(lost)
    other = s.ledger.lease(request_ids=["a"], owner="kv-connector transfer 3")  # somebody else's: fine
    s.check()
    s.ledger.end_lease(other)
    driver.run()
    assert_clean(driver)


def test_the_stall_guard_names_a_scheduler_that_makes_no_progress() -> None:
    driver = make(stall_steps=3)
    driver.submit(GenRequest("a", toks(4, 1), 2))
    driver.scheduler.schedule = lambda: StepPlan(0)  # type: ignore[method-assign]
    driver.scheduler.confirm = lambda plan, sampled: []  # type: ignore[method-assign]
    with pytest.raises(InvariantError, match="no progress in 3 steps"):
        for _ in range(5):
            driver.step()


# ---- registries -----------------------------------------------------------------------------------
def test_registries_are_the_one_list_of_choices() -> None:
    assert ADMISSION_POLICIES.names() == ("full", "incremental", "predicted")
    assert GROWTH_ACTIONS.names() == ("defer", "preempt", "reject", "headroom")
    assert VICTIM_POLICIES.names() == ("latest", "priority", "least_computed", "min_waste")
    assert RECOVERY_MODES.names() == ("recompute", "swap", "auto")
    for key, registry in (("policy", ADMISSION_POLICIES), ("victim", VICTIM_POLICIES),
                          ("on_growth_failure", GROWTH_ACTIONS), ("recovery", RECOVERY_MODES)):
        with pytest.raises(ConfigError, match=f"{key} must be one of {', '.join(registry.names())}"):
            SchedulerConfig(**{key: "nope"})
    for bad in (dict(max_running=0), dict(token_budget=2.5), dict(watermark=1.0), dict(headroom_blocks=-1),
                dict(predicted_quantile=0), dict(max_running=True)):
        with pytest.raises(ConfigError):
            SchedulerConfig(**bad)
    reg: Registry[int] = Registry("widget")
    reg.register("a", 1, "first")
    with pytest.raises(ConfigError, match="already registered"):
        reg.register("a", 2)
    with pytest.raises(ConfigError, match="unknown widget 'b'; choose one of a"):
        reg["b"]
    assert list(reg) == ["a"] and reg.help("a") == "first" and "a" in reg and len(reg) == 1


def test_cli_choices_come_from_the_registries() -> None:
    import click

    from kvledger.cli.runtime_cmds import serve_trace_cmd
    from kvledger.cli.sim_cmds import simulate_cmd
    from kvledger.core.eviction import policy_names

    def choices(cmd: click.Command, name: str) -> tuple[str, ...]:
        (param,) = [p for p in cmd.params if p.name == name]
        assert isinstance(param.type, click.Choice)
        return tuple(param.type.choices)

    assert choices(simulate_cmd, "policy") == ADMISSION_POLICIES.names()
    assert choices(simulate_cmd, "victim") == VICTIM_POLICIES.names()
    assert choices(simulate_cmd, "recovery") == RECOVERY_MODES.names()
    assert choices(simulate_cmd, "eviction") == policy_names()
    assert choices(serve_trace_cmd, "policy") == ADMISSION_POLICIES.names()
    assert choices(serve_trace_cmd, "on_growth_failure") == GROWTH_ACTIONS.names()
    assert choices(serve_trace_cmd, "recovery") == RECOVERY_MODES.names()
    assert choices(serve_trace_cmd, "eviction") == policy_names()


def test_a_fresh_virtual_clock_only_moves_forward() -> None:
    clock = VirtualClock()
    clock.advance(0.5)
    clock.wait_until(0.2)
    assert clock.now() == 0.5
    with pytest.raises(InvariantError):
        clock.advance(-1)
    assert ConstantExecutor(token=3, step_s=0.25).execute(StepPlan(0)).elapsed_s == 0.25


@pytest.mark.parametrize("kwargs", [{"feed_window": 0}, {"feed_window": -2}, {"feed_window": 1.0},
                                    {"check_every": -1}, {"stall_steps": 0}, {"idle_wait_s": -0.1},
                                    {"idle_wait_s": float("inf")}, {"idle_wait_s": "0.05"}, {"check_every": True}])
def test_driver_settings_are_bounded_before_anything_runs(kwargs) -> None:
    """A feed window of 0 let no request into the scheduler, so ``run()`` stepped forever; every setting is
    now checked when the driver is built."""
    s = Scheduler(KVLedger(8, 4), SchedulerConfig())
    with pytest.raises(ConfigError, match="driver: "):
        Driver(s, ConstantExecutor(), **kwargs)


def test_a_feed_window_of_one_still_finishes_every_request() -> None:
    s = Scheduler(KVLedger(8, 4), SchedulerConfig())
    d = Driver(s, ConstantExecutor(7, 0.01), feed_window=1)
    out = d.run([GenRequest(f"q{i}", [1, 2, 3, i], 3) for i in range(3)])
    assert sorted(m.request_id for m in out) == ["q0", "q1", "q2"] and all(m.generated == 3 for m in out)


def test_run_stops_after_max_steps() -> None:
    """A request of 3 prompt tokens and 20 new tokens needs 20 steps; ``run(max_steps=3)`` returns after
    exactly 3 with the request still running (nothing finished), and the next run finishes it."""
    driver = Driver(Scheduler(KVLedger(16, BS)), ConstantExecutor())
    driver.submit(GenRequest("a", toks(3, 100), 20))
    assert driver.run(max_steps=3) == []
    assert driver.steps == 3 and driver.has_work()
    assert len(driver.scheduler.branches("a")[0].output) == 3  # one token per step
    seen: list[int] = []
    done = driver.run(progress=lambda d: seen.append(d.steps), progress_every=5)
    assert [m.request_id for m in done] == ["a"] and driver.steps == 20
    assert seen == [8, 13, 18, 20]  # every 5th step of this run (its steps 5, 10, 15), then at the end


def test_a_driver_step_returns_the_executors_output() -> None:
    """``StepResult.output`` is the executor's output of that step: the prefill of a 3-token prompt
    samples one token for "a", and the step took the output's elapsed time."""
    driver = Driver(Scheduler(KVLedger(16, BS)), ConstantExecutor())
    driver.submit(GenRequest("a", toks(3, 100), 4))
    result = driver.step()
    assert result.output is not None
    assert list(result.output.sampled) == ["a"]
    assert result.end_s - result.start_s == pytest.approx(result.output.elapsed_s)


def _metrics(rid: str, arrival: float, first: float | None, finish: float | None, reason: str, *,
             prompt: int = 10, generated: int = 0, longest: int = 0, hits: int = 0, readmit: int = 0,
             preemptions: int = 0) -> RequestMetrics:
    m = RequestMetrics(rid, "g", arrival, prompt, 8)
    m.first_token_s, m.finish_s, m.finish_reason = first, finish, reason
    m.generated, m.longest, m.hit_tokens, m.readmit_hit_tokens, m.preemptions = generated, longest, hits, readmit, \
        preemptions
    return m


def test_a_run_summary_counts_every_figure_by_hand() -> None:
    """Three requests: two completed, one failed with an error (its reason has a colon). Every figure of
    the summary is worked out here from the definitions in docs/scheduler.md."""
    reqs = [
        _metrics("a", 1.0, 2.0, 5.0, "length", prompt=10, generated=5, longest=5, hits=4, preemptions=1),
        _metrics("b", 2.0, 3.0, 4.0, "stop", prompt=20, generated=3, longest=3, readmit=2),
        _metrics("c", 3.0, None, 7.0, "error: RuntimeError: boom: twice", prompt=30),
    ]
    s = summarize_requests(reqs)
    assert s["requests"] == 3 and s["completed"] == 2
    assert s["finish_reasons"] == {"length": 1, "stop": 1, "error": 1}
    assert s["duration_s"] == 6.0  # first arrival 1.0 .. last finish 7.0
    assert s["output_tokens"] == 8
    assert s["throughput_tok_s"] == pytest.approx(8 / 6)
    assert s["throughput_req_s"] == pytest.approx(2 / 6)
    assert s["total_tok_s"] == pytest.approx((8 + 10 + 20) / 6)  # prompts of completed requests only
    assert s["ttft_s"]["mean"] == pytest.approx(1.0) and s["ttft_s"]["max"] == 1.0
    assert s["tpot_s"]["p50"] == pytest.approx((3 / 4 + 1 / 2) / 2)  # (5-2)/(5-1), (4-3)/(3-1)
    assert s["e2e_s"]["max"] == 4.0 and s["e2e_s"]["p50"] == pytest.approx(3.0)  # completed only: 4, 2
    assert s["preempted_requests"] == 1
    assert (s["prefix_hit_tokens"], s["readmit_hit_tokens"], s["prompt_tokens"]) == (4, 2, 60)
    assert s["prefix_hit_rate"] == pytest.approx(4 / 60)


def test_an_unfinished_or_empty_run_summarises_without_dividing_by_zero() -> None:
    running = _metrics("r", 5.0, None, None, "")
    s = summarize_requests([running])
    assert s["finish_reasons"] == {"unfinished": 1}
    assert s["duration_s"] == 1e-12 and s["throughput_tok_s"] == 0.0  # no finish: the span is empty
    empty = summarize_requests([])
    assert (empty["requests"], empty["duration_s"], empty["prefix_hit_rate"]) == (0, 1e-12, 0.0)
    assert empty["ttft_s"] == {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    # One arrival at 2.0 and nothing else: the span starts at the first arrival, not at 0 or 1.
    late = _metrics("l", 2.0, 2.5, 3.0, "length", generated=2, longest=2)
    assert summarize_requests([late])["duration_s"] == 1.0


def test_percentiles_accept_both_ends_and_interpolate_like_numpy() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5 and percentile(xs, 90) == pytest.approx(3.7)
    assert percentile([7.0], 100) == 7.0 and percentile([], 50) is None
    for bad in (-0.5, 100.5):
        with pytest.raises(ValueError, match=r"percentile must be in \[0, 100\]"):
            percentile(xs, bad)


def test_a_metrics_row_carries_every_field_and_the_derived_times() -> None:
    m = _metrics("a", 1.0, 1.5, 3.5, "length", generated=5, longest=5)
    row = m.to_row()
    assert row["request_id"] == "a" and row["finish_reason"] == "length" and row["generated"] == 5
    assert (row["ttft_s"], row["tpot_s"], row["e2e_s"]) == (0.5, 0.5, 2.5)
    assert set(row) == set(RequestMetrics.__slots__) | {"ttft_s", "tpot_s", "e2e_s"}


def test_driver_fail_ends_a_request_with_the_error_as_its_reason() -> None:
    s = Scheduler(KVLedger(32, BS), SchedulerConfig(policy="full"))
    driver = Driver(s, ConstantExecutor(step_s=0.01))
    driver.submit(GenRequest("a", toks(4, 0), 8))
    driver.submit(GenRequest("b", toks(4, 50), 8))
    driver.submit(GenRequest("c", toks(4, 90), 8))
    driver.step()
    assert driver.metrics("a").request_id == "a" and driver.metrics("zz") is None
    assert driver.fail("a", RuntimeError("callback blew up")) is True
    assert driver.fail("b", "callback said no") is True
    assert driver.fail("zz", "nobody") is False
    done = {f.request.request_id: f for f in driver.step().finished}
    assert done["a"].finish_reasons == ["error: RuntimeError: callback blew up"]
    assert done["b"].finish_reasons == ["error: callback said no"]
    rest = driver.run()
    assert [m.request_id for m in rest] == ["c"] and rest[0].finish_reason == "length"


def test_a_driver_keeps_no_records_unless_asked() -> None:
    from kvledger.scheduler import Driver, GenRequest, Scheduler, SchedulerConfig
    driver = Driver(Scheduler(KVLedger(16, BS), SchedulerConfig()), Scripted())
    driver.submit(GenRequest("a", toks(4, 0), 2))
    finished = []
    while driver.has_work():
        finished += driver.step().finished
    assert [f.request.request_id for f in finished] == ["a"] and driver.records == []


def test_a_finished_id_used_again_can_be_cancelled_before_it_arrives() -> None:
    from kvledger.scheduler import GenRequest
    driver = make()
    driver.submit(GenRequest("a", toks(4, 0), 2))
    while driver.has_work():
        driver.step()
    driver.submit(GenRequest("a", toks(4, 50), 2, arrival_s=100.0))
    assert driver.cancel("a")
    finished = driver.step().finished
    assert [(f.request.request_id, f.metrics.finish_reason) for f in finished] == [("a", "cancelled")]
    assert not driver.has_work()


def test_a_step_run_again_request_by_request_takes_the_time_of_every_part() -> None:
    """The whole step raised once; run again one request at a time, it took three parts of 0.01 s."""
    driver = make(executor=Faulty(None, once=True))
    for r in _mixed():
        driver.submit(r)
    result = driver.step()
    assert len({w.request_id for w in (*result.plan.prefills, *result.plan.decodes)}) == 3
    assert result.end_s - result.start_s == pytest.approx(0.03)
