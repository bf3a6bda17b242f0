"""Does the simulator predict the real runtime? The same workload through both, side by side.

The workload: ``--requests`` (200) synthetic requests, prompts uniform in [--prompt-min, --prompt-max]
tokens (a third of them opening with one of two shared 32-token system prompts), outputs uniform in
[--out-min, --out-max] tokens, Poisson arrivals, seeded; replayed at each load of ``--loads``
(``name:requests-per-second``; default a light one the engine keeps up with and a saturated one).

* **runtime**: :class:`kvledger.runtime.engine.Engine` on the bundled SmolLM2-135M (CPU, fp32, greedy,
  no stop tokens), requests submitted with their arrival times and replayed by the scheduler's driver on
  the wall clock.
* **simulator**: :class:`kvledger.sim.simulator.Simulator` with the calibrated ``cpu-local`` profile
  (run ``kvledger calibrate`` first, or give ``--profile PATH``), the same pool, block size, policy and
  scheduler limits, fp32 KV and weights, on the driver's virtual clock.

Both sides drive the scheduler through the same :class:`~kvledger.scheduler.driver.Driver` and report
through the same metrics (:func:`kvledger.scheduler.metrics.summarize_requests`: TTFT, TPOT, percentiles),
so the two columns measure the same thing. Prints throughput and p50 / p90 TTFT and TPOT for both and
sim / real per load (the target is within 10%), the machine's load average before and after, then one
JSON line. ``--sim-only`` skips the runtime (no torch needed).

``--offload`` runs both sides with tiers below the device pool: a small pool (64 blocks unless
``--pool-blocks`` says otherwise), incremental admission with preemption by swap, a host tier of
``--host-blocks`` and a disk tier of ``--disk-blocks`` (a file in ``--disk-dir``), evicted prefix blocks
demoted and promoted back (``offload_prefixes``). The runtime moves real bytes on its transfer worker;
the simulator times them with the calibrated profile's ``links`` (run ``kvledger calibrate`` -- it measures
each tier's link -- on the same machine first). The target is within 20% on throughput and median TTFT;
transfer time hidden and exposed is reported for both sides.

On a shared machine, run ``kvledger calibrate`` and this benchmark back to back with the same
``OMP_NUM_THREADS`` (1 is the most robust when other processes compete for the cores: a two-thread
step waits for both threads to get a time slice, and a busy neighbour makes steps 10x slower at random).
``--bracket`` measures the calibration shapes in this process right before and right after each load's
replay and simulates with the profile fitted to the geometric mean of the two: on a machine whose speed
drifts within minutes, a profile from one side of the replay predicts that moment, not the replay.
``--replays N`` replays the runtime side N times per load and compares the simulator against each metric's
median; it prints the real engine's own spread (max / min over the identical replays) and says which
figures moved by more than the target on their own -- those a single sim / real ratio cannot check here.
``--in-situ`` also simulates with a profile fitted to the steps the real engine ran during the replay
(:func:`kvledger.sim.calibrate.step_measurements`: each logged step's shape and its whole cost to the loop,
planning and confirming included), so the comparison checks the loop -- scheduling, batching, queueing,
the metrics -- apart from how far the machine's speed moved since it was calibrated; it prints the
machine's drift *during* the replay (30 s windows of step cost over the fitted price, max / min), the
floor under that comparison. ``--dump-steps DIR`` writes the logged steps.
Usage: python benchmarks/sim_validation.py [--requests 200] [--loads light:1,saturated:4] [--sim-only] [--offload]
       [--bracket [--repeats 5]] [--replays N] [--in-situ] [--dump-steps DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from kvledger.scheduler import SchedulerConfig, summarize_requests
from kvledger.sim.simulator import SimConfig, Simulator
from kvledger.workloads import Poisson, Uniform, synthetic

MODEL = "smollm2-135m"
VOCAB_SAFE = 40000  # token ids below SmolLM2's 49,152-entry vocabulary
TARGET = 0.10
OFFLOAD_TARGET = 0.20
METRICS = (("throughput_tok_s", "throughput tok/s", 1), ("ttft_p50_s", "TTFT p50 ms", 1e3),
           ("ttft_p90_s", "TTFT p90 ms", 1e3), ("tpot_p50_s", "TPOT p50 ms", 1e3),
           ("tpot_p90_s", "TPOT p90 ms", 1e3))


def workload(args: argparse.Namespace, rate: float):
    reqs = synthetic(args.requests, arrivals=Poisson(rate), prompt_len=Uniform(args.prompt_min, args.prompt_max),
                     output_len=Uniform(args.out_min, args.out_max), system_prompts=2, system_prompt_len=32,
                     shared_fraction=1 / 3, seed=args.seed, token_base=100)
    top = max(max(r.prompt_tokens.runs[-1][0] + r.prompt_tokens.runs[-1][1] for r in reqs), 0)
    if top >= VOCAB_SAFE:
        sys.exit(f"workload uses token ids up to {top}; lower --requests or the prompt lengths")
    return reqs


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    extra = dict(recovery="swap", offload_prefixes=True, restore_ahead=args.restore_ahead) if args.offload else {}
    return SchedulerConfig(policy=args.policy, max_running=args.max_running, token_budget=args.token_budget,
                           prefill_chunk=args.prefill_chunk, **extra)


def figures(summary: dict, steps: int, preemptions: int, transfers: dict | None = None) -> dict:
    return {"throughput_tok_s": summary["throughput_tok_s"], "transfers": transfers,
            "ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p90_s": summary["ttft_s"]["p90"],
            "tpot_p50_s": summary["tpot_s"]["p50"], "tpot_p90_s": summary["tpot_s"]["p90"],
            "duration_s": summary["duration_s"], "completed": summary["completed"], "steps": steps,
            "preemptions": preemptions}


def sim_side(reqs, args: argparse.Namespace, profile=None) -> dict:
    if profile is None and args.profile:
        from kvledger.sim.cost_model import load_cpu_profile

        profile = load_cpu_profile(args.profile)
    block_bytes = 16 * 30 * 3 * 64 * 2 * 4  # SmolLM2-135M, fp32 KV
    tiers = dict(host_pool_bytes=args.host_blocks * block_bytes, disk_pool_bytes=args.disk_blocks * block_bytes,
                 staging_blocks=args.staging_blocks) if args.offload else {}
    cfg = SimConfig(model=MODEL, gpu="cpu-local", kv_dtype="fp32", weight_dtype="fp32", pool_blocks=args.pool_blocks,
                    block_size=16, scheduler=scheduler_config(args), profile=profile, **tiers)
    res = Simulator(cfg).run(reqs)
    transfers = None
    if args.offload:
        t = res.counters["transfers"]
        transfers = {"transfer_s": t["transfer_s"], "hidden_s": t["hidden_s"], "exposed_s": t["exposed_s"],
                     "promoted_blocks": res.counters["tiers"]["flow"]["promoted"],
                     "demoted_blocks": res.counters["tiers"]["flow"]["demoted"]}
    return figures(summarize_requests(res.requests), res.steps, sum(res.preemptions.values()), transfers)


def median_figures(replays: list[dict]) -> dict:
    """The runtime side of several replays of one workload: each metric's median over the replays (the
    first replay's other fields), and ``spread``: each metric's max / min -- how far the real engine moved
    on the identical workload, the floor under any sim / real comparison on this machine."""
    import statistics

    out = dict(replays[0])
    for key, _, _ in METRICS:
        out[key] = statistics.median(r[key] for r in replays)
    out["spread"] = {key: max(r[key] for r in replays) / min(r[key] for r in replays) for key, _, _ in METRICS}
    out["replays"] = [{key: r[key] for key, _, _ in METRICS} for r in replays]
    return out


def calibrate_now(args: argparse.Namespace) -> dict:
    """The runtime's step times of every calibration shape, measured now (what `kvledger calibrate` does)."""
    from kvledger.cli.calibrate_cmds import measure_runtime

    return measure_runtime(args.repeats)


def bracketed_profile(before: dict, after: dict):
    """One profile fitted to the geometric mean of each shape's step time measured right before and right
    after the replay: the machine's speed drifts by minutes (a lone decode 44-58 ms five minutes apart), so a
    profile measured on one side of the replay predicts the machine of that moment, not of the replay's."""
    import math

    from kvledger.cli.calibrate_cmds import fit_measured
    from kvledger.sim.calibrate import Measurement

    pooled = [Measurement(a.shape, math.sqrt(a.seconds * b.seconds))
              for a, b in zip(before["measurements"], after["measurements"], strict=True)]
    profile, report = fit_measured(before, measurements=pooled,
                                   source="sim_validation --bracket: calibrated before and after the replay")
    drift = {m.shape.name: b.seconds / m.seconds for m, b in zip(before["measurements"], after["measurements"],
                                                                  strict=True)}
    return profile, report, drift


def runtime_engine(args: argparse.Namespace):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        from kvledger.runtime.engine import Engine
    except ImportError as exc:
        sys.exit(f"the runtime engine is not available ({exc}); run with --sim-only")
    tiers = dict(host_blocks=args.host_blocks, disk_blocks=args.disk_blocks, disk_dir=args.disk_dir,
                 staging_blocks=args.staging_blocks) if args.offload else {}
    return Engine.from_model(MODEL, num_blocks=args.pool_blocks, block_size=16, scheduler_config=scheduler_config(args),
                             **tiers)


def runtime_side(reqs, args: argparse.Namespace) -> dict:
    from kvledger.runtime.sampling import SamplingParams

    engine = runtime_engine(args)
    engine.generate([[1, 2, 3, 4, 5, 6, 7, 8]], 4)  # warm-up outside the measurement
    logged: list[tuple[list[tuple[int, int]], list[int], float, float, float, float]] = []

    def log_step(result) -> None:  # every step's shape and its times, for --in-situ
        plan, out = result.plan, result.output
        if plan is not None and out is not None and (plan.prefills or plan.decodes):
            logged.append(([(w.end - w.start, w.start) for w in plan.prefills], [w.end for w in plan.decodes],
                           out.elapsed_s, result.start_s, result.end_s, out.transfer_exposed_s))

    engine.step_observers.append(log_step)
    tiers = engine.scheduler.host
    flow0 = dict(tiers.flow) if tiers is not None else {}
    greedy = SamplingParams(temperature=0.0)
    steps0 = engine.stats.steps
    t0 = engine.clock() + 0.05
    # Submitted with their arrival times: the driver holds each one back until the wall clock reaches it.
    handles = [engine.submit(r.prompt_tokens.tolist(), r.output_len, greedy, request_id=r.request_id,
                             arrival_s=t0 + r.arrival_s) for r in reqs]
    engine.run_until_idle()
    results = [h.result() for h in handles]
    engine.check()
    transfers = None
    if args.offload:
        s = engine.stats
        transfers = {"transfer_s": s.transfer_s, "hidden_s": s.transfer_hidden_s, "exposed_s": s.transfer_exposed_s,
                     # The tier ledger's flow, as the simulator's side reports it (write-backs included).
                     "promoted_blocks": tiers.flow["promoted"] - flow0["promoted"],
                     "demoted_blocks": tiers.flow["demoted"] - flow0["demoted"]}
        engine.close()
    out = figures(summarize_requests(r.metrics for r in results), engine.stats.steps - steps0,
                  sum(r.preemptions for r in results), transfers)
    out["_steps"] = logged
    out["_model"] = (engine.checkpoint.config, engine.runner.spec)
    return out


def loop_steps(logged: list, back_to_back_s: float = 0.005) -> tuple[list, dict]:
    """Each logged step's whole cost to the real loop, as the simulator's virtual clock charges it: a step
    that followed the previous one at once costs the time between their ends (planning, the forward,
    sampling, confirming, streaming); one that followed an idle wait costs its own span plus the median
    planning time of the back-to-back steps. The transfer time a step waited for is taken out: the simulator
    prices transfers by the profile's links, apart from compute. Returns ``(steps for step_measurements,
    report)``."""
    import itertools
    import statistics

    gaps = [b[3] - a[4] for a, b in itertools.pairwise(logged) if 0 <= b[3] - a[4] < back_to_back_s]
    plan_s = statistics.median(gaps) if gaps else 0.0
    steps, outside = [], []
    for i, (prefill, decode, elapsed, start, end, exposed) in enumerate(logged):
        prev_end = logged[i - 1][4] if i else None
        if prev_end is not None and 0 <= start - prev_end < back_to_back_s:
            cost = end - prev_end
        else:
            cost = end - start + plan_s
        steps.append((prefill, decode, max(cost - exposed, 1e-6)))
        outside.append(cost - elapsed)
    return steps, {"steps": len(steps), "back_to_back": len(gaps), "planning_ms_p50": plan_s * 1e3,
                   "outside_executor_ms_p50": statistics.median(outside) * 1e3 if outside else 0.0,
                   "executor_ms_p50": statistics.median(s[2] for s in logged) * 1e3 if logged else 0.0}


def in_situ_profile(replays: list[dict], base):
    """A profile fitted to the steps the real engine ran in ``replays`` (see
    :func:`kvledger.sim.calibrate.step_measurements`), with the tier links of ``base`` (the calibrated
    profile: links are measured by ``kvledger calibrate``, not by a replay)."""
    from kvledger.sim.calibrate import fit_profile, step_measurements
    from kvledger.sim.cost_model import CostModel, DeviceProfile

    per_replay = [loop_steps(r["_steps"]) for r in replays]
    steps = [step for costs, _ in per_replay for step in costs]
    report = dict(per_replay[-1][1])  # the last replay's loop figures ...
    report["steps"] = len(steps)  # ... and the steps of every replay
    config, spec = replays[0]["_model"]
    placeholder = DeviceProfile("fit", 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, "placeholder")
    cost = CostModel(config, spec, placeholder, weight_dtype="fp32")
    profile, fit = fit_profile(cost, step_measurements(steps), host_link_Bps=base.host_link_Bps,
                               transfer_overhead_s=base.transfer_overhead_s, links=base.links,
                               source="sim_validation --in-situ: fitted to the replay's own steps")
    fitted = CostModel(config, spec, profile, weight_dtype="fp32")
    report["drift"] = replay_drift([(costs, r["_steps"]) for (costs, _), r in zip(per_replay, replays, strict=True)],
                                   fitted)
    return profile, fit, report


def replay_drift(replays: list[tuple[list, list]], cost, window_s: float = 30.0) -> float:
    """How far the machine's speed moved *during* the replays: each step's real cost over what the in-situ
    profile prices it at, the median per ``window_s`` of the replay (windows of 20 steps or more), and the
    largest window's median over the smallest's. One profile prices the whole replay, so a drift above the
    target is a floor under the in-situ comparison too."""
    import statistics

    medians = []
    for steps, logged in replays:  # each replay's loop_steps costs beside its logged steps
        windows: dict[int, list[float]] = {}
        for (prefill, decode, seconds), raw in zip(steps, logged, strict=True):
            windows.setdefault(int((raw[3] - logged[0][3]) // window_s), []).append(
                seconds / cost.step_time(prefill, decode))
        medians += [statistics.median(v) for v in windows.values() if len(v) >= 20]
    return max(medians) / min(medians) if medians else 1.0


def compare(real: dict | None, sim: dict, target: float, label: str) -> dict:
    """Print the runtime and simulator columns and sim / real; returns the ratios of METRICS."""
    print(f"{'metric':<20}{'runtime':>12}{label:>12}{'sim / real':>12}")
    ratios = {}
    for key, name, scale in (*METRICS, ("steps", "steps", 1), ("preemptions", "preemptions", 1)):
        r = real[key] if real else None
        s = sim[key]
        ratio = s / r if r else None
        if key in {k for k, _, _ in METRICS}:
            ratios[key] = ratio
        shown = f"{ratio:.2f}" if ratio is not None else "-"
        print(f"{name:<20}{(f'{r * scale:,.1f}' if r is not None else '-'):>12}{s * scale:>12,.1f}{shown:>12}")
    for side, fig in (("runtime", real), ("simulator", sim)):
        t = fig and fig.get("transfers")
        if t:
            print(f"{side} transfers: {t['transfer_s'] * 1e3:,.1f} ms, hidden {t['hidden_s'] * 1e3:,.1f} ms, "
                  f"exposed {t['exposed_s'] * 1e3:,.1f} ms; {t['demoted_blocks']} blocks demoted, "
                  f"{t['promoted_blocks']} promoted")
    if real is not None:
        off = [k for k, v in ratios.items() if v is None or abs(v - 1) > target]
        print(f"{label} within {target:.0%}: " + ("all" if not off else f"not {', '.join(off)}"))
    return ratios


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--loads", default="light:1.0,saturated:4.0",
                   help="name:arrivals-per-second, comma-separated")
    p.add_argument("--prompt-min", type=int, default=16)
    p.add_argument("--prompt-max", type=int, default=96)
    p.add_argument("--out-min", type=int, default=4)
    p.add_argument("--out-max", type=int, default=24)
    p.add_argument("--policy", default="full")
    p.add_argument("--pool-blocks", type=int, default=None, help="KV pool in blocks [512; 64 with --offload]")
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--token-budget", type=int, default=512)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--profile", default=None, help="a calibrated cpu-local profile file [the cache's]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sim-only", action="store_true")
    p.add_argument("--offload", action="store_true", help="tiers below the pool: swaps, demotions, promotions")
    p.add_argument("--host-blocks", type=int, default=16)
    p.add_argument("--disk-blocks", type=int, default=256)
    p.add_argument("--disk-dir", default=None)
    p.add_argument("--staging-blocks", type=int, default=32)
    p.add_argument("--restore-ahead", action="store_true")
    p.add_argument("--bracket", action="store_true",
                   help="calibrate right before and right after each load's replay and simulate with the profile "
                        "fitted to both (the machine's drift during the replay is then averaged in)")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions per shape with --bracket")
    p.add_argument("--in-situ", action="store_true",
                   help="also simulate with a profile fitted to the replay's own steps (the machine's speed during "
                        "the replay): checks the loop apart from the machine's drift since calibration")
    p.add_argument("--dump-steps", default=None, metavar="DIR",
                   help="write every replay's logged steps to DIR/<load>.json (for studying the step costs)")
    p.add_argument("--replays", type=int, default=1,
                   help="replay the runtime side N times per load: sim / real against the median, and the real "
                        "engine's own spread (max / min) on the identical workload")
    args = p.parse_args()
    if not 1 <= args.replays <= 20:
        p.error(f"--replays must be in 1..20, got {args.replays}")
    if args.pool_blocks is None:
        args.pool_blocks = 64 if args.offload else 512
    if args.offload and args.policy == "full":
        args.policy = "incremental"  # full reservation never preempts: nothing would swap
    target = OFFLOAD_TARGET if args.offload else TARGET
    loads = []
    for item in args.loads.split(","):
        name, _, rate = item.partition(":")
        loads.append((name.strip(), float(rate)))
    load_before = os.getloadavg()
    out: dict = {"benchmark": "sim_validation", "requests": args.requests, "offload": args.offload,
                 "pool_blocks": args.pool_blocks, "policy": args.policy, "loads": {}}
    print(f"{args.requests} requests, prompts {args.prompt_min}-{args.prompt_max}, outputs {args.out_min}-"
          f"{args.out_max}; {MODEL} fp32, pool {args.pool_blocks} blocks, policy {args.policy}; "
          f"load average before: {' '.join(f'{x:.2f}' for x in load_before)}")
    for name, rate in loads:
        reqs = workload(args, rate)
        bracket = None
        if args.bracket and not args.sim_only:
            before = calibrate_now(args)
        wall = time.perf_counter()
        replays = [] if args.sim_only else [runtime_side(reqs, args) for _ in range(args.replays)]
        real = median_figures(replays) if replays else None
        wall = time.perf_counter() - wall
        if args.bracket and not args.sim_only:
            after = calibrate_now(args)
            profile, fit, drift = bracketed_profile(before, after)
            sim = sim_side(reqs, args, profile)
            bracket = {"profile": profile.to_dict(), "fit_rms_error_pct": fit["rms_error_pct"],
                       "worst_shape": fit["worst_shape"], "worst_error_pct": fit["worst_error_pct"],
                       "after_over_before": drift}
            print(f"\n{name}: calibrated before and after the replay; after / before per shape: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in drift.items()))
            print(f"bracketed fit: {profile.peak_flops / 1e9:.1f} GFLOP/s, {profile.mem_bandwidth_Bps / 1e9:.1f} GB/s, "
                  f"step overhead {profile.step_overhead_s * 1e3:.1f} ms, rms error {fit['rms_error_pct']:.1f}%")
        else:
            sim = sim_side(reqs, args)
        in_situ = None
        if args.in_situ and replays:
            if not args.bracket:
                from kvledger.sim.cost_model import load_cpu_profile

                profile = load_cpu_profile(args.profile)
            profile, fit, loop = in_situ_profile(replays, profile)
            in_situ = {"simulator": sim_side(reqs, args, profile), "profile": profile.to_dict(),
                       "fit_rms_error_pct": fit["rms_error_pct"], "worst_error_pct": fit["worst_error_pct"],
                       "fitted_steps": len(fit["points"]), "loop": loop}
        print(f"\n{name}: Poisson {rate:g}/s" + ("" if real is None else f" (runtime replay {wall:.0f} s)"))
        ratios = compare(real, sim, target, "simulator" if in_situ is None else "calibrated")
        if in_situ is not None:
            loop = in_situ["loop"]
            print(f"in situ: a profile fitted to {in_situ['fitted_steps']} of the replays' {loop['steps']} steps "
                  f"(rms error {in_situ['fit_rms_error_pct']:.1f}%); the real loop spends "
                  f"{loop['outside_executor_ms_p50']:.1f} ms per step outside the executor "
                  f"(planning {loop['planning_ms_p50']:.1f} ms), executor p50 {loop['executor_ms_p50']:.1f} ms; "
                  f"the machine's speed during the replay, 30 s windows, max / min: {loop['drift']:.2f}")
            in_situ["sim_over_real"] = compare(real, in_situ["simulator"], target, "in situ")
        if real is not None and args.replays > 1:
            wide = {k: v for k, v in real["spread"].items() if v - 1 > target}
            print(f"real engine over {args.replays} identical replays, max / min: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in real["spread"].items()))
            if wide:
                print(f"the real engine itself moved by more than {target:.0%} on "
                      f"{', '.join(wide)}: this machine cannot check the target on those figures")
        if args.dump_steps and replays:
            os.makedirs(args.dump_steps, exist_ok=True)
            path = os.path.join(args.dump_steps, f"{name}.json")
            with open(path, "w") as f:
                json.dump([r["_steps"] for r in replays], f)
            print(f"steps logged by each replay (prefill entries, decode contexts, executor s, start, end, "
                  f"exposed transfer s): {path}")
        if real is not None:
            real = {k: v for k, v in real.items() if not k.startswith("_")}
        out["loads"][name] = {"rate": rate, "simulator": sim, "runtime": real, "sim_over_real": ratios,
                              "bracket": bracket, "in_situ": in_situ}
    out["load_average_before"] = load_before
    out["load_average_after"] = os.getloadavg()
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in out['load_average_after'])}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
