"""What a fleet runs: :class:`FleetSpec`, Ray-free, so that the command line reads its defaults (and a test
or the fleet simulator builds one) without importing Ray.

Each engine replica runs :meth:`FleetSpec.engine_config`: the one engine configuration every engine is
built from (``Engine.from_config``); the ingress routes with :meth:`FleetSpec.score`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import checks
from ..engine_config import EngineConfig
from ..errors import ConfigError
from ..placement.score import ScoreConfig


@dataclass(frozen=True)
class FleetSpec:
    """What every engine replica runs and how the ingress routes to it."""

    model: str = "smollm2-135m"
    pool_blocks: int = 64
    block_size: int = 16
    dtype: str = "fp32"
    max_running: int = 256
    engine_replicas: int = 2
    ingress_replicas: int = 2
    stats_period_s: float = 10.0
    retries: int | None = None  # after a refusal (default: engine_replicas - 1)
    retry_s: float = 0.05
    min_match_tokens: int = 64
    queue_weight: float = 0.1
    view_key: str = "kvledger"
    torch_threads: int = 1
    news_period_s: float = 0.25  # how often an ingress asks each replica for its cache events and load
    # A host-memory tier of this many blocks below each replica's pool: evicted prefix blocks are demoted
    # to it and promoted back on a hit (offload_prefixes), and routers keep counting them as the replica's.
    host_blocks: int = 0
    # The engine knobs a replica runs with beyond the pool (vLLM's names on the command line): the KV format
    # (None: the compute dtype), prefix caching, tokens per step and the model length (None: the model's).
    kv_dtype: str | None = None
    allow_untested_kv: bool = False
    prefix_caching: bool = True
    max_batched_tokens: int = 8192  # tokens per engine step
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("pool_blocks", "block_size", "max_running", "engine_replicas", "ingress_replicas",
                     "torch_threads"):
            checks.positive(getattr(self, name), name)
        checks.non_negative(self.host_blocks, "host_blocks")
        checks.positive(self.max_batched_tokens, "max_batched_tokens")
        if not self.stats_period_s > 0 or not self.retry_s > 0 or not self.news_period_s > 0:
            raise ConfigError("stats_period_s, retry_s and news_period_s must be positive")

    def score(self) -> ScoreConfig:
        return ScoreConfig(min_match_tokens=self.min_match_tokens, queue_weight=self.queue_weight)

    def engine_config(self) -> EngineConfig:
        """What each engine replica runs: full reservation (the router's door books a request's whole
        declaration), and evicted prefixes demoted to the host tier when there is one."""
        from ..scheduler import SchedulerConfig

        scheduler = SchedulerConfig(policy="full", max_running=self.max_running, token_budget=self.max_batched_tokens,
                                    offload_prefixes=self.host_blocks > 0)
        return EngineConfig(model=self.model, dtype=self.dtype, kv_dtype=self.kv_dtype, num_blocks=self.pool_blocks,
                            block_size=self.block_size, host_blocks=self.host_blocks, scheduler=scheduler,
                            prefix_caching=self.prefix_caching, max_model_len=self.max_model_len,
                            allow_untested_kv=self.allow_untested_kv)


__all__ = ["FleetSpec"]
