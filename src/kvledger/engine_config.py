"""One engine configuration, torch-free: everything that decides how an engine is built.

:class:`EngineConfig` names the model, the compute dtype, the KV format, the pool (in blocks or bytes),
the block size, int4's residual pages, the tiers below the pool, the eviction policy, prefix caching, the
attention backend, the model length and the scheduler's own :class:`~kvledger.scheduler.SchedulerConfig`.
``Engine.from_config`` (:mod:`kvledger.runtime.loading`) is the one path from it to an engine: the
commands (``generate``, ``serve-trace``, ``serve``, ``fleet serve``, ``diagnose``), the server and the fleet's
engine replicas all build one and hand it over, so a knob is decided once.

It imports no torch (the fleet's ingress and the command line read it without loading the runtime) and
validates on construction: a bad value is one :class:`~kvledger.errors.ConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .core import checks
from .core.eviction import policy_names
from .core.sizing.geometry import canonical_dtype
from .core.sizing.kv_formats import KV_FORMATS
from .errors import ConfigError
from .scheduler import SchedulerConfig

COMPUTE_DTYPES = ("fp32", "bf16", "fp16")
DEFAULT_MODEL = "smollm2-135m"
MAX_POOL_BYTES = 64 * 2**30  # real KV tensors on this machine's memory: beyond this is a mistake, not a plan
MAX_RUNTIME_BLOCKS = 65_536  # the most blocks a command lets the runtime allocate (a CPU pool beyond is a mistake)


def _count(value: Any, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How an engine is built. Give the pool as ``num_blocks`` or ``pool_bytes`` (whole blocks that fit
    beside int4's residual pages), not both; with neither, :attr:`default_blocks` blocks."""

    model: str = DEFAULT_MODEL  # a bundled name, a Hugging Face folder or a .gguf file
    dtype: str = "fp32"  # compute dtype of the weights (fp32, bf16, fp16; vLLM's names are accepted)
    kv_dtype: str | None = None  # the KV cache format (None: the compute dtype)
    num_blocks: int | None = None
    pool_bytes: int | None = None
    block_size: int = 16
    residual_slots: int | None = None  # int4's residual pages (None: one per sequence that may run, <= 32)
    host_blocks: int = 0
    disk_blocks: int = 0
    disk_dir: str | None = None
    tier_compression: str = "none"
    eviction: str = "lru"
    prefix_caching: bool = True
    attention_backend: str = "auto"
    max_model_len: int | None = None  # prompt + output of one sequence (None: the model's context)
    allow_untested_kv: bool = False  # serve a quantised KV format without a passing quality record
    device: str = "cpu"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    default_blocks = 1024  # the pool when neither num_blocks nor pool_bytes is given

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"model must be a non-empty string, got {self.model!r}")
        compute = self._dtype_name(self.dtype, "dtype")
        if compute not in COMPUTE_DTYPES:
            raise ConfigError(f"--dtype must be fp32, bf16 or fp16, got {self.dtype!r}")
        object.__setattr__(self, "dtype", compute)
        if self.kv_dtype is not None:
            kv = self._dtype_name(self.kv_dtype, "kv_dtype")
            if kv not in KV_FORMATS:
                raise ConfigError(f"unknown KV format {self.kv_dtype!r} (known: {', '.join(KV_FORMATS)})")
            object.__setattr__(self, "kv_dtype", kv)
        if self.num_blocks is not None and self.pool_bytes is not None:
            raise ConfigError("give the KV pool as num_blocks or pool_bytes, not both")
        if self.num_blocks is not None:
            _count(self.num_blocks, "num_blocks", 1)
        if self.pool_bytes is not None:
            _count(self.pool_bytes, "pool_bytes", 1)
            if self.pool_bytes > MAX_POOL_BYTES:
                raise ConfigError(f"the KV pool of {self.pool_bytes:,} B is more than the runtime allocates "
                                  f"({MAX_POOL_BYTES // 2**30} GiB)")
        _count(self.block_size, "block_size", 1)
        if self.residual_slots is not None:
            _count(self.residual_slots, "residual_slots", 1)
        _count(self.host_blocks, "host_blocks", 0)
        _count(self.disk_blocks, "disk_blocks", 0)
        if self.eviction not in policy_names():
            raise ConfigError(f"unknown eviction policy {self.eviction!r}; choose one of {', '.join(policy_names())}")
        if self.max_model_len is not None:
            _count(self.max_model_len, "max_model_len", 2)
        if not isinstance(self.scheduler, SchedulerConfig):
            raise ConfigError(f"scheduler must be a SchedulerConfig, got {type(self.scheduler).__name__}")
        for name in ("prefix_caching", "allow_untested_kv"):
            checks.flag(getattr(self, name), name)

    @staticmethod
    def _dtype_name(value: Any, what: str) -> str:
        if not isinstance(value, str):
            raise ConfigError(f"{what} must be a dtype name, got {value!r}")
        return canonical_dtype(value)

    @property
    def pool(self) -> dict[str, int]:
        """The pool as the loader takes it: ``{"num_blocks": n}`` or ``{"pool_bytes": b}``."""
        if self.pool_bytes is not None:
            return {"pool_bytes": self.pool_bytes}
        return {"num_blocks": self.default_blocks if self.num_blocks is None else self.num_blocks}

    def with_(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "scheduler"}
        out["scheduler"] = self.scheduler.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        """The inverse of :meth:`to_dict` (a fleet replica gets its configuration this way)."""
        if not isinstance(data, dict):
            raise ConfigError(f"an engine configuration is a mapping, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown engine settings: {', '.join(map(str, unknown))}")
        values = dict(data)
        if "scheduler" in values and isinstance(values["scheduler"], dict):
            values["scheduler"] = SchedulerConfig(**values["scheduler"])
        return cls(**values)


__all__ = ["COMPUTE_DTYPES", "DEFAULT_MODEL", "MAX_POOL_BYTES", "MAX_RUNTIME_BLOCKS", "EngineConfig"]
