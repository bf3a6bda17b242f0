"""The options of kvledger's KV cache manager inside vLLM, read from vLLM's ``additional_config`` or the
environment. Standard library only, so the options are checked (and tested) without vLLM installed.

``--additional-config '{"kvledger": {"admission": "full", "eviction": "lru", "check": false,
"quotas": {"tenant-a": 512}, "pins": [[1, 2, 3, ...], {"prompt": "You are ...", "cache_salt": "a"}]}}'``;
each key may also come from ``KVLEDGER_VLLM_<KEY>`` (``ADMISSION``, ``EVICTION``, ``CHECK``,
``PREDICTED_QUANTILE``, ``PREDICTED_MIN_SAMPLES``, ``PINS`` as JSON, ``METRICS``), which ``additional_config``
overrides. An unknown key or value is a
:class:`~kvledger.errors.ConfigError` naming the choices: vLLM fails at start-up, not mid-run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ...core.eviction import EVICTION_POLICIES
from ...errors import ConfigError

# What admission reserves inside vLLM. ``full``: the prompt and every output token the request may still
# produce (``max_tokens``), as one atomic decision -- an admitted request is never preempted.
# ``incremental``: the prompt only; output blocks are taken as tokens arrive, and vLLM preempts (recompute)
# when none is left, as its own manager does. ``predicted``: the prompt and the ``predicted_quantile`` of the
# output lengths of requests finished so far (the full allowance until ``predicted_min_samples`` have
# finished); growth beyond it as ``incremental`` (kvledger's scheduler's policy of the same name).
ADMISSION_POLICIES = ("full", "incremental", "predicted")
KEYS = ("admission", "eviction", "check", "quotas", "predicted_quantile", "predicted_min_samples", "pins", "metrics")


@dataclass(frozen=True, slots=True)
class Pin:
    """A prefix kept in the cache: its blocks, once computed, are never evicted. ``tokens`` are prompt
    token ids; ``prompt`` is text, tokenized as vLLM tokenizes a completion prompt (needs the model's
    tokenizer); ``cache_salt`` is the trust group whose requests hit it."""

    tokens: tuple[int, ...] = ()
    prompt: str | None = None
    cache_salt: str | None = None

    @classmethod
    def parse(cls, entry: object) -> Pin:
        if isinstance(entry, str):
            return cls(prompt=entry)
        if isinstance(entry, (list, tuple)):
            entry = {"prompt_token_ids": entry}
        if not isinstance(entry, Mapping) or not set(entry) <= {"prompt_token_ids", "prompt", "cache_salt"} \
                or ("prompt_token_ids" in entry) == ("prompt" in entry):
            raise ConfigError("kvledger pins are token id lists, prompt strings, or mappings with "
                              f"prompt_token_ids or prompt (and cache_salt); got {entry!r}")
        tokens = entry.get("prompt_token_ids") or ()
        if not isinstance(tokens, (list, tuple)) or any(type(t) is not int or t < 0 for t in tokens):
            raise ConfigError(f"kvledger pin token ids must be non-negative integers, got {tokens!r}")
        prompt, salt = entry.get("prompt"), entry.get("cache_salt")
        if (prompt is not None and (type(prompt) is not str or not prompt)) or \
                (salt is not None and type(salt) is not str):
            raise ConfigError(f"kvledger pin prompt and cache_salt are strings, got {entry!r}")
        if "prompt_token_ids" in entry and not tokens:
            raise ConfigError("kvledger pin token ids must not be empty")
        return cls(tuple(tokens), prompt, salt)

ENV_PREFIX = "KVLEDGER_VLLM_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True, slots=True)
class Options:
    """kvledger's manager options (``additional_config["kvledger"]``)."""

    admission: str = "full"
    eviction: str = "lru"
    check: bool = False  # KVLedger.check() after every schedule and update: a debug mode, O(pool) a step
    quotas: tuple[tuple[str, int], ...] = field(default=())  # (trust group = vLLM's cache_salt, max blocks)
    predicted_quantile: float = 0.9
    predicted_min_samples: int = 20
    pins: tuple[Pin, ...] = field(default=())
    metrics: bool = True  # kvledger: Prometheus metrics beside vLLM's (integrations/vllm/metrics.py)

    def __post_init__(self) -> None:
        if self.admission not in ADMISSION_POLICIES:
            raise ConfigError(f"kvledger admission must be one of {', '.join(ADMISSION_POLICIES)}; "
                              f"got {self.admission!r}")
        if EVICTION_POLICIES.get(self.eviction) is None:
            raise ConfigError(f"kvledger eviction must be one of {', '.join(EVICTION_POLICIES.keys())}; "
                              f"got {self.eviction!r}")
        for name in ("check", "metrics"):
            if type(getattr(self, name)) is not bool:
                raise ConfigError(f"kvledger {name} must be true or false, got {getattr(self, name)!r}")
        for group, blocks in self.quotas:
            if type(group) is not str or type(blocks) is not int or blocks < 0:
                raise ConfigError(f"kvledger quotas map a cache_salt to a block count >= 0, got {group!r}: {blocks!r}")
        q = self.predicted_quantile
        if type(q) not in (int, float) or not 0 < q <= 1:
            raise ConfigError(f"kvledger predicted_quantile must be in (0, 1], got {q!r}")
        m = self.predicted_min_samples
        if type(m) is not int or m < 1:
            raise ConfigError(f"kvledger predicted_min_samples must be an integer >= 1, got {m!r}")

    @classmethod
    def from_vllm(cls, additional_config: object = None, environ: Mapping[str, str] | None = None) -> Options:
        """The options from vLLM's ``additional_config`` (its ``"kvledger"`` entry) over the environment."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for key in ("admission", "eviction"):
            if ENV_PREFIX + key.upper() in env:
                values[key] = env[ENV_PREFIX + key.upper()].strip().lower()
        for key in ("check", "metrics"):
            if ENV_PREFIX + key.upper() in env:
                values[key] = _flag(env[ENV_PREFIX + key.upper()], ENV_PREFIX + key.upper())
        for key, kind in (("predicted_quantile", float), ("predicted_min_samples", int)):
            name = ENV_PREFIX + key.upper()
            if name in env:
                try:
                    values[key] = kind(env[name])
                except ValueError:
                    raise ConfigError(f"{name} must be a number, got {env[name]!r}") from None
        if ENV_PREFIX + "PINS" in env:
            try:
                values["pins"] = json.loads(env[ENV_PREFIX + "PINS"])
            except ValueError:
                raise ConfigError(f"{ENV_PREFIX}PINS must be a JSON list of pins, got {env[ENV_PREFIX + 'PINS']!r}") \
                    from None
        section = additional_config.get("kvledger") if isinstance(additional_config, Mapping) else None
        if section is not None:
            if not isinstance(section, Mapping):
                raise ConfigError(f"additional_config['kvledger'] must be a mapping, got {section!r}")
            unknown = set(section) - set(KEYS)
            if unknown:
                raise ConfigError(f"additional_config['kvledger'] has unknown keys {sorted(unknown)}; "
                                  f"known: {', '.join(KEYS)}")
            for key in ("admission", "eviction", "check", "predicted_quantile", "predicted_min_samples", "pins",
                        "metrics"):
                if key in section:
                    values[key] = section[key]
            quotas = section.get("quotas") or {}
            if not isinstance(quotas, Mapping):
                raise ConfigError("additional_config['kvledger']['quotas'] must map a cache_salt to blocks, "
                                  f"got {quotas!r}")
            values["quotas"] = tuple((k, v) for k, v in quotas.items())
        pins = values.get("pins")
        if pins is not None:
            if not isinstance(pins, (list, tuple)):
                raise ConfigError(f"kvledger pins must be a list, got {pins!r}")
            values["pins"] = tuple(Pin.parse(p) for p in pins)
        return cls(**values)  # type: ignore[arg-type]


def _flag(text: str, name: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ConfigError(f"{name} must be 0 or 1, got {text!r}")
