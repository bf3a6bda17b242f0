"""The discrete-event simulator: a workload through the real scheduler and ledger, timed by the cost model.

Events are arrivals, scheduler steps and completions. One step is exactly what an engine does:

    plan = scheduler.schedule()                     # the same Scheduler + KVLedger the runtime drives
    dt   = cost_model.step_time(prefills, decodes) + plan.transfer_wait_s
    now += dt
    scheduler.confirm(plan, sampled)                # one synthetic token per sampling sequence

so admission, growth, eviction, preemption and the host tier are the production code, not a copy of it.
Only the forward pass is replaced: by the roofline of :mod:`kvledger.sim.cost_model`, and by a synthetic
sampled token (no stop tokens: every request generates exactly its trace ``output_len`` tokens, its
``max_new_tokens``).

Per request the simulator records TTFT, TPOT, end-to-end latency, preemptions and prefix-hit tokens.
Per step it records the pool broken down into token slots that always sum to the pool:

    tokens    slots of held blocks that hold a token (ledger token states)
    slack     empty slots of held blocks (the partial tail block, lookahead slots)
    promised  blocks promised to running requests but not materialised yet (a claim on free/evictable)
    deferred  blocks released while an in-flight step or swap still leases them (in transit)
    retained  idle cached blocks (evictable), less what promises already claim of them
    free      free blocks, less what promises claim of them

Prompts are materialised lazily: a request's token list exists from the moment it is handed to the
scheduler (at arrival, at most ``feed_window`` requests ahead of admission) until it finishes, when its
record is taken and the scheduler's copy dropped.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..core.geometry import KVSpec, config_int, text_config
from ..core.identity import CacheContext
from ..core.inventory import GPUS, build_inventory, count_parameters_per_rank
from ..core.ledger import KVLedger
from ..core.models import load_model_config
from ..errors import ConfigError, InvariantError
from ..scheduler import GenRequest, HostPool, RecoveryCosts, Scheduler, SchedulerConfig, TransferModel
from ..scheduler.config import GROWTH_ACTIONS, POLICIES, RECOVERY, VICTIMS
from ..units import parse_bytes
from .cost_model import CPU_LOCAL, CostModel, DeviceProfile, get_profile
from .workloads import SimRequest, assign_trust_groups

SAMPLED_TOKEN = 0  # the synthetic token every sampling sequence gets
STOP_TOKEN = 1  # with declared_max_new: the last token of a request's trace output (a stop token)
BREAKDOWN_KEYS = ("tokens", "slack", "promised", "deferred", "retained", "free")


# ---- configuration ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimConfig:
    """One simulated deployment. Every field can be swept (``--sweep key=v1,v2``) except ``profile``.

    model: bundled model name or a config.json path. gpu: device profile name (a catalogue GPU or
    ``cpu-local``); a catalogue GPU also sizes the pool. tp: tensor-parallel degree (per-rank memory and
    time). pool_blocks: the pool size directly (overrides the inventory). device_memory: bytes per rank
    when ``gpu`` is not a catalogue GPU (e.g. cpu-local). trust_groups: ``trace`` (the trace's groups),
    ``request`` (every request its own trust group: no sharing across requests) or a count N (requests
    spread over N tenants at random, seeded). host_pool_bytes: host tier for swapped requests (0 = none).
    max_model_len: prompts and outputs are clamped to it (default: the model's max_position_embeddings).
    declared_max_new: None (the default) gives every request its trace output length as max_new_tokens and
    no stop token, so ``full`` reservation knows each true length (an oracle). A number N declares
    max_new_tokens = max(N, output) -- what a client asks for -- and the request ends with a stop token
    after its trace output, so ``full`` reserves N, ``predicted`` learns the real lengths.
    feed_window: arrivals handed to the scheduler ahead of admission (FCFS admission only ever looks at
    the head of the queue, so this only bounds memory). check_every: run the ledger's full invariant
    check every N steps (0 = never; tests use 1). sample_every: record the per-step pool breakdown every
    N steps (1 = every step).
    """

    model: str = "llama-3.1-8b"
    gpu: str = "h100-80gb"
    tp: int = 1
    policy: str = "full"
    block_size: int = 16
    prefix_cache: bool = True
    trust_groups: str = "trace"
    host_pool_bytes: int = 0
    utilization: float = 0.9
    pool_blocks: int | None = None
    device_memory: int | None = None
    max_running: int = 256
    token_budget: int = 8192
    prefill_chunk: int = 2048
    victim: str = "latest"
    recovery: str = "recompute"
    on_growth_failure: str = "preempt"
    watermark: float = 0.01
    kv_dtype: str | None = None
    weight_dtype: str | None = None
    max_model_len: int | None = None
    declared_max_new: int | None = None
    feed_window: int = 512
    check_every: int = 0
    sample_every: int = 1
    seed: int = 0
    profile: DeviceProfile | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "block_size", "max_running", "token_budget", "prefill_chunk", "feed_window",
                     "sample_every"):
            _positive_int(getattr(self, name), name)
        for name in ("host_pool_bytes", "check_every", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
        for name in ("pool_blocks", "device_memory", "max_model_len", "declared_max_new"):
            if getattr(self, name) is not None:
                _positive_int(getattr(self, name), name)
        for name, allowed in (("policy", POLICIES), ("victim", VICTIMS), ("recovery", RECOVERY),
                              ("on_growth_failure", GROWTH_ACTIONS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        if isinstance(self.utilization, bool) or not isinstance(self.utilization, int | float) \
                or not 0 < self.utilization <= 1:
            raise ConfigError(f"utilization must be in (0, 1], got {self.utilization!r}")
        if isinstance(self.watermark, bool) or not isinstance(self.watermark, int | float) \
                or not 0 <= self.watermark < 1:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark!r}")
        tg = str(self.trust_groups)
        if tg not in ("trace", "request") and not (tg.isdigit() and int(tg) >= 1):
            raise ConfigError(f"trust_groups must be 'trace', 'request' or a positive count, got {tg!r}")
        object.__setattr__(self, "trust_groups", tg)
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model must be a bundled model name or a config.json path")
        if self.profile is not None and not isinstance(self.profile, DeviceProfile):
            raise ConfigError("profile must be a DeviceProfile")

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "profile"}
        if self.profile is not None:
            out["profile"] = self.profile.name
        return out


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    return value


SWEEP_KEYS = tuple(f.name for f in fields(SimConfig) if f.name != "profile")
_BOOL_WORDS = {"on": True, "off": False, "true": True, "false": False, "yes": True, "no": False,
               "1": True, "0": False}
_BYTE_KEYS = ("host_pool_bytes", "device_memory")


def parse_value(key: str, text: str) -> Any:
    """Parse one sweep value for ``key`` (a SimConfig field; dashes allowed): ``on/off`` for booleans,
    byte sizes like ``64GiB`` for the *_bytes / device_memory keys, ``none`` for optional ones."""
    name = key.strip().replace("-", "_")
    aliases = {"host_pool": "host_pool_bytes", "prefix_caching": "prefix_cache", "device": "gpu",
               "isolate_groups": "trust_groups"}
    name = aliases.get(name, name)
    if name not in SWEEP_KEYS:
        raise ConfigError(f"unknown sweep key {key!r}; known: {', '.join(SWEEP_KEYS)}")
    raw = text.strip()
    default = next(f.default for f in fields(SimConfig) if f.name == name)
    if key.strip().replace("-", "_") == "isolate_groups":
        flag = _BOOL_WORDS.get(raw.lower())
        if flag is None:
            raise ConfigError(f"isolate-groups takes on/off, got {text!r}")
        return name, ("request" if flag else "trace")
    if raw.lower() == "none" and name in ("pool_blocks", "device_memory", "max_model_len", "kv_dtype",
                                          "weight_dtype", "declared_max_new"):
        return name, None
    if isinstance(default, bool):
        flag = _BOOL_WORDS.get(raw.lower())
        if flag is None:
            raise ConfigError(f"{name} takes on/off, got {text!r}")
        return name, flag
    if name in _BYTE_KEYS:
        if raw in ("0", "0B", "0b"):
            return name, 0
        return name, parse_bytes(raw)
    if name in ("pool_blocks", "max_model_len", "declared_max_new") or isinstance(default, int):
        try:
            return name, int(raw.replace("_", ""))
        except ValueError:
            raise ConfigError(f"{name} takes an integer, got {text!r}") from None
    if isinstance(default, float):
        try:
            return name, float(raw)
        except ValueError:
            raise ConfigError(f"{name} takes a number, got {text!r}") from None
    return name, raw


def parse_sweep(specs: Iterable[str]) -> list[tuple[str, list[Any]]]:
    """``["policy=full,incremental", "block_size=16,32"]`` -> ``[("policy", [...]), ("block_size", [...])]``."""
    out: list[tuple[str, list[Any]]] = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep or not key.strip() or not values.strip():
            raise ConfigError(f"--sweep takes key=v1,v2,...; got {spec!r}")
        parsed = [parse_value(key, v) for v in values.split(",") if v.strip()]
        name = parsed[0][0]
        if any(n == name for n, _ in out):
            raise ConfigError(f"sweep key {name!r} given twice")
        out.append((name, [v for _, v in parsed]))
    return out


def sweep_configs(base: SimConfig, grid: Sequence[tuple[str, Sequence[Any]]]) -> list[tuple[dict[str, Any], SimConfig]]:
    """Every combination of the grid applied to ``base`` (first key varies slowest)."""
    combos: list[dict[str, Any]] = [{}]
    for key, values in grid:
        combos = [{**c, key: v} for c in combos for v in values]
    return [(c, replace(base, **c)) for c in combos]


# ---- the deployment: model, geometry, pool, cost model --------------------------------------------


@dataclass(frozen=True)
class Deployment:
    """What a SimConfig resolves to: geometry, pool and cost model (built once per run)."""

    spec: KVSpec
    model_cfg: dict[str, Any]
    profile: DeviceProfile
    cost: CostModel
    pool_blocks: int
    pool_source: str  # how the pool was sized
    inventory: dict[str, Any]
    max_model_len: int | None
    host_blocks: int

    @property
    def block_bytes(self) -> int:
        return self.spec.block_bytes


def build_deployment(config: SimConfig) -> Deployment:
    cfg = load_model_config(config.model)
    spec = KVSpec.from_hf_config(cfg, kv_dtype=config.kv_dtype, tp=config.tp, block_size=config.block_size,
                                 name=config.model)
    profile = config.profile or get_profile(config.gpu)
    cost = CostModel(cfg, spec, profile, weight_dtype=config.weight_dtype)
    gpu_key = config.gpu.strip().lower()
    inventory: dict[str, Any] = {}
    if config.pool_blocks is not None:
        pool_blocks, source = config.pool_blocks, "pool_blocks override"
    else:
        kwargs: dict[str, Any] = dict(utilization=config.utilization, max_batched_tokens=config.token_budget,
                                      max_seqs=config.max_running, weight_dtype=config.weight_dtype)
        if config.device_memory is not None:
            kwargs["device_bytes"] = config.device_memory
            source = f"inventory: {config.device_memory} B x {config.utilization:g} - weights - workspace - reserve"
        elif gpu_key in GPUS:
            kwargs["gpu"] = gpu_key
            source = f"inventory: {gpu_key} x {config.utilization:g} - weights - workspace - reserve"
        else:
            raise ConfigError(f"device profile {config.gpu!r} has no memory size: give pool_blocks "
                              f"(--pool-blocks) or device_memory (--device-memory)")
        inv = build_inventory(spec, cfg, **kwargs)
        pool_blocks = inv.pool_blocks
        inventory = inv.to_dict()
        if pool_blocks < 1:
            raise ConfigError("the KV pool has no room for a single block")
    max_len = config.max_model_len
    if max_len is None:
        max_len = config_int(text_config(cfg), "max_position_embeddings", default=None)
    host_blocks = config.host_pool_bytes // spec.block_bytes if config.host_pool_bytes else 0
    return Deployment(spec, cfg, profile, cost, pool_blocks, source, inventory, max_len, host_blocks)


def _recovery_costs(dep: Deployment) -> RecoveryCosts:
    """The scheduler's recompute-vs-swap prices from the same device profile the step times use."""
    params = count_parameters_per_rank(dep.model_cfg, dep.spec.tp)
    per_token = 2 * (params.attention + params.mlp + params.embedding)
    transfer = TransferModel(link_Bps=dep.profile.host_link_Bps, overhead_s=dep.profile.transfer_overhead_s)
    return RecoveryCosts(flops_per_token=float(per_token), flops_per_s=dep.profile.effective_flops,
                         block_bytes=dep.spec.block_bytes, transfer=transfer)


# ---- results ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class RequestRecord:
    """One request's fate. Times are seconds of simulated time; None where it never happened."""

    request_id: str
    trust_group: str
    arrival_s: float
    prompt_len: int
    output_len: int  # max_new_tokens given to the scheduler (after clamping)
    n: int = 1
    admitted_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    generated: int = 0  # tokens generated over all branches
    preemptions: int = 0
    hit_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    readmit_hit_tokens: int = 0  # found again when re-admitted after a preemption
    finish_reason: str = ""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first: (finish - first token) / (tokens per branch - 1)."""
        per_branch = self.generated // max(self.n, 1)
        if self.first_token_s is None or self.finish_s is None or per_branch < 2:
            return None
        return (self.finish_s - self.first_token_s) / (per_branch - 1)

    @property
    def completed(self) -> bool:
        return self.finish_reason in ("length", "stop")

    def to_row(self) -> dict[str, Any]:
        row = {f: getattr(self, f) for f in self.__slots__}
        row.update(ttft_s=self.ttft_s, tpot_s=self.tpot_s, e2e_s=self.e2e_s)
        return row


@dataclass
class Timeline:
    """Per-step columns (parallel lists). ``t_s`` is the step's start, ``dt_s`` its duration. The
    breakdown columns are token slots (blocks x block_size) and sum to ``pool_slots`` at every step."""

    t_s: list[float] = field(default_factory=list)
    dt_s: list[float] = field(default_factory=list)
    prefill_tokens: list[int] = field(default_factory=list)
    decodes: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    swapped: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    slack: list[int] = field(default_factory=list)
    promised: list[int] = field(default_factory=list)
    deferred: list[int] = field(default_factory=list)
    retained: list[int] = field(default_factory=list)
    free: list[int] = field(default_factory=list)

    COLUMNS = ("t_s", "dt_s", "prefill_tokens", "decodes", "running", "waiting", "swapped", *BREAKDOWN_KEYS)

    def __len__(self) -> int:
        return len(self.t_s)

    def rows(self) -> Iterable[tuple[Any, ...]]:
        return zip(*(getattr(self, c) for c in self.COLUMNS), strict=True)


@dataclass
class SimResult:
    config: SimConfig
    deployment: Deployment
    requests: list[RequestRecord]
    timeline: Timeline
    steps: int
    preemptions: dict[str, int]
    counters: dict[str, Any]
    notes: list[str]
    wall_s: float

    @property
    def pool_slots(self) -> int:
        return self.deployment.pool_blocks * self.deployment.spec.block_size

    def summary(self) -> dict[str, Any]:
        return summarize(self)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) of ``values``; None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stats(values: list[float]) -> dict[str, float | None]:
    return {"mean": (sum(values) / len(values)) if values else None, "p50": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99), "max": max(values) if values else None}


def summarize(result: SimResult) -> dict[str, Any]:
    dep, cfg = result.deployment, result.config
    reqs = result.requests
    done = [r for r in reqs if r.completed]
    first = min((r.arrival_s for r in reqs), default=0.0)
    last = max((r.finish_s for r in reqs if r.finish_s is not None), default=first)
    span = max(last - first, 1e-12)
    out_tokens = sum(r.generated for r in reqs)
    prompt_tokens_done = sum(r.prompt_len for r in done)
    prompt_tokens = sum(r.prompt_len for r in reqs)
    hit = sum(r.hit_tokens for r in reqs)
    tl = result.timeline
    weights = tl.dt_s
    total_w = sum(weights)
    pool = result.pool_slots
    memory = {}
    for key in BREAKDOWN_KEYS:
        col = getattr(tl, key)
        memory[key] = (sum(v * w for v, w in zip(col, weights, strict=True)) / (total_w * pool)) if total_w else 0.0
    reasons: dict[str, int] = {}
    for r in reqs:
        key = r.finish_reason.split(":", 1)[0] or "unfinished"
        reasons[key] = reasons.get(key, 0) + 1
    return {
        "model": cfg.model, "gpu": dep.profile.name, "tp": cfg.tp, "policy": cfg.policy,
        "block_size": cfg.block_size, "prefix_cache": cfg.prefix_cache, "trust_groups": cfg.trust_groups,
        "pool_blocks": dep.pool_blocks, "pool_bytes": dep.pool_blocks * dep.block_bytes,
        "block_bytes": dep.block_bytes, "pool_source": dep.pool_source,
        "host_blocks": dep.host_blocks,
        "requests": len(reqs), "completed": len(done), "finish_reasons": reasons,
        "steps": result.steps, "sim_duration_s": span,
        "throughput_tok_s": out_tokens / span,
        "throughput_req_s": len(done) / span,
        "total_tok_s": (out_tokens + prompt_tokens_done) / span,
        "output_tokens": out_tokens,
        "ttft_s": _stats([r.ttft_s for r in reqs if r.ttft_s is not None]),
        "tpot_s": _stats([r.tpot_s for r in reqs if r.tpot_s is not None]),
        "e2e_s": _stats([r.e2e_s for r in done]),
        "preemptions": result.preemptions,
        "preempted_requests": sum(1 for r in reqs if r.preemptions),
        "prefix_hit_tokens": hit, "prompt_tokens": prompt_tokens,
        "prefix_hit_rate": hit / prompt_tokens if prompt_tokens else 0.0,
        "memory_time_avg": memory,
        "peak_running": max(tl.running, default=0),
        "mean_running": (sum(r * w for r, w in zip(tl.running, weights, strict=True)) / total_w) if total_w else 0.0,
        "counters": result.counters,
        "notes": result.notes,
        "wall_s": result.wall_s,
    }


# ---- preparing the workload ------------------------------------------------------------------------


def prepare_workload(requests: Sequence[SimRequest], config: SimConfig, max_model_len: int | None
                     ) -> tuple[list[SimRequest], list[str]]:
    """Trust groups as configured, outputs of 0 raised to 1 (the scheduler needs max_new_tokens >= 1),
    prompts and outputs clamped to ``max_model_len``. Returns the requests and notes on what changed."""
    notes: list[str] = []
    reqs = list(requests)
    if config.trust_groups == "request":
        reqs = [replace(r, trust_group=f"req-{r.request_id}") for r in reqs]
        notes.append("every request is its own trust group: no prefix is shared between requests")
    elif config.trust_groups != "trace":
        reqs = assign_trust_groups(reqs, int(config.trust_groups), seed=config.seed)
        notes.append(f"requests spread over {config.trust_groups} trust groups at random (seed {config.seed})")
    zero = cut_prompt = cut_output = 0
    out = []
    for r in reqs:
        changes: dict[str, Any] = {}
        output = r.output_len
        if output < 1:
            output = 1
            zero += 1
        if max_model_len is not None:
            prompt_len = r.prompt_len
            if prompt_len >= max_model_len:
                changes["prompt_tokens"] = r.prompt_tokens[: max_model_len - 1]
                prompt_len = max_model_len - 1
                cut_prompt += 1
            if prompt_len + output > max_model_len:
                output = max_model_len - prompt_len
                cut_output += 1
        if output != r.output_len:
            changes["output_len"] = output
        out.append(replace(r, **changes) if changes else r)
    if zero:
        notes.append(f"{zero} request(s) with output_len 0 generate 1 token (the scheduler needs >= 1)")
    if cut_prompt:
        notes.append(f"{cut_prompt} prompt(s) longer than the model context ({max_model_len}) were cut to "
                     f"{max_model_len - 1} tokens")
    if cut_output:
        notes.append(f"{cut_output} output(s) were clamped so prompt + output fits the model context "
                     f"({max_model_len})")
    return out, notes


# ---- the simulation loop ---------------------------------------------------------------------------


def _forget(sched: Scheduler, rid: str) -> None:
    """Drop a finished request's branches (and their token lists) from the scheduler."""
    sched.forget(rid)


Progress = Callable[[float, int, int], None]  # (sim time, requests finished, requests total)


class Simulator:
    """One run: ``Simulator(config).run(requests)`` -> :class:`SimResult`."""

    def __init__(self, config: SimConfig, deployment: Deployment | None = None) -> None:
        self.config = config
        self.dep = deployment or build_deployment(config)

    def run(self, requests: Sequence[SimRequest], *, progress: Progress | None = None,
            progress_every: int = 2000) -> SimResult:
        cfg, dep = self.config, self.dep
        wall0 = time.perf_counter()
        workload, notes = prepare_workload(requests, cfg, dep.max_model_len)
        bs = dep.spec.block_size
        ledger = KVLedger(dep.pool_blocks, bs, prefix_caching=cfg.prefix_cache)
        sched_cfg = SchedulerConfig(policy=cfg.policy, on_growth_failure=cfg.on_growth_failure,
                                    victim=cfg.victim, recovery=cfg.recovery, max_running=cfg.max_running,
                                    token_budget=cfg.token_budget, prefill_chunk=cfg.prefill_chunk,
                                    watermark=cfg.watermark)
        host = HostPool(dep.host_blocks, dep.block_bytes) if dep.host_blocks else None
        sched = Scheduler(ledger, sched_cfg, host=host, costs=_recovery_costs(dep))
        self.scheduler = sched  # kept for inspection after the run
        step_time = dep.cost.step_time
        pool = ledger.pool
        seq_of = ledger.sequence
        contexts: dict[str, CacheContext] = {}
        model_name = str(cfg.model)

        records: dict[str, RequestRecord] = {}
        out_records: list[RequestRecord] = []
        awaiting_first: dict[str, RequestRecord] = {}  # admitted, no token yet
        tl = Timeline()
        preempt = {"recompute": 0, "swap": 0}
        total = len(workload)
        i_next = 0
        now = 0.0
        steps = 0
        sample_every = cfg.sample_every
        check_every = cfg.check_every
        feed_window = cfg.feed_window
        token = (SAMPLED_TOKEN,)
        declared = cfg.declared_max_new
        max_len = dep.max_model_len
        stop_ids = frozenset({STOP_TOKEN})
        stop = (STOP_TOKEN,)
        remaining: dict[str, int] = {}  # seq id -> tokens still to generate (declared_max_new only)
        stuck_cancelled = 0
        idle_steps = 0

        def finish(rid: str, at: float) -> None:
            rec = records.pop(rid)
            branches = sched.branches(rid)
            rec.finish_s = at
            rec.generated = sum(br.num_generated for br in branches)
            rec.preemptions = max(br.preemptions for br in branches)
            reasons = [br.finish_reason or "" for br in branches]
            rec.finish_reason = reasons[0] if len(set(reasons)) == 1 else ",".join(sorted(set(reasons)))
            if rec.first_token_s is None and rec.generated:
                rec.first_token_s = at
            awaiting_first.pop(rid, None)
            out_records.append(rec)
            _forget(sched, rid)

        while True:
            # -- arrivals --
            if i_next < total and not sched.has_work() and workload[i_next].arrival_s > now:
                now = workload[i_next].arrival_s  # idle until the next arrival
            while i_next < total and workload[i_next].arrival_s <= now and len(sched.waiting) < feed_window:
                r = workload[i_next]
                i_next += 1
                ctx = contexts.get(r.trust_group)
                if ctx is None:
                    ctx = contexts[r.trust_group] = CacheContext(trust_group=r.trust_group, model=model_name,
                                                                 kv_dtype=dep.spec.kv_dtype)
                if declared is None:
                    sched.add(GenRequest(r.request_id, r.prompt_tokens.tolist(), r.output_len, ctx, n=r.n,
                                         priority=r.priority, arrival_s=r.arrival_s))
                else:
                    allowance = max(declared, r.output_len)
                    if max_len is not None:
                        allowance = max(min(allowance, max_len - r.prompt_len), r.output_len)
                    sched.add(GenRequest(r.request_id, r.prompt_tokens.tolist(), allowance, ctx, n=r.n,
                                         priority=r.priority, arrival_s=r.arrival_s, stop_token_ids=stop_ids))
                    rid0 = r.request_id
                    for b in range(r.n):
                        remaining[rid0 if b == 0 else f"{rid0}/{b}"] = r.output_len
                records[r.request_id] = RequestRecord(r.request_id, r.trust_group, r.arrival_s, r.prompt_len,
                                                      r.output_len, r.n)
            if not sched.has_work():
                if i_next >= total:
                    break
                continue

            # -- one step --
            plan = sched.schedule()
            steps += 1
            t0 = now
            for rid in plan.admitted:
                rec = records.get(rid)
                if rec is None:
                    continue
                sid = rid if rid in ledger else next(
                    (br.seq_id for br in sched.branches(rid) if br.seq_id in ledger), None)
                if sid is None:
                    continue
                hits = seq_of(sid).hit_blocks * bs
                if rec.admitted_s is None:
                    rec.admitted_s = t0
                    rec.hit_tokens = hits
                    awaiting_first[rid] = rec
                else:
                    rec.readmit_hit_tokens += hits
            for p in plan.preempted:
                preempt[p.mode] = preempt.get(p.mode, 0) + 1
            prefills, decodes = plan.prefills, plan.decodes
            if steps % sample_every == 0 or not (prefills or decodes):
                self._sample(tl, sched, seq_of, pool, ledger, bs, t0)
            if prefills or decodes:
                dt = step_time([(w.end - w.start, w.start) for w in prefills], [w.end for w in decodes])
            else:
                dt = 0.0
            dt += plan.transfer_wait_s
            if steps % sample_every == 0 or not (prefills or decodes):
                tl.dt_s.append(dt)
                tl.prefill_tokens.append(sum(w.end - w.start for w in prefills))
                tl.decodes.append(len(decodes))
            now = t0 + dt
            sampled = {w.seq_id: token for w in decodes}
            for w in prefills:
                if w.sample:
                    sampled[w.seq_id] = token
            if declared is not None:
                for sid in sampled:
                    left = remaining[sid] - 1
                    if left <= 0:
                        sampled[sid] = stop
                        del remaining[sid]
                    else:
                        remaining[sid] = left
            done = sched.confirm(plan, sampled)
            if check_every and steps % check_every == 0:
                sched.check()

            # -- completions --
            if awaiting_first:
                for rid in [rid for rid, rec in awaiting_first.items()
                            if any(br.num_generated for br in sched.branches(rid))]:
                    awaiting_first.pop(rid).first_token_s = now
            for rid, _reason in plan.ended:
                rid = rid.split("/", 1)[0]
                if rid in records and rid in sched.finished:
                    finish(rid, t0)
            for br in done:
                rid = br.request.request_id
                if rid in records and rid in sched.finished:
                    finish(rid, now)

            if prefills or decodes or plan.swap_in or plan.swap_out or plan.copies:
                idle_steps = 0
            elif not (plan.admitted or plan.preempted or plan.ended):
                # Nothing could run and nothing changed: no lease is outstanding between steps, so the
                # pool will look the same next step. The stuck request is rejected (see _stuck_victim).
                victim = self._stuck_victim(sched)
                if victim is not None:
                    stuck_cancelled += 1
                    rec = records.get(victim)
                    alone = not sched.running
                    sched.cancel(victim)
                    if rec is not None:
                        finish(victim, now)
                        rec.finish_reason = ("rejected: cannot run even with the pool to itself" if alone
                                             else "rejected: stuck (no running request could grow)")
            else:
                idle_steps += 1
                if idle_steps > 10_000:
                    raise InvariantError("the scheduler made no progress for 10,000 steps (livelock)")
            if progress is not None and steps % progress_every == 0:
                progress(now, len(out_records), total)

        if progress is not None:
            progress(now, len(out_records), total)
        for rid in list(records):  # never finished (cannot happen unless a run is cut short)
            out_records.append(records.pop(rid))
        if stuck_cancelled:
            notes.append(f"{stuck_cancelled} request(s) could not run even with nothing else running "
                         "(watermark, max_running or a deadlock) and were rejected")
        never = sum(1 for r in out_records if r.finish_reason.startswith("never"))
        if never:
            notes.append(f"{never} request(s) are larger than the whole pool and were rejected")
        stats = ledger.stats()
        counters = {"admissions": stats["admissions"], "lifetimes": stats["lifetimes"],
                    "ledger_prefix_cache": stats["prefix_cache"]}
        if host is not None:
            counters["host_blocks_used_at_end"] = host.num_used
        out_records.sort(key=lambda r: (r.arrival_s, r.request_id))
        return SimResult(cfg, dep, out_records, tl, steps, preempt, counters, notes,
                         time.perf_counter() - wall0)

    # -- helpers --

    @staticmethod
    def _stuck_victim(sched: Scheduler) -> str | None:
        if sched.running:  # every running request is stuck (e.g. defer with a single request)
            return max(sched.running, key=lambda rid: sched.running[rid][0].admitted_order)
        if sched.swapped:
            return sched.swapped[0][0].request.request_id
        if sched.waiting:
            return sched.waiting[0][0].request.request_id
        return None

    @staticmethod
    def _sample(tl: Timeline, sched: Scheduler, seq_of: Callable[[str], Any], pool: Any, ledger: KVLedger,
                bs: int, t0: float) -> None:
        """Append the pool breakdown (token slots) of this step; O(running sequences).

        A sequence holds ceil(n / block_size) blocks (the simulator asks for no lookahead slots), so its
        empty slots are those of its partial tail block; only forked branches can share a partial tail,
        so families of several branches are deduplicated by block id (as ledger.token_usage() does)."""
        slack = 0
        running = 0
        tails: dict[int, int] | None = None
        for branches in sched.running.values():
            if len(branches) == 1:
                running += 1
                rem = branches[0].in_ledger % bs
                if rem:
                    slack += bs - rem
                continue
            for br in branches:
                running += 1
                seq = seq_of(br.seq_id)
                blocks = seq.table.blocks
                n = len(seq.tokens)
                full = -(-n // bs)
                if len(blocks) > full:
                    slack += (len(blocks) - full) * bs
                rem = n % bs
                if rem:
                    if tails is None:
                        tails = {}
                    b = blocks[n // bs]
                    if tails.get(b, 0) < rem:
                        tails[b] = rem
        if tails:
            slack += sum(bs - fill for fill in tails.values())
        deferred = pool.deferred
        held = pool.num_active - deferred
        free, retained, promised = pool.num_free, pool.num_retained, ledger.promised
        from_free = min(promised, free)
        tl.t_s.append(t0)
        tl.running.append(running)
        tl.waiting.append(len(sched.waiting))
        tl.swapped.append(len(sched.swapped))
        tl.tokens.append(held * bs - slack)
        tl.slack.append(slack)
        tl.promised.append(promised * bs)
        tl.deferred.append(deferred * bs)
        tl.retained.append((retained - (promised - from_free)) * bs)
        tl.free.append((free - from_free) * bs)


def prefix_hit_bound(requests: Sequence[SimRequest], block_size: int, *, isolate: str = "trace"
                     ) -> dict[str, Any]:
    """The prefix-cache hit rate an unbounded cache allows: the share of prompt tokens in leading full
    blocks whose whole prefix appeared (as full blocks) in an earlier request of the same trust group.

    Block identity is the prefix itself (as the ledger's chained digests make it), computed from the
    prompts' token runs without materialising them; with Mooncake's 512-token hash-id blocks and
    ``block_size=512`` this is exactly "hash id seen before". ``isolate`` as SimConfig.trust_groups
    ("trace" or "request"; a request alone never hits).
    """
    _positive_int(block_size, "block_size")
    seen: set[Any] = set()
    hit = total = hit_requests = partial_hit = 0
    for r in requests:
        total += r.prompt_len
        if isolate == "request":
            continue
        parent = hash(r.trust_group)
        leading = True
        hits = 0
        full, rem = divmod(r.prompt_len, block_size)
        for i in range(full + (1 if rem else 0)):
            key = (parent, r.prompt_tokens[i * block_size:(i + 1) * block_size].runs)
            parent = hash(key)
            if leading and key in seen:
                if i < full:
                    hits += 1
                else:
                    partial_hit += rem
            else:
                leading = False
                seen.add(key)
        hit += hits * block_size
        hit_requests += bool(hits)
    return {"hit_tokens": hit, "prompt_tokens": total, "bound": hit / total if total else 0.0,
            "bound_with_partial_blocks": (hit + partial_hit) / total if total else 0.0,
            "requests_with_hits": hit_requests, "block_size": block_size}


def simulate(requests: Sequence[SimRequest], config: SimConfig | None = None, *,
             progress: Progress | None = None, **overrides: Any) -> SimResult:
    """Convenience: ``simulate(requests, policy="incremental", pool_blocks=4096)``."""
    config = replace(config or SimConfig(), **overrides)
    return Simulator(config).run(requests, progress=progress)


def run_sweep(requests: Sequence[SimRequest], base: SimConfig, grid: Sequence[tuple[str, Sequence[Any]]],
              progress: Callable[[int, int, dict[str, Any]], None] | None = None
              ) -> list[tuple[dict[str, Any], SimResult]]:
    """Run every combination of ``grid`` on the same requests."""
    out = []
    combos = sweep_configs(base, grid)
    for k, (values, config) in enumerate(combos):
        if progress is not None:
            progress(k, len(combos), values)
        out.append((values, Simulator(config).run(requests)))
    return out


__all__ = [
    "BREAKDOWN_KEYS", "CPU_LOCAL", "SWEEP_KEYS", "Deployment", "RequestRecord", "SimConfig", "SimResult",
    "Simulator", "Timeline", "build_deployment", "parse_sweep", "parse_value", "percentile",
    "prefix_hit_bound", "prepare_workload", "run_sweep", "simulate", "summarize", "sweep_configs",
]
