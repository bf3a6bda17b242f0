"""Drift: kvledger's manager against the installed vLLM's ``KVCacheManager``. A vLLM release that adds,
renames or re-signs a manager method, or makes its scheduler call something the adapter lacks, fails here
by name -- not as an AttributeError in a user's server halfway through a run."""

from __future__ import annotations

import inspect
import re

import vllm
from vllm.v1.core import kv_cache_manager as vllm_manager
from vllm.v1.core.sched import async_scheduler, scheduler

from kvledger.integrations.vllm import VLLM_VERSION
from kvledger.integrations.vllm.manager import LedgerKVCacheManager

# vLLM's manager members the adapter does not offer, each with the reason it is never reached.
NOT_OFFERED = {
    "block_pool": "read only for deferred frees and copy-on-write copies, i.e. KV connectors (refused)",
}


def public_members(cls: type) -> dict[str, object]:
    return {name: member for name, member in inspect.getmembers(cls) if not name.startswith("_")}


def test_pinned_release() -> None:
    assert vllm.__version__ == VLLM_VERSION, (
        f"vLLM {vllm.__version__} is installed, kvledger's manager is written against {VLLM_VERSION}: "
        "re-read vllm/v1/core/kv_cache_manager.py and sched/scheduler.py, then move the pin")


def test_every_method_of_vllms_manager_is_offered_with_its_signature() -> None:
    theirs = public_members(vllm_manager.KVCacheManager)
    ours = public_members(LedgerKVCacheManager)
    missing = sorted(set(theirs) - set(ours) - set(NOT_OFFERED))
    assert missing == [], f"vLLM's KVCacheManager has members kvledger's manager lacks: {missing}"
    differ = []
    for name, member in theirs.items():
        if name in NOT_OFFERED or not callable(member):
            continue
        want = list(inspect.signature(member).parameters.values())
        got = list(inspect.signature(ours[name]).parameters.values())
        if [(p.name, p.kind, p.default) for p in want] != [(p.name, p.kind, p.default) for p in got]:
            differ.append(f"{name}{inspect.signature(member)} vs ours {name}{inspect.signature(ours[name])}")
    assert differ == [], "signatures changed:\n" + "\n".join(differ)
    props = sorted(n for n, m in theirs.items() if isinstance(m, property) and not isinstance(ours.get(n), property))
    assert props == [], f"properties that are not properties here: {props}"


def test_every_member_vllms_scheduler_uses_is_offered() -> None:
    used = set()
    for module in (scheduler, async_scheduler):
        used |= set(re.findall(r"self\.kv_cache_manager\.([A-Za-z_]\w*)", inspect.getsource(module)))
    instance_attrs = {"empty_kv_cache_blocks", "mamba_shared_prefix_checkpoint", "block_size", "null_block",
                      "kv_cache_config", "retained_hit_group_ids", "num_kv_cache_groups", "coordinator"}
    lacking = sorted(u for u in used if u not in NOT_OFFERED and not hasattr(LedgerKVCacheManager, u)
                     and u not in instance_attrs)
    assert lacking == [], f"vLLM's scheduler calls manager members kvledger's lacks: {lacking}"


def test_the_manager_builds_the_attributes_the_scheduler_reads() -> None:
    from kvledger.integrations.vllm.harness import build_scheduler
    manager = build_scheduler("kvledger", num_blocks=32).scheduler.kv_cache_manager
    assert isinstance(manager, LedgerKVCacheManager)
    for name in ("empty_kv_cache_blocks", "mamba_shared_prefix_checkpoint", "kv_cache_config"):
        assert hasattr(manager, name), name
    assert isinstance(manager.empty_kv_cache_blocks, vllm_manager.KVCacheBlocks)


def test_vllms_engine_core_reads_what_it_needs_of_the_manager() -> None:
    """EngineCore reads ``kv_cache_manager.coordinator.single_type_managers`` at start-up and for KV event
    consumers' metadata; both must work on kvledger's manager (a real `vllm serve` failed here once)."""
    from types import SimpleNamespace

    from vllm.v1.engine.core import EngineCore

    from kvledger.integrations.vllm.harness import build_scheduler
    sched = build_scheduler("kvledger", num_blocks=32).scheduler
    core = SimpleNamespace(scheduler=sched, vllm_config=sched.vllm_config)
    EngineCore._initialize_effective_attention_block_size(core)
    assert sched.vllm_config.cache_config.effective_attention_block_size == 16
    assert [m["block_size"] for m in EngineCore.get_kv_cache_group_metadata(core)] == [16]
