"""The engine's prefix-cache reset reaches every tier: after it, nothing computed before it -- on the
device, in host memory or on disk -- is served again (after a weight update that KV is wrong)."""

from __future__ import annotations

import pytest
import torch

from kvledger.runtime.engine import Engine
from kvledger.scheduler import SchedulerConfig

BS = 4
NEW = 6


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (13,), generator=gen).tolist() + [i + 1] for i in range(3)]


@pytest.mark.parametrize("tiers", [dict(host_blocks=8), dict(host_blocks=2, disk_blocks=16)], ids=["host", "host+disk"])
def test_an_engine_reset_forgets_the_tiers_and_recomputes_the_same_tokens(tiny_llama, tiers, tmp_path) -> None:
    path, _ = tiny_llama
    cfg = SchedulerConfig(offload_prefixes=True, max_running=1)
    engine = Engine.from_model(path, num_blocks=8, block_size=BS, scheduler_config=cfg, disk_dir=tmp_path, **tiers)
    first, second, third = prompts()
    want = engine.generate([first], NEW)[0].output
    engine.generate([second], NEW)
    engine.generate([third], NEW)  # the first prompt's blocks were evicted and demoted
    host = engine.scheduler.host
    assert host.index, "the scenario needs demoted prefix blocks"
    reset = engine.reset_prefix_cache()
    assert reset and reset.cleared_tier_entries > 0
    assert host.index == {} and host.counts["cached"] == 0
    promoted = engine.stats.promoted_blocks
    again = engine.generate([first], NEW)[0]
    assert engine.stats.promoted_blocks == promoted  # nothing came back from below the device
    assert again.cached_prompt_tokens == 0 and again.output == want
    engine.check()
    engine.close()
