"""The seed's admission lab: N requests with a common prefix, spread over G trust groups, admitted
together into one pool under full output reservation. Every number comes from running the real ledger.

This module sits above the ledger core and below the faces (CLI, later the web lab).
"""

from __future__ import annotations

from dataclasses import dataclass

from .core import checks
from .core.identity import request_context
from .core.ledger import Decision, KVLedger, Request
from .errors import ConfigError
from .scheduler import ConstantExecutor, GenRequest, SchedulerConfig, StepPlan
from .scheduler.policies import OutputLengthTracker, reserve_tokens
from .scheduler.replica import Replica

_SHARED_TOKEN_BASE = 1_000  # the common prefix: the same token ids in every group (only trust separates)
_PRIVATE_TOKEN_BASE = 1_000_000  # private suffixes: distinct per request


@dataclass(frozen=True, slots=True)
class LabSpec:
    pool_blocks: int
    block_size: int
    requests: int
    prompt: int
    shared_prefix: int
    max_new: int
    groups: int = 1
    prefix_caching: bool = True
    model: str = "lab"
    branches: int = 1  # n-way parallel sampling per request
    policy: str = "full"

    def __post_init__(self) -> None:
        for name in ("pool_blocks", "block_size", "requests", "prompt", "groups", "branches"):
            checks.positive(getattr(self, name), name.replace("_", "-"))
        for name in ("shared_prefix", "max_new"):
            checks.count(getattr(self, name), name.replace("_", "-"))
        if self.shared_prefix > self.prompt:
            raise ConfigError(f"shared-prefix ({self.shared_prefix}) cannot exceed prompt ({self.prompt})")
        if self.groups > self.requests:
            raise ConfigError(f"groups ({self.groups}) cannot exceed requests ({self.requests})")


def _config(spec: LabSpec) -> SchedulerConfig:
    # One step prefills everything: the lab is about memory, not about chunking.
    return SchedulerConfig(policy=spec.policy, token_budget=10**9, prefill_chunk=10**9,
                           max_running=10**6)


def lab_requests(spec: LabSpec) -> list[Request]:
    shared = list(range(_SHARED_TOKEN_BASE, _SHARED_TOKEN_BASE + spec.shared_prefix))
    out = []
    private_len = spec.prompt - spec.shared_prefix
    for i in range(spec.requests):
        start = _PRIVATE_TOKEN_BASE + i * private_len
        prompt = shared + list(range(start, start + private_len))
        ctx = request_context(f"group-{i % spec.groups}", spec.model)
        out.append(Request(f"req-{i}", prompt, spec.max_new, ctx, branches=spec.branches))
    return out


def _admit_all(spec: LabSpec, pool_blocks: int, prefix_caching: bool) -> tuple[KVLedger, list[Decision]]:
    """Admit every request at once, reserving what the policy reserves (the same code the scheduler
    uses), and keeping the policy's watermark free."""
    ledger = KVLedger(pool_blocks, spec.block_size, prefix_caching=prefix_caching)
    config = _config(spec)
    keep_free = config.keep_free(pool_blocks)
    reserve = reserve_tokens(config, OutputLengthTracker(), spec.max_new, spec.max_new)
    decisions = []
    for r in lab_requests(spec):
        policy_request = Request(r.request_id, r.prompt, r.max_new_tokens, r.context,
                                 reserve_new_tokens=reserve, branches=r.branches)
        decisions.append(ledger.admit(policy_request, keep_free))
    ledger.check()
    return ledger, decisions


def _growth_is_cheap(spec: LabSpec) -> bool:
    if spec.max_new == 0:
        return False  # nothing grows: the admission above is the whole story
    return spec.requests * spec.branches * (spec.max_new + spec.prompt // spec.block_size) <= 2_000_000


def request_blocks(spec: LabSpec) -> int:
    """Blocks one request's prompt and whole output allowance cover (one branch)."""
    return -(-(spec.prompt + spec.max_new) // spec.block_size)


@dataclass(frozen=True, slots=True)
class GrowthBound:
    """At most what `run_growth` does for a spec, worked out from the spec alone (nothing admitted), so
    that a caller can refuse a run before starting it."""

    steps: int  # scheduler steps
    audited_blocks: int  # blocks the audit after every step visits: the pool, and every table in it


def growth_bound(spec: LabSpec) -> GrowthBound:
    """Steps: while a request waits, the requests running hold or are promised more than the pool's
    admissible blocks less what the waiting one needs (else it would be admitted), and none holds more
    than a whole request with all its branches; so at least ``at_once`` of them run, each producing a
    token every step for at most ``max_new + 1`` steps. With nothing waiting every request left finishes
    within ``max_new + 1`` steps. In one trust group the running requests hold the common prefix's full
    blocks once, and a waiting request needs only its private blocks; across groups nothing is counted as
    shared. Audit: every step checks the whole pool and every running branch's table, which covers at
    most ``request_blocks`` blocks, on each of its steps."""
    if not _growth_is_cheap(spec):
        return GrowthBound(0, 0)
    per_branch = request_blocks(spec)
    per_request = per_branch + (spec.branches - 1) * (per_branch - spec.prompt // spec.block_size)
    admissible = spec.pool_blocks - _config(spec).keep_free(spec.pool_blocks)
    at_once = admissible // per_request
    shared = spec.shared_prefix // spec.block_size if spec.prefix_caching else 0
    if spec.groups == 1 and 0 < shared < per_request:
        at_once = max(at_once, (admissible - shared) // (per_request - shared))
    at_once = max(1, at_once)
    lifetime = spec.max_new + 1
    steps = lifetime if spec.requests <= at_once else spec.requests * lifetime // at_once + lifetime
    tables = spec.requests * spec.branches * lifetime * per_branch
    return GrowthBound(steps, steps * spec.pool_blocks + tables)


def run_growth(spec: LabSpec) -> dict:
    """Run the requests to completion through the real scheduler (each generates its whole allowance)
    and report what growth does under the policy: how many start at once, preemptions, steps. It is
    the scheduler's one step loop (a :class:`Driver`) with a constant-token executor."""
    replica = Replica.assemble(spec.pool_blocks, spec.block_size, _config(spec), prefix_caching=spec.prefix_caching)
    sched = replica.scheduler
    started: list[int] = []
    running_peak = 0

    def planned(plan: StepPlan, t: float) -> None:
        nonlocal running_peak
        if not started:
            started.append(len(plan.admitted))
        running_peak = max(running_peak, len(sched.running))

    driver = replica.drive(ConstantExecutor(), check_every=1, on_planned=planned, keep_records=True)
    for r in lab_requests(spec):
        driver.submit(GenRequest(r.request_id, list(r.prompt), spec.max_new, r.context, n=spec.branches))
    driver.run(max_steps=100 * (spec.prompt + spec.max_new) * spec.requests)
    if driver.has_work():
        raise ConfigError("the growth run made no progress")  # a guard, never expected
    ended = {m.request_id: m.finish_reason.split(",")[0] or "?" for m in driver.records}
    return {
        "policy": spec.policy,
        "started_at_once": started[0] if started else 0,
        "peak_running_requests": running_peak,
        "preemptions": sched.preemptions,
        "steps": driver.steps,
        "finish_reasons": sorted(set(ended.values())),
    }


def _charged(ledger: KVLedger) -> int:
    u = ledger.usage()
    return u.active + u.promised


def run_lab(spec: LabSpec) -> dict:
    """Admit every request in order into the real pool; then measure what all of them would need
    together (with and without sharing) by admitting them into a pool large enough for everyone."""
    bs = spec.block_size
    blocks_per_request = request_blocks(spec)
    # Each extra branch: its own output allowance plus one copy of the prompt's partial tail.
    per_branch = blocks_per_request - spec.prompt // bs
    branch_blocks = (spec.branches - 1) * per_branch
    ledger, decisions = _admit_all(spec, spec.pool_blocks, spec.prefix_caching)
    roomy = spec.requests * (blocks_per_request + branch_blocks)
    full = LabSpec(spec.pool_blocks, bs, spec.requests, spec.prompt, spec.shared_prefix, spec.max_new,
                   spec.groups, spec.prefix_caching, spec.model, spec.branches, "full")
    together, _ = _admit_all(full, roomy, spec.prefix_caching)
    unshared, _ = _admit_all(full, roomy, False)
    # What one request of a group shares with another of the same group: ask the ledger with a pair.
    pair = LabSpec(2 * (blocks_per_request + branch_blocks), bs, 2, spec.prompt, spec.shared_prefix,
                   spec.max_new, 1, spec.prefix_caching, spec.model, spec.branches, "full")
    shared_blocks = _admit_all(pair, pair.pool_blocks, spec.prefix_caching)[1][1].blocks_hit
    usage = ledger.usage()
    admitted = [d for d in decisions if d.admitted]
    return {
        "policy": spec.policy,
        "pool_blocks": spec.pool_blocks,
        "block_size": bs,
        "requests": spec.requests,
        "groups": spec.groups,
        "prompt": spec.prompt,
        "shared_prefix": spec.shared_prefix,
        "max_new": spec.max_new,
        "prefix_caching": spec.prefix_caching,
        "branches": spec.branches,
        "blocks_per_request": blocks_per_request,
        "branch_blocks_per_request": branch_blocks,
        "shared_prefix_blocks": shared_blocks,
        "private_blocks_per_request": blocks_per_request - shared_blocks,
        "blocks_needed_all": _charged(together),
        "blocks_needed_unshared": _charged(unshared),
        "admitted": len(admitted),
        "admitted_blocks": usage.active + usage.promised,
        "free_blocks_after": usage.available,
        "growth": run_growth(spec) if _growth_is_cheap(spec) else None,
        "usage": usage.as_dict(),
        "token_usage": ledger.token_usage(),
        "decisions": [
            {
                "request": d.request_id,
                "group": f"group-{i % spec.groups}",
                "outcome": d.outcome.value,
                "blocks_total": d.blocks_total,
                "blocks_shared": d.blocks_hit,
                "blocks_new": d.blocks_new,
                "blocks_promised": d.blocks_promised,
                "blocks_branches": d.blocks_branches,
                "reason": d.detail or d.reason,  # the lab is the operator's view of its own pool
            }
            for i, d in enumerate(decisions)
        ],
    }
