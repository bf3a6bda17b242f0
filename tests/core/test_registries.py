"""Every choice list is one registry type with one rule: a name registered twice is refused unless the
caller says ``replace=True``; an unknown name is one ConfigError naming the choices; the lists read in
registration order and cannot be written to except by registering."""

from __future__ import annotations

import pytest

from kvledger.core.eviction import EVICTION_POLICIES
from kvledger.core.registry import Registry
from kvledger.core.sizing.kv_formats import KV_FORMATS
from kvledger.errors import ConfigError
from kvledger.runtime import attention
from kvledger.runtime.host_store import CODECS
from kvledger.scheduler import (
    ADMISSION_POLICIES,
    GROWTH_ACTIONS,
    RECOVERY_MODES,
    VICTIM_POLICIES,
)
from kvledger.workloads import TRACE_FORMATS

ALL = {"admission policy": ADMISSION_POLICIES, "growth action": GROWTH_ACTIONS, "recovery": RECOVERY_MODES,
       "victim": VICTIM_POLICIES, "eviction": EVICTION_POLICIES, "KV format": KV_FORMATS, "trace": TRACE_FORMATS,
       "codec": CODECS, "attention": attention._BACKENDS}


@pytest.mark.parametrize("what", sorted(ALL))
def test_every_choice_list_is_a_registry(what: str) -> None:
    registry = ALL[what]
    assert isinstance(registry, Registry) and len(registry) >= 2
    first = registry.names()[0]
    copy = registry.copy()
    with pytest.raises(ConfigError, match="is already registered"):
        copy.register(first, registry[first])
    copy.register(first, registry[first], replace=True)
    assert copy.names() == registry.names() and copy[first] is registry[first]
    copy.register("a-new-one", registry[first])
    assert "a-new-one" in copy and "a-new-one" not in registry  # a copy: the original is untouched
    with pytest.raises(ConfigError, match=r"unknown .*'nope'.*" + first):
        registry["nope"]
    assert registry.get("nope") is None and registry.get(3) is None
    with pytest.raises(TypeError):
        registry["x"] = registry[first]  # type: ignore[index]
    assert [n for n, _ in registry.items()] == list(registry.keys()) == list(registry)
    assert registry.values() == [registry[n] for n in registry]


def test_a_name_must_be_a_clean_non_empty_string() -> None:
    reg: Registry[int] = Registry("thing")
    for bad in ("", " x", "x ", None, 3):
        with pytest.raises(ConfigError, match="a thing needs a non-empty name"):
            reg.register(bad, 1)  # type: ignore[arg-type]
    assert reg.register("x", 1, "help") == 1 and reg.help("x") == "help" and repr(reg) == "Registry('thing': x)"


def test_a_registry_refuses_bad_or_duplicate_names_and_lists_in_order() -> None:
    reg: Registry[int] = Registry("widget")
    assert reg.register("b", 2, "bee") == 2 and reg.register("a", 1) == 1
    assert reg.names() == ("b", "a") and list(reg) == ["b", "a"] and len(reg) == 2
    assert "a" in reg and "c" not in reg and 1 not in reg
    assert reg.help("b") == "bee" and repr(reg) == "Registry('widget': b, a)"
    for bad in ("", " a", "a ", None, 3):
        with pytest.raises(ConfigError, match="widget needs a non-empty name"):
            reg.register(bad, 0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="widget 'a' is already registered"):
        reg.register("a", 9)
    assert reg["a"] == 1
    with pytest.raises(ConfigError, match="unknown widget 'z'; choose one of b, a"):
        reg["z"]
