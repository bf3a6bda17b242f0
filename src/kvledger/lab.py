"""The seed's admission lab: N requests with a common prefix, spread over G trust groups, admitted
together into one pool under full output reservation. Every number comes from running the real ledger.

This module sits above the ledger core and below the faces (CLI, later the web lab).
"""

from __future__ import annotations

from dataclasses import dataclass

from .core.identity import CacheContext
from .core.ledger import Decision, KVLedger, Request
from .errors import ConfigError

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

    def __post_init__(self) -> None:
        for name in ("pool_blocks", "block_size", "requests", "prompt", "groups", "branches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")
        for name in ("shared_prefix", "max_new"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 0, got {value!r}")
        if self.shared_prefix > self.prompt:
            raise ConfigError(f"shared-prefix ({self.shared_prefix}) cannot exceed prompt ({self.prompt})")
        if self.groups > self.requests and self.requests > 1:
            raise ConfigError(f"groups ({self.groups}) cannot exceed requests ({self.requests})")


def lab_requests(spec: LabSpec) -> list[Request]:
    shared = list(range(_SHARED_TOKEN_BASE, _SHARED_TOKEN_BASE + spec.shared_prefix))
    out = []
    private_len = spec.prompt - spec.shared_prefix
    for i in range(spec.requests):
        start = _PRIVATE_TOKEN_BASE + i * private_len
        prompt = shared + list(range(start, start + private_len))
        ctx = CacheContext(trust_group=f"group-{i % spec.groups}", model=spec.model)
        out.append(Request(f"req-{i}", prompt, spec.max_new, ctx, branches=spec.branches))
    return out


def _admit_all(spec: LabSpec, pool_blocks: int, prefix_caching: bool) -> tuple[KVLedger, list[Decision]]:
    ledger = KVLedger(pool_blocks, spec.block_size, prefix_caching=prefix_caching)
    decisions = [ledger.admit(r) for r in lab_requests(spec)]
    ledger.check()
    return ledger, decisions


def _charged(ledger: KVLedger) -> int:
    u = ledger.usage()
    return u.active + u.promised


def run_lab(spec: LabSpec) -> dict:
    """Admit every request in order into the real pool; then measure what all of them would need
    together (with and without sharing) by admitting them into a pool large enough for everyone."""
    bs = spec.block_size
    blocks_per_request = -(-(spec.prompt + spec.max_new) // bs)
    # Each extra branch: its own output allowance plus one copy of the prompt's partial tail.
    per_branch = blocks_per_request - spec.prompt // bs
    branch_blocks = (spec.branches - 1) * per_branch
    ledger, decisions = _admit_all(spec, spec.pool_blocks, spec.prefix_caching)
    roomy = spec.requests * (blocks_per_request + branch_blocks)
    together, _ = _admit_all(spec, roomy, spec.prefix_caching)
    unshared, _ = _admit_all(spec, roomy, False)
    # What one request of a group shares with another of the same group: ask the ledger with a pair.
    pair = LabSpec(2 * (blocks_per_request + branch_blocks), bs, 2, spec.prompt, spec.shared_prefix,
                   spec.max_new, 1, spec.prefix_caching, spec.model, spec.branches)
    shared_blocks = _admit_all(pair, pair.pool_blocks, spec.prefix_caching)[1][1].blocks_hit
    usage = ledger.usage()
    admitted = [d for d in decisions if d.admitted]
    return {
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
                "reason": d.reason,
            }
            for i, d in enumerate(decisions)
        ],
    }
