"""One engine configuration and one build path: ``EngineConfig`` (torch-free, validated on construction)
and ``Engine.from_config``, which every other way of building an engine (``from_model``, the commands, the
server, the fleet's replicas) goes through."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvledger.engine_config import EngineConfig
from kvledger.errors import ConfigError
from kvledger.runtime.engine import Engine
from kvledger.scheduler import SchedulerConfig

BS = 4


def test_the_configuration_imports_no_torch() -> None:
    code = ("import sys, kvledger.engine_config as c; c.EngineConfig(kv_dtype='int8');"
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=120).returncode == 0


@pytest.mark.parametrize("changes, message", [
    ({"dtype": "int8"}, "--dtype must be fp32, bf16 or fp16, got 'int8'"),
    ({"dtype": "fp7"}, "unknown dtype 'fp7'"),
    ({"kv_dtype": "fp7"}, "unknown dtype 'fp7'"),
    ({"num_blocks": 4, "pool_bytes": 1024}, "num_blocks or pool_bytes, not both"),
    ({"num_blocks": 0}, "num_blocks must be an integer >= 1, got 0"),
    ({"num_blocks": True}, "num_blocks must be an integer >= 1, got True"),
    ({"pool_bytes": 2**40}, "more than the runtime allocates (64 GiB)"),
    ({"block_size": 0}, "block_size must be an integer >= 1"),
    ({"host_blocks": -1}, "host_blocks must be an integer >= 0"),
    ({"eviction": "mru"},
     "unknown eviction policy 'mru'; choose one of lru, arc, gdsf, lfu, priority, s3fifo, sglang-priority"),
    ({"max_model_len": 1}, "max_model_len must be an integer >= 2"),
    ({"scheduler": {"policy": "full"}}, "scheduler must be a SchedulerConfig"),
    ({"prefix_caching": "yes"}, "prefix_caching must be True or False"),
    ({"model": ""}, "model must be a non-empty string"),
])
def test_a_bad_setting_is_one_typed_error(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        EngineConfig(**changes)
    assert message in str(err.value)


def test_names_are_canonical_and_the_pool_has_one_default() -> None:
    cfg = EngineConfig(dtype="bfloat16", kv_dtype="float16")
    assert (cfg.dtype, cfg.kv_dtype) == ("bf16", "fp16")
    assert cfg.pool == {"num_blocks": EngineConfig.default_blocks}
    assert EngineConfig(pool_bytes=4096).pool == {"pool_bytes": 4096}
    assert cfg.with_(num_blocks=8).pool == {"num_blocks": 8}
    with pytest.raises(ConfigError):
        cfg.with_(block_size=-1)


def test_a_configuration_travels_as_a_dict() -> None:
    cfg = EngineConfig(kv_dtype="int8", num_blocks=64, host_blocks=8,
                       scheduler=SchedulerConfig(policy="full", max_running=4))
    data = cfg.to_dict()
    assert data["scheduler"]["policy"] == "full"
    assert EngineConfig.from_dict(data) == cfg
    with pytest.raises(ConfigError, match="unknown engine settings: pool"):
        EngineConfig.from_dict({**data, "pool": 3})


def test_from_config_builds_what_it_describes(tiny_llama) -> None:
    path = str(tiny_llama[0])
    cfg = EngineConfig(model=path, num_blocks=40, block_size=BS, host_blocks=8, eviction="priority",
                       prefix_caching=False, scheduler=SchedulerConfig(policy="full", max_running=3))
    engine = Engine.from_config(cfg)
    assert engine.runner.store.num_blocks == 40 and engine.spec.block_size == BS
    assert engine.spec.kv_dtype == "fp32" and engine.model_name == path
    assert engine.scheduler.config.policy == "full" and engine.scheduler.config.max_running == 3
    assert engine.ledger.prefix_caching is False and engine.host_store is not None
    assert engine.max_context == 256  # the tiny model's max_position_embeddings
    out = [r.outputs for r in engine.generate([[3, 1, 4, 1, 5]], 4)]
    same = Engine.from_model(path, num_blocks=40, block_size=BS, host_blocks=8, eviction="priority",
                             prefix_caching=False, scheduler_config=SchedulerConfig(policy="full", max_running=3))
    assert [r.outputs for r in same.generate([[3, 1, 4, 1, 5]], 4)] == out and len(out[0][0]) == 4


def test_the_model_length_bounds_the_engine(tiny_llama) -> None:
    path = str(tiny_llama[0])
    engine = Engine.from_config(EngineConfig(model=path, num_blocks=40, block_size=BS, max_model_len=32))
    assert engine.max_context == 32
    with pytest.raises(ConfigError, match="max_model_len 300 exceeds the model's context of 256 tokens"):
        Engine.from_config(EngineConfig(model=path, num_blocks=40, block_size=BS, max_model_len=300))


def test_from_model_still_wants_exactly_one_pool_size(tiny_llama) -> None:
    with pytest.raises(ConfigError, match="exactly one of num_blocks or pool_bytes"):
        Engine.from_model(tiny_llama[0], block_size=BS)
