"""What the web lab accepts: the `kvledger admit` controls as JSON, bounded before anything runs.

Field names and meanings are the CLI's (`--kv-heads` is `kv_heads`, `--prefix-cache` is `prefix_cache`).
Bounds keep one lab run to well under a few seconds on a laptop; the choice lists come from the
registries (bundled models, KV dtypes, admission policies), never from a list kept here.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from ..core.geometry import KV_DTYPE_BYTES, KVSpec, canonical_dtype
from ..core.models import list_models, load_model_config
from ..errors import ConfigError
from ..lab import LabSpec
from ..units import parse_bytes

# Requests x branches x (prompt + output allowance): the lab's growth run steps through every token of
# every request, so this caps one run at a few seconds on a small machine.
MAX_LAB_TOKENS = 262_144
MAX_POOL_BLOCKS = 65_536
# The growth run takes about one scheduler step per output token per wave of requests, and audits the
# whole pool every step: these two products bound its steps and its audit work.
MAX_DECODE_STEPS = 16_384  # requests x branches x (output allowance + 1)
MAX_AUDIT_WORK = 16_777_216  # pool blocks x (output allowance + 1)


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
        steps = self.requests * self.branches * (self.max_new + 1)
        if steps > MAX_DECODE_STEPS:
            raise ValueError(
                f"requests x branches x (output allowance + 1) = {steps:,} decode steps; the lab runs at most "
                f"{MAX_DECODE_STEPS:,}")
        return self

    def resolve(self) -> tuple[KVSpec, int, LabSpec]:
        """(geometry, pool bytes, the lab spec) -- ConfigError for what the core refuses."""
        spec = self.kv_spec()
        pool_bytes = parse_bytes(self.pool)
        pool_blocks = spec.pool_blocks(pool_bytes)
        if pool_blocks > MAX_POOL_BLOCKS:
            raise ConfigError(f"the lab draws pools of at most {MAX_POOL_BLOCKS:,} blocks; {self.pool} is "
                              f"{pool_blocks:,} blocks of {spec.block_bytes:,} bytes")
        if pool_blocks * (self.max_new + 1) > MAX_AUDIT_WORK:
            raise ConfigError(
                f"pool blocks x (output allowance + 1) = {pool_blocks:,} x {self.max_new + 1:,} is more than the "
                f"lab steps through ({MAX_AUDIT_WORK:,}): use a smaller pool or a shorter output allowance")
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
                   "max_decode_steps": MAX_DECODE_STEPS, "max_audit_work": MAX_AUDIT_WORK, "requests": 64,
                   "groups": 64, "branches": 16, "block_size": 1024, "prompt": 65_536, "max_new": 65_536},
    }
