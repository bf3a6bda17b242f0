"""The discrete-event simulator: a workload through the real scheduler and ledger, timed by the cost model.

Events are arrivals, scheduler steps and completions. The step loop is the engine's own -- the
scheduler's :class:`~kvledger.scheduler.driver.Driver` on a virtual clock -- with the forward pass
replaced by :class:`CostModelExecutor`:

    plan = scheduler.schedule()                     # the same Scheduler + KVLedger the runtime drives
    compute = cost_model.step_time(prefills, decodes)
    dt   = compute + exposed transfer time          # scheduler/transfers.py: what the step depends on waits,
    now += dt                                       # the rest hides behind at most `compute`
    scheduler.confirm(plan, sampled)                # one synthetic token per sampling sequence

so admission, growth, eviction, preemption, the liveness rule and the tiers below the device pool (host
and disk: swapped requests, demoted and promoted prefix blocks, each link timed by the device profile's
``link``) are the production code,
not a copy of it, and so are the request metrics (:mod:`kvledger.scheduler.metrics`: TTFT, TPOT,
end-to-end, preemptions, prefix-hit tokens; the runtime reports the very same definitions). Sampled
tokens are synthetic (no stop tokens: every request generates exactly its trace ``output_len`` tokens,
its ``max_new_tokens``).

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

The module is past 700 lines because the event loop, its arrival feed and its records share one clock and
one request table; the cost model, workloads and reports live in their own modules.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..core import checks
from ..core.eviction import policy_names
from ..core.groups import KVCacheGroup
from ..core.identity import CacheContext
from ..core.ledger import KVLedger
from ..core.sizing.engines import check_engine
from ..core.sizing.geometry import KVSpec, config_int, state_geometry, text_config
from ..core.sizing.hybrid import hybrid_plan, is_hybrid
from ..core.sizing.inventory import GPUS, build_inventory, count_parameters_per_rank
from ..core.sizing.models import load_model_config
from ..core.tiers import TierLedger
from ..errors import ConfigError
from ..scheduler import (
    SCHEDULER_KEYS,
    GenRequest,
    RecoveryCosts,
    RequestMetrics,
    Scheduler,
    SchedulerConfig,
    StepOutput,
    StepPlan,
    VirtualClock,
    distribution,
    percentile,
    summarize_requests,
)
from ..scheduler.growth import REJECTED_NO_ROOM, REJECTED_OUTGREW
from ..scheduler.replica import Replica, tier_ledger
from ..scheduler.tiers import DEMOTION_RULES, cost_aware_rule
from ..scheduler.transfers import step_transfer_timing
from ..units import parse_bytes
from ..workloads import SimRequest, assign_trust_groups
from .cost_model import CPU_LOCAL, CostModel, DeviceProfile, get_profile

SAMPLED_TOKEN = 0  # the synthetic token every sampling sequence gets
STOP_TOKEN = 1  # with declared_max_new: the last token of a request's trace output (a stop token)
BREAKDOWN_KEYS = ("tokens", "slack", "promised", "deferred", "retained", "free")


# ---- configuration ---------------------------------------------------------------------------------




@dataclass(frozen=True, init=False)
class SimConfig:
    """One simulated deployment. Every field can be swept (``--sweep key=v1,v2``) except ``profile``,
    and so can every :class:`SchedulerConfig` field.

    ``scheduler`` is the scheduler's own configuration, embedded whole (no setting is mirrored or
    dropped). For convenience the constructor also takes scheduler keys directly --
    ``SimConfig(policy="incremental", headroom_blocks=4)`` -- and routes them into ``scheduler``; read
    them back as ``config.scheduler.policy`` (``config.policy`` works too).

    model: bundled model name or a config.json path. gpu: device profile name (a catalogue GPU or
    ``cpu-local``); a catalogue GPU also sizes the pool. tp: tensor-parallel degree (per-rank memory and
    time). pool_blocks: the pool size directly (overrides the inventory). device_memory: bytes per rank
    when ``gpu`` is not a catalogue GPU (e.g. cpu-local). engine: whose memory accounting sizes the pool
    from the device (``vllm`` or ``kvledger``, as ``kvledger plan --engine``), at the scheduler's step
    shape. eviction: the ledger's eviction policy for retained blocks (lru, priority). trust_groups:
    ``trace`` (the trace's groups), ``request`` (every request its own trust group: no sharing across
    requests) or a count N (requests spread over N tenants at random, seeded). host_pool_bytes /
    disk_pool_bytes: the tiers below the device pool, for swapped requests and (with the scheduler's
    ``offload_prefixes``) demoted prefix blocks (0 = none); demotion: which evicted prefix blocks go
    down (``always``, or ``cost``: only to a tier whose load, plus the write when urgent, beats
    recomputing the block at its depth, by the cost model and the profile's links);
    ``staging_blocks``: the transfers' bounded staging buffer, in blocks (one fixed cost per round).
    max_model_len: prompts and outputs are clamped to it (default: the model's max_position_embeddings).
    declared_max_new: None (the default) gives every request its trace output length as max_new_tokens and
    no stop token, so ``full`` reservation knows each true length (an oracle). A number N declares
    max_new_tokens = max(N, output) -- what a client asks for -- and the request ends with a stop token
    after its trace output, so ``full`` reserves N, ``predicted`` learns the real lengths.
    feed_window: arrivals handed to the scheduler ahead of admission (admission only ever looks at the
    head of the queue, so this only bounds memory). check_every: run the ledger's full invariant check
    every N steps (0 = never; tests use 1). sample_every: record the per-step pool breakdown every N
    steps (1 = every step). kv_groups: charge a model with sliding-window or state (Mamba-2 / gated-delta-net) layers
    by KV cache group, as vLLM's hybrid allocator does (`KVLedger(kv_groups=...)`, one table per group in every step
    plan): the pool is the same KV bytes in blocks of one group's page (``pool_blocks``, when given, counts blocks of
    every layer, as without it; with state layers a block holds the tokens that make a page hold one layer's state,
    and a request holds one block per state group); a prefix hit is the longest every group serves (none with a state
    group: no state is cached).
    """

    model: str = "llama-3.1-8b"
    gpu: str = "h100-80gb"
    tp: int = 1
    block_size: int = 16
    prefix_cache: bool = True
    kv_groups: bool = False
    eviction: str = "lru"
    trust_groups: str = "trace"
    host_pool_bytes: int = 0
    disk_pool_bytes: int = 0
    demotion: str = "always"
    staging_blocks: int = 32
    utilization: float = 0.9
    pool_blocks: int | None = None
    device_memory: int | None = None
    engine: str = "kvledger"
    kv_dtype: str | None = None
    weight_dtype: str | None = None
    max_model_len: int | None = None
    declared_max_new: int | None = None
    feed_window: int = 512
    check_every: int = 0
    sample_every: int = 1
    seed: int = 0
    profile: DeviceProfile | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __init__(self, *, scheduler: SchedulerConfig | None = None, **values: Any) -> None:
        if scheduler is not None and not isinstance(scheduler, SchedulerConfig):
            raise ConfigError(f"scheduler must be a SchedulerConfig, got {type(scheduler).__name__}")
        sched_values = {k: values.pop(k) for k in SCHEDULER_KEYS if k in values}
        object.__setattr__(self, "scheduler", replace(scheduler or SchedulerConfig(), **sched_values))
        for f in fields(self):
            if f.name == "scheduler":
                continue
            object.__setattr__(self, f.name, values.pop(f.name, f.default))
        if values:
            raise ConfigError(f"unknown simulation setting {next(iter(values))!r}; known: {', '.join(SWEEP_KEYS)}")
        self.__post_init__()

    def __getattr__(self, name: str) -> Any:
        # Read-only access to the embedded scheduler settings (config.policy == config.scheduler.policy).
        if name in SCHEDULER_KEYS:
            return getattr(object.__getattribute__(self, "scheduler"), name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __post_init__(self) -> None:
        for name in ("tp", "block_size", "feed_window", "sample_every", "staging_blocks"):
            checks.positive(getattr(self, name), name)
        for name in ("host_pool_bytes", "disk_pool_bytes", "check_every", "seed"):
            checks.non_negative(getattr(self, name), name)
        for name in ("pool_blocks", "device_memory", "max_model_len", "declared_max_new"):
            if getattr(self, name) is not None:
                checks.positive(getattr(self, name), name)
        check_engine(self.engine)
        checks.flag(self.kv_groups, "kv_groups")
        if self.eviction not in policy_names():
            raise ConfigError(f"eviction must be one of {', '.join(policy_names())}; got {self.eviction!r}")
        DEMOTION_RULES.check(self.demotion, "demotion")
        if isinstance(self.utilization, bool) or not isinstance(self.utilization, int | float) \
                or not 0 < self.utilization <= 1:
            raise ConfigError(f"utilization must be in (0, 1], got {self.utilization!r}")
        tg = str(self.trust_groups)
        if tg not in ("trace", "request") and not (tg.isdigit() and int(tg) >= 1):
            raise ConfigError(f"trust_groups must be 'trace', 'request' or a positive count, got {tg!r}")
        object.__setattr__(self, "trust_groups", tg)
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model must be a bundled model name or a config.json path")
        if self.profile is not None and not isinstance(self.profile, DeviceProfile):
            raise ConfigError("profile must be a DeviceProfile")

    def with_values(self, **values: Any) -> SimConfig:
        """A copy with ``values`` changed (simulation or scheduler keys)."""
        return replace(self, **values)

    def to_dict(self) -> dict[str, Any]:
        """Every setting, flat (scheduler keys beside the simulation's), as reports and sweeps name them."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("profile", "scheduler")}
        if not self.kv_groups:
            del out["kv_groups"]  # named only when on: a uniform run's report reads as it always did
        out.update(self.scheduler.to_dict())
        if self.profile is not None:
            out["profile"] = self.profile.name
        return out


SWEEP_KEYS = tuple(f.name for f in fields(SimConfig) if f.name not in ("profile", "scheduler")) + SCHEDULER_KEYS
_BOOL_WORDS = {"on": True, "off": False, "true": True, "false": False, "yes": True, "no": False,
               "1": True, "0": False}
_BYTE_KEYS = ("host_pool_bytes", "disk_pool_bytes", "device_memory")


def parse_value(key: str, text: str) -> Any:
    """Parse one sweep value for ``key`` (a SimConfig field; dashes allowed): ``on/off`` for booleans,
    byte sizes like ``64GiB`` for the *_bytes / device_memory keys, ``none`` for optional ones."""
    name = key.strip().replace("-", "_")
    aliases = {"host_pool": "host_pool_bytes", "disk_pool": "disk_pool_bytes", "prefix_caching": "prefix_cache",
               "device": "gpu",
               "isolate_groups": "trust_groups"}
    name = aliases.get(name, name)
    if name not in SWEEP_KEYS:
        raise ConfigError(f"unknown sweep key {key!r}; known: {', '.join(SWEEP_KEYS)}")
    raw = text.strip()
    all_fields = {f.name: f for f in (*fields(SimConfig), *fields(SchedulerConfig))}
    default = all_fields[name].default
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
        return name, parse_bytes(raw, unit_required=True)  # as on the command line: "80" is no size
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
    return [(c, base.with_values(**c)) for c in combos]


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
    disk_blocks: int = 0
    kv_groups: tuple[KVCacheGroup, ...] | None = None  # a pool charged by KV cache group (SimConfig.kv_groups)
    group_block_bytes: int = 0  # ... whose block is one group's page
    group_block_size: int = 0  # ... of this many tokens (raised until a page holds a state layer's state)

    @property
    def block_bytes(self) -> int:
        return self.group_block_bytes or self.spec.block_bytes

    @property
    def block_size(self) -> int:
        """Tokens per block of the pool the ledger keeps."""
        return self.group_block_size or self.spec.block_size

    def tiers(self) -> TierLedger | None:
        """A fresh ledger of the tiers below the device pool (None without any)."""
        return tier_ledger(self.host_blocks, self.disk_blocks)

    def block_cost(self, depth: int) -> float:
        """Seconds a prefix hit on the block at ``depth`` saves: the compute time of its tokens attending
        to the ``depth`` blocks before them -- its marginal cost inside a busy, compute-bound prefill step
        (a step's weight reads and fixed overheads are paid whether the block is recomputed or not)."""
        bs = self.block_size
        return self.cost.breakdown([(bs, depth * bs)]).compute_s


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
                                      max_seqs=config.max_running, weight_dtype=config.weight_dtype,
                                      engine=config.engine, model_name=config.model)
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
    disk_blocks = config.disk_pool_bytes // spec.block_bytes if config.disk_pool_bytes else 0
    groups: tuple[KVCacheGroup, ...] | None = None
    group_bytes = group_block_size = 0
    if config.kv_groups:
        state = state_geometry(cfg, spec.tp)
        if not is_hybrid(spec, state):
            raise ConfigError(f"kv_groups: {config.model} has no sliding-window or state layers to group")
        step = min(config.scheduler.prefill_chunk, config.scheduler.token_budget)
        hybrid = hybrid_plan(spec, pool_blocks * spec.block_bytes, max_len or 8192, step, state)
        # The same KV bytes in blocks of one group's page; full groups first (the ledger keeps the first). With
        # state layers the block holds `hybrid.block_size` tokens (a page holds a layer's state), one per state
        # group per request.
        planned = sorted(hybrid.groups, key=lambda g: g.kind != "full")
        groups = tuple(KVCacheGroup(g.kind, g.layers, g.window, g.layer_block_bytes) for g in planned)
        pool_blocks, group_bytes = hybrid.pool_blocks, hybrid.block_bytes
        group_block_size = hybrid.block_size
        source += f"; KV cache groups: {len(groups)} of {hybrid.group_size} layers, {pool_blocks:,} blocks"
        if state is not None:
            source += f" of {group_block_size} tokens"
        # The tiers below hold the pool's blocks: as many of one group's page as their bytes take.
        host_blocks = config.host_pool_bytes // group_bytes if config.host_pool_bytes else 0
        disk_blocks = config.disk_pool_bytes // group_bytes if config.disk_pool_bytes else 0
    return Deployment(spec, cfg, profile, cost, pool_blocks, source, inventory, max_len, host_blocks, disk_blocks,
                      groups, group_bytes, group_block_size)


def tier_links(dep: Deployment, tiers: TierLedger | None, staging_blocks: int) -> Callable[[int], Any] | None:
    """The executor's ``links``: a tier slot -> the calibrated link of the tier that owns it (None without
    tiers)."""
    if tiers is None:
        return None
    models = [dep.profile.link(name, staging_blocks=staging_blocks) for name in tiers.names]
    return lambda slot: models[tiers.tier_of(slot)]


def recovery_costs(dep: Deployment, staging_blocks: int = 32) -> RecoveryCosts:
    """The scheduler's recompute-vs-swap prices from the same device profile the step times use."""
    params = count_parameters_per_rank(dep.model_cfg, dep.spec.tp)
    per_token = 2 * (params.attention + params.mlp + params.embedding)
    transfer = dep.profile.link("host", staging_blocks=staging_blocks)
    return RecoveryCosts(flops_per_token=float(per_token), flops_per_s=dep.profile.effective_flops,
                         block_bytes=dep.block_bytes, transfer=transfer)


# ---- results ---------------------------------------------------------------------------------------


# One request's fate: the shared metrics definition (times in seconds of simulated time).
RequestRecord = RequestMetrics


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
        return self.deployment.pool_blocks * self.deployment.block_size

    def summary(self) -> dict[str, Any]:
        return summarize(self)


def summarize(result: SimResult) -> dict[str, Any]:
    dep, cfg = result.deployment, result.config
    reqs = result.requests
    run = summarize_requests(reqs)
    tl = result.timeline
    weights = tl.dt_s
    total_w = sum(weights)
    pool = result.pool_slots
    memory = {}
    for key in BREAKDOWN_KEYS:
        col = getattr(tl, key)
        memory[key] = (sum(v * w for v, w in zip(col, weights, strict=True)) / (total_w * pool)) if total_w else 0.0
    return {
        "model": cfg.model, "gpu": dep.profile.name, "tp": cfg.tp, "policy": cfg.scheduler.policy,
        "block_size": dep.block_size, "prefix_cache": cfg.prefix_cache, "eviction": cfg.eviction,
        "trust_groups": cfg.trust_groups,
        "pool_blocks": dep.pool_blocks, "pool_bytes": dep.pool_blocks * dep.block_bytes,
        "block_bytes": dep.block_bytes, "pool_source": dep.pool_source,
        "host_blocks": dep.host_blocks, "disk_blocks": dep.disk_blocks,
        "requests": run["requests"], "completed": run["completed"], "finish_reasons": run["finish_reasons"],
        "steps": result.steps, "sim_duration_s": run["duration_s"],
        "throughput_tok_s": run["throughput_tok_s"],
        "throughput_req_s": run["throughput_req_s"],
        "total_tok_s": run["total_tok_s"],
        "output_tokens": run["output_tokens"],
        "ttft_s": run["ttft_s"], "tpot_s": run["tpot_s"], "e2e_s": run["e2e_s"],
        "preemptions": result.preemptions,
        "preempted_requests": run["preempted_requests"],
        "prefix_hit_tokens": run["prefix_hit_tokens"], "readmit_hit_tokens": run["readmit_hit_tokens"],
        "prompt_tokens": run["prompt_tokens"], "prefix_hit_rate": run["prefix_hit_rate"],
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


class CostModelExecutor:
    """The simulator's executor: a step takes the cost model's time for its prefill chunks and decodes plus
    the transfer time it waits for (:func:`~kvledger.scheduler.transfers.step_transfer_timing`: what the
    step depends on in full, the rest only where it outlasts the compute; ``links`` maps a tier slot to its
    link, ``None`` without tiers); every sampling sequence gets ``SAMPLED_TOKEN``, or ``STOP_TOKEN`` for
    the last token of its trace output when the request carries that length as its payload
    (``declared_max_new``)."""

    def __init__(self, step_time: Callable[[list[tuple[int, int]], list[int]], float], *,
                 links: Callable[[int], Any] | None = None, block_bytes: int = 0, block_size: int = 16) -> None:
        self.step_time = step_time
        self.links = links
        self.block_bytes = block_bytes
        self.block_size = block_size

    def execute(self, plan: StepPlan) -> StepOutput:
        prefills, decodes = plan.prefills, plan.decodes
        dt = self.step_time([(w.end - w.start, w.start) for w in prefills], [w.end for w in decodes]) \
            if prefills or decodes else 0.0
        out = StepOutput(elapsed_s=dt)
        if self.links is not None and (plan.swap_out or plan.swap_in or plan.tier_transfers):
            t = step_transfer_timing(plan, dt, self.links, self.block_bytes, self.block_size)
            out.elapsed_s += t.exposed_s
            out.transfer_s, out.transfer_hidden_s, out.transfer_exposed_s = t.total_s, t.hidden_s, t.exposed_s
        elif plan.swap_out or plan.swap_in:
            out.elapsed_s += plan.transfer_wait_s
            out.transfer_s = out.transfer_exposed_s = plan.transfer_wait_s
        sampled = out.sampled
        token, stop = [SAMPLED_TOKEN], [STOP_TOKEN]
        for w in (*prefills, *decodes):
            if not w.sample:
                continue
            req = w.request
            trace_len = req.payload if req is not None else None
            # The token sampled now sits at position w.end: output number w.end - prompt + 1.
            if trace_len is not None and w.end - len(req.prompt) + 1 >= trace_len:
                sampled[w.seq_id] = stop
            else:
                sampled[w.seq_id] = token
        return out


Progress = Callable[[float, int, int], None]  # (sim time, requests finished, requests total)


class Simulator:
    """One run: ``Simulator(config).run(requests)`` -> :class:`SimResult`."""

    def __init__(self, config: SimConfig, deployment: Deployment | None = None) -> None:
        self.config = config
        self.dep = deployment or build_deployment(config)

    def _arrivals(self, workload: Sequence[SimRequest]) -> Iterator[GenRequest]:
        """The trace as scheduler requests, built only when the driver pulls them (prompts are
        materialised lazily, at most ``feed_window`` requests ahead of admission)."""
        cfg, dep = self.config, self.dep
        contexts: dict[str, CacheContext] = {}
        declared, max_len = cfg.declared_max_new, dep.max_model_len
        stop_ids = frozenset({STOP_TOKEN})
        for r in workload:
            ctx = contexts.get(r.trust_group)
            if ctx is None:
                ctx = contexts[r.trust_group] = dep.spec.cache_context(r.trust_group, str(cfg.model))
            if declared is None:
                yield GenRequest(r.request_id, r.prompt_tokens.tolist(), r.output_len, ctx, n=r.n,
                                 priority=r.priority, arrival_s=r.arrival_s)
            else:
                allowance = max(declared, r.output_len)
                if max_len is not None:
                    allowance = max(min(allowance, max_len - r.prompt_len), r.output_len)
                yield GenRequest(r.request_id, r.prompt_tokens.tolist(), allowance, ctx, n=r.n, priority=r.priority,
                                 arrival_s=r.arrival_s, stop_token_ids=stop_ids, payload=r.output_len)

    def run(self, requests: Sequence[SimRequest], *, progress: Progress | None = None,
            progress_every: int = 2000) -> SimResult:
        cfg, dep = self.config, self.dep
        wall0 = time.perf_counter()
        workload, notes = prepare_workload(requests, cfg, dep.max_model_len)
        bs = dep.block_size
        replica = Replica.assemble(dep.pool_blocks, bs, cfg.scheduler, eviction=cfg.eviction,
                                   prefix_caching=cfg.prefix_cache, tiers=dep.tiers(),
                                   costs=recovery_costs(dep, cfg.staging_blocks), kv_groups=dep.kv_groups)
        ledger, host, sched = replica.ledger, replica.tiers, replica.scheduler
        block_cost = dep.block_cost
        set_cost = getattr(ledger.pool.retained, "set_block_cost", None)
        if set_cost is not None:  # gdsf weighs blocks by the time recomputing them takes here
            set_cost(block_cost)
        if host is not None and cfg.demotion == "cost":
            links = [dep.profile.link(name, staging_blocks=cfg.staging_blocks) for name in host.names]
            bb = dep.spec.block_bytes
            flow = host.flow  # the chance a demoted entry comes back: promoted / demoted so far (prior 1/2)
            host.worth = cost_aware_rule(block_cost, [link.time_s(1, bb, "in") for link in links],
                                         [link.time_s(1, bb, "out") for link in links],
                                         reuse=lambda: (flow["promoted"] + 1) / (flow["demoted"] + 2))
        self.scheduler = sched  # kept for inspection after the run
        tl = Timeline()
        preempt = {"recompute": 0, "swap": 0}
        sample_every = cfg.sample_every
        seq_of, pool = ledger.sequence, ledger.pool

        def planned(plan: StepPlan, t0: float) -> None:
            for p in plan.preempted:
                preempt[p.mode] = preempt.get(p.mode, 0) + 1
            if driver.steps % sample_every == 0 or not (plan.prefills or plan.decodes):
                self._sample(tl, sched, seq_of, pool, ledger, bs, t0)

        def executed(plan: StepPlan, output: StepOutput) -> None:
            if output.transfer_s:
                transfers["transfer_s"] += output.transfer_s
                transfers["hidden_s"] += output.transfer_hidden_s
                transfers["exposed_s"] += output.transfer_exposed_s
                transfers["steps_with_transfers"] += 1
            if driver.steps % sample_every == 0 or not (plan.prefills or plan.decodes):
                tl.dt_s.append(output.elapsed_s)
                tl.prefill_tokens.append(sum(w.end - w.start for w in plan.prefills))
                tl.decodes.append(len(plan.decodes))

        links = tier_links(dep, host, cfg.staging_blocks)
        transfers = {"transfer_s": 0.0, "hidden_s": 0.0, "exposed_s": 0.0, "steps_with_transfers": 0}
        executor = CostModelExecutor(dep.cost.step_time, links=links, block_bytes=dep.block_bytes, block_size=bs)
        driver = replica.drive(executor, clock=VirtualClock(), feed_window=cfg.feed_window,
                               check_every=cfg.check_every, on_planned=planned, on_executed=executed,
                               keep_records=True)
        total = len(workload)
        report = None if progress is None else (
            lambda d: progress(d.clock.now(), len(d.records), total))  # noqa: E731
        driver.run(self._arrivals(workload), origin=0.0, progress=report, progress_every=progress_every)
        records = driver.records
        stuck = sum(1 for r in records if r.finish_reason in (REJECTED_NO_ROOM, REJECTED_OUTGREW))
        if stuck:
            notes.append(f"{stuck} request(s) could not run even with nothing else running (they outgrew the "
                         "pool, or the pool could not take them back) and were rejected")
        never = sum(1 for r in records if r.finish_reason.startswith("never"))
        if never:
            notes.append(f"{never} request(s) are larger than the whole pool and were rejected")
        stats = ledger.stats()
        counters = {"admissions": stats["admissions"], "lifetimes": stats["lifetimes"],
                    "ledger_prefix_cache": stats["prefix_cache"]}
        if host is not None:
            counters["host_blocks_used_at_end"] = host.num_used
            counters["tiers"] = sched.tier_stats()
            counters["transfers"] = transfers
        records.sort(key=lambda r: (r.arrival_s, r.request_id))
        return SimResult(cfg, dep, records, tl, driver.steps, preempt, counters, notes,
                         time.perf_counter() - wall0)

    # -- helpers --

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
    checks.positive(block_size, "block_size")
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
    """Convenience: ``simulate(requests, policy="incremental", pool_blocks=4096)`` (simulation or
    scheduler keys)."""
    config = (config or SimConfig()).with_values(**overrides)
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
    "BREAKDOWN_KEYS", "CPU_LOCAL", "SWEEP_KEYS", "CostModelExecutor", "Deployment",
    "RequestRecord", "SimConfig", "SimResult", "Simulator", "Timeline", "build_deployment", "distribution",
    "parse_sweep", "parse_value", "percentile",
    "prefix_hit_bound", "prepare_workload", "run_sweep", "simulate", "summarize", "sweep_configs",
]
