"""The options of kvledger's KV cache manager inside vLLM, read from vLLM's ``additional_config`` or the
environment. Standard library only, so the options are checked (and tested) without vLLM installed.

``--additional-config '{"kvledger": {"admission": "full", "eviction": "lru", "check": false,
"quotas": {"tenant-a": 512}}}'``; each key may also come from ``KVLEDGER_VLLM_<KEY>`` (``ADMISSION``,
``EVICTION``, ``CHECK``), which ``additional_config`` overrides. An unknown key or value is a
:class:`~kvledger.errors.ConfigError` naming the choices: vLLM fails at start-up, not mid-run.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ...core.eviction import EVICTION_POLICIES
from ...errors import ConfigError

# What admission reserves inside vLLM. ``full``: the prompt and every output token the request may still
# produce (``max_tokens``), as one atomic decision -- an admitted request is never preempted.
# ``incremental``: the prompt only; output blocks are taken as tokens arrive, and vLLM preempts (recompute)
# when none is left, as its own manager does.
ADMISSION_POLICIES = ("full", "incremental")

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

    def __post_init__(self) -> None:
        if self.admission not in ADMISSION_POLICIES:
            raise ConfigError(f"kvledger admission must be one of {', '.join(ADMISSION_POLICIES)}; "
                              f"got {self.admission!r}")
        if EVICTION_POLICIES.get(self.eviction) is None:
            raise ConfigError(f"kvledger eviction must be one of {', '.join(EVICTION_POLICIES.keys())}; "
                              f"got {self.eviction!r}")
        if type(self.check) is not bool:
            raise ConfigError(f"kvledger check must be true or false, got {self.check!r}")
        for group, blocks in self.quotas:
            if type(group) is not str or type(blocks) is not int or blocks < 0:
                raise ConfigError(f"kvledger quotas map a cache_salt to a block count >= 0, got {group!r}: {blocks!r}")

    @classmethod
    def from_vllm(cls, additional_config: object = None, environ: Mapping[str, str] | None = None) -> Options:
        """The options from vLLM's ``additional_config`` (its ``"kvledger"`` entry) over the environment."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for key in ("admission", "eviction"):
            if ENV_PREFIX + key.upper() in env:
                values[key] = env[ENV_PREFIX + key.upper()].strip().lower()
        if ENV_PREFIX + "CHECK" in env:
            values["check"] = _flag(env[ENV_PREFIX + "CHECK"], ENV_PREFIX + "CHECK")
        section = additional_config.get("kvledger") if isinstance(additional_config, Mapping) else None
        if section is not None:
            if not isinstance(section, Mapping):
                raise ConfigError(f"additional_config['kvledger'] must be a mapping, got {section!r}")
            unknown = set(section) - {"admission", "eviction", "check", "quotas"}
            if unknown:
                raise ConfigError(f"additional_config['kvledger'] has unknown keys {sorted(unknown)}; "
                                  "known: admission, eviction, check, quotas")
            for key in ("admission", "eviction", "check"):
                if key in section:
                    values[key] = section[key]
            quotas = section.get("quotas") or {}
            if not isinstance(quotas, Mapping):
                raise ConfigError("additional_config['kvledger']['quotas'] must map a cache_salt to blocks, "
                                  f"got {quotas!r}")
            values["quotas"] = tuple((k, v) for k, v in quotas.items())
        return cls(**values)  # type: ignore[arg-type]


def _flag(text: str, name: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ConfigError(f"{name} must be 0 or 1, got {text!r}")
