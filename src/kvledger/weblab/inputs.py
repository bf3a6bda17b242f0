"""What the web lab accepts: the `kvledger admit` controls as JSON, bounded before anything runs.

Field names and meanings are the CLI's (`--kv-heads` is `kv_heads`, `--prefix-cache` is `prefix_cache`).
Every field has a range, and the controls as a whole a work bound (`LabWork`, `MAX_LAB_WORK`): an upper
bound on the blocks the heaviest endpoint visits, worked out from the controls before anything runs, so
that every accepted input is answered within a second or two. The choice lists come from the
registries (bundled models, KV dtypes, admission policies), never from a list kept here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from ..core.sizing.geometry import KV_DTYPE_BYTES, KVSpec, canonical_dtype
from ..core.sizing.models import list_models, load_model_config
from ..errors import ConfigError
from ..lab import LabSpec, growth_bound, request_blocks
from ..units import parse_bytes

# Requests x branches x (prompt + output allowance): the prompts the lab materialises.
MAX_LAB_TOKENS = 262_144
MAX_POOL_BLOCKS = 65_536  # the ledger keeps per-block state in Python lists; the maps read every block
# The work bound (see LabWork), in audited-block visits of about 0.1 us: the heaviest accepted controls
# take at most about 1 s of CPU (/api/lab, on a 2-core machine); the seed's controls about 5,000,000.
MAX_LAB_WORK = 8_000_000
# What the other things the lab does cost, in audited blocks (measured on a 2-core machine, where an
# audited block takes 0.1-0.2 us: a scheduler step's own work 60-130 us, an admitted block 1 us, a prompt
# token hashed 0.3 us, a block map's block 3 us).
STEP_COST = 500
ADMITTED_BLOCK_COST = 6
PROMPT_TOKEN_COST = 2
MAPPED_BLOCK_COST = 16
ADMISSIONS_PER_RUN = 4  # run_lab admits every request three times (its pool, together, unshared), and a pair


@dataclass(frozen=True, slots=True)
class LabWork:
    """An upper bound on the work the heaviest lab endpoint does for one set of controls, from the
    controls alone. /api/lab runs the lab for one trust group, the controls' group count and one group
    per request; the model answer (/api/decision) for one group and one per request, then once more for
    one group at a shorter allowance. Each run: its growth run's steps and the blocks its per-step audits
    visit (`growth_bound`), and its admissions. Besides: the block maps' replays and the pool blocks they
    read, and the model answer's binary search over the output allowance (one admission each, for one
    group and for one group per request)."""

    steps: int
    audited_blocks: int
    admitted_blocks: int
    prompt_tokens: int
    mapped_blocks: int

    @classmethod
    def of(cls, lab: LabSpec) -> LabWork:
        # /api/lab: one group, the controls' groups, one per request (each once); /api/decision: one group
        # twice, one per request. Growth is the same for every count of groups above one.
        groups = (1, 1, lab.requests) if lab.groups in (1, lab.requests) else (1, lab.groups, lab.requests)
        growth = [growth_bound(replace(lab, groups=g)) for g in groups]
        runs = len(growth)
        passes = runs * (ADMISSIONS_PER_RUN + 1) + 2 * (lab.max_new.bit_length() + 1)
        return cls(steps=sum(g.steps for g in growth), audited_blocks=sum(g.audited_blocks for g in growth),
                   admitted_blocks=passes * lab.requests * lab.branches * request_blocks(lab),
                   prompt_tokens=passes * lab.requests * lab.prompt, mapped_blocks=runs * lab.pool_blocks)

    @property
    def visits(self) -> int:
        return (self.steps * STEP_COST + self.audited_blocks + self.admitted_blocks * ADMITTED_BLOCK_COST
                + self.prompt_tokens * PROMPT_TOKEN_COST + self.mapped_blocks * MAPPED_BLOCK_COST)

    def refusal(self) -> str | None:
        """Why these controls are refused, or None when they are within the bound."""
        if self.visits <= MAX_LAB_WORK:
            return None
        return (f"needs up to {self.visits:,} units of lab work (a unit: about one block audited), more than "
                f"the lab's bound of {MAX_LAB_WORK:,} (max_lab_work): up to {self.steps:,} decode steps, "
                f"{self.audited_blocks:,} blocks audited, {self.admitted_blocks:,} admitted and "
                f"{self.mapped_blocks:,} mapped; use a smaller pool or a shorter output allowance, fewer requests "
                f"or branches, or a larger block size")


def policy_names() -> tuple[str, ...]:
    """The admission policies, from the scheduler's registry (or its older tuple, before the registry)."""
    try:
        from ..scheduler.policies import ADMISSION_POLICIES  # type: ignore[attr-defined]
    except ImportError:
        from ..scheduler.config import POLICIES  # type: ignore[attr-defined]

        return tuple(POLICIES)
    return tuple(ADMISSION_POLICIES.names())


def _int(lo: int, hi: int) -> Any:
    return Annotated[int, Field(strict=True, ge=lo, le=hi)]


class GeometryInput(BaseModel):
    """A bundled model, or explicit layers / KV heads / head dim; plus KV dtype, TP and block size."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, max_length=64)
    layers: _int(1, 1024) | None = None  # type: ignore[valid-type]
    kv_heads: _int(1, 1024) | None = None  # type: ignore[valid-type]
    head_dim: _int(1, 8192) | None = None  # type: ignore[valid-type]
    kv_dtype: str | None = Field(default=None, max_length=32)
    tp: _int(1, 64) = 1  # type: ignore[valid-type]
    block_size: _int(1, 1024) = 16  # type: ignore[valid-type]

    @field_validator("model")
    @classmethod
    def _bundled_model(cls, value: str | None) -> str | None:
        # Only bundled names: the lab never reads a path it was sent.
        if value is not None and value not in list_models():
            raise ValueError(f"unknown model {value!r}; bundled models are: {', '.join(list_models())}")
        return value

    @field_validator("kv_dtype")
    @classmethod
    def _dtype(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return canonical_dtype(value)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    def kv_spec(self) -> KVSpec:
        """The geometry, by the core's own rules (ConfigError on anything it refuses)."""
        explicit = (self.layers, self.kv_heads, self.head_dim)
        if self.model is not None:
            if any(v is not None for v in explicit):
                raise ConfigError("give either a bundled model or layers / KV heads / head dim, not both")
            cfg = load_model_config(self.model)
            return KVSpec.from_hf_config(cfg, kv_dtype=self.kv_dtype, tp=self.tp, block_size=self.block_size,
                                         name=self.model)
        if any(v is None for v in explicit):
            raise ConfigError("give a bundled model, or all of layers, KV heads and head dim")
        return KVSpec(self.layers, self.kv_heads, self.head_dim, kv_dtype=self.kv_dtype or "bf16",  # type: ignore[arg-type]
                      block_size=self.block_size, tp=self.tp)


class LabInput(GeometryInput):
    """The controls of `kvledger admit`, as one JSON object."""

    pool: str = Field(default="512MiB", min_length=1, max_length=32)
    requests: _int(1, 64) = 8  # type: ignore[valid-type]
    prompt: _int(1, 65_536) = 2048  # type: ignore[valid-type]
    shared_prefix: _int(0, 65_536) = 0  # type: ignore[valid-type]
    max_new: _int(0, 65_536) = 257  # type: ignore[valid-type]
    groups: _int(1, 64) = 1  # type: ignore[valid-type]
    prefix_cache: StrictBool = True
    policy: str = "full"
    branches: _int(1, 16) = 1  # type: ignore[valid-type]

    @field_validator("policy")
    @classmethod
    def _policy(cls, value: str) -> str:
        if value not in policy_names():
            raise ValueError(f"policy must be one of {', '.join(policy_names())}, got {value!r}")
        return value

    @model_validator(mode="after")
    def _size(self) -> LabInput:
        tokens = self.requests * self.branches * (self.prompt + self.max_new)
        if tokens > MAX_LAB_TOKENS:
            raise ValueError(
                f"the lab runs at most {MAX_LAB_TOKENS:,} tokens in all (requests x branches x (prompt + output "
                f"allowance)); this asks for {tokens:,}")
        # A prefix longer than the prompt, or more groups than requests, is the core's to refuse (400); the
        # work is that of the controls with both clamped, so a bound past it is still the first thing said.
        clamped = self.model_copy(update={"shared_prefix": min(self.shared_prefix, self.prompt),
                                          "groups": min(self.groups, self.requests)})
        try:
            lab = clamped.resolve()[2]
        except ConfigError:
            return self  # the core refuses the geometry or the pool anyway: resolve() says why (400)
        refusal = LabWork.of(lab).refusal()
        if refusal is not None:
            raise ValueError(refusal)
        return self

    def resolve(self) -> tuple[KVSpec, int, LabSpec]:
        """(geometry, pool bytes, the lab spec) -- ConfigError for what the core refuses."""
        spec = self.kv_spec()
        pool_bytes = parse_bytes(self.pool, unit_required=True)  # as the CLI's --pool: "512" is no size
        pool_blocks = spec.pool_blocks(pool_bytes)
        if pool_blocks > MAX_POOL_BLOCKS:
            raise ConfigError(f"the lab draws pools of at most {MAX_POOL_BLOCKS:,} blocks; {self.pool} is "
                              f"{pool_blocks:,} blocks of {spec.block_bytes:,} bytes")
        return spec, pool_bytes, LabSpec(pool_blocks, spec.block_size, self.requests, self.prompt,
                                         self.shared_prefix, self.max_new, self.groups, self.prefix_cache,
                                         self.model or "explicit", self.branches, self.policy)


def choices() -> dict[str, Any]:
    """Everything a form needs to offer, from the registries."""
    return {
        "models": list_models(),
        "kv_dtypes": sorted(KV_DTYPE_BYTES),
        "policies": list(policy_names()),
        "limits": {"max_lab_tokens": MAX_LAB_TOKENS, "max_pool_blocks": MAX_POOL_BLOCKS,
                   "max_lab_work": MAX_LAB_WORK, "requests": 64,
                   "groups": 64, "branches": 16, "block_size": 1024, "prompt": 65_536, "max_new": 65_536},
    }
